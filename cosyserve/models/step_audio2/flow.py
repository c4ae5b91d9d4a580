"""The Step-Audio-2-mini flow (upstream ``CausalMaskedDiffWithXvec`` with a DiT decoder).

speech tokens (25 Hz) -> embedding -> :class:`UpsampleConformerEncoderV2` (50 Hz) ->
``encoder_proj`` = mu -> :class:`StepAudio2CFM` (10 Euler steps, CFG) -> 80-bin log-mel.

Entry points: :meth:`StepAudio2Flow.inference` (offline, batched, per-item identical to a batch of one),
:meth:`StepAudio2Flow.setup_stream` (per-speaker prompt pass that fills the caches) and
:meth:`StepAudio2Flow.stream_chunk` (one cached chunk). Estimator-cache trimming is the stream's
(:mod:`cosyserve.token2wav.step_audio2`; the engine's Step-Audio2 kind keeps streams and voices).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cosyserve.config import load_hyperpyyaml
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.speech_tokens import speech_token_ids

from .cfm import StepAudio2CFM, EstimatorCache
from .config import StepAudio2FlowConfig
from .encoder_v2 import EncoderCache, UpsampleConformerEncoderV2

CHECKPOINT_NAME = "flow.pt"
CONFIG_NAME = "flow.yaml"


@dataclass
class FlowStreamCache:
    """Everything a streaming request carries from one chunk to the next (batch 1)."""

    encoder: EncoderCache
    estimator: EstimatorCache


class StepAudio2Flow(nn.Module):
    def __init__(self, cfg: StepAudio2FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoderV2(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = StepAudio2CFM(cfg)

    @property
    def up_rate(self) -> int:
        return self.cfg.encoder.up_rate

    @property
    def pre_lookahead_len(self) -> int:
        return self.cfg.encoder.pre_lookahead_len

    def _param(self) -> torch.Tensor:
        return self.encoder_proj.weight

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        speech_token_ids(tokens.reshape(-1), self.cfg.vocab_size)

    @torch.inference_mode()
    def project_speaker(self, spk_emb: torch.Tensor) -> torch.Tensor:
        """(B, spk_embed_dim) speaker embedding -> L2-normalised -> (B, output_size)."""
        w = self._param()
        return self.spk_embed_affine_layer(F.normalize(spk_emb.to(w.device, w.dtype), dim=1))

    # ------------------------------------------------------------------ offline
    def encode(self, tokens: torch.Tensor, token_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (B, L) right-padded, token_lens (B,) -> mu (B, 80, r*L), frame lengths (B,)."""
        self._check_tokens(tokens[torch.arange(tokens.shape[1], device=tokens.device)[None] < token_lens[:, None]])
        valid = (torch.arange(tokens.shape[1], device=tokens.device)[None] < token_lens[:, None]).unsqueeze(-1)
        emb = self.input_embedding(tokens.clamp(0, self.cfg.vocab_size - 1)) * valid
        h, frame_mask = self.encoder(emb, token_lens)
        return self.encoder_proj(h).transpose(1, 2), frame_mask.squeeze(1).sum(-1)

    @torch.inference_mode()
    def inference(
        self,
        tokens: torch.Tensor,
        token_lens: torch.Tensor,
        prompt_mel: torch.Tensor,
        prompt_mel_lens: torch.Tensor,
        spk_emb: torch.Tensor,
        noise: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Offline mel for prompt‖target tokens (B, L) with lengths (B,); prompt_mel (B, M_max, 80)
        with lengths (B,) conditions the first M_i frames; spk_emb (B, 192); noise (B, 80, ≥ r*L).
        Returns mel (B, 80, r*L) float32 and frame lengths (B,); frames past an item's length are padding."""
        w = self._param()
        tokens, token_lens = tokens.to(w.device), token_lens.to(w.device)
        mu, frame_lens = self.encode(tokens, token_lens)
        batch, _, frames = mu.shape
        frame_idx = torch.arange(frames, device=w.device)[None]
        mask = (frame_idx < frame_lens[:, None]).unsqueeze(1).to(w.dtype)
        cond = torch.zeros_like(mu)
        prompt_len = min(prompt_mel.shape[1], frames)
        prompt_valid = (frame_idx[:, :prompt_len] < prompt_mel_lens.to(w.device)[:, None]).unsqueeze(1)
        cond[:, :, :prompt_len] = prompt_mel[:, :prompt_len].to(w.device, w.dtype).transpose(1, 2) * prompt_valid
        mel = self.decoder.solve(noise[:, :, :frames].to(w.device, w.dtype), mu, mask, self.project_speaker(spk_emb), cond)
        return mel.float(), frame_lens

    # ------------------------------------------------------------------ streaming
    def _embed_chunk(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise InvalidInputError(f"a stream chunk must be (1, m) token ids; got shape {tuple(tokens.shape)}")
        self._check_tokens(tokens)
        return self.input_embedding(tokens.to(self._param().device))

    @torch.inference_mode()
    def setup_stream(
        self, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor, spk_proj: torch.Tensor
    ) -> tuple[torch.Tensor, FlowStreamCache]:
        """Prompt pass for a speaker: prompt_tokens (1, n), prompt_mel (1, r*n, 80) already aligned,
        spk_proj (1, 80). The first ``pre_lookahead_len`` prompt tokens stand in as look-ahead;
        cond = the prompt mel. Returns the (discarded upstream) mel (1, 80, r*n) and the caches."""
        n = prompt_tokens.shape[1]
        if n < self.pre_lookahead_len or prompt_mel.shape[1] != self.up_rate * n:
            raise InvalidInputError(
                f"speaker prompt needs at least {self.pre_lookahead_len} tokens and {self.up_rate} mel frames "
                f"per token; got {n} tokens and {prompt_mel.shape[1]} frames")
        w = self._param()
        tokens = torch.cat([prompt_tokens, prompt_tokens[:, :self.pre_lookahead_len]], dim=1)
        cache = FlowStreamCache(self.encoder.empty_cache(w.device, w.dtype),
                                self.decoder.empty_cache(1, w.device, w.dtype))
        cond = prompt_mel.to(w.device, w.dtype).transpose(1, 2)
        return self._chunk(tokens, False, spk_proj, cache, cond)

    @torch.inference_mode()
    def stream_chunk(
        self, tokens: torch.Tensor, last_chunk: bool, spk_proj: torch.Tensor, cache: FlowStreamCache
    ) -> tuple[torch.Tensor, FlowStreamCache]:
        """tokens (1, m) including ``pre_lookahead_len`` look-ahead tokens unless ``last_chunk``.
        Returns the chunk mel (1, 80, r*m') float32 and the new caches (untrimmed)."""
        return self._chunk(tokens, last_chunk, spk_proj, cache, None)

    def _chunk(self, tokens, last_chunk, spk_proj, cache: FlowStreamCache, cond: torch.Tensor | None):
        h, encoder_cache = self.encoder.forward_chunk(self._embed_chunk(tokens), last_chunk, cache.encoder)
        mu = self.encoder_proj(h).transpose(1, 2)
        cond = torch.zeros_like(mu) if cond is None else cond
        mel, estimator_cache = self.decoder.solve_chunk(mu, spk_proj.to(mu.dtype), cond, cache.estimator)
        return mel.float(), FlowStreamCache(encoder_cache, estimator_cache)


def load_step_audio2_flow(model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> StepAudio2Flow:
    """Build the flow from ``model_dir/flow.yaml`` (released values when absent) and load
    ``model_dir/flow.pt`` strictly."""
    model_dir = Path(model_dir)
    config_path = model_dir / CONFIG_NAME
    cfg = StepAudio2FlowConfig.from_yaml_tree(load_hyperpyyaml(config_path)) if config_path.exists() else StepAudio2FlowConfig.real()
    flow = StepAudio2Flow(cfg)
    load_step_audio2_flow_state_dict(flow, model_dir / CHECKPOINT_NAME)
    return flow.to(device=device, dtype=dtype).eval()


def load_step_audio2_flow_state_dict(flow: StepAudio2Flow, path: str | Path) -> None:
    """Strict load of a ``flow.pt``-style state dict; any key or shape mismatch is a ModelLoadError."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read Step-Audio2 flow checkpoint {path}: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{path} is not a plain state dict of tensors")
    try:
        flow.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"{path} does not match the Step-Audio2 flow built from its config: {exc}") from exc
