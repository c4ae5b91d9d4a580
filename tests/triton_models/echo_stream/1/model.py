"""Decoupled echo model: sends INPUT0 back split into NUM_CHUNKS responses."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            values = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            num_chunks = int(pb_utils.get_input_tensor_by_name(request, "NUM_CHUNKS").as_numpy()[0])
            for chunk in np.array_split(values, num_chunks):
                sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", chunk)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
