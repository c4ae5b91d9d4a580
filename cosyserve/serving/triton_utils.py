"""What every cosyserve Triton Python model needs: parameters, request tensors, errors, metrics.

Only importable inside Triton's Python backend (``triton_python_backend_utils``). Models are
configured with ``max_batch_size > 0``, so every tensor has a leading batch dimension; clients
send one utterance per request (``[1, ...]``) and each request is handled on its own.
"""

from __future__ import annotations

import faulthandler
import json
import os
import threading
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from ..errors import CapacityError, InvalidInputError, RequestCancelledError, RequestTimeoutError
from ..llm.prompt import NUM_SPEECH_TOKENS, SPEECH_TOKEN_OFFSET
from .settings import Settings, parse_settings

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

# A stub that crashes then writes its Python stacks to the server log (the stub ignores
# PYTHONFAULTHANDLER); otherwise clients only see "Stub process ... is not healthy".
faulthandler.enable()


def model_config(args: dict) -> dict:
    return json.loads(args["model_config"])


def model_parameters(config: dict) -> dict[str, str]:
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def model_settings(config: dict, cls: type[Settings]) -> Settings:
    """The model's typed settings (:mod:`.settings`) from its parameters."""
    return parse_settings(cls, model_parameters(config))


def limit_torch_threads(threads: int, default: int | None = 1) -> None:
    """Set this model process's torch CPU threads: ``threads`` (the ``torch_threads`` setting), if
    not 0, else ``default`` (None: torch's own, one per core).

    Every Triton model is its own process on the same cores, and with torch's default each one
    runs a worker per core: in a 16-stream benchmark on a 16-core host the two front-end models
    held 13 cores, starving the threads that launch GPU work. Models whose heavy work is on a
    GPU, or in onnxruntime with its own thread, keep one.
    """
    threads = threads or default
    if threads:
        import torch

        torch.set_num_threads(threads)


MPS_PRIORITIES = {"normal": "0", "below_normal": "1"}  # CUDA_MPS_CLIENT_PRIORITY values


def apply_mps_settings(share: str, priority: str) -> None:
    """How this model process shares the GPU under CUDA MPS (no effect without MPS):
    ``mps_thread_percentage`` caps the share of SMs it may use (1-100; empty: all) and
    ``mps_priority`` (``normal``/``below_normal``; empty: normal) ranks its work against the other
    processes'. Call before anything touches CUDA: MPS reads ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
    and ``CUDA_MPS_CLIENT_PRIORITY`` when the process creates its context.

    Under MPS the kernels of the LLM and token2wav processes run side by side and slow each other
    down (docs/benchmarks.md measures both knobs; neither is set by default).
    """
    if share:
        if not share.isdigit() or not 1 <= int(share) <= 100:
            raise ValueError(f"model parameter mps_thread_percentage must be an integer in 1..100, got {share!r}")
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = share
    if priority:
        if priority not in MPS_PRIORITIES:
            raise ValueError(f"model parameter mps_priority must be one of {sorted(MPS_PRIORITIES)}, got {priority!r}")
        os.environ["CUDA_MPS_CLIENT_PRIORITY"] = MPS_PRIORITIES[priority]


# ----- request tensors -----

def optional_input(request, name: str) -> np.ndarray | None:
    """The request's tensor ``name`` without its batch dimension, or None when not sent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.ndim == 0 or array.shape[0] != 1:
        raise InvalidInputError(
            f"input {name} has shape {list(array.shape)}; send one utterance per request (batch dimension 1)")
    return array[0]


def required_input(request, name: str) -> np.ndarray:
    array = optional_input(request, name)
    if array is None:
        raise InvalidInputError(f"input {name} is required")
    return array


def optional_scalar(request, name: str):
    """A ``[1]``-shaped input as a Python scalar, or None."""
    array = optional_input(request, name)
    if array is None:
        return None
    if array.size != 1:
        raise InvalidInputError(f"input {name} must hold exactly one value, got {array.size}")
    value = array.reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value  # BYTES arrive as bytes objects


def optional_text(request, name: str) -> str | None:
    value = optional_scalar(request, name)
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInputError(f"input {name} is not valid UTF-8 text ({exc})") from None
    return str(value)


def tensor(name: str, array: np.ndarray) -> "pb_utils.Tensor":
    """An output tensor with the batch dimension (1) added."""
    return pb_utils.Tensor(name, np.ascontiguousarray(array)[None])


# ----- errors -----

def error_response(exc: BaseException) -> "pb_utils.InferenceResponse":
    """A per-request error: bad input -> INVALID_ARG (HTTP 400), timed out -> UNAVAILABLE (the
    API's 504), cancelled -> CANCELLED, out of capacity -> UNAVAILABLE, else INTERNAL."""
    if isinstance(exc, InvalidInputError):
        error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
    elif isinstance(exc, RequestTimeoutError):
        error = pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE)
    elif isinstance(exc, RequestCancelledError):
        error = pb_utils.TritonError(str(exc), pb_utils.TritonError.CANCELLED)
    elif isinstance(exc, CapacityError):
        error = pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE)
    else:
        pb_utils.Logger.log_error("".join(traceback.format_exception(exc)))
        error = pb_utils.TritonError(f"internal error: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
    return pb_utils.InferenceResponse(error=error)


def respond_each(requests, run) -> list:
    """Non-decoupled execute: ``run(request) -> output tensors`` per request; errors stay per request."""
    responses = []
    for request in requests:
        try:
            responses.append(pb_utils.InferenceResponse(output_tensors=run(request)))
        except Exception as exc:
            responses.append(error_response(exc))
    return responses


def respond_batch(requests, prepare, run_batch) -> list:
    """Non-decoupled execute over a batch: ``prepare(request) -> item`` per request (its errors stay
    with that request), then one ``run_batch(items) -> [output tensors]`` for all prepared ones."""
    outcomes: list = [None] * len(requests)
    items = {}
    for index, request in enumerate(requests):
        try:
            items[index] = prepare(request)
        except Exception as exc:
            outcomes[index] = exc
    if items:
        try:
            outcomes_of_batch = run_batch(list(items.values()))
        except Exception as exc:
            outcomes_of_batch = [exc] * len(items)
        for index, outcome in zip(items, outcomes_of_batch):
            outcomes[index] = outcome
    return [error_response(outcome) if isinstance(outcome, BaseException)
            else pb_utils.InferenceResponse(output_tensors=outcome) for outcome in outcomes]


def raw_speech_tokens(llm_ids: np.ndarray, name: str) -> np.ndarray:
    """Speech tokens as they travel between models, LLM ids (151663 + k) -> raw speech tokens k (int32)."""
    ids = llm_ids.reshape(-1).astype(np.int64)
    last = SPEECH_TOKEN_OFFSET + NUM_SPEECH_TOKENS - 1
    if ids.size and (ids.min() < SPEECH_TOKEN_OFFSET or ids.max() > last):
        raise InvalidInputError(f"{name} holds ids {ids.min()}..{ids.max()}; speech tokens are sent as LLM ids "
                                f"{SPEECH_TOKEN_OFFSET}..{last}")
    return (ids - SPEECH_TOKEN_OFFSET).astype(np.int32)


def reference_wav(request) -> np.ndarray:
    """``reference_wav`` (16 kHz float32) cut to ``reference_wav_len`` when that is sent."""
    wav = required_input(request, "reference_wav").reshape(-1)
    if wav.size == 0:
        raise InvalidInputError("reference_wav is empty; send 0.5 to 30 s of 16 kHz audio")
    length = optional_scalar(request, "reference_wav_len")
    if length is not None:
        if not 0 < length <= wav.size:
            raise InvalidInputError(
                f"reference_wav_len is {length}; it must be in 1..{wav.size} (the samples in reference_wav)")
        wav = wav[:length]
    return wav


def raise_response_error(response, model_name: str) -> None:
    """Re-raise a BLS response's error; a sub-model's INVALID_ARG stays an InvalidInputError and
    its UNAVAILABLE (out of capacity) a CapacityError, so the caller's client gets the same code."""
    if not response.has_error():
        return
    error = response.error()
    if error.code() == pb_utils.TritonError.INVALID_ARG:
        raise InvalidInputError(error.message())
    if error.code() == pb_utils.TritonError.UNAVAILABLE:
        raise CapacityError(f"model {model_name!r}: {error.message()}")
    raise RuntimeError(f"model {model_name!r} failed: {error.message()}")


# ----- decoupled BLS calls -----

class FinishedResponseIterators:
    """Decoupled BLS response iterators that have ended, kept alive until the stub lets go of them.

    Triton 24.10's Python stub holds its own reference to each decoupled BLS response iterator
    and drops it on its utils thread, without the GIL, a little after the last response (a
    queued cleanup). If that is the last reference, the iterator and the numpy arrays of every
    response it buffered are freed on that thread while Python runs on another: the heap gets
    corrupted and the stub dies ("Stub process ... is not healthy"); load widens the window.
    (The Python backend of 24.12 frees those arrays under the GIL.) So Python keeps its
    reference until the stub is known to have dropped its own: the utils thread works through
    its queue in order and also answers ``is_cancelled()``, so an ``is_cancelled()`` that asked
    the server (returned False; True is cached) proves every earlier cleanup done.

    One per stub thread that makes BLS calls (this project's BLS models use only the request
    thread).
    """

    def __init__(self) -> None:
        self._kept: list = []

    def keep(self, iterator) -> None:
        """Hold ``iterator``, which has returned its final response (its cleanup is queued)."""
        self._kept.append(iterator)

    def release(self, is_cancelled) -> None:
        """Drop what the stub has let go of. ``is_cancelled``: the bound method of a request (or
        response sender) that is still open: asking a finished request's is a use-after-free."""
        count = len(self._kept)
        if count and not is_cancelled():
            del self._kept[:count]


# ----- metrics -----

class Metric:
    """A Prometheus gauge, counter or histogram (``buckets``: upper bounds) on Triton's metrics
    endpoint, labelled with the model name.

    Exposes per-request state (active LLM requests, open token2wav streams, generated tokens)
    so that operators and tests can check that nothing outlives its request.
    """

    # Metric updates from several threads of one model process at once crash the server
    # (Triton 24.10 Python backend), so every update in this process goes through one lock.
    _lock = threading.Lock()

    def __init__(self, name: str, description: str, model_name: str, kind: str = "gauge",
                 buckets: list[float] | None = None):
        kinds = {"gauge": pb_utils.MetricFamily.GAUGE, "counter": pb_utils.MetricFamily.COUNTER,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}
        # The family must outlive its metric objects, hence kept on self.
        self._family = pb_utils.MetricFamily(name=name, description=description, kind=kinds[kind])
        labels = {"model": model_name}
        self._metric = (self._family.Metric(labels=labels, buckets=buckets) if kind == "histogram"
                        else self._family.Metric(labels=labels))

    def set(self, value: float) -> None:
        with self._lock:
            self._metric.set(value)

    def increment(self, delta: float = 1) -> None:
        with self._lock:
            self._metric.increment(delta)

    def observe(self, value: float) -> None:
        with self._lock:
            self._metric.observe(value)


class WorkMetrics:
    """Running totals kept by plain objects (``attribute`` of ``source``) as Triton counters.

    ``fields``: metric name -> (description, source, attribute). :meth:`publish` adds what each
    total grew by since the last call, so the objects stay free of Triton (they also serve
    offline runs and tests). Thread-safe.
    """

    def __init__(self, model_name: str, fields: dict[str, tuple[str, object, str]]):
        self._fields = [(Metric(name, text, model_name, kind="counter"), source, attribute)
                        for name, (text, source, attribute) in fields.items()]
        self._published = [0] * len(self._fields)
        self._lock = threading.Lock()

    def publish(self) -> None:
        with self._lock:
            for index, (metric, source, attribute) in enumerate(self._fields):
                value = getattr(source, attribute)
                if value > self._published[index]:
                    metric.increment(value - self._published[index])
                    self._published[index] = value
