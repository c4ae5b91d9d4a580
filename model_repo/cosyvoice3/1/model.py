"""Triton model `cosyvoice3`: text + reference voice -> 24 kHz waveform with CosyVoice3 (logic in cosyserve.serving.cosyvoice3_bls)."""
from cosyserve.serving.cosyvoice3_bls import CosyVoice3BLS
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = CosyVoice3BLS(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
