"""The ``llm`` Triton model: this package's LLM engine behind TensorRT-LLM's tensor interface.

Same inputs and outputs as the ``tensorrt_llm`` model of NVIDIA's runtime, so the BLS can talk to
either (template parameters ``llm_model_name``, ``llm_protocol``). Decoupled, one instance:
``execute`` only hands each request to the engine (which batches all in-flight requests
continuously) and returns; a thread per request streams the engine's tokens back through the
response sender (one per request, not one for all: a send that never returns, see below, holds
up its own request only).

* ``streaming`` true: one response per burst of new tokens (``output_ids`` [1, 1, n_new],
  ``sequence_length`` [1, 1] = n_new; n_new is 1 unless the engine got ahead of the sends, then
  every token not yet sent), then an empty final response; false: one final response
  with every token. Ids are LLM ids (raw speech token + the checkpoint's speech offset: 151663 for
  CosyVoice2, 151924 for CosyVoice3, told by its vocab size); the end-of-speech id is not
  returned. The prompt is never echoed (TRT-LLM ``exclude_input_in_output``).
* ``stop`` true stops the in-flight request with the same request id: that one ends like a
  finished request, the stop request gets an empty final response. A cancelled caller (client
  disconnect) stops its request too, and so does a caller that no longer takes responses: a send
  that has waited ``send_timeout_s`` (parameter, default 10 s) means the caller's process died
  (Triton 24.10 then blocks that send for ever), so a watchdog thread stops the request.
* Only the requested outputs are built: Triton 24.10's stub drops the others without the GIL.
* Sampling: ``temperature``, ``runtime_top_k``, ``runtime_top_p``, ``repetition_penalty``,
  ``seed`` or ``random_seed`` (its older name; equal when both are sent), ``min_tokens``,
  ``request_output_len``; absent ones take TRT-LLM's defaults.
* What a TensorRT-LLM engine needs and this one has built in is accepted and checked (see
  :mod:`cosyserve.llm.trtllm.request`): ``embedding_bias`` ``[1, vocab]`` must be the head bias of
  ``llm_dir`` (which the engine applies anyway) or zeros; ``stop_words_list`` with ``end_id``
  must be the three end-of-speech ids, at which the engine always stops. A CosyVoice3 checkpoint
  has no head bias and stops on its 200 stop classes by itself: those two inputs are refused.

Parameters: ``llm_dir`` (HuggingFace-format LLM), ``device`` (auto|cpu|cuda), optional
``model_dir`` (its spk2info.pt voices get their ``<|sos|>{prompt_text}`` prefix cached at start-up),
``llm_backend`` (``torch``, default, or ``hf``), ``send_timeout_s``, ``mps_thread_percentage`` and
``mps_priority`` (:func:`~cosyserve.serving.triton_utils.apply_mps_settings`).
Metrics: ``cosyserve_llm_active_requests`` (requests being streamed),
``cosyserve_llm_generated_tokens_total`` and ``cosyserve_llm_tensorrt_llm_requests_total``
(requests that came in TensorRT-LLM's full form: ``embedding_bias``, ``stop_words_list`` and
``seed``, all accepted); with the ``torch`` back end also the engine's work
(:class:`~cosyserve.llm.engine.llm_engine.EngineCounters`, published every second and at each
request's end): ``cosyserve_llm_engine_busy_seconds_total``, ``cosyserve_llm_prefill_seconds_total``,
``cosyserve_llm_decode_steps_total``, ``cosyserve_llm_decode_rows_total``.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from ..errors import InvalidInputError, RequestCancelledError
from ..llm.backends import create_backend
from ..llm.models.config import Qwen2Config
from ..llm.prompt import layout_for_vocab_size, register_voice_prefixes
from ..llm.sampling import SamplingParams
from ..llm.stream import TokenStream
from ..runtime import SPK2INFO
from ..llm.trtllm.request import check_embedding_bias, check_stop_words, embedding_bias, request_seed
from .settings import LLMSettings
from .triton_utils import (FINAL, Metric, WorkMetrics, error_response, apply_mps_settings, limit_torch_threads,
                           model_settings, optional_input, optional_scalar, required_input, tensor)

DEFAULT_OUTPUT_LEN = 750
CLOSE_JOIN_S = 5.0  # how long unloading waits for each request's thread to send its last response


@dataclass(eq=False)
class _Generation:
    """A request being streamed back by ``thread``; ``sending_since`` is set while a send waits."""

    stream: TokenStream
    sender: Any
    outputs: frozenset[str]
    thread: threading.Thread = field(init=False)
    sending_since: float | None = None

    def send(self, response=None, flags: int = 0) -> None:
        self.sending_since = time.monotonic()
        try:
            self.sender.send(response, flags=flags)
        finally:
            self.sending_since = None


class LLMModel:
    def __init__(self, config: dict):
        settings = model_settings(config, LLMSettings)
        apply_mps_settings(settings.mps_thread_percentage, settings.mps_priority)
        llm_dir = settings.llm_dir
        device = settings.torch_device()
        limit_torch_threads(settings.torch_threads, 1 if device.type == "cuda" else None)
        self.layout = layout_for_vocab_size(Qwen2Config.from_model_dir(llm_dir).vocab_size)
        self.backend = create_backend(settings.llm_backend, llm_dir, device)
        # what a TensorRT-LLM caller's embedding_bias must be (a CosyVoice3 head has no bias)
        self.head_bias = embedding_bias(llm_dir).numpy() if self.layout.head_bias else None
        if settings.model_dir:  # registered voices: precompute their prompt prefixes
            from transformers import AutoTokenizer

            from ..frontend.speakers import SpeakerRegistry

            registry = SpeakerRegistry.load(settings.model_dir / SPK2INFO)
            register_voice_prefixes(self.backend, AutoTokenizer.from_pretrained(llm_dir), registry)
        self.active = Metric("cosyserve_llm_active_requests", "LLM requests being generated", config["name"])
        self.generated = Metric("cosyserve_llm_generated_tokens_total", "speech tokens generated",
                                config["name"], kind="counter")
        self.trtllm_requests = Metric("cosyserve_llm_tensorrt_llm_requests_total",
                                      "requests with embedding_bias, stop_words_list and seed (all accepted)",
                                      config["name"], kind="counter")
        engine = getattr(self.backend, "engine", None)  # the torch back end's LLMEngine
        self._engine_counters = WorkMetrics(config["name"], {
            "cosyserve_llm_engine_busy_seconds_total": ("wall time of LLM engine steps", engine.counters, "busy_s"),
            "cosyserve_llm_prefill_seconds_total": ("wall time of LLM prefills", engine.counters, "prefill_s"),
            "cosyserve_llm_decode_steps_total": ("LLM decode steps", engine.counters, "decode_steps"),
            "cosyserve_llm_decode_rows_total": ("requests advanced, summed over decode steps", engine.counters,
                                                "decode_rows"),
        }) if engine else None
        self.send_timeout_s = settings.send_timeout_s
        self._generations: set[_Generation] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_sends, name="llm-send-watchdog", daemon=True)
        self._watchdog.start()

    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                if optional_scalar(request, "stop"):
                    self.backend.cancel(request.request_id())
                    sender.send(flags=FINAL)
                    continue
                stream, streaming = self._submit(request)
            except Exception as exc:
                _send_error(sender.send, exc)
                continue
            generation = _Generation(stream, sender, frozenset(request.requested_output_names()))
            generation.thread = threading.Thread(target=self._serve, args=(generation, streaming), daemon=True)
            with self._lock:
                self._generations.add(generation)
            self.active.increment(1)
            generation.thread.start()
        return None

    def _submit(self, request):
        ids = required_input(request, "input_ids").reshape(-1)
        length = optional_scalar(request, "input_lengths")
        if length is not None:
            if not 0 < length <= ids.size:
                raise InvalidInputError(f"input_lengths is {length}; it must be in 1..{ids.size} (the input_ids sent)")
            ids = ids[:length]
        end_id = optional_scalar(request, "end_id")
        stop_ids = self.layout.stop_ids
        if end_id is not None and end_id not in stop_ids:
            raise InvalidInputError(f"end_id {end_id} is not an end-of-speech id of this model "
                                    f"({stop_ids[0]}..{stop_ids[-1]})")
        trtllm_form = self._check_trtllm_inputs(request, end_id)
        params = SamplingParams(
            temperature=_number(request, "temperature", 1.0),
            top_k=int(_number(request, "runtime_top_k", 0)),
            top_p=_number(request, "runtime_top_p", 1.0) or 1.0,  # TRT-LLM: top_p 0 means off
            repetition_penalty=_number(request, "repetition_penalty", 1.0),
            seed=request_seed(_optional_int(request, "seed"), _optional_int(request, "random_seed")),
            ras=False,  # TRT-LLM samples without repetition-aware resampling
            min_tokens=int(_number(request, "min_tokens", 0)),
            max_tokens=int(_number(request, "request_output_len", DEFAULT_OUTPUT_LEN)),
        )
        request_id = request.request_id() or uuid.uuid4().hex
        stream = self.backend.generate_stream([int(i) for i in ids], params, request_id)
        if trtllm_form:
            self.trtllm_requests.increment(1)
        return stream, bool(optional_scalar(request, "streaming"))

    def _check_trtllm_inputs(self, request, end_id: int | None) -> bool:
        """Check what only a TensorRT-LLM engine needs; True when the request sent all of it."""
        stop_words = optional_input(request, "stop_words_list")
        bias = optional_input(request, "embedding_bias")
        if self.head_bias is None and (stop_words is not None or bias is not None):
            raise InvalidInputError(f"stop_words_list and embedding_bias are not taken by this {self.layout.name} "
                                    "LLM: its head has no bias and it stops on its own stop ids")
        if stop_words is not None:
            check_stop_words(stop_words, end_id)
        if bias is not None:
            check_embedding_bias(bias, self.head_bias)
        return stop_words is not None and bias is not None and optional_input(request, "seed") is not None

    def _serve(self, generation: _Generation, streaming: bool) -> None:
        stream, outputs = generation.stream, generation.outputs
        tokens: list[int] = []
        offset = self.layout.speech_token_offset
        try:
            for burst in _until_stopped(stream):
                if generation.sender.is_cancelled():  # the caller went away
                    stream.close()
                    break
                if streaming:
                    generation.send(_ids_response(burst, outputs, offset))
                else:
                    tokens.extend(burst)
            generation.send(None if streaming else _ids_response(tokens, outputs, offset), flags=FINAL)
        except Exception as exc:  # an engine failure
            _send_error(generation.send, exc)
        finally:
            self._release(generation)

    def _watch_sends(self) -> None:
        """Stop the requests whose caller no longer takes responses (their threads stay blocked);
        publish the engine's counters."""
        while not self._closed.wait(1.0):
            if self._engine_counters:
                self._engine_counters.publish()
            deadline = time.monotonic() - self.send_timeout_s
            with self._lock:
                stuck = [g for g in self._generations if g.sending_since is not None and g.sending_since < deadline]
            for generation in stuck:
                pb_utils.Logger.log_warn(f"LLM request {generation.stream.request_id}: a response has waited more "
                                         f"than {self.send_timeout_s:g} s to be taken; stopping the request")
                self._release(generation)

    def _release(self, generation: _Generation) -> None:
        """Stop the engine request and count it out, once (its thread or the watchdog)."""
        with self._lock:
            if generation not in self._generations:
                return
            self._generations.remove(generation)
        generation.stream.close()
        self.generated.increment(generation.stream.num_tokens)
        self.active.increment(-1)
        if self._engine_counters:
            self._engine_counters.publish()

    def close(self) -> None:
        # Threads still running when the stub tears down crash it: end them first.
        self._closed.set()
        self._watchdog.join()
        with self._lock:
            generations = list(self._generations)
        self.backend.close()  # ends every stream
        for generation in generations:
            generation.thread.join(timeout=CLOSE_JOIN_S)


def _until_stopped(stream):
    """The stream's tokens in bursts (one response per burst: under load a response carries every
    token generated since the last one); a ``stop`` request ends it like the end of speech, as in
    TensorRT-LLM."""
    try:
        while True:
            yield stream.available()
    except (StopIteration, RequestCancelledError):
        return


def _send_error(send, exc: Exception) -> None:
    # Triton 24.10 never delivers a decoupled model's error response to a BLS caller (and the
    # lost response keeps the caller from unloading); one that also carries the final flag
    # leaves the caller's response iterator hanging. So errors are kept for real failures and
    # the final flag travels alone.
    send(error_response(exc))
    send(flags=FINAL)


def _ids_response(raw_tokens: list[int], outputs: frozenset[str], speech_token_offset: int
                  ) -> "pb_utils.InferenceResponse":
    ids = np.asarray(raw_tokens, dtype=np.int32).reshape(1, -1) + speech_token_offset  # (beam, tokens)
    arrays = {"output_ids": ids, "sequence_length": np.array([ids.shape[1]], np.int32)}
    return pb_utils.InferenceResponse(output_tensors=[tensor(name, a) for name, a in arrays.items() if name in outputs])


def _number(request, name: str, default: float) -> float:
    value = optional_scalar(request, name)
    return default if value is None else value


def _optional_int(request, name: str) -> int | None:
    value = optional_scalar(request, name)
    return None if value is None else int(value)
