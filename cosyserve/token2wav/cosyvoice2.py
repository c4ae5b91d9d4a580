"""CosyVoice2 token2wav: speech tokens → 24 kHz waveform (flow + HiFT), offline and streaming.

Reproduces the Triton ``token2wav`` model (``CosyVoice2Model.token2wav``):

* offline (no ``token_offset``): flow non-streaming over all tokens, HiFT in one call;
* streaming: every call re-runs the flow over *all* tokens received so far (no flow cache) with
  ``streaming = not finalize``; the first ``token_mel_ratio · token_offset`` frames (already
  voiced) are dropped and the rest goes through a :class:`HiftStream` (8-frame mel cache,
  3840-sample excitation cache, Hamming cross-fade, 3840 samples withheld until the next chunk).

Token ids are raw speech tokens in [0, vocab_size) (6561), not LLM ids.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInputError
from ..models.flow import CosyVoice2Flow, load_flow
from ..models.hift import HiFTGenerator, load_hift
from .vocoder_stream import HiftStream, SineNoiseProvider, VocoderChunk


@dataclass
class _Prompt:
    tokens: torch.Tensor  # (1, P) long
    feat: torch.Tensor  # (1, ratio·P, 80)
    embedding: torch.Tensor  # (1, spk_embed_dim)


class CosyVoice2Token2Wav:
    """Flow + HiFT on one device. ``dtype`` is the flow's compute dtype; HiFT keeps its own
    (the Triton deployment runs the flow in fp16 and HiFT in fp32). Open streams are tracked so
    servers and tests can check that no per-request state outlives its request."""

    def __init__(self, flow: CosyVoice2Flow, hift: HiFTGenerator, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        self.dtype = dtype
        self.flow = flow.to(device=self.device, dtype=dtype).eval()
        self.hift = hift.to(device=self.device).eval()
        self._streams: dict[str, Token2WavStream] = {}
        self._lock = threading.Lock()

    # ----- offline -----

    def offline(self, tokens: Any, prompt_tokens: Any, prompt_feat: Any, embedding: Any, *,
                generator: torch.Generator | None = None, sine_noise: SineNoiseProvider | None = None) -> torch.Tensor:
        """All tokens at once → waveform (480·2·len(tokens),) float32 on the CPU.

        HiFT randomness: drawn on ``generator`` (default generator if None), or injected by
        ``sine_noise`` (called with the sample count).
        """
        prompt = self._prompt(prompt_tokens, prompt_feat, embedding)
        tokens = self._tokens(tokens, "tokens")
        if tokens.shape[1] == 0:
            raise InvalidInputError("tokens is empty; at least one speech token is required")
        mel = self._flow(tokens, prompt, streaming=False, finalize=True)
        noise = sine_noise(mel.shape[2] * self.hift.hop_length) if sine_noise else None
        speech, _ = self.hift.inference(mel, generator=generator, sine_noise=noise)
        return speech[0].float().cpu()

    # ----- streaming -----

    def open_stream(self, request_id: str, prompt_tokens: Any, prompt_feat: Any, embedding: Any, *,
                    generator: torch.Generator | None = None,
                    sine_noise: SineNoiseProvider | None = None) -> "Token2WavStream":
        """Start a streaming session for ``request_id`` (must not already be open). HiFT randomness
        as in :meth:`offline`; one generator serves all chunks of the session in order."""
        prompt = self._prompt(prompt_tokens, prompt_feat, embedding)
        with self._lock:
            if request_id in self._streams:
                raise InvalidInputError(f"a token2wav stream for request id {request_id!r} is already open")
            vocoder = HiftStream(self.hift, generator=generator, sine_noise=sine_noise)
            stream = Token2WavStream(self, request_id, prompt, vocoder)
            self._streams[request_id] = stream
        return stream

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def open_stream_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def get_stream(self, request_id: str) -> "Token2WavStream":
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            raise InvalidInputError(f"no open token2wav stream for request id {request_id!r}")
        return stream

    def close_all(self) -> None:
        """Close every open stream (server shutdown)."""
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.close()

    def _forget(self, stream: "Token2WavStream") -> None:
        with self._lock:
            # Only if still registered: the id may have been reused by a newer stream.
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]

    # ----- helpers -----

    def _flow(self, tokens: torch.Tensor, prompt: _Prompt, *, streaming: bool, finalize: bool) -> torch.Tensor:
        return self.flow.inference(tokens, prompt.tokens, prompt.feat, prompt.embedding,
                                   streaming=streaming, finalize=finalize)

    def _tokens(self, value: Any, name: str) -> torch.Tensor:
        """Speech-token ids as a (1, n) long tensor on the device; ids must lie in [0, vocab_size)."""
        tokens = torch.as_tensor(value) if not isinstance(value, torch.Tensor) else value
        if tokens.numel() == 0:
            tokens = tokens.long()  # an empty list parses as float
        if tokens.dim() == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.dim() != 1:
            raise InvalidInputError(
                f"{name} must be a 1-D sequence (or (1, n)) of speech-token ids, got shape {tuple(tokens.shape)}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise InvalidInputError(f"{name} must hold integer speech-token ids, got dtype {tokens.dtype}")
        vocab = self.flow.cfg.vocab_size
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise InvalidInputError(
                f"{name} has ids in [{int(tokens.min())}, {int(tokens.max())}]; raw speech-token ids must lie in "
                f"[0, {vocab}) (LLM ids must be shifted back before token2wav)"
            )
        return tokens.to(self.device, torch.long)[None]

    def _prompt(self, prompt_tokens: Any, prompt_feat: Any, embedding: Any) -> _Prompt:
        tokens = self._tokens(prompt_tokens, "prompt_tokens")
        cfg = self.flow.cfg
        feat = _float_tensor(prompt_feat, "prompt_feat")
        if feat.dim() == 2:
            feat = feat[None]
        expected = (1, cfg.token_mel_ratio * tokens.shape[1], cfg.output_size)
        if tuple(feat.shape) != expected:
            raise InvalidInputError(
                f"prompt_feat must be (1, {cfg.token_mel_ratio}·prompt tokens, {cfg.output_size}) = {expected} "
                f"(time-major mel, exactly {cfg.token_mel_ratio} frames per prompt token), got {tuple(feat.shape)}"
            )
        emb = _float_tensor(embedding, "embedding").reshape(1, -1)
        if emb.shape[1] != cfg.spk_embed_dim:
            raise InvalidInputError(f"embedding must hold {cfg.spk_embed_dim} values, got {emb.shape[1]}")
        return _Prompt(tokens, feat.to(self.device, self.dtype), emb.to(self.device, self.dtype))


class Token2WavStream:
    """One request's streaming session (see :meth:`CosyVoice2Token2Wav.open_stream`).

    Call :meth:`step` with the cumulative tokens each time the scheduler emits a chunk; the
    returned pieces concatenate to the waveform. The session closes itself after the final step
    and on any error (its state may then be inconsistent); :meth:`close` is idempotent and also
    serves cancellation. Usable as a context manager.
    """

    def __init__(self, owner: CosyVoice2Token2Wav, request_id: str, prompt: _Prompt, vocoder: HiftStream):
        self.owner = owner
        self.request_id = request_id
        self._prompt: _Prompt | None = prompt
        self._vocoder = vocoder
        self._frames_done = 0  # mel frames already handed to the vocoder

    @property
    def closed(self) -> bool:
        return self._prompt is None

    def step(self, tokens_so_far: Any, token_offset: int, finalize: bool) -> torch.Tensor:
        """Voice tokens[token_offset:] → waveform piece (S,) float32 on the CPU."""
        return self.step_chunk(tokens_so_far, token_offset, finalize).audio[0].float().cpu()

    def step_chunk(self, tokens_so_far: Any, token_offset: int, finalize: bool) -> VocoderChunk:
        """:meth:`step` returning the vocoder call's details (mel given to HiFT, raw output...)."""
        if self._prompt is None:
            raise InvalidInputError(f"token2wav stream {self.request_id!r} is closed (finalized, cancelled or failed)")
        try:
            chunk = self._step(tokens_so_far, token_offset, finalize)
        except BaseException:
            self.close()
            raise
        if finalize:
            self.close()
        return chunk

    def _step(self, tokens_so_far: Any, token_offset: int, finalize: bool) -> VocoderChunk:
        cfg = self.owner.flow.cfg
        tokens = self.owner._tokens(tokens_so_far, "tokens_so_far")
        if isinstance(token_offset, bool) or not isinstance(token_offset, int) or token_offset < 0:
            raise InvalidInputError(f"token_offset must be a non-negative int, got {token_offset!r}")
        if token_offset * cfg.token_mel_ratio != self._frames_done:
            raise InvalidInputError(
                f"token_offset {token_offset} does not continue the stream: {self._frames_done // cfg.token_mel_ratio} "
                "tokens have been voiced so far"
            )
        voiceable = tokens.shape[1] - (0 if finalize else cfg.pre_lookahead_len)
        if voiceable <= token_offset:
            raise InvalidInputError(
                f"{tokens.shape[1]} tokens with token_offset {token_offset}: a "
                f"{'final' if finalize else 'non-final'} step needs more than "
                f"{token_offset + (0 if finalize else cfg.pre_lookahead_len)} tokens"
                + ("" if finalize else f" (the last {cfg.pre_lookahead_len} are look-ahead only)")
            )
        mel = self.owner._flow(tokens, self._prompt, streaming=not finalize, finalize=finalize)
        mel = mel[:, :, token_offset * cfg.token_mel_ratio:]
        chunk = self._vocoder.push(mel, finalize=finalize)
        self._frames_done += mel.shape[2]
        return chunk

    def close(self) -> None:
        """Release the caches and leave the owner's registry (idempotent)."""
        self._prompt = None
        self._vocoder.close()
        self.owner._forget(self)

    def __enter__(self) -> "Token2WavStream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _float_tensor(value: Any, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(value) if not isinstance(value, torch.Tensor) else value
    if not tensor.is_floating_point():
        raise InvalidInputError(f"{name} must be floating point, got dtype {tensor.dtype}")
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidInputError(f"{name} contains NaN or infinite values")
    return tensor


def load_token2wav(model_dir: str | Path, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> CosyVoice2Token2Wav:
    """Load ``flow.pt`` + ``hift.pt`` (configured by ``cosyvoice2.yaml`` when present) from a
    CosyVoice2 model directory. The flow runs in ``dtype``, HiFT in float32."""
    flow = load_flow(model_dir, device, dtype)
    hift = load_hift(model_dir, device, torch.float32)
    return CosyVoice2Token2Wav(flow, hift, device, dtype)

