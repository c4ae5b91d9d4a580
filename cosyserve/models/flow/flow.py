"""CosyVoice2 flow: speech tokens + prompt mel + speaker embedding -> mel (upstream ``CausalMaskedDiffWithXvec``).

:meth:`CosyVoice2Flow.inference` recomputes everything from the first prompt token, like
upstream (no flow cache). Streaming calls use block-causal masks; non-final streaming calls
(``finalize=False``) hold back the last ``pre_lookahead_len`` tokens as look-ahead context, so
they produce no frames. :meth:`CosyVoice2Flow.inference_batch` runs requests of different
lengths together (right padding + masks; each result equals the request run alone). Streams that
compute only each chunk's new frames: :mod:`cosyserve.token2wav.flow_engine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ...config import load_hyperpyyaml
from ...errors import InvalidInputError, ModelLoadError
from ...runtime import host_to_device
from ...speech_tokens import speech_token_ids
from .cache import StreamWindow
from .cfm import N_TIMESTEPS, NOISE_FRAMES, CausalConditionalCFM
from .config import FlowConfig
from .encoder import UpsampleConformerEncoder

CONFIG_FILE = "cosyvoice2.yaml"
WEIGHTS_FILE = "flow.pt"


@dataclass
class FlowConditions:
    """Everything the flow-matching sampler is conditioned on (prompt frames included).

    Items of a batch may differ in length: frames from ``frames[b]`` on are right padding.
    """

    spks: torch.Tensor  # (B, 80) normalised + projected speaker vector
    encoder_out: torch.Tensor  # (B, T, D) encoder output before the 80-dim projection
    mu: torch.Tensor  # (B, 80, T) projected encoder output
    cond: torch.Tensor  # (B, 80, T) prompt mel in the first prompt_frames[b] frames, zeros after
    mask: torch.Tensor  # (B, 1, T) 1 on each item's frames, 0 on padding
    prompt_frames: list[int]  # per item
    frames: list[int]  # per item, prompt + target

    def target_mels(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each item's target frames (1, 80, frames - prompt_frames) of a sampled (B, 80, T) mel, as float32."""
        return [x[b:b + 1, :, p:f].float() for b, (p, f) in enumerate(zip(self.prompt_frames, self.frames))]


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

    def encode(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None, *, streaming: bool, finalize: bool,
               window: StreamWindow | None = None) -> torch.Tensor:
        """(B, n) prompt+target tokens -> encoder output (B, ratio * n', D), n' = n or n - lookahead.

        ``lengths`` (B,): tokens per item of a right-padded batch (None: all n). Without
        ``finalize`` the last ``pre_lookahead_len`` tokens of each item are look-ahead only.
        ``window``: ``tokens`` are those from ``window.start`` on of an incremental stream.
        """
        lookahead = 0 if finalize else self.cfg.pre_lookahead_len
        embedded = self.input_embedding(tokens.clamp(min=0))
        out = self.encoder(embedded, lengths, lookahead=lookahead, streaming=streaming, window=window)
        return out[:, :self.cfg.token_mel_ratio * (tokens.size(1) - lookahead)]

    def project(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """Encoder output (B, T, D) -> decoder condition mu (B, 80, T)."""
        return self.encoder_proj(encoder_out).transpose(1, 2).contiguous()

    @staticmethod
    def prompt_condition(prompt_feat: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """cond (B, 80, end - start) of frames [start, end): the prompt mel (B, 2P, 80) where it lasts, zeros after."""
        cond = prompt_feat.new_zeros(prompt_feat.size(0), end - start, prompt_feat.size(2))
        prompt = prompt_feat[:, start:end]
        cond[:, :prompt.size(1)] = prompt
        return cond.transpose(1, 2)

    def conditions(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                   embedding: torch.Tensor, *, streaming: bool, finalize: bool) -> FlowConditions:
        """Validate a request (or a batch of equally long ones) and compute the sampler's conditioning."""
        self._check_inputs(token, prompt_token, prompt_feat, embedding, finalize)
        rows = [(token[b:b + 1], prompt_token[b:b + 1], prompt_feat[b:b + 1], embedding[b:b + 1])
                for b in range(token.size(0))]
        return self._conditions(rows, streaming=streaming, finalize=finalize)

    def batch_conditions(self, tokens: Sequence[torch.Tensor], prompt_tokens: Sequence[torch.Tensor],
                         prompt_feats: Sequence[torch.Tensor], embeddings: Sequence[torch.Tensor], *,
                         streaming: bool, finalize: bool) -> FlowConditions:
        """:meth:`conditions` of requests with their own lengths (one batch-1 tensor per request in each argument)."""
        counts = [len(tokens), len(prompt_tokens), len(prompt_feats), len(embeddings)]
        if len(set(counts)) > 1 or not counts[0]:
            raise InvalidInputError(
                "flow batch needs one tokens / prompt_tokens / prompt_feats / embeddings entry per request "
                f"(at least one request), got {counts}"
            )
        rows = list(zip(tokens, prompt_tokens, prompt_feats, embeddings))
        for i, row in enumerate(rows):
            self._check_inputs(*row, finalize)
            if row[0].size(0) != 1:
                raise InvalidInputError(f"flow batch request {i} must have batch size 1, got {row[0].size(0)}")
        return self._conditions(rows, streaming=streaming, finalize=finalize)

    def _conditions(self, rows: list[tuple[torch.Tensor, ...]], *, streaming: bool, finalize: bool) -> FlowConditions:
        weight = self.spk_embed_affine_layer.weight
        device, dtype = weight.device, weight.dtype
        sequences = [host_to_device(torch.cat([prompt_token, token], dim=1)[0].long(), device)
                     for token, prompt_token, _, _ in rows]
        lengths = [seq.size(0) for seq in sequences]
        padded = len(set(lengths)) > 1
        encoder_out = self.encode(pad_sequence(sequences, batch_first=True),
                                  host_to_device(lengths, device) if padded else None,
                                  streaming=streaming, finalize=finalize)
        mu = self.project(encoder_out)
        lookahead = 0 if finalize else self.cfg.pre_lookahead_len
        frames = [self.cfg.token_mel_ratio * (length - lookahead) for length in lengths]
        total = mu.size(2)
        mask = (torch.arange(total, device=device)[None, :] < host_to_device(frames, device)[:, None])
        cond = torch.cat([self.prompt_condition(feat.to(device=device, dtype=dtype), 0, total)
                          for _, _, feat, _ in rows])
        spks = self.speaker_vector(torch.cat([emb for _, _, _, emb in rows]).to(device=device, dtype=dtype))
        prompt_frames = [feat.size(1) for _, _, feat, _ in rows]
        return FlowConditions(spks, encoder_out, mu, cond, mask.unsqueeze(1).to(dtype), prompt_frames, frames)

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, *, streaming: bool, finalize: bool,
                  n_timesteps: int = N_TIMESTEPS) -> torch.Tensor:
        """Mel (B, 80, frames) float32 of the target tokens only.

        token (B, n) / prompt_token (B, P) speech-token ids; prompt_feat (B, 2P, 80) prompt mel;
        embedding (B, 192) speaker embedding. frames = 2n if finalize else 2(n - 3).
        """
        c = self.conditions(token, prompt_token, prompt_feat, embedding, streaming=streaming, finalize=finalize)
        return torch.cat(c.target_mels(self._sample(c, streaming, n_timesteps)))

    @torch.inference_mode()
    def inference_batch(self, tokens: Sequence[torch.Tensor], prompt_tokens: Sequence[torch.Tensor],
                        prompt_feats: Sequence[torch.Tensor], embeddings: Sequence[torch.Tensor], *,
                        streaming: bool, finalize: bool, n_timesteps: int = N_TIMESTEPS) -> list[torch.Tensor]:
        """:meth:`inference` of several requests of any lengths in one batch.

        Request b is (tokens[b] (1, n_b), prompt_tokens[b] (1, P_b), prompt_feats[b] (1, 2P_b, 80),
        embeddings[b] (1, 192)); returns its mel (1, 80, frames_b), equal to running it alone.
        """
        c = self.batch_conditions(tokens, prompt_tokens, prompt_feats, embeddings, streaming=streaming,
                                  finalize=finalize)
        return c.target_mels(self._sample(c, streaming, n_timesteps))

    def _sample(self, c: FlowConditions, streaming: bool, n_timesteps: int) -> torch.Tensor:
        return self.decoder(c.mu, c.mask, c.spks, c.cond, streaming=streaming, n_timesteps=n_timesteps)

    def _check_inputs(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                      embedding: torch.Tensor, finalize: bool) -> None:
        self.check_ids("token", token)
        self.check_prompt(prompt_token, prompt_feat, embedding, batch=token.size(0))
        self.check_length(prompt_token.size(1), token.size(1), finalize)

    def check_ids(self, name: str, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InvalidInputError(f"flow {name} must be a 2-D tensor, got {shape}")
        speech_token_ids(value.reshape(-1), self.cfg.vocab_size, f"flow {name}")

    def check_prompt(self, prompt_token: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor,
                      batch: int) -> None:
        cfg = self.cfg
        self.check_ids("prompt_token", prompt_token)
        for name, value, ndim in (("prompt_feat", prompt_feat, 3), ("embedding", embedding, 2)):
            if not isinstance(value, torch.Tensor) or value.dim() != ndim:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise InvalidInputError(f"flow {name} must be a {ndim}-D tensor, got {shape}")
            if not value.is_floating_point():
                raise InvalidInputError(f"flow {name} must be a floating-point tensor, got dtype {value.dtype}")
        if any(v.size(0) != batch for v in (prompt_token, prompt_feat, embedding)):
            raise InvalidInputError(
                "flow inputs disagree on the batch size: token "
                f"{batch}, prompt_token {prompt_token.size(0)}, prompt_feat {prompt_feat.size(0)}, "
                f"embedding {embedding.size(0)}"
            )
        if embedding.size(1) != cfg.spk_embed_dim:
            raise InvalidInputError(f"flow embedding must be (B, {cfg.spk_embed_dim}), got {tuple(embedding.shape)}")
        expected_feat = (batch, cfg.token_mel_ratio * prompt_token.size(1), cfg.output_size)
        if tuple(prompt_feat.shape) != expected_feat:
            raise InvalidInputError(
                f"flow prompt_feat must be (B, {cfg.token_mel_ratio} * prompt tokens, {cfg.output_size}) = "
                f"{expected_feat}, got {tuple(prompt_feat.shape)}"
            )

    def check_length(self, prompt_tokens: int, target_tokens: int, finalize: bool) -> None:
        cfg = self.cfg
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
