"""Triton model `audio_tokenizer` of the CosyVoice3 repository: 16 kHz reference audio -> raw v3 speech codes.

A thin adapter: the logic is in cosyserve.serving.frontend_models.
"""
from cosyserve.serving.frontend_models import AudioTokenizerV3Model
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = AudioTokenizerV3Model(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
