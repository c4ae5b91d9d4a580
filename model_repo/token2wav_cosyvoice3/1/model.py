"""Triton model `token2wav` of the CosyVoice3 repository: raw speech codes -> waveform (logic in cosyserve.serving.token2wav_cv3_model)."""
from cosyserve.serving.token2wav_cv3_model import Cv3Token2WavModel
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = Cv3Token2WavModel(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
