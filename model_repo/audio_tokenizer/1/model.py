"""Triton model `audio_tokenizer`: 16 kHz reference audio -> prompt speech tokens.

A thin adapter: the logic is in cosyserve.serving.frontend_models.
"""
from cosyserve.serving.frontend_models import AudioTokenizerModel
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = AudioTokenizerModel(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
