"""Triton model `token2wav_dit`: speech tokens -> waveform with the DiT flow, streams keyed by request id (logic in cosyserve.serving.token2wav_dit_model)."""
from cosyserve.serving.token2wav_dit_model import Token2WavDitModel
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = Token2WavDitModel(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
