"""CosyVoice3's ``token2wav`` Triton model (template ``token2wav_cosyvoice3``): speech tokens -> 24 kHz waveform.

Over :class:`~cosyserve.token2wav.cosyvoice3.CosyVoice3Token2Wav` (DiT flow + causal HiFT; when
streaming the vocoder is incremental, and the flow too unless ``incremental_stream`` is false: then
it re-runs over the prefix with full attention, as the reference). Tokens travel as raw codes 0..6560, as between the reference's
CosyVoice3 models. The reference splits this into ``token2wav`` (mel) and ``vocoder`` (waveform,
re-vocoding the whole mel each chunk); here one model returns only the new samples.

* Without ``token_offset``: offline (full-attention flow over every token, one vocoder call).
* With ``token_offset`` + ``finalize``: one step of the streaming session keyed by the request id,
  which must carry ``prompt_speech_tokens``, ``prompt_speech_feat`` (FP16 [2P, 80]) and
  ``prompt_spk_embedding`` (FP16 [192]) at its first step (later steps may omit them). The session
  closes after ``finalize``, on ``cancel`` (an empty waveform back), on any error, or when idle
  for ``stream_idle_timeout_s``.

Requests of a batch run one after the other. Metrics: ``cosyserve_token2wav_open_streams``,
``cosyserve_token2wav_voices_cached`` and ``cosyserve_token2wav_voice_prefix_{hits,misses}_total``
(streams of a voice whose prompt-only flow states were kept, ``voice_prefixes``).
"""

from __future__ import annotations

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..errors import InvalidInputError
from ..frontend.prompt import PromptFeatures, Voice
from ..token2wav.cosyvoice3 import load_cosyvoice3_token2wav
from .settings import Cv3Token2WavSettings
from .token2wav_model import PROMPT_INPUTS
from .triton_utils import (Metric, WorkMetrics, error_response, limit_torch_threads, model_settings, optional_input,
                           optional_scalar, required_input, tensor)


class Cv3Token2WavModel:
    def __init__(self, config: dict):
        settings = model_settings(config, Cv3Token2WavSettings)
        device = settings.torch_device()
        limit_torch_threads(settings.torch_threads, 1 if device.type == "cuda" else None)
        self.token2wav = load_cosyvoice3_token2wav(settings.model_dir, device, settings.flow_dtype(device),
                                                   settings.stream_idle_timeout_s, settings.incremental_stream is not False,
                                                   settings.voice_prefixes, settings.window_graphs(device))
        self.open_streams = Metric("cosyserve_token2wav_open_streams", "token2wav streaming sessions open",
                                   config["name"])
        self.voices_cached = Metric("cosyserve_token2wav_voices_cached", "voices whose prompt-only flow states "
                                    "are kept", config["name"])
        self.prefix_lookups = WorkMetrics(config["name"], {
            f"cosyserve_token2wav_voice_prefix_{outcome}_total": (
                f"incremental streams that found ({outcome}) their voice's prompt states kept", self.token2wav,
                f"prefix_{outcome}") for outcome in ("hits", "misses")})

    def execute(self, requests) -> list:
        responses = []
        for request in requests:
            try:
                waveform = self._run(request)
                responses.append(pb_utils.InferenceResponse(output_tensors=[tensor("waveform", waveform)]))
            except Exception as exc:
                self.token2wav.cancel(request.request_id())  # a failed request never keeps a session
                responses.append(error_response(exc))
        self.open_streams.set(self.token2wav.open_sessions)
        self.voices_cached.set(self.token2wav.cached_voices)
        self.prefix_lookups.publish()
        return responses

    def _run(self, request) -> np.ndarray:
        request_id = request.request_id()
        if optional_scalar(request, "cancel"):
            self.token2wav.cancel(request_id)
            return np.zeros(0, np.float32)
        tokens = required_input(request, "target_speech_tokens").reshape(-1)
        token_offset = optional_scalar(request, "token_offset")
        if token_offset is None:
            return self.token2wav.offline(request_id, tokens, self._voice(request, required=True))
        finalize = optional_scalar(request, "finalize")
        if finalize is None:
            raise InvalidInputError("token_offset needs finalize (true on the last chunk of the stream)")
        if not request_id:
            raise InvalidInputError("streaming token2wav (token_offset given) needs a request id to key its session")
        return self.token2wav.step(request_id, tokens, self._voice(request, required=int(token_offset) == 0),
                                   int(token_offset), bool(finalize))

    @staticmethod
    def _voice(request, required: bool) -> Voice | None:
        prompt = {name: optional_input(request, name) for name in PROMPT_INPUTS}
        sent = [name for name, value in prompt.items() if value is not None]
        if not sent and not required:
            return None  # a later step of an open session
        if len(sent) != len(PROMPT_INPUTS):
            raise InvalidInputError(f"got {sent}: {list(PROMPT_INPUTS)} are required together (CosyVoice3 has no "
                                    "default speaker)")
        return Voice("", PromptFeatures(
            speech_tokens=torch.from_numpy(prompt["prompt_speech_tokens"].reshape(-1).astype(np.int32)),
            speech_feat=torch.from_numpy(prompt["prompt_speech_feat"].astype(np.float32).reshape(-1, 80)),
            embedding=torch.from_numpy(prompt["prompt_spk_embedding"].astype(np.float32).reshape(-1))))

    def close(self) -> None:
        for request_id in list(self.token2wav.session_ids):
            self.token2wav.cancel(request_id)
