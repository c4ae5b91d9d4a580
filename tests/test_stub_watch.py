"""The stub watch's rule for a crashed stub (cosyserve.serving.stub_watch); its effect on a real
server is tested in tests/test_faults.py."""

from cosyserve.serving.processes import Stub
from cosyserve.serving.stub_watch import crashed_stubs

LLM, T2W = Stub(10, "llm", "llm_0_0"), Stub(11, "token2wav", "token2wav_0_0")
READY = {"llm", "token2wav"}


def test_a_stub_gone_under_a_ready_model_has_crashed():
    assert crashed_stubs({10: LLM, 11: T2W}, {11: T2W}, READY) == [LLM]


def test_a_stub_replaced_by_a_reload_has_not():
    reloaded = Stub(20, "llm", "llm_0_0")  # explicit load: the new instance starts before the old one ends
    assert crashed_stubs({10: LLM, 11: T2W}, {20: reloaded, 11: T2W}, READY) == []


def test_a_stub_of_a_model_being_unloaded_has_not():
    assert crashed_stubs({10: LLM, 11: T2W}, {11: T2W}, {"token2wav"}) == []

