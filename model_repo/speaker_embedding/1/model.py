"""Triton model `speaker_embedding`: 16 kHz reference audio -> speaker embedding.

A thin adapter: the logic is in cosyserve.serving.frontend_models.
"""
from cosyserve.serving.frontend_models import SpeakerEmbeddingModel
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = SpeakerEmbeddingModel(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
