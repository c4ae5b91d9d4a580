"""Triton models `cosyvoice2`, `cosyvoice3`, `cosyvoice2_dit` (parameter model_kind): text (+ voice) -> 24 kHz
waveform, streaming or offline.

A thin adapter: the front door is cosyserve.serving.frontdoor, the engine cosyserve.engine.
"""
from cosyserve.serving.frontdoor import EngineFrontDoor
from cosyserve.serving.triton_utils import model_config


class TritonPythonModel:
    def initialize(self, args):
        self.model = EngineFrontDoor(model_config(args))

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.close()
        del self.model  # freed here: left to the Triton 24.10 stub's own teardown, torch models crash it
