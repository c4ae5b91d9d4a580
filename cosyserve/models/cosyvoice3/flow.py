"""The CosyVoice3 flow: speech tokens + prompt mel + speaker embedding -> mel (upstream ``CausalMaskedDiffWithDiT``).

tokens (25 Hz) -> 80-d embedding -> pre-look-ahead conv (the only "encoder") -> each frame
repeated ×2 = mu (50 Hz) -> conditional flow matching with the :class:`Cv3DiT` estimator
(10 Euler steps on a cosine grid, CFG 0.7, the fixed seed-0 noise buffer shared with CosyVoice2).

:meth:`CosyVoice3Flow.inference` is upstream's call: everything is recomputed from the first
prompt token. ``finalize=False`` keeps the last ``pre_lookahead_len`` tokens as look-ahead
context only; ``streaming=True`` gives the DiT its block-causal 50-frame mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import InvalidInputError, ModelLoadError
from ...speech_tokens import speech_token_ids
from ..flow.cfm import N_TIMESTEPS, cosine_time_grid, fixed_noise
from .config import Cv3FlowConfig, config_from_model_dir
from .dit import Cv3DiT, WindowState, commit_window, window_kv

# (z, mu2, cond2, spks2, state) -> Cv3CFM.sample_state_window's outputs
WindowSampler = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]

WEIGHTS_FILE = "flow.pt"


class PreLookaheadLayer(nn.Module):
    """Conv1d(in -> C, kernel 1 + look-ahead) -> leaky ReLU -> causal Conv1d(C -> in, kernel 3) -> + input.

    Unlike CosyVoice2's (same width in and out, inside a conformer encoder) this one widens to
    ``channels`` and is the flow's whole token encoder.
    """

    def __init__(self, in_channels: int, channels: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(in_channels, channels, lookahead + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, 3)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, n, in) -> (B, n, in). ``context`` (B, lookahead, in): the real tokens after x;
        None stands in zeros (the last call of a stream)."""
        h = x.transpose(1, 2)
        if context is None:
            h = F.pad(h, (0, self.lookahead))
        else:
            h = torch.cat([h, context.transpose(1, 2)], dim=2)
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


def _with_uncond(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[conditional rows ‖ zeros]: the classifier-free guidance batch of mu, speaker, cond."""
    return [torch.cat([v, torch.zeros_like(v)]) for v in tensors]


class Cv3CFM(nn.Module):
    """``CausalConditionalCFM`` around the DiT: Euler steps with classifier-free guidance.

    The estimator batch is [conditional rows ‖ rows with mu, speaker and cond zeroed];
    v = (1 + r)·v_cond − r·v_uncond; t accumulates dt like upstream.
    """

    def __init__(self, cfg: Cv3FlowConfig):
        super().__init__()
        self.estimator = Cv3DiT(cfg.estimator)
        self.cfg_rate = cfg.inference_cfg_rate

    def euler_steps(self, z, mask, mu, spks, cond, *, streaming: bool,
                    n_timesteps: int = N_TIMESTEPS) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (t given to the estimator, raw estimator output (2B, 80, T), state after the step)."""
        mask2, mu2, spks2, cond2 = torch.cat([mask, mask]), *_with_uncond(mu, spks, cond)

        def estimate(_step: int, x2: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
            return self.estimator(x2, mask2, mu2, t2, spks2, cond2, streaming=streaming)

        return self._integrate(z, n_timesteps, estimate)

    def window_steps(self, z, mu, spks, cond, state: WindowState, commit: int,
                     sampler: "WindowSampler | None" = None) -> tuple[torch.Tensor, WindowState]:
        """Block-masked sampling of a window of frames after the committed ones of ``state``
        (:meth:`Cv3DiT.forward_window` at every Euler step): z, mu, cond (1, 80, W), spks (1, 80).
        Returns the sampled window and the state with the window's first ``commit`` frames committed.
        ``sampler`` runs :meth:`sample_state_window` another way (CUDA graphs, ``cosyserve.token2wav``)."""
        chunk = self.estimator.cfg.static_chunk_size
        if state.frames % chunk or not 0 <= commit <= z.shape[2]:
            raise ValueError(f"window at frame {state.frames} (block {chunk}) cannot commit {commit} of "
                             f"{z.shape[2]} frames")
        mu2, spks2, cond2 = _with_uncond(mu, spks, cond)
        x, kv, inputs1, inputs2 = (sampler or self.sample_state_window)(z, mu2, cond2, spks2, state)
        return x, commit_window(state, kv, inputs1, inputs2, commit)

    def sample_state_window(self, z, mu2, cond2, spks2, state: WindowState) -> tuple[torch.Tensor, ...]:
        """:meth:`sample_window` on the window after ``state``'s committed frames, eagerly (the default
        :data:`WindowSampler`)."""
        angles, mask = self.estimator.window_geometry(state.frames, z.shape[2])
        return self.sample_window(z, mu2, cond2, spks2, state.kv, state.conv_context, angles, mask)

    def sample_window(self, z, mu2, cond2, spks2, past_kv: torch.Tensor | None, conv_context: torch.Tensor | None,
                      angles: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every Euler step on one window (conditions already in CFG rows, :func:`_with_uncond`):
        ``past_kv`` (steps, blocks, 2, 2B, heads, P, dim_head), ``conv_context`` (steps, 2, 2B, D, 30).
        Returns the sampled window (B, 80, W), the window's keys/values of every step (steps, blocks,
        2, 2B, heads, W, dim_head) and the position convolutions' inputs (steps, 2B, D, 30 + W) x 2.
        Pure tensor work without host synchronisation (capturable in a CUDA graph)."""
        outputs = []

        def estimate(step: int, x2: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
            kv = None if past_kv is None else window_kv(past_kv[step], x2.shape[2], self.estimator.cfg, x2)
            out, kv, inputs1, inputs2 = self.estimator.forward_window(
                x2, mu2, t2, spks2, cond2, kv, None if conv_context is None else conv_context[step], angles, mask)
            outputs.append((kv, inputs1, inputs2))
            return out

        for _, _, x in self._integrate(z, N_TIMESTEPS, estimate):
            pass
        kv, inputs1, inputs2 = (torch.stack(parts) for parts in zip(*outputs))
        return x, kv, inputs1, inputs2

    def _integrate(self, z: torch.Tensor, n_timesteps: int, estimate) -> Iterator[tuple[torch.Tensor, ...]]:
        t_span = cosine_time_grid(n_timesteps, z.device, z.dtype)
        x, t, dt = z, t_span[0], t_span[1] - t_span[0]
        for step in range(1, n_timesteps + 1):
            out = estimate(step - 1, torch.cat([x, x]), t.expand(2 * x.shape[0]))
            v_cond, v_uncond = out.chunk(2)
            x = x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)
            yield t, out, x
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t

    def forward(self, mu, mask, spks, cond, *, streaming: bool) -> torch.Tensor:
        """mu, cond (B, 80, T); mask (B, 1, T); spks (B, 80) -> sampled mel (B, 80, T)."""
        x = fixed_noise(mu.shape[2], mu.device, mu.dtype).expand(mu.shape[0], -1, -1)
        for _, _, x in self.euler_steps(x, mask, mu, spks, cond, streaming=streaming):
            pass
        return x


@dataclass
class Cv3FlowInputs:
    """The sampler's conditions for one request (prompt frames included)."""

    spks: torch.Tensor  # (1, 80) normalised + projected speaker vector
    token_emb: torch.Tensor  # (1, n, 80) embedded prompt + target tokens (look-ahead included)
    pre_lookahead_out: torch.Tensor  # (1, n', 80), n' = n or n - look-ahead
    mu: torch.Tensor  # (1, 80, 2n')
    cond: torch.Tensor  # (1, 80, 2n'): prompt mel, then zeros
    mask: torch.Tensor  # (1, 1, 2n') all ones
    prompt_frames: int


class CosyVoice3Flow(nn.Module):
    def __init__(self, cfg: Cv3FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.pre_lookahead_channels,
                                                     cfg.pre_lookahead_len)
        self.decoder = Cv3CFM(cfg)

    def voice_prefix_frames(self, prompt_tokens: int) -> int:
        """Frames at the start of a stream that depend on the voice only: whole attention blocks of
        frames before the last ``pre_lookahead_len`` prompt tokens (a token's frames see the
        ``pre_lookahead_len`` tokens after it through the pre-look-ahead conv; the DiT's blocks see no
        later block, its position convs no later frame)."""
        frames = self.cfg.token_mel_ratio * max(0, prompt_tokens - self.cfg.pre_lookahead_len)
        chunk = self.cfg.estimator.static_chunk_size
        return frames // chunk * chunk

    def speaker_vector(self, embedding: torch.Tensor) -> torch.Tensor:
        """(B, 192) speaker embedding -> L2-normalised -> (B, 80)."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def prepare(self, tokens: torch.Tensor, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor,
                embedding: torch.Tensor, *, finalize: bool) -> Cv3FlowInputs:
        """tokens (1, N), prompt_tokens (1, P), prompt_feat (1, 2P, 80), embedding (1, 192) -> conditions."""
        w = self.spk_embed_affine_layer.weight
        if tokens.dim() != 2 or prompt_tokens.dim() != 2 or tokens.shape[0] != 1 or prompt_tokens.shape[0] != 1:
            raise InvalidInputError("the CosyVoice3 flow takes one request: tokens and prompt tokens of shape (1, n)")
        all_tokens = torch.cat([prompt_tokens, tokens], dim=1).to(w.device)
        speech_token_ids(all_tokens.reshape(-1), self.cfg.vocab_size)
        lookahead = 0 if finalize else self.cfg.pre_lookahead_len
        if all_tokens.shape[1] <= lookahead:
            raise InvalidInputError(f"a non-final flow call needs more than {lookahead} tokens (look-ahead)")
        prompt_frames = prompt_feat.shape[1]
        if prompt_feat.dim() != 3 or prompt_feat.shape[2] != self.cfg.output_size or \
                prompt_frames != self.cfg.token_mel_ratio * prompt_tokens.shape[1]:
            raise InvalidInputError(
                f"prompt_feat must be (1, {self.cfg.token_mel_ratio}·prompt tokens, {self.cfg.output_size}); got "
                f"{tuple(prompt_feat.shape)} for {prompt_tokens.shape[1]} prompt tokens")
        spks = self.speaker_vector(embedding.to(w.device, w.dtype))
        token_emb = self.input_embedding(all_tokens.clamp(min=0))
        if finalize:
            h = self.pre_lookahead_layer(token_emb)
        else:
            h = self.pre_lookahead_layer(token_emb[:, :-lookahead], context=token_emb[:, -lookahead:])
        mu = h.repeat_interleave(self.cfg.token_mel_ratio, dim=1).transpose(1, 2)
        if mu.shape[2] < prompt_frames:
            raise InvalidInputError(f"{tokens.shape[1]} target tokens leave no frame after the look-ahead")
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_frames] = prompt_feat.to(w.device, w.dtype).transpose(1, 2)
        mask = torch.ones_like(mu[:, :1])
        return Cv3FlowInputs(spks, token_emb, h, mu, cond, mask, prompt_frames)

    @torch.inference_mode()
    def inference(self, tokens: torch.Tensor, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, *, streaming: bool, finalize: bool) -> torch.Tensor:
        """Mel (1, 80, 2·(N − look-ahead)) float32 of the target tokens (the prompt frames dropped)."""
        inputs = self.prepare(tokens, prompt_tokens, prompt_feat, embedding, finalize=finalize)
        mel = self.decoder(inputs.mu, inputs.mask, inputs.spks, inputs.cond, streaming=streaming)
        return mel[:, :, inputs.prompt_frames:].float()


@dataclass(frozen=True)
class Cv3VoicePrefix:
    """The estimator state of a voice's prompt-only blocks: frames [0, ``frames``) of every stream of
    that voice, whatever its target tokens (:meth:`CosyVoice3Flow.voice_prefix_frames`). States are
    never changed in place (a commit makes new tensors), so streams share them."""

    state: WindowState

    @property
    def frames(self) -> int:
        return self.state.frames


class Cv3FlowStream:
    """Incremental block-masked flow for one utterance: each :meth:`push` samples only the frames after
    the last complete 50-frame block (the incomplete block is re-solved, complete ones never change
    under block masks), attending to the cached per-Euler-step keys/values of the committed blocks.

    Every call's output equals the reference's ``streaming=True`` call on all tokens so far (the
    Triton BLS's non-final calls, ``flow_tiny_io`` ``chunk{i}/mel``) restricted to the new frames; the
    final call is block-masked too (``stream_full/mel``), where the reference's final call uses full
    attention. The token conditions (embedding, pre-look-ahead conv) are recomputed over all tokens
    each call: they cost little next to the DiT.

    The blocks that hold only the voice's prompt are the same for every stream of that voice: a
    stream given the voice's ``prefix`` starts after them; one opened with ``keep_prefix`` samples
    them apart in its first push and offers them as :attr:`prefix` for the next streams.
    """

    def __init__(self, flow: CosyVoice3Flow, prompt_tokens: torch.Tensor, prompt_feat: torch.Tensor,
                 embedding: torch.Tensor, prefix: Cv3VoicePrefix | None = None, keep_prefix: bool = False,
                 sampler: WindowSampler | None = None):
        self.flow = flow
        self.sampler = sampler  # how windows are sampled (None: eagerly, Cv3CFM.sample_state_window)
        self.prompt = (prompt_tokens, prompt_feat, embedding)
        self.tokens = prompt_tokens.new_zeros(1, 0)
        self.state = prefix.state if prefix else WindowState(0, None, None)  # committed frames, prompt included
        self.emitted = prompt_feat.shape[1]  # frames returned so far, counting the prompt's
        self.finished = False
        self.prefix = prefix
        self._keep_prefix = keep_prefix and prefix is None

    @property
    def committed(self) -> int:
        """Frames (prompt included) whose estimator states are kept."""
        return self.state.frames

    @torch.inference_mode()
    def push(self, tokens: torch.Tensor, finalize: bool = False) -> torch.Tensor:
        """Append target tokens (1, n) and return the new mel frames (1, 80, f) float32. Non-final calls
        keep the last ``pre_lookahead_len`` tokens as look-ahead, as the reference does."""
        if self.finished:
            raise InvalidInputError("this flow stream is finished")
        flow, chunk = self.flow, self.flow.cfg.estimator.static_chunk_size
        self.tokens = torch.cat([self.tokens, tokens.to(self.tokens.device)], dim=1)
        prompt_tokens, prompt_feat, embedding = self.prompt
        lookahead = 0 if finalize else flow.cfg.pre_lookahead_len
        if prompt_tokens.shape[1] + self.tokens.shape[1] <= lookahead or \
                flow.cfg.token_mel_ratio * (prompt_tokens.shape[1] + self.tokens.shape[1] - lookahead) <= self.emitted:
            self.finished = finalize
            return prompt_feat.new_zeros(1, flow.cfg.output_size, 0)
        c = flow.prepare(self.tokens, prompt_tokens, prompt_feat, embedding, finalize=finalize)
        noise = fixed_noise(c.mu.shape[2], c.mu.device, c.mu.dtype)
        if self._keep_prefix:
            self._keep_prefix = False
            frames = flow.voice_prefix_frames(prompt_tokens.shape[1])
            if frames:
                window = slice(0, frames)
                _, self.state = flow.decoder.window_steps(noise[:, :, window], c.mu[:, :, window], c.spks,
                                                          c.cond[:, :, window], self.state, frames, self.sampler)
                self.prefix = Cv3VoicePrefix(self.state)
        start, end = self.state.frames, c.mu.shape[2]
        commit = end - start if finalize else end // chunk * chunk - start
        window = slice(start, end)
        mel, self.state = flow.decoder.window_steps(noise[:, :, window], c.mu[:, :, window], c.spks,
                                                    c.cond[:, :, window], self.state, commit, self.sampler)
        new = mel[:, :, self.emitted - start:].float()
        self.emitted, self.finished = end, finalize
        return new


def load_cosyvoice3_flow(model_dir: str | Path, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32, *, config: Cv3FlowConfig | None = None,
                         weights: str | Path | None = None) -> CosyVoice3Flow:
    """Build the flow from ``model_dir/cosyvoice3.yaml`` (or ``config``) and strictly load
    ``model_dir/flow.pt`` (or ``weights``)."""
    model_dir = Path(model_dir)
    config = config or config_from_model_dir(model_dir, Cv3FlowConfig)
    path = Path(weights) if weights is not None else model_dir / WEIGHTS_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read CosyVoice3 flow checkpoint {path}: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{path} is not a plain state dict of tensors")
    flow = CosyVoice3Flow(config)
    expected_inv_freq = flow.decoder.estimator.rotary_embed.inv_freq.clone()
    try:
        flow.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"{path} does not match the CosyVoice3 flow built from its config: {exc}") from exc
    if not torch.allclose(flow.decoder.estimator.rotary_embed.inv_freq, expected_inv_freq, rtol=1e-6, atol=0):
        raise ModelLoadError(f"{path}: rotary inv_freq differs from base-10000 frequencies of dim_head "
                             f"{config.estimator.dim_head}")
    return flow.to(device=device, dtype=dtype).eval().requires_grad_(False)
