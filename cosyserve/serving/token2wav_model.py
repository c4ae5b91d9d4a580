"""The ``token2wav`` Triton model: speech tokens (LLM ids) -> 24 kHz waveform, offline or streaming.

* Without ``token_offset``: the offline path (flow over every token, HiFT in one call).
* With ``token_offset`` + ``finalize``: one step of the streaming session keyed by the request id
  (the BLS sets ``request_id`` on its BLS requests). The session opens at its first step and
  closes after ``finalize``, on ``cancel`` (returns an empty waveform), on any error, or when
  idle for ``stream_idle_timeout_s`` (default 600 s). Sessions live in this process, hence one
  instance.
* Without ``prompt_*`` inputs the default speaker of ``spk2info.pt`` ("001") is used; otherwise
  all three prompt inputs must be sent (LLM ids for the tokens, fp16 features).

Metrics: ``cosyserve_token2wav_open_streams``, ``cosyserve_token2wav_batched_units_total`` and,
for where the time goes, ``cosyserve_token2wav_{flow,hift}_seconds_total`` (device time per stage,
:class:`~cosyserve.token2wav.cosyvoice2.Token2WavCounters`), ``cosyserve_token2wav_execute_seconds_total``
(wall time inside ``execute``), ``cosyserve_token2wav_flow_{calls,rows,frames,padded_frames}_total``
(:class:`~cosyserve.token2wav.graphs.FlowCounters`: batch fill and padding). With the flow engine
(``incremental_stream``): ``cosyserve_token2wav_state_pages{,_in_use}`` (its page pool) and
``cosyserve_token2wav_voices_cached`` (and ``cosyserve_token2wav_state_voice_pages``: the pages in use that hold them; the
rest belong to open streams, 0 when none is open); the registered speakers' prompt state is
computed at load (up to ``max_voices``).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..errors import InvalidInputError
from ..frontend.prompt import PromptFeatures
from ..frontend.speakers import SpeakerRegistry
from ..engine.front_end import DEFAULT_SPEAKER, Voice
from ..runtime import SPK2INFO
from ..token2wav.cosyvoice2 import load_token2wav
from ..token2wav.sessions import LocalToken2Wav, Token2WavCall
from .settings import Token2WavSettings
from .triton_utils import (Metric, WorkMetrics, error_response, apply_mps_settings, limit_torch_threads,
                           model_settings, optional_input, optional_scalar, raw_speech_tokens, required_input, tensor)

PROMPT_INPUTS = ("prompt_speech_tokens", "prompt_speech_feat", "prompt_spk_embedding")


class Token2WavModel:
    """Every request of a Triton batch is parsed alone (a bad one fails alone), then all valid ones
    run together through :meth:`LocalToken2Wav.run`: concurrent streams share flow and HiFT batches.

    Parameters: :class:`~cosyserve.serving.settings.Token2WavSettings`.
    """

    def __init__(self, config: dict):
        settings = model_settings(config, Token2WavSettings)
        apply_mps_settings(settings.mps_thread_percentage, settings.mps_priority)
        device = settings.torch_device()
        limit_torch_threads(settings.torch_threads, 1 if device.type == "cuda" else None)
        model = load_token2wav(settings.model_dir, device, settings.flow_dtype(device), settings.options(device))
        self.token2wav = LocalToken2Wav(model, settings.stream_idle_timeout_s, max_batch=settings.max_batch)
        registry = SpeakerRegistry.load(settings.model_dir / SPK2INFO)
        speaker = registry.get(DEFAULT_SPEAKER)
        self.default_voice = Voice(speaker.prompt_text, speaker.features, speaker.speaker_id)
        self.open_streams = Metric("cosyserve_token2wav_open_streams", "token2wav streaming sessions open",
                                   config["name"])
        self.batch_units = Metric("cosyserve_token2wav_batched_units_total",
                                  "token2wav requests run in shared batches", config["name"], kind="counter")
        self.work_metrics = WorkMetrics(config["name"], {
            "cosyserve_token2wav_flow_seconds_total": ("device time of flow batches", model.counters, "flow_s"),
            "cosyserve_token2wav_hift_seconds_total": ("device time of HiFT batches", model.counters, "hift_s"),
            "cosyserve_token2wav_flow_calls_total": ("flow Euler-loop batches", model.sampler.counters, "calls"),
            "cosyserve_token2wav_flow_rows_total": ("requests in flow batches", model.sampler.counters, "rows"),
            "cosyserve_token2wav_flow_frames_total": ("mel frames of requests in flow batches", model.sampler.counters,
                                                      "frames"),
            "cosyserve_token2wav_flow_padded_frames_total": ("mel frames computed by flow batches, padding included",
                                                             model.sampler.counters, "padded_frames"),
            "cosyserve_token2wav_engine_fallbacks_total": ("streams that left the flow engine for the full re-run "
                                                           "because its state pool was full", model.counters,
                                                           "engine_fallbacks"),
        })
        self.execute_seconds = Metric("cosyserve_token2wav_execute_seconds_total",
                                      "wall time inside execute", config["name"], kind="counter")
        self.engine = model.engine
        if self.engine is not None:
            # registered voices' prompt state now (the default speaker last: most recently used)
            ids = [i for i in registry.ids() if i != DEFAULT_SPEAKER][:self.engine.max_voices - 1]
            for features in [registry.get(i).features for i in ids] + [self.default_voice.features]:
                self.engine.open(features.speech_tokens.reshape(1, -1).long(), features.speech_feat.reshape(
                    1, -1, features.speech_feat.shape[-1]), features.embedding.reshape(1, -1)).close()
            Metric("cosyserve_token2wav_state_pages", "pages of the flow engine's state pool",
                   config["name"]).set(self.engine.pool.pages)
            self.pages_in_use = Metric("cosyserve_token2wav_state_pages_in_use",
                                       "state pages held by streams and cached voices", config["name"])
            self.voices_cached = Metric("cosyserve_token2wav_voices_cached", "voices whose prompt state is kept",
                                        config["name"])
            self.voice_pages = Metric("cosyserve_token2wav_state_voice_pages",
                                      "state pages holding cached voices' prompt state", config["name"])
            self._publish_engine()

    def _publish_engine(self) -> None:
        if self.engine is not None:
            self.pages_in_use.set(self.engine.pool.pages - self.engine.pool.free_pages)
            self.voices_cached.set(self.engine.cached_voices)
            self.voice_pages.set(self.engine.voice_pages)

    def execute(self, requests) -> list:
        started = time.perf_counter()
        outcomes: list = [None] * len(requests)  # per request: waveform or exception
        calls, call_index = [], []
        for index, request in enumerate(requests):
            try:
                call = self._call(request)
            except Exception as exc:
                self.token2wav.cancel(request.request_id())  # a failed request never keeps a session
                outcomes[index] = exc
                continue
            if call is None:  # cancel
                outcomes[index] = np.zeros(0, np.float32)
            else:
                calls.append(call)
                call_index.append(index)
        for index, result in zip(call_index, self.token2wav.run(calls)):
            outcomes[index] = result
        self.batch_units.increment(len(calls))
        self.open_streams.set(self.token2wav.open_sessions)
        self._publish_engine()
        self.work_metrics.publish()
        responses = [error_response(o) if isinstance(o, Exception) else
                     pb_utils.InferenceResponse(output_tensors=[tensor("waveform", o)]) for o in outcomes]
        self.execute_seconds.increment(time.perf_counter() - started)
        return responses

    def _call(self, request) -> Token2WavCall | None:
        """The request as a :class:`Token2WavCall`; None for a ``cancel`` request (done here)."""
        request_id = request.request_id()
        if optional_scalar(request, "cancel"):
            self.token2wav.cancel(request_id)
            return None
        tokens = raw_speech_tokens(required_input(request, "target_speech_tokens"), "target_speech_tokens")
        voice = self._voice(request)
        token_offset = optional_scalar(request, "token_offset")
        if token_offset is None:
            return Token2WavCall(request_id, tokens, voice)
        finalize = optional_scalar(request, "finalize")
        if finalize is None:
            raise InvalidInputError("token_offset needs finalize (true on the last chunk of the stream)")
        if not request_id:
            raise InvalidInputError("streaming token2wav (token_offset given) needs a request id to key its session")
        return Token2WavCall(request_id, tokens, voice, int(token_offset), bool(finalize))

    def _voice(self, request) -> Voice:
        prompt = {name: optional_input(request, name) for name in PROMPT_INPUTS}
        sent = [name for name, value in prompt.items() if value is not None]
        if not sent:
            return self.default_voice
        if len(sent) != len(PROMPT_INPUTS):
            raise InvalidInputError(f"got {sent} but not the others: {list(PROMPT_INPUTS)} go together "
                                    "(or send none of them for the default speaker)")
        features = PromptFeatures(
            speech_tokens=torch.from_numpy(raw_speech_tokens(prompt["prompt_speech_tokens"], "prompt_speech_tokens")),
            speech_feat=torch.from_numpy(prompt["prompt_speech_feat"].astype(np.float32)),
            embedding=torch.from_numpy(prompt["prompt_spk_embedding"].astype(np.float32).reshape(-1)),
        )
        return Voice("", features)

    def close(self) -> None:
        self.token2wav.close_all()

