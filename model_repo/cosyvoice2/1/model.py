"""Triton model `cosyvoice2`: text (+ voice) -> 24 kHz waveform, streaming or offline.

A thin adapter: the logic is in cosyserve.serving.bls.
"""
from cosyserve.serving.bls import CosyVoice2BLS
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = CosyVoice2BLS(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
