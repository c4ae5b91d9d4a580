"""Echo model: OUTPUT0 = INPUT0, TEXT_OUT = TEXT (tests the Python backend round trip)."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUTPUT0", values), pb_utils.Tensor("TEXT_OUT", text)]
                )
            )
        return responses
