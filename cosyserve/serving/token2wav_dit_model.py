"""The ``token2wav_dit`` Triton model: speech tokens (LLM ids) -> 24 kHz waveform with the DiT flow.

Inputs (all ``[1, ...]``): ``target_speech_tokens`` INT32 (speech token + 151663); the speaker as
``reference_wav`` FP32 (16 kHz) + ``reference_wav_len`` INT32, or ``speaker_id`` BYTES (a voice of
the ``spk2info`` file); ``finalize`` BOOL; ``cancel`` BOOL. Output: ``waveform`` FP32.

* With ``finalize``: one chunk of the stream keyed by the request id (the BLS sets ``request_id``
  on its requests). A chunk carries only its new tokens (+3 look-ahead unless ``finalize``). The
  first chunk opens the stream and must name the speaker; later chunks may repeat it (NVIDIA's BLS
  does), it is then ignored. The stream closes after ``finalize``, on ``cancel`` (answered with an
  empty waveform), on any error, or when idle for ``stream_idle_timeout_s``.
* Without ``finalize``: offline, the whole utterance in one call.

Streams and speaker caches live in this process, hence one instance (config.pbtxt). Logic:
:class:`~cosyserve.token2wav.dit_service.DitToken2WavService`. Metrics:
``cosyserve_token2wav_dit_open_streams``, ``cosyserve_token2wav_dit_cached_speakers``.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidInputError
from ..token2wav.dit_service import DitToken2WavService, SpeakerRef, load_dit_service
from .settings import DitToken2WavSettings
from .triton_utils import (Metric, limit_torch_threads, model_settings, optional_input, optional_scalar, optional_text,
                           raw_speech_tokens, reference_wav, required_input, respond_each, tensor)


class Token2WavDitModel:
    def __init__(self, config: dict):
        settings = model_settings(config, DitToken2WavSettings)
        device = settings.torch_device()
        limit_torch_threads(settings.torch_threads, 1 if device.type == "cuda" else None)
        self.service: DitToken2WavService = load_dit_service(
            settings.model_dir, device, spk2info=settings.spk2info, max_speakers=settings.max_speakers,
            idle_timeout_s=settings.stream_idle_timeout_s)
        name = config["name"]
        self.open_streams = Metric("cosyserve_token2wav_dit_open_streams", "DiT token2wav streams open", name)
        self.cached_speakers = Metric("cosyserve_token2wav_dit_cached_speakers",
                                      "speakers whose DiT stream caches are kept", name)

    def execute(self, requests) -> list:
        responses = respond_each(requests, self._run_or_close)
        self.open_streams.set(len(self.service.open_stream_ids))
        self.cached_speakers.set(len(self.service.cached_speakers))
        return responses

    def _run_or_close(self, request) -> list:
        try:
            return [tensor("waveform", self._run(request))]
        except Exception:
            self.service.cancel(request.request_id())  # a failed request never keeps a stream
            raise

    def _run(self, request) -> np.ndarray:
        request_id = request.request_id()
        if optional_scalar(request, "cancel"):
            self.service.cancel(request_id)
            return np.zeros(0, np.float32)
        tokens = raw_speech_tokens(required_input(request, "target_speech_tokens"), "target_speech_tokens")
        speaker = _speaker(request)
        finalize = optional_scalar(request, "finalize")
        if finalize is None:
            if speaker is None:
                raise InvalidInputError("send the speaker: reference_wav (+ reference_wav_len) or speaker_id")
            return self.service.offline(tokens, speaker)
        return self.service.step(request_id, tokens, speaker, bool(finalize))

    def close(self) -> None:
        self.service.close()


def _speaker(request) -> SpeakerRef | None:
    speaker_id = optional_text(request, "speaker_id")
    has_wav = optional_input(request, "reference_wav") is not None
    if has_wav and speaker_id:
        raise InvalidInputError("send either reference_wav or speaker_id, not both")
    if has_wav:
        return SpeakerRef(wav16=reference_wav(request).astype(np.float32))
    return SpeakerRef(speaker_id=speaker_id) if speaker_id else None
