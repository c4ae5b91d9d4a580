"""The ``cosyvoice2_offline`` Triton model: one response per request, for clients that cannot read a
decoupled model (Triton's HTTP ``infer``), from the ``cosyvoice2`` engine of the same server.

There is one engine per GPU, in the ``cosyvoice2`` model's process; this model owns no model. It
forwards each request, its inputs as sent plus ``streaming`` false, to ``cosyvoice2`` (a BLS call)
and answers with the one waveform the engine returns, or its error. Each instance forwards one
request at a time: ``instance_count`` bounds the offline requests in flight, Triton queues the
rest (``max_queue_size``, ``queue_timeout_microseconds``: refused at once past them).
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from .triton_utils import error_response

ENGINE_MODEL = "cosyvoice2"


class OfflineProxy:
    def __init__(self, config: dict):
        self.inputs = [entry["name"] for entry in config["input"]]

    def execute(self, requests) -> list:
        return [self._forward(request) for request in requests]

    def _forward(self, request):
        try:
            inputs = [tensor for name in self.inputs
                      if (tensor := pb_utils.get_input_tensor_by_name(request, name)) is not None]
            inputs.append(pb_utils.Tensor("streaming", np.array([[False]], np.bool_)))
            responses = pb_utils.InferenceRequest(model_name=ENGINE_MODEL, inputs=inputs,
                                                  requested_output_names=["waveform"],
                                                  request_id=request.request_id()).exec(decoupled=True)
            waveform = None
            for response in responses:
                if response.has_error():
                    return pb_utils.InferenceResponse(error=response.error())
                output = pb_utils.get_output_tensor_by_name(response, "waveform")
                if output is not None:
                    waveform = output.as_numpy()
            if waveform is None:
                raise RuntimeError(f"{ENGINE_MODEL} answered without a waveform")
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("waveform", waveform)])
        except Exception as exc:
            return error_response(exc)
