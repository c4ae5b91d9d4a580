"""What the text-to-speech front doors share (:mod:`.frontdoor`; ``cosyvoice2``, ``cosyvoice3``,
``cosyvoice2_dit``): the reference's wire protocol, the listener-side stream metrics, BLS requests.

Inputs (all ``[1, ...]``): ``target_text`` BYTES; optional ``reference_wav`` FP32 (16 kHz) with
``reference_wav_len`` INT32 and ``reference_text`` BYTES (zero-shot voice), or ``speaker_id`` BYTES
(a registered voice of spk2info.pt, or a voice uploaded through the HTTP API); neither = the default
speaker "001" where the model has one. Optional ``max_tokens`` / ``min_tokens`` INT32 override the
model's speech-token limits for one request; ``text_frontend`` BOOL (false: the text as sent) and
``instruction`` BYTES (instruct mode). Output: ``waveform`` FP32. ``decoupled`` true streams one
response per chunk, then an empty one with the final flag (or the error with it); false answers once.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from ..clients import Playback
from ..engine.front_end import TokenLimits, validate_text
from .triton_utils import Metric, optional_input, optional_scalar, optional_text, reference_wav

# Audio buffered ahead of the listener's playback when a chunk is sent (seconds; below 0: it stalled).
BUFFER_BUCKETS = [-1.0, -0.2, 0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]


def bls_request(model_name: str, inputs: dict[str, np.ndarray], outputs: list[str], request_id: str = ""):
    return pb_utils.InferenceRequest(model_name=model_name, requested_output_names=outputs, request_id=request_id,
                                     inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()])


class ListenerMetrics:
    """The listener's side of every stream, as the server sees it: playback starts with the first
    chunk sent and plays the chunks back to back (:class:`~cosyserve.clients.Playback`)."""

    def __init__(self, model_name: str):
        self.buffer_s = Metric("cosyserve_stream_buffer_seconds", "audio a stream's listener still had "
                               "buffered when its next chunk was sent (negative: playback had stalled)",
                               model_name, kind="histogram", buckets=BUFFER_BUCKETS)
        self.underruns = Metric("cosyserve_stream_underruns", "chunks sent after the audio before them had "
                                "finished playing", model_name, kind="counter")
        self.stall_s = Metric("cosyserve_stream_stall_seconds", "playback stalls of those underruns, in seconds",
                              model_name, kind="counter")

    def played(self, playback: Playback, seconds: float) -> None:
        """A chunk of ``seconds`` was sent now on the stream whose listener is ``playback``."""
        underruns, stall = playback.underruns, playback.stall_s
        buffered = playback.arrive(time.monotonic(), seconds)
        if buffered is not None:
            self.buffer_s.observe(buffered)
        if playback.underruns > underruns:
            self.underruns.increment(playback.underruns - underruns)
            self.stall_s.increment(playback.stall_s - stall)


@dataclass
class TTSInputs:
    """A request's inputs, checked."""

    request_id: str  # unique even when clients reuse ids: it keys the LLM request and the token2wav session
    target_text: str
    reference_wav: np.ndarray | None
    reference_text: str | None
    speaker_id: str | None
    limits: TokenLimits
    text_frontend: bool  # optional input ``text_frontend`` (default true): normalise and split the text
    instruction: str | None  # optional input ``instruction``: instruct mode
    prepare_voice: bool = False  # optional input ``prepare_voice``: only compute and keep the voice's state


def parse_tts_inputs(request, limits: TokenLimits, max_text_chars: int) -> TTSInputs:
    """Read and check a request's text, voice and token-limit inputs (the voice is resolved by the caller)."""
    target_text = validate_text(optional_text(request, "target_text"), "target_text", max_text_chars)
    wav = reference_wav(request) if optional_input(request, "reference_wav") is not None else None
    text_frontend = optional_scalar(request, "text_frontend")
    prepare_voice = optional_scalar(request, "prepare_voice")
    return TTSInputs(f"{request.request_id() or 'tts'}-{uuid.uuid4().hex[:12]}", target_text, wav,
                     optional_text(request, "reference_text"), optional_text(request, "speaker_id"),
                     limits.override(optional_scalar(request, "max_tokens"), optional_scalar(request, "min_tokens")),
                     True if text_frontend is None else bool(text_frontend), optional_text(request, "instruction"),
                     bool(prepare_voice))
