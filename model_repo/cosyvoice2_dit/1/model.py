"""Triton model `cosyvoice2_dit`: text (+ voice) -> 24 kHz waveform, LLM via an OpenAI-compatible server and the DiT token2wav (logic in cosyserve.serving.dit_bls)."""
from cosyserve.serving.dit_bls import CosyVoice2DitBLS
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = CosyVoice2DitBLS(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
