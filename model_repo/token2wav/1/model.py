"""Triton model `token2wav`: speech tokens -> waveform, offline or streaming sessions.

A thin adapter: the logic is in cosyserve.serving.token2wav_model.
"""
from cosyserve.serving.token2wav_model import Token2WavModel
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = Token2WavModel(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
