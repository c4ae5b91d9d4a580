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
(:class:`~cosyserve.token2wav.graphs.FlowCounters`: batch fill and padding).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..errors import InvalidInputError
from ..frontend.prompt import PromptFeatures
from ..frontend.speakers import SpeakerRegistry
from ..pipeline.tts import DEFAULT_SPEAKER, Voice
from ..runtime import SPK2INFO, STREAM_IDLE_TIMEOUT_S, resolve_device, resolve_device_dtype
from ..token2wav.cosyvoice2 import (DEFAULT_PRECAPTURE_FRAMES, Token2WavOptions, load_token2wav,
                                    streaming_vocoder_frames)
from ..token2wav.sessions import LocalToken2Wav, Token2WavCall
from .triton_utils import (Metric, WorkMetrics, error_response, apply_mps_settings, limit_torch_threads,
                           model_parameters, optional_input, optional_scalar, parse_flag, raw_speech_tokens,
                           required_input, required_parameter, tensor)

PROMPT_INPUTS = ("prompt_speech_tokens", "prompt_speech_feat", "prompt_spk_embedding")


class Token2WavModel:
    """Every request of a Triton batch is parsed alone (a bad one fails alone), then all valid ones
    run together through :meth:`LocalToken2Wav.run`: concurrent streams share flow and HiFT batches.

    Parameters (all optional but ``model_dir``): ``device``; ``dtype`` of the flow (default fp16
    on CUDA, fp32 on CPU; HiFT stays fp32); ``cuda_graphs`` (default on CUDA: replay the flow's
    ODE loop from CUDA graphs); ``precapture_frames`` (default 1500 with graphs: capture every
    flow graph for ``max_batch`` requests of up to that many frames at load, 0: lazily);
    ``hift_graphs`` (default: as ``cuda_graphs``: HiFT graphs of the non-final streaming chunk
    shapes of the exponential schedule for up to ``hift_max_tokens`` tokens (default 750), captured at load;
    other shapes run eagerly); ``compile`` (default off: torch.compile the flow estimator);
    ``incremental_stream`` (default off: streaming steps compute only their new frames, at ~115 MB
    of state per second of audio per stream); ``max_batch`` (units per flow batch, default 16);
    ``stream_idle_timeout_s``; ``mps_thread_percentage`` and ``mps_priority`` (see :func:`apply_mps_settings`).
    """

    def __init__(self, config: dict):
        params = model_parameters(config)
        apply_mps_settings(params)
        model_dir = Path(required_parameter(params, "model_dir"))
        device = resolve_device(params.get("device") or "auto")
        on_cuda = device.type == "cuda"
        limit_torch_threads(params, 1 if on_cuda else None)
        dtype_name = params.get("dtype") or "auto"
        dtype = ((torch.float16 if on_cuda else torch.float32) if dtype_name == "auto"
                 else resolve_device_dtype(device, dtype_name)[1])
        cuda_graphs = parse_flag(params.get("cuda_graphs") or "auto", on_cuda)
        max_batch = int(params.get("max_batch") or 16)
        precapture = params.get("precapture_frames") or "auto"
        hift_graphs = parse_flag(params.get("hift_graphs") or "auto", cuda_graphs)
        hift_shapes = streaming_vocoder_frames(int(params.get("hift_max_tokens") or 750)) if hift_graphs else ()
        options = Token2WavOptions(
            cuda_graphs=cuda_graphs, compile=parse_flag(params.get("compile") or "auto", False),
            precapture_frames=(DEFAULT_PRECAPTURE_FRAMES if cuda_graphs else 0) if precapture == "auto" else int(precapture),
            precapture_batch=max_batch, hift_graphs=hift_graphs, hift_precapture_frames=hift_shapes,
            incremental_stream=parse_flag(params.get("incremental_stream") or "auto", False))
        idle_timeout = float(params.get("stream_idle_timeout_s") or STREAM_IDLE_TIMEOUT_S)
        self.token2wav = LocalToken2Wav(load_token2wav(model_dir, device, dtype, options), idle_timeout,
                                        max_batch=max_batch)
        speaker = SpeakerRegistry.load(model_dir / SPK2INFO).get(DEFAULT_SPEAKER)
        self.default_voice = Voice(speaker.prompt_text, speaker.features, speaker.speaker_id)
        self.open_streams = Metric("cosyserve_token2wav_open_streams", "token2wav streaming sessions open",
                                   config["name"])
        self.batch_units = Metric("cosyserve_token2wav_batched_units_total",
                                  "token2wav requests run in shared batches", config["name"], kind="counter")
        model = self.token2wav.model
        self.work_metrics = WorkMetrics(config["name"], {
            "cosyserve_token2wav_flow_seconds_total": ("device time of flow batches", model.counters, "flow_s"),
            "cosyserve_token2wav_hift_seconds_total": ("device time of HiFT batches", model.counters, "hift_s"),
            "cosyserve_token2wav_flow_calls_total": ("flow Euler-loop batches", model.sampler.counters, "calls"),
            "cosyserve_token2wav_flow_rows_total": ("requests in flow batches", model.sampler.counters, "rows"),
            "cosyserve_token2wav_flow_frames_total": ("mel frames of requests in flow batches", model.sampler.counters,
                                                      "frames"),
            "cosyserve_token2wav_flow_padded_frames_total": ("mel frames computed by flow batches, padding included",
                                                             model.sampler.counters, "padded_frames"),
        })
        self.execute_seconds = Metric("cosyserve_token2wav_execute_seconds_total",
                                      "wall time inside execute", config["name"], kind="counter")

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
        self.token2wav.model.close_all()

