"""Triton model `llm`: prompt ids -> speech-token ids, TensorRT-LLM tensor interface.

A thin adapter: the logic is in cosyserve.serving.llm_model.
"""
from cosyserve.serving.llm_model import LLMModel
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = LLMModel(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
