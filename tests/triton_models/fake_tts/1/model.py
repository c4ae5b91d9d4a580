"""Stand-in for cosyvoice2 with the same tensors: 0.1 s of 24 kHz audio per target-text character.

Sample 0 holds reference_wav_len and sample 1 the number of reference_text characters (0 when
absent), so tests can check what the client sent. With a decoupled config the audio is sent
in NUM_CHUNKS responses, CHUNK_DELAY_S apart, then an empty final response.
"""
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

OUTPUT_RATE = 24000
SAMPLES_PER_CHAR = OUTPUT_RATE // 10
NUM_CHUNKS = 3
CHUNK_DELAY_S = 0.02


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))

    def execute(self, requests):
        responses = []
        for request in requests:
            target = _scalar(request, "target_text", b"").decode("utf-8")
            audio = np.zeros((1, SAMPLES_PER_CHAR * len(target)), dtype=np.float32)
            audio[0, 0] = _scalar(request, "reference_wav_len", 0)
            audio[0, 1] = len(_scalar(request, "reference_text", b"").decode("utf-8"))
            if not self.decoupled:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("waveform", audio)]))
                continue
            sender = request.get_response_sender()
            for chunk in np.array_split(audio, NUM_CHUNKS, axis=1):
                time.sleep(CHUNK_DELAY_S)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("waveform", np.ascontiguousarray(chunk))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None if self.decoupled else responses
