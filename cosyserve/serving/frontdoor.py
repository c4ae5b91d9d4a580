"""The ``cosyvoice2``, ``cosyvoice3`` and ``cosyvoice2_dit`` Triton models: a thin front door over
the engine core of this GPU (parameter ``model_kind``: which model's stack the engine runs).

The engine core (LLM, flow and HiFT) runs in a process of its own, which the model instance starts
and talks to over ZMQ (:class:`~cosyserve.engine.client.EngineClient`): the text front-end, the
voices (a new clip's speech tokenizer and speaker encoder), response sending, metrics and
cancellation stay here, on this stub's GIL, and never slow the loop. ``execute`` reads each
request's inputs (:func:`~cosyserve.serving.protocol.parse_tts_inputs`, the reference's wire
protocol unchanged) and returns at once; a pool of ``prepare_threads`` resolves the voice and builds
the prompts, then hands the request to the engine, which refuses it when it is past capacity (gRPC
``UNAVAILABLE`` "overloaded: ...", the API's 429). PCM comes back through each request's response
sender as soon as the engine sends it: one thread sends every response. Nothing is a process per
request: concurrency is the engine's, bounded by its admission (``max_streams``,
``admission_min_buffer_s``), not by instance counts. If the engine process dies, its requests end
with an error at once and it is started again (docs/operations.md).

Decoupled (streaming): one response per chunk, then the final flag. Not decoupled: one response
with the whole waveform (the engine's offline path: one flow pass over each segment). The
optional ``streaming`` BOOL input (default: the model's mode) lets a decoupled model voice a
request offline and answer it in one response: what ``cosyvoice2_offline`` asks for on behalf
of HTTP clients (:mod:`.offline_proxy`).

Speech tokens: :class:`~.settings.EngineSettings` (our LLM engine in the engine process, an
OpenAI-compatible server, or a Triton LLM model such as ``tensorrt_llm``: only this stub can call
it, so each segment's tokens are read here on a thread and forwarded to the engine).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from ..clients import Playback
from ..engine.client import EngineClient
from ..engine.process import EngineSpec
from ..engine.request import FIRST_CHUNK_STAGES, first_chunk_stages
from ..engine.wire import STATS_PERIOD_S
from ..engine.runners.llm import BackendLLM
from ..engine.service import MODEL_KINDS, TTSEngine, load_frontend
from ..errors import CapacityError
from ..frontend.voice_store import VOICES_DIR
from ..llm.prompt import PromptLayout
from ..llm.stream import Finished, TokenStream
from ..llm.trtllm.request import TritonLLMInputs, resolve_protocol
from ..engine.front_end import TokenLimits, TTSRequest
from ..schedule import OUTPUT_SAMPLE_RATE
from .protocol import ListenerMetrics, bls_request, parse_tts_inputs
from .offline_proxy import tagged_error
from .settings import EngineSettings
from .triton_utils import (FINAL, FinishedResponseIterators, Metric, WorkMetrics, error_response,
                           limit_torch_threads, model_settings, raise_response_error, tensor)

# How often open streams are asked whether their client has gone (seconds).
CANCEL_POLL_S = 0.05


class TritonModelTokens:
    """Speech tokens from a Triton LLM model with TensorRT-LLM's tensor interface (``tensorrt_llm``,
    or this package's ``llm``), as a :mod:`cosyserve.llm` back end: each request's responses are
    read on a thread of its own into its :class:`~cosyserve.llm.stream.TokenStream`. Finished
    response iterators are kept until the stub lets go of them (``finished``, released by the
    front door while some request is open)."""

    def __init__(self, model_name: str, inputs: TritonLLMInputs, layout: PromptLayout):
        self.model_name = model_name
        self.inputs = inputs
        self.layout = layout  # output id of speech token 0 and how many there are
        self.finished = FinishedResponseIterators()
        self._lock = threading.Lock()

    def generate_stream(self, prompt_ids, params, request_id=None) -> TokenStream:
        stream = TokenStream(request_id, lambda: self._stop(request_id))
        inputs = self.inputs.generate(prompt_ids, params.max_tokens, params.min_tokens)
        threading.Thread(target=self._read, args=(stream, inputs, request_id), daemon=True,
                         name=f"llm-{request_id}").start()
        return stream

    def _read(self, stream: TokenStream, inputs: dict, request_id: str) -> None:
        responses = None
        try:
            responses = bls_request(self.model_name, inputs, ["output_ids", "sequence_length"], request_id).exec(
                decoupled=True)
            ended = False
            for response in responses:  # read to the final response even once the speech ended
                raise_response_error(response, self.model_name)
                output_ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
                if output_ids is None or ended:
                    continue
                length = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
                ids = output_ids.as_numpy()[0][0][:length].astype(np.int64) - self.layout.speech_token_offset
                for token in ids.tolist():
                    if not 0 <= token < self.layout.num_speech_tokens:
                        ended = True
                        break
                    stream.put(token)
            stream.put(Finished("stop"))
        except Exception as exc:
            stream.put(Finished("error", exc))
        finally:
            if responses is not None:
                with self._lock:
                    self.finished.keep(responses)

    def _stop(self, request_id: str) -> None:
        def stop() -> None:
            responses = bls_request(self.model_name, self.inputs.stop(), ["output_ids"], request_id).exec(decoupled=True)
            for _ in responses:
                pass
            with self._lock:
                self.finished.keep(responses)
        threading.Thread(target=stop, daemon=True, name=f"llm-stop-{request_id}").start()

    def release(self, is_cancelled) -> None:
        with self._lock:
            self.finished.release(is_cancelled)

    def register_prefix(self, key, ids) -> None:
        """The Triton LLM model keeps its own prefix cache."""

    def close(self) -> None:
        pass


@dataclass(eq=False)
class _Reply:
    """One request's response side: its sender, offline pieces, its listener's playback."""

    request_id: str
    sender: object
    streaming: bool
    pieces: list = field(default_factory=list)
    playback: Playback = field(default_factory=Playback)
    submitted: bool = False  # handed to the engine (a refusal for capacity may still come back)
    trace: dict = field(default_factory=lambda: {"arrival": time.monotonic()})  # first-chunk stamps


class _StatsCounters:
    """The engine's running totals as attributes, for :class:`~.triton_utils.WorkMetrics`: the last
    :class:`~cosyserve.engine.wire.EngineStats` fetched by :meth:`refresh`."""

    def __init__(self, engine: TTSEngine) -> None:
        self._engine = engine
        self.stats = engine.stats()

    def refresh(self):
        self.stats = self._engine.stats()
        return self.stats

    def __getattr__(self, name: str) -> float:
        return self.stats.counters.get(name, 0)


class EngineFrontDoor:
    def __init__(self, config: dict):
        settings = model_settings(config, EngineSettings)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        device = settings.torch_device()
        limit_torch_threads(settings.torch_threads, 1 if device.type == "cuda" else None)
        self.limits = TokenLimits(settings.max_tokens, settings.min_tokens)
        self.timeout_s = settings.request_timeout_s
        self.triton_llm = None
        model = MODEL_KINDS[settings.model_kind]
        token_source = None
        if settings.llm_url:
            llm, llm_options = "openai", {"base_url": settings.llm_url, "model": settings.llm_model or None}
        elif settings.llm_model_name:
            protocol = resolve_protocol(settings.llm_protocol, settings.llm_model_name)
            inputs = TritonLLMInputs(protocol, model.sampling, True, settings.llm_tokenizer_dir, end_id=model.layout.eos_id)
            self.triton_llm = TritonModelTokens(settings.llm_model_name, inputs, model.layout)
            token_source = BackendLLM(self.triton_llm, model.sampling)
            llm, llm_options = "client", {}
        else:
            llm, llm_options = "engine", {"max_slots": settings.llm_max_slots, "max_model_len": settings.llm_max_model_len}
        self.own_llm = llm == "engine"
        voices_dir = settings.voices_dir or settings.model_dir / VOICES_DIR
        frontend_backend = None if settings.frontend_backend == "auto" else settings.frontend_backend
        spec = EngineSpec(
            settings.model_kind, str(settings.model_dir), str(settings.llm_tokenizer_dir), str(device),
            kind_options=settings.kind_options(device), llm=llm, llm_options=llm_options,
            strategy=settings.streaming_strategy, max_streams=settings.max_streams,
            min_buffer_s=settings.admission_min_buffer_s, max_batch_frames=settings.max_batch_frames,
            max_batch_jobs=settings.max_batch_jobs, voices_dir=str(voices_dir), frontend_backend=frontend_backend,
            spk2info=str(settings.spk2info) if settings.spk2info else None,
            warm_up=settings.warm_up_engine(device), torch_threads=settings.torch_threads)
        # the engine process loads while the front end loads here (text, prompts, voices; a new clip's
        # models on this device, off the engine's GIL and CUDA stream)
        client = EngineClient.spawn(spec, token_source=token_source)
        try:
            prompter, voices, warm_voice = load_frontend(
                settings.model_kind, settings.model_dir, settings.llm_tokenizer_dir, device, voices_dir=voices_dir,
                max_text_chars=settings.max_text_chars, frontend_backend=frontend_backend, spk2info=settings.spk2info)
            client.wait_ready()
        except BaseException:
            client.close()
            raise
        self.engine = TTSEngine(client, prompter, voices, warm_voice)
        if settings.warm_up is not False:  # the text front-end: before the server reports ready
            self.engine.prompter.text.warm_up()
        self.prepare = ThreadPoolExecutor(settings.prepare_threads, thread_name_prefix="prepare")
        self._replies: dict[str, _Reply] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self._metrics(config["name"])
        self._responder = threading.Thread(target=self._respond, name="responder", daemon=True)
        self._responder.start()

    def _metrics(self, name: str) -> None:
        self.in_progress = Metric("cosyserve_requests_in_progress", "requests taken and not yet answered", name)
        self.listeners = ListenerMetrics(name)
        self.admitted = Metric("cosyserve_requests_admitted", "requests the engine took", name, kind="counter")
        self.refused = Metric("cosyserve_requests_refused", "requests refused because the engine was past "
                              "max_streams or a stream had less than admission_min_buffer_s of audio buffered",
                              name, kind="counter")
        # the reference layout's names for the LLM's and the flow's live requests (operators and tests
        # read them); the LLM's only when the engine runs ours: an LLM model or server counts its own
        stats = self.engine.stats()
        self.llm_requests = Metric("cosyserve_llm_active_requests", "LLM requests generating in the engine",
                                   name) if self.own_llm else None
        llm_tokens = {"cosyserve_llm_generated_tokens_total": ("speech tokens the engine's LLM produced", "tokens")
                      } if self.own_llm else {}
        self._counters = _StatsCounters(self.engine)
        self._published: dict[Metric, float] = {}  # gauge -> the value last set
        self._published_at = 0.0
        self.work = WorkMetrics(name, {metric: (text, self._counters, field) for metric, (text, field) in {
            **llm_tokens,
            **{f"cosyserve_engine_{stage}_seconds_total": (f"the loop's time: {text}", f"{stage}_s")
               for stage, text in (("voice", "new voices' state, launched as their requests arrive"),
                                   ("start", "chunks starting (encoder)"), ("flow", "launching batches' Euler steps"),
                                   ("vocoder", "launching HiFT and the PCM's copy"),
                                   ("host", "requests, tokens, scheduling and emitting PCM"),
                                   ("idle", "waiting for work, or for the GPU when nothing else is left"))},
            "cosyserve_engine_iterations_total": ("iterations of the loop", "iterations"),
            "cosyserve_engine_flow_batches_total": ("flow batches solved (all Euler steps of their chunks)",
                                                    "flow_batches"),
            "cosyserve_engine_flow_batch_jobs_total": ("chunk jobs solved in flow batches", "flow_batch_jobs"),
            **({"cosyserve_engine_llm_busy_seconds_total": ("the LLM's time stepping (its own thread)", "llm_busy_s")}
               if self.own_llm else {})}.items()})
        # the way of each stream's first chunk, stage by stage (engine/request.py FIRST_CHUNK_STAGES):
        # a benchmark divides each total's growth by the traced chunks' to get the stages' means
        self.first_chunks = Metric("cosyserve_first_chunks_traced", "streams whose first chunk's stages are "
                                   "counted in cosyserve_first_chunk_<stage>_seconds", name, kind="counter")
        self.first_chunk_stages = {stage: Metric(f"cosyserve_first_chunk_{stage}_seconds",
                                                 f"time of first chunks in stage {stage}", name, kind="counter")
                                   for stage, _ in FIRST_CHUNK_STAGES}
        self.streams = Metric("cosyserve_engine_streams", "streaming requests in the engine", name)
        self.requests = Metric("cosyserve_engine_requests", "requests in the engine", name)
        # the token2wav kind's state: open streams, cached voices, and its state pages where it has them
        self.kind_gauges = {gauge: Metric(f"cosyserve_token2wav_{gauge}", text, name)
                            for gauge, (text, _) in stats.gauges.items()}
        self._publish()

    def _publish(self) -> None:
        """The engine's latest stats to Triton's gauges and counters: only the values that changed
        (each update is a round trip to the server; an idle engine costs none)."""
        stats = self._counters.refresh()
        gauges = [(self.streams, stats.streams), (self.requests, stats.requests)]
        if self.llm_requests is not None:
            gauges.append((self.llm_requests, stats.generating))
        gauges += [(self.kind_gauges[name], value) for name, (_, value) in stats.gauges.items() if name in self.kind_gauges]
        for metric, value in gauges:
            if self._published.get(metric) != value:
                metric.set(value)
                self._published[metric] = value
        self.work.publish()

    # ----- Triton's thread -----

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            # read as sent (any shape): a bad request's error must reach cosyvoice2_offline with its code too
            stream = pb_utils.get_input_tensor_by_name(request, "streaming")
            streaming = self.decoupled and (stream is None or bool(stream.as_numpy().all()))
            try:
                inputs = parse_tts_inputs(request, self.limits, self.engine.prompter.max_text_chars)
            except Exception as exc:
                sender.send(self._error_response(exc, streaming), flags=FINAL)
                continue
            self.in_progress.increment()
            self.prepare.submit(self._start, inputs, _Reply(inputs.request_id, sender, streaming))
        return None

    # ----- prepare threads -----

    def _start(self, inputs, reply: _Reply) -> None:
        try:
            voice = self.engine.voices.resolve(inputs.reference_wav, inputs.reference_text, inputs.speaker_id)
            if inputs.prepare_voice:  # features computed (and stored, for an uploaded voice); the engine's
                # state next: answered once the engine has computed it (CosyVoice2) or launched it, so
                # that the voice's first request, sent then, does not wait behind it
                self.engine.prepare_voice(voice, done=lambda: self._outbox.put((reply, _DONE)))
                return
            request = TTSRequest(inputs.request_id, inputs.target_text, voice, inputs.limits, inputs.text_frontend,
                                 inputs.instruction)
            self._replies[reply.request_id] = reply
            reply.submitted = True
            self.engine.submit(request, streaming=reply.streaming, timeout_s=self.timeout_s, trace=reply.trace,
                               emit=lambda pcm: self._outbox.put((reply, pcm)),
                               finish=lambda error: self._outbox.put((reply, error or _DONE)))
        except Exception as exc:
            self._replies.pop(reply.request_id, None)
            self._outbox.put((reply, exc))

    # ----- the responder thread -----

    def _respond(self) -> None:
        polled = time.monotonic()
        while True:
            try:
                reply, item = self._outbox.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                reply = item = None
            if reply is not None:
                try:
                    self._send(reply, item)
                except Exception as exc:  # the client is gone: the request ends here
                    pb_utils.Logger.log_warn(f"request {reply.request_id}: {type(exc).__name__}: {exc}")
                    self.engine.cancel(reply.request_id)
            if self._closing and reply is None:
                return
            if time.monotonic() - polled >= CANCEL_POLL_S:
                polled = time.monotonic()
                self._poll_cancelled()

    def _send(self, reply: _Reply, item) -> None:
        if isinstance(item, np.ndarray):
            if not reply.streaming:
                reply.pieces.append(item)
                return
            reply.sender.send(pb_utils.InferenceResponse(output_tensors=[tensor("waveform", item)]))
            reply.trace.setdefault("sent", time.monotonic())
            self.listeners.played(reply.playback, item.size / OUTPUT_SAMPLE_RATE)
            return
        # the last item: _DONE or the error (a refusal for capacity comes from the engine this way too)
        self._replies.pop(reply.request_id, None)
        self.in_progress.increment(-1)
        if isinstance(item, CapacityError):
            self.refused.increment()
        elif reply.submitted:
            self.admitted.increment()
        if item is _DONE and reply.streaming:
            self._trace(reply.trace)
        if self.triton_llm is not None:
            self.triton_llm.release(reply.sender.is_cancelled)  # before the final flag closes the sender
        if item is _DONE:
            if reply.streaming:
                reply.sender.send(flags=FINAL)
            else:
                waveform = np.concatenate(reply.pieces) if reply.pieces else np.zeros(0, np.float32)
                reply.sender.send(pb_utils.InferenceResponse(output_tensors=[tensor("waveform", waveform)]),
                                  flags=FINAL)
        else:
            reply.sender.send(self._error_response(item, reply.streaming), flags=FINAL)

    def _trace(self, trace: dict) -> None:
        stages = first_chunk_stages(trace)
        if stages is not None:
            self.first_chunks.increment()
            for stage, seconds in stages.items():
                self.first_chunk_stages[stage].increment(seconds)

    def _error_response(self, exc: BaseException, streaming: bool):
        response = error_response(exc)
        if self.decoupled and not streaming:  # asked by cosyvoice2_offline: keep the code (offline_proxy)
            response = pb_utils.InferenceResponse(error=tagged_error(response.error()))
        return response

    def _poll_cancelled(self) -> None:
        for reply in list(self._replies.values()):
            if reply.sender.is_cancelled():
                self.engine.cancel(reply.request_id)
        if time.monotonic() - self._published_at >= STATS_PERIOD_S:  # the engine's stats are no fresher
            self._published_at = time.monotonic()
            self._publish()

    def close(self) -> None:
        self.prepare.shutdown(wait=True)
        self.engine.close()  # every request still open ends (finish with an error): the responder answers it
        self._closing = True
        self._responder.join(timeout=30)


_DONE = object()
