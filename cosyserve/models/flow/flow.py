"""CosyVoice2 flow: speech tokens + prompt mel + speaker embedding -> mel (upstream ``CausalMaskedDiffWithXvec``).

Every call recomputes everything from the first prompt token (no flow cache). Streaming calls
use block-causal masks; non-final streaming calls (``finalize=False``) hold back the last
``pre_lookahead_len`` tokens as look-ahead context, so they produce no frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...config import load_hyperpyyaml
from ...errors import InvalidInputError, ModelLoadError
from .cfm import NOISE_FRAMES, CausalConditionalCFM
from .config import FlowConfig
from .encoder import UpsampleConformerEncoder

CONFIG_FILE = "cosyvoice2.yaml"
WEIGHTS_FILE = "flow.pt"


@dataclass
class FlowConditions:
    """Everything the flow-matching sampler is conditioned on (prompt frames included)."""

    spks: torch.Tensor  # (B, 80) normalised + projected speaker vector
    encoder_out: torch.Tensor  # (B, T, D) encoder output before the 80-dim projection
    mu: torch.Tensor  # (B, 80, T) projected encoder output
    cond: torch.Tensor  # (B, 80, T) prompt mel in the first prompt_frames frames, zeros after
    mask: torch.Tensor  # (B, 1, T) frame mask
    prompt_frames: int


class CosyVoice2Flow(nn.Module):
    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder, cfg.pre_lookahead_len)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = CausalConditionalCFM(cfg.cfm, cfg.estimator)

    def speaker_vector(self, embedding: torch.Tensor) -> torch.Tensor:
        """(B, 192) speaker embedding -> L2-normalised -> (B, 80)."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def encode(self, tokens: torch.Tensor, *, streaming: bool, finalize: bool) -> torch.Tensor:
        """(B, n) prompt+target tokens -> encoder output (B, ratio * n', D), n' = n or n - lookahead."""
        embedded = self.input_embedding(tokens.clamp(min=0))
        if finalize:
            return self.encoder(embedded, streaming=streaming)
        lookahead = self.cfg.pre_lookahead_len
        return self.encoder(embedded[:, :-lookahead], embedded[:, -lookahead:], streaming=streaming)

    def conditions(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                   embedding: torch.Tensor, *, streaming: bool, finalize: bool) -> FlowConditions:
        """Validate the request and compute the sampler's conditioning."""
        self._check_inputs(token, prompt_token, prompt_feat, embedding, finalize)
        weight = self.spk_embed_affine_layer.weight
        device, dtype = weight.device, weight.dtype
        tokens = torch.cat([prompt_token, token], dim=1).to(device=device, dtype=torch.long)
        prompt_feat = prompt_feat.to(device=device, dtype=dtype)
        spks = self.speaker_vector(embedding.to(device=device, dtype=dtype))
        encoder_out = self.encode(tokens, streaming=streaming, finalize=finalize)
        mu = self.encoder_proj(encoder_out).transpose(1, 2).contiguous()
        batch, channels, frames = mu.shape
        prompt_frames = prompt_feat.size(1)
        cond = torch.zeros(batch, frames, channels, device=device, dtype=dtype)
        cond[:, :prompt_frames] = prompt_feat
        mask = torch.ones(batch, 1, frames, device=device, dtype=dtype)
        return FlowConditions(spks, encoder_out, mu, cond.transpose(1, 2), mask, prompt_frames)

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, *, streaming: bool, finalize: bool) -> torch.Tensor:
        """Mel (B, 80, frames) float32 of the target tokens only.

        token (B, n) / prompt_token (B, P) speech-token ids; prompt_feat (B, 2P, 80) prompt mel;
        embedding (B, 192) speaker embedding. frames = 2n if finalize else 2(n - 3).
        """
        c = self.conditions(token, prompt_token, prompt_feat, embedding, streaming=streaming, finalize=finalize)
        mel = self.decoder(c.mu, c.mask, c.spks, c.cond, streaming=streaming)
        return mel[:, :, c.prompt_frames:].float()

    def _check_inputs(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                      embedding: torch.Tensor, finalize: bool) -> None:
        cfg = self.cfg
        for name, value, ndim in (("token", token, 2), ("prompt_token", prompt_token, 2),
                                  ("prompt_feat", prompt_feat, 3), ("embedding", embedding, 2)):
            if not isinstance(value, torch.Tensor) or value.dim() != ndim:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise InvalidInputError(f"flow {name} must be a {ndim}-D tensor, got {shape}")
        for name, value in (("token", token), ("prompt_token", prompt_token)):
            if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
                raise InvalidInputError(f"flow {name} must hold integer speech-token ids, got dtype {value.dtype}")
            if value.numel() and int(value.max()) >= cfg.vocab_size:
                raise InvalidInputError(
                    f"flow {name} has id {int(value.max())}; speech-token ids must be below {cfg.vocab_size}"
                )
        for name, value in (("prompt_feat", prompt_feat), ("embedding", embedding)):
            if not value.is_floating_point():
                raise InvalidInputError(f"flow {name} must be a floating-point tensor, got dtype {value.dtype}")
        batch = token.size(0)
        if any(v.size(0) != batch for v in (prompt_token, prompt_feat, embedding)):
            raise InvalidInputError(
                "flow inputs disagree on the batch size: token "
                f"{batch}, prompt_token {prompt_token.size(0)}, prompt_feat {prompt_feat.size(0)}, "
                f"embedding {embedding.size(0)}"
            )
        if embedding.size(1) != cfg.spk_embed_dim:
            raise InvalidInputError(f"flow embedding must be (B, {cfg.spk_embed_dim}), got {tuple(embedding.shape)}")
        prompt_tokens, target_tokens = prompt_token.size(1), token.size(1)
        expected_feat = (batch, cfg.token_mel_ratio * prompt_tokens, cfg.output_size)
        if tuple(prompt_feat.shape) != expected_feat:
            raise InvalidInputError(
                f"flow prompt_feat must be (B, {cfg.token_mel_ratio} * prompt tokens, {cfg.output_size}) = "
                f"{expected_feat}, got {tuple(prompt_feat.shape)}"
            )
        if target_tokens == 0:
            raise InvalidInputError("flow token is empty; at least one target speech token is required")
        lookahead = 0 if finalize else cfg.pre_lookahead_len
        if target_tokens <= lookahead:
            raise InvalidInputError(
                f"a non-final flow call needs more than {lookahead} tokens (the last {lookahead} are "
                f"look-ahead only), got {target_tokens}"
            )
        frames = cfg.token_mel_ratio * (prompt_tokens + target_tokens - lookahead)
        if frames > NOISE_FRAMES:
            raise InvalidInputError(
                f"flow request of {frames} mel frames (prompt + target) exceeds the maximum {NOISE_FRAMES}"
            )


def load_flow_state_dict(model: CosyVoice2Flow, state_dict: dict, source: str) -> None:
    """Strictly load ``state_dict`` into ``model`` (taking over its tensors), with a clear error on mismatch."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [
        f"{k} {tuple(v.shape)} (expected {tuple(expected[k].shape)})"
        for k, v in state_dict.items()
        if k in expected and tuple(v.shape) != tuple(expected[k].shape)
    ]
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:5])}{', ...' if len(items) > 5 else ''}"
        for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", mismatched))
        if items
    ]
    if problems:
        raise ModelLoadError(f"{source} does not match the flow architecture of the config: " + "; ".join(problems))
    model.load_state_dict(state_dict, strict=True, assign=True)


def flow_from_state_dict(cfg: FlowConfig, state_dict: dict, source: str, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32) -> CosyVoice2Flow:
    """Build the flow without random init (on the meta device) and strictly load the weights."""
    with torch.device("meta"):
        model = CosyVoice2Flow(cfg)
    load_flow_state_dict(model, state_dict, source)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_flow(model_dir: Path | str, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> CosyVoice2Flow:
    """Load ``flow.pt`` from a model directory, configured by its ``cosyvoice2.yaml`` (released defaults if absent)."""
    model_dir = Path(model_dir)
    config_path = model_dir / CONFIG_FILE
    cfg = FlowConfig.from_yaml_tree(load_hyperpyyaml(config_path)) if config_path.is_file() else FlowConfig.real()
    weights = model_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise ModelLoadError(f"flow weights {weights} not found")
    try:
        state_dict = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt / unsafe pickles
        raise ModelLoadError(f"cannot read flow weights {weights}: {exc}") from exc
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ModelLoadError(f"{weights} is not a state dict of tensors")
    return flow_from_state_dict(cfg, state_dict, str(weights), device, dtype)


def random_flow_state_dict(cfg: FlowConfig, seed: int) -> dict[str, torch.Tensor]:
    """Weights of a randomly initialised flow (upstream initialisers), without touching global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CosyVoice2Flow(cfg).state_dict()
