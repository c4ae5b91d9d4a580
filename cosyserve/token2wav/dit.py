"""DiT token2wav (Step-Audio-2-mini flow + HiFT): speech tokens -> 24 kHz waveform.

Reproduces NVIDIA's ``token2wav_dit`` runtime (served here as the engine's Step-Audio2 kind,
:mod:`cosyserve.engine.kinds.step_audio2`):

* **offline** (:meth:`DitToken2Wav.offline`): per item, flow over prompt‖target tokens with the
  prompt mel as condition, then one HiFT call on the frames after the prompt mel. Items may be
  batched; an item's output never depends on the rest of the batch (upstream's batch leaks
  padding into shorter items; we do not). Initial noise defaults to the fixed buffer's first
  frames (as StepFun's original single-item code; NVIDIA's runtime draws fresh noise per call).
* **streaming** (:meth:`DitToken2Wav.open_stream`): per speaker, the prompt is aligned to
  n = min(M // 2, n_p) tokens / P = 2n frames and run once through the flow to fill caches
  (:class:`SpeakerState`, LRU-bounded, shared read-only by that speaker's requests). Each
  request then feeds chunks of *new* tokens (+3 look-ahead unless last); per chunk the flow
  extends the request's caches, the estimator attention cache is trimmed to its first P and
  last 100 entries, and HiFT runs through :class:`HiftStream` (8-frame overlap, cross-fade).
  Per-request state is released on the last chunk, on any error and on :meth:`DitStream.close`.

A stream's chunk schedule is :class:`~cosyserve.schedule.DitChunkScheduler`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInputError
from ..speech_tokens import speech_token_ids
from ..models.dit.flow import DitFlow, FlowStreamCache, load_dit_flow
from ..models.hift import HiFTGenerator, load_hift
from .vocoder_stream import HiftStream, SineNoiseProvider, VocoderChunk

ESTIMATOR_CACHE_KEEP = 100  # oldest estimator-cache entries kept besides the first P
DEFAULT_MAX_SPEAKERS = 8  # each real-size speaker cache holds ~0.6 MiB (fp16) per prompt frame
# The front-end files of a Step-Audio-2-mini ``token2wav/`` directory (the same models as CosyVoice2's
# speech_tokenizer_v2.onnx and campplus.onnx)
DIT_TOKENIZER_ONNX = "speech_tokenizer_v2_25hz.onnx"
DIT_SPEAKER_ONNX = "campplus.onnx"

# ---------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class SpeakerPrompt:
    """Front-end outputs for a prompt: speech tokens (n_p,), 24 kHz log-mel (M, 80) time-major,
    CAM++ embedding (192,)."""

    tokens: Any
    mel: Any
    embedding: Any


@dataclass(frozen=True)
class OfflineRequest:
    tokens: Any  # (n,) target speech tokens
    prompt: SpeakerPrompt


@dataclass
class SpeakerState:
    """Per-speaker streaming state (read-only once built; requests share its tensors)."""

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
class DitStreamChunk:
    """What one streaming call produced."""

    audio: torch.Tensor  # (1, S) float32 samples to emit
    mel: torch.Tensor  # (1, 80, F) flow output of this chunk
    noise_offset: int  # first rand_noise frame used (= estimator cache length before the chunk)
    cache: FlowStreamCache | None  # the request's caches after this chunk (trimmed); None if no flow ran
    vocoder: VocoderChunk


# ---------------------------------------------------------------------------------- runtime
class DitToken2Wav:
    """Flow + HiFT as given (the flow may run in fp16/bf16; the deployment keeps HiFT in fp32).

    ``vocoder_noise`` injects HiFT's harmonic-source noise (tests); otherwise HiFT draws it on
    every call, as upstream does."""

    def __init__(
        self,
        flow: DitFlow,
        hift: HiFTGenerator,
        *,
        max_speakers: int = DEFAULT_MAX_SPEAKERS,
        vocoder_noise: SineNoiseProvider | None = None,
    ):
        if max_speakers < 1:
            raise InvalidInputError("max_speakers must be at least 1")
        self.flow = flow.eval()
        self.hift = hift.eval()
        self.max_speakers = max_speakers
        self.vocoder_noise = vocoder_noise
        self._speakers: OrderedDict[str, SpeakerState] = OrderedDict()
        self._streams: dict[str, DitStream] = {}
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.flow.cfg.vocab_size

    def _sine_noise(self, frames: int) -> torch.Tensor | None:
        return None if self.vocoder_noise is None else self.vocoder_noise(frames * self.hift.hop_length)

    # ----------------------------------------------------------------------------- offline
    def offline(
        self,
        requests: Sequence[OfflineRequest],
        *,
        noise: Sequence[torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
    ) -> list[torch.Tensor]:
        """Waveforms (S_i,) float32 on the CPU, S_i = 480·(2·(n_p + n_i) − M_i).

        ``noise`` optionally gives each item's initial noise (1, 80, ≥ 2·(n_p + n_i));
        ``generator`` drives HiFT's source noise."""
        if not requests:
            raise InvalidInputError("offline() needs at least one request")
        if noise is not None and len(noise) != len(requests):
            raise InvalidInputError(f"got {len(noise)} noise tensors for {len(requests)} requests")
        vocab, r = self.vocab_size, self.flow.up_rate
        items = []
        for i, req in enumerate(requests):
            target = speech_token_ids(req.tokens, vocab, f"requests[{i}].tokens")
            prompt_tokens = speech_token_ids(req.prompt.tokens, vocab, f"requests[{i}].prompt.tokens")
            mel = _floats(req.prompt.mel, f"requests[{i}].prompt.mel", (None, self.flow.cfg.output_size))
            emb = _floats(req.prompt.embedding, f"requests[{i}].prompt.embedding", (self.flow.cfg.spk_embed_dim,))
            tokens = torch.cat([prompt_tokens, target])
            if tokens.numel() == 0:
                raise InvalidInputError(f"requests[{i}] has no tokens at all")
            items.append((tokens, mel, emb))
        lengths = torch.tensor([t.numel() for t, _, _ in items])
        mel_lens = torch.tensor([m.shape[0] for _, m, _ in items])
        tokens = torch.nn.utils.rnn.pad_sequence([t for t, _, _ in items], batch_first=True)
        prompt_mel = torch.nn.utils.rnn.pad_sequence([m for _, m, _ in items], batch_first=True)
        frames = r * int(lengths.max())
        z = torch.zeros(len(items), self.flow.cfg.output_size, frames, device=self.flow.decoder.rand_noise.device)
        for i, n in enumerate(lengths.tolist()):
            item_noise = self.flow.decoder.noise_slice(0, r * n) if noise is None else noise[i]
            if item_noise.dim() != 3 or item_noise.shape[1] != z.shape[1] or item_noise.shape[2] < r * n:
                raise InvalidInputError(f"noise[{i}] must be (1, {z.shape[1]}, >= {r * n}); got {tuple(item_noise.shape)}")
            z[i, :, : r * n] = item_noise[0, :, : r * n]
        mels, frame_lens = self.flow.inference(tokens, lengths, prompt_mel, mel_lens,
                                               torch.stack([e for _, _, e in items]), z)
        waves = []
        for i, (start, end) in enumerate(zip(mel_lens.tolist(), frame_lens.tolist())):
            if end <= start:  # the prompt mel covers every generated frame
                waves.append(torch.zeros(0))
                continue
            speech, _ = self.hift.inference(mels[i:i + 1, :, start:end], generator=generator,
                                            sine_noise=self._sine_noise(end - start))
            waves.append(speech[0].float().cpu())
        return waves

    # ----------------------------------------------------------------------------- speakers
    def speaker_state(self, key: str, prompt: SpeakerPrompt | None = None) -> SpeakerState:
        """The cached streaming state of speaker ``key``, built from ``prompt`` on first use."""
        with self._lock:
            state = self._speakers.get(key)
            if state is not None:
                self._speakers.move_to_end(key)
                return state
        if prompt is None:
            raise InvalidInputError(f"speaker {key!r} is not cached; send its prompt")
        state = self._build_speaker(prompt)
        with self._lock:
            self._speakers[key] = state
            self._speakers.move_to_end(key)
            while len(self._speakers) > self.max_speakers:
                self._speakers.popitem(last=False)  # streams already open keep their own references
        return state

    @property
    def cached_speakers(self) -> list[str]:
        with self._lock:
            return list(self._speakers)

    def _build_speaker(self, prompt: SpeakerPrompt) -> SpeakerState:
        flow, r = self.flow, self.flow.up_rate
        tokens = speech_token_ids(prompt.tokens, self.vocab_size, "prompt.tokens")
        mel = _floats(prompt.mel, "prompt.mel", (None, flow.cfg.output_size))
        emb = _floats(prompt.embedding, "prompt.embedding", (flow.cfg.spk_embed_dim,))
        n = min(mel.shape[0] // r, tokens.numel())  # align tokens and frames (r frames per token)
        if n < flow.pre_lookahead_len:
            raise InvalidInputError(
                f"speaker prompt too short: {tokens.numel()} tokens / {mel.shape[0]} mel frames give {n} aligned "
                f"tokens; at least {flow.pre_lookahead_len} are needed")
        with torch.inference_mode():
            spk_proj = flow.project_speaker(emb[None])
            _, cache = flow.setup_stream(tokens[None, :n], mel[None, : r * n], spk_proj)
        return SpeakerState(spk_proj, r * n, cache)

    # ----------------------------------------------------------------------------- streams
    def open_stream(
        self,
        request_id: str,
        speaker: str,
        prompt: SpeakerPrompt | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> "DitStream":
        """Start request ``request_id`` for speaker key ``speaker`` (``prompt`` needed if uncached)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidInputError("request_id must be a non-empty string")
        with self._lock:
            if request_id in self._streams:
                raise InvalidInputError(f"a DiT token2wav stream for request id {request_id!r} is already open")
        state = self.speaker_state(speaker, prompt)
        with self._lock:
            if request_id in self._streams:
                raise InvalidInputError(f"a DiT token2wav stream for request id {request_id!r} is already open")
            vocoder = HiftStream(self.hift, generator=generator, sine_noise=self.vocoder_noise)
            stream = DitStream(self, request_id, state, vocoder)
            self._streams[request_id] = stream
        return stream

    def get_stream(self, request_id: str) -> "DitStream":
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            raise InvalidInputError(f"no open DiT token2wav stream for request id {request_id!r}")
        return stream

    @property
    def open_stream_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def close(self) -> None:
        """Close every open stream and drop the speaker caches (idempotent)."""
        with self._lock:
            streams = list(self._streams.values())
            self._speakers.clear()
        for stream in streams:
            stream.close()

    def _forget(self, stream: "DitStream") -> None:
        with self._lock:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]


class DitStream:
    """One request's streaming session. :meth:`step` voices the next chunk of tokens; the session
    closes itself after the last chunk and on any error; :meth:`close` (idempotent) cancels."""

    def __init__(self, owner: DitToken2Wav, request_id: str, speaker: SpeakerState, vocoder: HiftStream):
        self.owner = owner
        self.request_id = request_id
        self._speaker: SpeakerState | None = speaker
        self._cache: FlowStreamCache | None = speaker.flow_cache  # shared until the first chunk replaces it
        self._vocoder = vocoder

    @property
    def closed(self) -> bool:
        return self._speaker is None

    @property
    def cache(self) -> FlowStreamCache | None:
        """The request's current flow caches (after trimming); None once closed."""
        return self._cache

    def step(self, tokens: Any, finalize: bool) -> torch.Tensor:
        """Voice one chunk -> waveform piece (S,) float32 on the CPU."""
        return self.step_chunk(tokens, finalize).audio[0].cpu()

    def step_chunk(self, tokens: Any, finalize: bool) -> DitStreamChunk:
        """:meth:`step` with the chunk's details. ``tokens``: the new tokens followed by
        ``pre_lookahead_len`` look-ahead tokens, or just the remaining tokens when ``finalize``."""
        if self._speaker is None:
            raise InvalidInputError(f"DiT token2wav stream {self.request_id!r} is closed (finalized, cancelled or failed)")
        try:
            chunk = self._step(speech_token_ids(tokens, self.owner.vocab_size, "tokens"), bool(finalize))
        except BaseException:
            self.close()
            raise
        if finalize:
            self.close()
        return chunk

    def _step(self, tokens: torch.Tensor, finalize: bool) -> DitStreamChunk:
        owner, speaker = self.owner, self._speaker
        offset = self._cache.estimator.frames
        cache = None
        if tokens.numel() == 0:
            if not finalize:
                raise InvalidInputError("a chunk that is not the last needs tokens")
            # Nothing new to voice: flush the vocoder's withheld overlap.
            mel = torch.zeros(1, owner.flow.cfg.output_size, 0)
        else:
            mel, cache = owner.flow.stream_chunk(tokens[None], finalize, speaker.spk_proj, self._cache)
            estimator = cache.estimator.trimmed(speaker.prompt_frames, ESTIMATOR_CACHE_KEEP)
            cache = self._cache = FlowStreamCache(cache.encoder, estimator)
        vocoded = self._vocoder.push(mel, finalize=finalize)
        return DitStreamChunk(vocoded.audio.float(), mel, offset, cache, vocoded)

    def close(self) -> None:
        """Release the per-request caches and leave the owner's registry (idempotent)."""
        self._speaker = None
        self._cache = None
        self._vocoder.close()
        self.owner._forget(self)

    def __enter__(self) -> "DitStream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def load_dit_token2wav(
    model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kwargs: Any
) -> DitToken2Wav:
    """Load ``flow.pt`` (+ ``flow.yaml``) and ``hift.pt`` from a Step-Audio-2-mini ``token2wav``
    directory. The flow runs in ``dtype``, HiFT (default constructor values) in float32."""
    model_dir = Path(model_dir)
    flow = load_dit_flow(model_dir, device, dtype)
    hift = load_hift(model_dir / "hift.pt", device, torch.float32)
    return DitToken2Wav(flow, hift, **kwargs)
