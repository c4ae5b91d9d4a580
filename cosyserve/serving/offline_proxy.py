"""The ``cosyvoice2_offline`` Triton model: one response per request, for clients that cannot read a
decoupled model (Triton's HTTP ``infer``), from the ``cosyvoice2`` engine of the same server.

There is one engine per GPU, in the ``cosyvoice2`` model's process; this model owns no model. It
forwards each request, its inputs as sent plus ``streaming`` false, to ``cosyvoice2`` (a BLS call)
and answers with the one waveform the engine returns, or its error (with its code: :data:`CODE_TAG`). Each instance forwards one
request at a time: ``instance_count`` bounds the offline requests in flight, Triton queues the
rest (``max_queue_size``, ``queue_timeout_microseconds``: refused at once past them).
"""

from __future__ import annotations

import re

import numpy as np
import triton_python_backend_utils as pb_utils

from .triton_utils import error_response

ENGINE_MODEL = "cosyvoice2"
# Triton 24.10 hands a decoupled model's error to a BLS caller with code INTERNAL whatever it was,
# so the engine's front door puts the code at the head of the message of the errors it sends this
# model ("[INVALID_ARG] ...": bad input stays INVALID_ARG, capacity UNAVAILABLE), and this model
# sends it on with that code and without the tag.
CODE_TAG = re.compile(r"^\[([A-Z_]+)\] ")


def tagged_error(error) -> "pb_utils.TritonError":
    """``error`` (a TritonError) with its code at the head of its message, for this model to read."""
    return pb_utils.TritonError(f"[{str(error.code()).rpartition('.')[2]}] {error.message()}", error.code())


def untagged_error(message: str) -> "pb_utils.TritonError":
    match = CODE_TAG.match(message)
    code = getattr(pb_utils.TritonError, match.group(1), None) if match else None
    if code is None:
        return pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(message[match.end():], code)


class OfflineProxy:
    def __init__(self, config: dict):
        self.inputs = [entry["name"] for entry in config["input"]]

    def execute(self, requests) -> list:
        return [self._forward(request) for request in requests]

    def _forward(self, request):
        try:
            inputs = [tensor for name in self.inputs
                      if (tensor := pb_utils.get_input_tensor_by_name(request, name)) is not None]
            # as many rows as the text: a request of several is refused by cosyvoice2's own check
            rows = next((t.as_numpy().shape[0] for t in inputs if t.name() == "target_text"), 1)
            inputs.append(pb_utils.Tensor("streaming", np.zeros((rows, 1), np.bool_)))
            responses = pb_utils.InferenceRequest(model_name=ENGINE_MODEL, inputs=inputs,
                                                  requested_output_names=["waveform"],
                                                  request_id=request.request_id()).exec(decoupled=True)
            waveform = None
            for response in responses:
                if response.has_error():
                    return pb_utils.InferenceResponse(error=untagged_error(response.error().message()))
                output = pb_utils.get_output_tensor_by_name(response, "waveform")
                if output is not None:
                    waveform = output.as_numpy()
            if waveform is None:
                raise RuntimeError(f"{ENGINE_MODEL} answered without a waveform")
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("waveform", waveform)])
        except Exception as exc:
            return error_response(exc)
