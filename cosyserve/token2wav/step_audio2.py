"""Step-Audio2's token2wav (the Step-Audio-2-mini flow with a DiT estimator, and HiFT), one request
at a time: speech tokens -> 24 kHz waveform as NVIDIA's ``token2wav_dit`` runtime computes it.

This is the computation the parity suite checks against the reference's vectors and the engine's
kind (:mod:`cosyserve.engine.kinds.step_audio2`) reproduces with the work of many streams packed
together; it keeps no registry of streams or voices (the engine's kind keeps those).

* **offline** (:func:`offline_waveforms`): per item, flow over prompt‖target tokens with the
  prompt mel as condition, then one HiFT call on the frames after the prompt mel. Items may be
  batched; an item's output never depends on the rest of the batch (upstream's batch leaks
  padding into shorter items; we do not). Initial noise defaults to the fixed buffer's first
  frames (as StepFun's original single-item code; NVIDIA's runtime draws fresh noise per call).
* **streaming**: a voice's prompt is aligned to n = min(M // 2, n_p) tokens / P = 2n frames and
  run once through the flow to fill caches (:func:`build_voice_state`; read-only, shared by that
  voice's streams). A :class:`StepAudio2Stream` then takes chunks of *new* tokens (+3 look-ahead
  unless last); per chunk the flow extends the stream's caches, the estimator attention cache is
  trimmed to its first P and last 100 entries, and HiFT runs through :class:`HiftStream` (8-frame
  overlap, cross-fade). The stream's state is released on the last chunk, on any error and on
  :meth:`StepAudio2Stream.close`.

A stream's chunk schedule is :class:`~cosyserve.schedule.StepAudio2ChunkScheduler`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInputError
from ..speech_tokens import speech_token_ids
from ..models.step_audio2.flow import StepAudio2Flow, FlowStreamCache, load_step_audio2_flow
from ..models.hift import HiFTGenerator, load_hift
from .vocoder_stream import HiftStream, SineNoiseProvider, VocoderChunk

ESTIMATOR_CACHE_KEEP = 100  # oldest estimator-cache entries kept besides the first P
DEFAULT_MAX_VOICES = 8  # each real-size voice state holds ~0.6 MiB (fp16) per prompt frame
# The front-end files of a Step-Audio-2-mini ``token2wav/`` directory (the same models as CosyVoice2's
# speech_tokenizer_v2.onnx and campplus.onnx)
STEP_AUDIO2_TOKENIZER_ONNX = "speech_tokenizer_v2_25hz.onnx"
STEP_AUDIO2_SPEAKER_ONNX = "campplus.onnx"

# ---------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class VoicePrompt:
    """Front-end outputs for a prompt: speech tokens (n_p,), 24 kHz log-mel (M, 80) time-major,
    CAM++ embedding (192,)."""

    tokens: Any
    mel: Any
    embedding: Any


@dataclass(frozen=True)
class OfflineRequest:
    tokens: Any  # (n,) target speech tokens
    prompt: VoicePrompt


@dataclass
class VoiceState:
    """A voice's streaming state (read-only once built; its streams share its tensors)."""

    spk_proj: torch.Tensor  # (1, 80)
    prompt_frames: int  # P = 2n aligned prompt frames
    flow_cache: FlowStreamCache


def _floats(value: Any, name: str, shape: tuple[int | None, ...]) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if len(shape) == 2 and tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if len(shape) == 1:
        tensor = tensor.reshape(-1)
    ok = tensor.dim() == len(shape) and all(w is None or w == s for w, s in zip(shape, tensor.shape))
    if not ok or not tensor.is_floating_point():
        raise InvalidInputError(f"{name} must be a float tensor of shape {shape} (None = any); got "
                                f"{tuple(tensor.shape)} {tensor.dtype}")
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidInputError(f"{name} contains NaN or infinite values")
    return tensor.float()


@dataclass
class StepAudio2Chunk:
    """What one streaming call produced."""

    audio: torch.Tensor  # (1, S) float32 samples to emit
    mel: torch.Tensor  # (1, 80, F) flow output of this chunk
    noise_offset: int  # first rand_noise frame used (= estimator cache length before the chunk)
    cache: FlowStreamCache | None  # the request's caches after this chunk (trimmed); None if no flow ran
    vocoder: VocoderChunk


# ---------------------------------------------------------------------------------- models
@dataclass
class StepAudio2Models:
    """The flow (fp32, fp16 or bf16) and HiFT (fp32, as the deployment keeps it), in eval mode."""

    flow: StepAudio2Flow
    hift: HiFTGenerator

    def __post_init__(self):
        self.flow.eval()
        self.hift.eval()

    @property
    def vocab_size(self) -> int:
        return self.flow.cfg.vocab_size


def load_step_audio2(model_dir: str | Path, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> StepAudio2Models:
    """``flow.pt`` (+ ``flow.yaml``) in ``dtype`` and ``hift.pt`` (default constructor values) in
    float32, from a Step-Audio-2-mini ``token2wav`` directory."""
    model_dir = Path(model_dir)
    return StepAudio2Models(load_step_audio2_flow(model_dir, device, dtype),
                            load_hift(model_dir / "hift.pt", device, torch.float32))


def _hift_noise(hift: HiFTGenerator, sine_noise: SineNoiseProvider | None, frames: int) -> torch.Tensor | None:
    return None if sine_noise is None else sine_noise(frames * hift.hop_length)


# ---------------------------------------------------------------------------------- offline
def offline_waveforms(
    models: StepAudio2Models,
    requests: Sequence[OfflineRequest],
    *,
    noise: Sequence[torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    sine_noise: SineNoiseProvider | None = None,
) -> list[torch.Tensor]:
    """Waveforms (S_i,) float32 on the CPU, S_i = 480·(2·(n_p + n_i) − M_i).

    ``noise`` optionally gives each item's initial noise (1, 80, ≥ 2·(n_p + n_i)); HiFT's source
    noise comes from ``sine_noise`` (tests, parity) or is drawn per call (``generator``)."""
    flow, hift = models.flow, models.hift
    if not requests:
        raise InvalidInputError("offline_waveforms() needs at least one request")
    if noise is not None and len(noise) != len(requests):
        raise InvalidInputError(f"got {len(noise)} noise tensors for {len(requests)} requests")
    vocab, r = models.vocab_size, flow.up_rate
    items = []
    for i, req in enumerate(requests):
        target = speech_token_ids(req.tokens, vocab, f"requests[{i}].tokens")
        prompt_tokens = speech_token_ids(req.prompt.tokens, vocab, f"requests[{i}].prompt.tokens")
        mel = _floats(req.prompt.mel, f"requests[{i}].prompt.mel", (None, flow.cfg.output_size))
        emb = _floats(req.prompt.embedding, f"requests[{i}].prompt.embedding", (flow.cfg.spk_embed_dim,))
        tokens = torch.cat([prompt_tokens, target])
        if tokens.numel() == 0:
            raise InvalidInputError(f"requests[{i}] has no tokens at all")
        items.append((tokens, mel, emb))
    lengths = torch.tensor([t.numel() for t, _, _ in items])
    mel_lens = torch.tensor([m.shape[0] for _, m, _ in items])
    tokens = torch.nn.utils.rnn.pad_sequence([t for t, _, _ in items], batch_first=True)
    prompt_mel = torch.nn.utils.rnn.pad_sequence([m for _, m, _ in items], batch_first=True)
    frames = r * int(lengths.max())
    z = torch.zeros(len(items), flow.cfg.output_size, frames, device=flow.decoder.rand_noise.device)
    for i, n in enumerate(lengths.tolist()):
        item_noise = flow.decoder.noise_slice(0, r * n) if noise is None else noise[i]
        if item_noise.dim() != 3 or item_noise.shape[1] != z.shape[1] or item_noise.shape[2] < r * n:
            raise InvalidInputError(f"noise[{i}] must be (1, {z.shape[1]}, >= {r * n}); got {tuple(item_noise.shape)}")
        z[i, :, : r * n] = item_noise[0, :, : r * n]
    with torch.inference_mode():
        mels, frame_lens = flow.inference(tokens, lengths, prompt_mel, mel_lens,
                                          torch.stack([e for _, _, e in items]), z)
        waves = []
        for i, (start, end) in enumerate(zip(mel_lens.tolist(), frame_lens.tolist())):
            if end <= start:  # the prompt mel covers every generated frame
                waves.append(torch.zeros(0))
                continue
            speech, _ = hift.inference(mels[i:i + 1, :, start:end], generator=generator,
                                       sine_noise=_hift_noise(hift, sine_noise, end - start))
            waves.append(speech[0].float().cpu())
    return waves


# ---------------------------------------------------------------------------------- streaming
def build_voice_state(flow: StepAudio2Flow, prompt: VoicePrompt) -> VoiceState:
    """The prompt aligned (n = min(M // 2, n_p) tokens, 2n frames) and run once through the flow."""
    r = flow.up_rate
    tokens = speech_token_ids(prompt.tokens, flow.cfg.vocab_size, "prompt.tokens")
    mel = _floats(prompt.mel, "prompt.mel", (None, flow.cfg.output_size))
    emb = _floats(prompt.embedding, "prompt.embedding", (flow.cfg.spk_embed_dim,))
    n = min(mel.shape[0] // r, tokens.numel())  # align tokens and frames (r frames per token)
    if n < flow.pre_lookahead_len:
        raise InvalidInputError(
            f"voice prompt too short: {tokens.numel()} tokens / {mel.shape[0]} mel frames give {n} aligned "
            f"tokens; at least {flow.pre_lookahead_len} are needed")
    with torch.inference_mode():
        spk_proj = flow.project_speaker(emb[None])
        _, cache = flow.setup_stream(tokens[None, :n], mel[None, : r * n], spk_proj)
    return VoiceState(spk_proj, r * n, cache)


class StepAudio2Stream:
    """One request's stream of one voice. :meth:`step` voices the next chunk of tokens; the stream
    closes itself after the last chunk and on any error; :meth:`close` (idempotent) cancels."""

    def __init__(self, models: StepAudio2Models, voice: VoiceState, *, generator: torch.Generator | None = None,
                 sine_noise: SineNoiseProvider | None = None):
        self.models = models
        self._voice: VoiceState | None = voice
        self._cache: FlowStreamCache | None = voice.flow_cache  # shared until the first chunk replaces it
        self._vocoder = HiftStream(models.hift, generator=generator, sine_noise=sine_noise)

    @property
    def closed(self) -> bool:
        return self._voice is None

    @property
    def cache(self) -> FlowStreamCache | None:
        """The stream's current flow caches (after trimming); None once closed."""
        return self._cache

    def step(self, tokens: Any, finalize: bool) -> torch.Tensor:
        """Voice one chunk -> waveform piece (S,) float32 on the CPU."""
        return self.step_chunk(tokens, finalize).audio[0].cpu()

    def step_chunk(self, tokens: Any, finalize: bool) -> StepAudio2Chunk:
        """:meth:`step` with the chunk's details. ``tokens``: the new tokens followed by
        ``pre_lookahead_len`` look-ahead tokens, or just the remaining tokens when ``finalize``."""
        if self._voice is None:
            raise InvalidInputError("this Step-Audio2 stream is closed (finalized, cancelled or failed)")
        try:
            with torch.inference_mode():
                chunk = self._step(speech_token_ids(tokens, self.models.vocab_size, "tokens"), bool(finalize))
        except BaseException:
            self.close()
            raise
        if finalize:
            self.close()
        return chunk

    def _step(self, tokens: torch.Tensor, finalize: bool) -> StepAudio2Chunk:
        flow, voice = self.models.flow, self._voice
        offset = self._cache.estimator.frames
        cache = None
        if tokens.numel() == 0:
            if not finalize:
                raise InvalidInputError("a chunk that is not the last needs tokens")
            # Nothing new to voice: flush the vocoder's withheld overlap.
            mel = torch.zeros(1, flow.cfg.output_size, 0)
        else:
            mel, cache = flow.stream_chunk(tokens[None], finalize, voice.spk_proj, self._cache)
            estimator = cache.estimator.trimmed(voice.prompt_frames, ESTIMATOR_CACHE_KEEP)
            cache = self._cache = FlowStreamCache(cache.encoder, estimator)
        vocoded = self._vocoder.push(mel, finalize=finalize)
        return StepAudio2Chunk(vocoded.audio.float(), mel, offset, cache, vocoded)

    def close(self) -> None:
        """Release the stream's caches (idempotent)."""
        self._voice = None
        self._cache = None
        self._vocoder.close()

    def __enter__(self) -> "StepAudio2Stream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
