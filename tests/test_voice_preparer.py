"""The engine's voice preparation thread (cosyserve.engine.preparer): bursts prepared together,
callbacks answered once the voices are computed, close answering what is left."""

from __future__ import annotations

import threading
import time

from cosyserve.engine.preparer import VoicePreparer


def test_a_burst_of_voices_is_one_preparation_and_callbacks_follow_the_wait():
    calls, waited, answered = [], [], threading.Event()
    preparer = VoicePreparer(calls.append, waited.append, gather_s=0.2, gather_max_s=5.0).start()
    try:
        for k in range(4):  # 20 ms apart: within the gather time of each other
            preparer.put([f"v{k}"], answered.set if k == 3 else None)
            time.sleep(0.02)
        assert answered.wait(10)
        assert calls == [["v0", "v1", "v2", "v3"]] and waited == calls
    finally:
        preparer.close()


def test_voices_apart_are_separate_preparations():
    calls, done = [], threading.Event()
    preparer = VoicePreparer(calls.append, lambda voices: None, gather_s=0.001, gather_max_s=0.001).start()
    try:
        preparer.put(["a"])
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        preparer.put(["b"], done.set)
        assert done.wait(10) and calls == [["a"], ["b"]]
    finally:
        preparer.close()


def test_close_answers_callbacks_still_queued():
    answered = threading.Event()
    preparer = VoicePreparer(lambda voices: None, lambda voices: None)  # never started
    preparer.put(["a"], answered.set)
    preparer.close()
    assert answered.is_set()


def test_a_voice_queued_again_is_queued_once():
    """A voice put while one of its key waits is not queued again (a gathering preparation is not kept
    waiting by it); its callback still follows the preparation."""
    calls, answered = [], threading.Event()
    preparer = VoicePreparer(calls.append, lambda voices: None, gather_s=0.001, gather_max_s=0.001, key=str.lower)
    preparer.put(["a", "A", "b"])
    preparer.put(["B"], answered.set)
    assert preparer.queued("b") and preparer.queued("B") and not preparer.queued("c")
    preparer.start()
    try:
        assert answered.wait(10) and calls == [["a", "b"]]
    finally:
        preparer.close()


def test_a_gathered_burst_is_prepared_without_waiting_for_more():
    """A burst put as gathered (a front-end batch) is prepared at once, though the gather would wait
    seconds for more."""
    calls, answered = [], threading.Event()
    preparer = VoicePreparer(calls.append, lambda voices: None, gather_s=5.0, gather_max_s=30.0).start()
    try:
        began = time.monotonic()
        preparer.put(["a", "b"], answered.set, gathered=True)
        assert answered.wait(10) and time.monotonic() - began < 4.0 and calls == [["a", "b"]]
    finally:
        preparer.close()
