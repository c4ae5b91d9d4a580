"""Triton model `cosyvoice2_offline`: one response per request from the `cosyvoice2` engine
(for HTTP clients). A thin adapter: the logic is in cosyserve.serving.offline_proxy."""
from cosyserve.serving.offline_proxy import OfflineProxy
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = OfflineProxy(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)
