"""The text-in WebSockets' protocol (cosyserve/api/text_stream.py) against a fake speech stream:
where text is cut, audio in order while later pieces are already requested, the ends of a context
and of a socket, bad messages, cancellation. The same sockets against Triton: tests/test_api.py."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from cosyserve.api.encoding import PCMEncoder
from cosyserve.api.text_stream import (CLOSE_POLICY, CLOSE_TIMEOUT, CLOSE_TOO_BIG, CLOSE_UNSUPPORTED,
                                       MAX_MESSAGE_BYTES, ProtocolError, SpeechSocket, TextSplitter, Utterance)
from cosyserve.api.triton import Synthesis

SAMPLES_PER_CHAR = 240  # the fake voice: 10 ms of audio per character


@pytest.mark.parametrize("feeds, pieces, rest", [
    (["Hello there. ", "How are ", "you today? Fine"], ["Hello there.", "How are you today?"], "Fine"),
    (["A short one, ", "and then a much longer clause, ", "end"], ["A short one, and then a much longer clause,"],
     "end"),
    (["你好，世界。今天", "天气很好！"], ["你好，世界。", "今天天气很好！"], None),
    (["It costs 3.5 dollars. "], ["It costs 3.5 dollars."], None),
    (["Whole sentences.", "Sent without a space!", "And a clause"], ["Whole sentences.", "Sent without a space!"],
     "And a clause"),
    (["word " * 80], ["word " * 59 + "word"], "word " * 20),
])
def test_text_is_cut_at_sentence_ends_long_clauses_and_spaces(feeds, pieces, rest):
    splitter = TextSplitter()
    got = [piece for text in feeds for piece in splitter.feed(text)]
    assert got == [p.strip() for p in pieces]
    assert splitter.flush() == (rest.strip() if rest else None)


class FakeVoice:
    """Speech requests that record when they start and end; each character is SAMPLES_PER_CHAR
    samples, in chunks of 4 characters, every sample equal to the piece's number."""

    def __init__(self, delay_s: float = 0.005, fail_on: str | None = None, refusals: int = 0):
        self.delay_s, self.fail_on, self.refusals = delay_s, fail_on, refusals
        self.started: list[str] = []
        self.closed: list[str] = []
        self.running = 0
        self.most_running = 0

    async def stream(self, synthesis: Synthesis):
        if self.refusals:
            self.refusals -= 1
            raise RuntimeError("overloaded: this server is sending 2 streams, its limit of 2 (max_streams)")
        number = len(self.started)
        self.started.append(synthesis.text)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if self.fail_on and self.fail_on in synthesis.text:
                raise RuntimeError(f"cannot voice {synthesis.text!r}")
            for start in range(0, len(synthesis.text), 4):
                await asyncio.sleep(self.delay_s)
                count = min(4, len(synthesis.text) - start) * SAMPLES_PER_CHAR
                yield np.full(count, number / 100, dtype=np.float32)
        finally:
            self.running -= 1
            self.closed.append(synthesis.text)


def app_for(voice: FakeVoice, multi: bool, timeout_s: float = 5.0) -> FastAPI:
    app = FastAPI()

    @app.websocket("/ws")
    async def socket(websocket: WebSocket) -> None:
        await websocket.accept()

        def check_key(key):
            if key != "k":
                raise ProtocolError("invalid API key")

        await SpeechSocket(websocket, "001", timeout_s, multi=multi, stream=voice.stream, encoder=PCMEncoder,
                           check_key=check_key if websocket.query_params.get("auth") else None,
                           error_of=lambda exc: (str(exc), "internal_error", 1011)).run()
    return app


def received(ws) -> list[dict]:
    """Messages until the server closes; the close's code last, as {"close": code}."""
    messages = []
    while True:
        try:
            messages.append(json.loads(ws.receive_text()))
        except WebSocketDisconnect as exc:
            messages.append({"close": exc.code})
            return messages


def pcm(messages: list[dict], context: str | None = None) -> np.ndarray:
    data = b"".join(base64.b64decode(m["audio"]) for m in messages
                    if m.get("audio") and m.get("contextId") == context)
    return np.frombuffer(data, "<i2")


def test_a_stream_speaks_its_pieces_in_order_while_later_ones_are_requested():
    voice = FakeVoice()
    text = "The first sentence is here. Then a second one follows it. And a third ends the text."
    with TestClient(app_for(voice, multi=False)).websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"text": " ", "voice_settings": {"stability": 0.5}}))
        for word in text.split(" "):
            ws.send_text(json.dumps({"text": word + " "}))
        ws.send_text(json.dumps({"text": ""}))
        messages = received(ws)
    assert voice.started == ["The first sentence is here.", "Then a second one follows it.",
                             "And a third ends the text."]
    assert messages[-2] == {"isFinal": True} and messages[-1] == {"close": 1000}
    audio = pcm(messages)
    sizes = [len(piece) * SAMPLES_PER_CHAR for piece in voice.started]
    assert audio.size == sum(sizes)
    bounds = np.cumsum([0] + sizes)
    for number in range(3):  # each piece's audio whole and in order
        assert np.all(np.abs(audio[bounds[number]:bounds[number + 1]] - round(number / 100 * 32767)) <= 1)
    audio = [m for m in messages if m.get("audio")]
    aligned = [m for m in messages if m.get("audio") == ""]
    assert all(m["isFinal"] is None and m["alignment"] is None for m in audio)
    # each piece's estimated alignment after its audio: its characters, spread over its audio
    assert ["".join(m["alignment"]["chars"]) for m in aligned] == [piece + " " for piece in voice.started]
    for m, piece in zip(aligned, voice.started):
        times = m["normalizedAlignment"]
        assert times == m["alignment"] and len(times["charStartTimesMs"]) == len(piece) + 1
        assert times["charStartTimesMs"][0] == 0
        assert sum(times["charDurationsMs"]) == round(1000 * len(piece) * SAMPLES_PER_CHAR / 24000)
        assert all(b >= a for a, b in zip(times["charStartTimesMs"], times["charStartTimesMs"][1:]))
    assert voice.most_running >= 2 and sorted(voice.closed) == sorted(voice.started)


def test_flush_voices_what_is_buffered_and_at_most_two_pieces_run_at_once():
    voice = FakeVoice(delay_s=0.02)
    with TestClient(app_for(voice, multi=False)).websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"text": " "}))
        ws.send_text(json.dumps({"text": "no end mark yet", "flush": True}))
        for k in range(5):
            ws.send_text(json.dumps({"text": f"Sentence number {k}. "}))
        ws.send_text(json.dumps({"text": ""}))
        messages = received(ws)
    assert voice.started[0] == "no end mark yet" and len(voice.started) == 6
    assert voice.most_running == 2
    assert pcm(messages).size == sum(len(t) for t in voice.started) * SAMPLES_PER_CHAR


def test_contexts_of_one_socket_speak_apart_and_close_socket_ends_them_all():
    voice = FakeVoice()
    with TestClient(app_for(voice, multi=True)).websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"text": " ", "context_id": "a"}))
        ws.send_text(json.dumps({"text": "Context a speaks. ", "context_id": "a"}))
        ws.send_text(json.dumps({"text": "Context b speaks too. ", "context_id": "b"}))
        ws.send_text(json.dumps({"text": "", "context_id": "b"}))  # keeps it alive, nothing else
        ws.send_text(json.dumps({"text": "Unflushed", "context_id": "a", "flush": True}))
        ws.send_text(json.dumps({"close_socket": True}))
        messages = received(ws)
    assert sorted(voice.started) == ["Context a speaks.", "Context b speaks too.", "Unflushed"]
    assert {"isFinal": True, "contextId": "a"} in messages and {"isFinal": True, "contextId": "b"} in messages
    assert pcm(messages, "a").size == (len("Context a speaks.") + len("Unflushed")) * SAMPLES_PER_CHAR
    assert pcm(messages, "b").size == len("Context b speaks too.") * SAMPLES_PER_CHAR
    assert messages[-1] == {"close": 1000}


def test_close_context_voices_what_was_sent_then_answers_final():
    """Pipecat's end of a turn: the sentences, a flush, close_context; the audio ends, then isFinal."""
    voice = FakeVoice()
    with TestClient(app_for(voice, multi=True)).websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"text": ""}))  # a keep-alive before any context: opens none
        ws.send_text(json.dumps({"text": " ", "context_id": "turn1", "voice_settings": {"speed": 1.0}}))
        ws.send_text(json.dumps({"text": "Hello there.", "context_id": "turn1"}))
        ws.send_text(json.dumps({"text": "How can I help", "context_id": "turn1"}))
        ws.send_text(json.dumps({"context_id": "turn1", "flush": True}))
        ws.send_text(json.dumps({"context_id": "turn1", "close_context": True}))
        messages = [json.loads(ws.receive_text())]
        while not messages[-1].get("isFinal"):
            messages.append(json.loads(ws.receive_text()))
        ws.send_text(json.dumps({"close_socket": True}))
        messages += received(ws)
    assert voice.started == ["Hello there.", "How can I help"]
    assert pcm(messages, "turn1").size == len("Hello there.How can I help") * SAMPLES_PER_CHAR
    finals = [m for m in messages if m.get("isFinal")]
    assert finals == [{"isFinal": True, "contextId": "turn1"}]  # none for a "default" context
    assert messages.index(finals[0]) > max(i for i, m in enumerate(messages) if m.get("audio"))


def test_a_new_context_cancels_a_closed_one_still_voicing():
    voice = FakeVoice(delay_s=0.05)
    with TestClient(app_for(voice, multi=True)).websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"text": "A long sentence that is interrupted soon. " * 3, "context_id": "old"}))
        first = json.loads(ws.receive_text())
        assert first["contextId"] == "old" and first["audio"]
        ws.send_text(json.dumps({"context_id": "old", "close_context": True}))
        ws.send_text(json.dumps({"text": "The new turn. ", "context_id": "new"}))
        ws.send_text(json.dumps({"close_socket": True}))
        messages = received(ws)
    assert {"isFinal": True, "contextId": "old"} in messages
    assert pcm([first] + messages, "old").size < 3 * len("A long sentence that is interrupted soon.") * SAMPLES_PER_CHAR
    assert pcm(messages, "new").size == len("The new turn.") * SAMPLES_PER_CHAR
    assert voice.running == 0 and sorted(voice.closed) == sorted(voice.started)  # every request ended


@pytest.mark.parametrize("send, code, words", [
    (b"\x00binary", CLOSE_UNSUPPORTED, "binary"),
    ("not json", CLOSE_UNSUPPORTED, "JSON"),
    ("[1, 2]", CLOSE_UNSUPPORTED, "JSON objects"),
    (json.dumps({"text": 5}), CLOSE_POLICY, "'text' must be a string"),
    (json.dumps({"flush": "yes", "text": "a"}), CLOSE_POLICY, "'flush' must be true or false"),
    (json.dumps({"no_text": 1}), CLOSE_POLICY, "needs 'text'"),
    (json.dumps({"text": "x" * (MAX_MESSAGE_BYTES + 1)}), CLOSE_TOO_BIG, "larger than"),
])
def test_bad_messages_get_an_error_and_a_close_code(send, code, words):
    voice = FakeVoice()
    with TestClient(app_for(voice, multi=False)).websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"text": " "}))
        ws.send_bytes(send) if isinstance(send, bytes) else ws.send_text(send)
        messages = received(ws)
    assert messages[-1] == {"close": code} and words in messages[-2]["message"]


def test_text_after_the_end_a_missing_key_and_an_idle_socket_are_refused():
    voice = FakeVoice()
    with TestClient(app_for(voice, multi=False)).websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"text": "Slow enough to still be speaking. " * 4}))
        ws.send_text(json.dumps({"text": ""}))
        ws.send_text(json.dumps({"text": "more"}))
        messages = received(ws)
    assert messages[-1] == {"close": CLOSE_POLICY} and "after the end" in messages[-2]["message"]
    with TestClient(app_for(voice, multi=False)).websocket_connect("/ws?auth=1") as ws:
        ws.send_text(json.dumps({"text": " ", "xi_api_key": "wrong"}))
        messages = received(ws)
    assert messages[-1] == {"close": CLOSE_POLICY} and messages[-2]["message"] == "invalid API key"
    with TestClient(app_for(voice, multi=False)).websocket_connect("/ws?auth=1") as ws:
        ws.send_text(json.dumps({"text": "Keyed. ", "xi_api_key": "k"}))
        ws.send_text(json.dumps({"text": ""}))
        assert received(ws)[-2:] == [{"isFinal": True}, {"close": 1000}]
    with TestClient(app_for(voice, multi=False, timeout_s=0.2)).websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"text": " "}))
        messages = received(ws)
    assert messages[-1] == {"close": CLOSE_TIMEOUT} and "inactivity" in messages[-2]["message"]


def test_a_failed_piece_ends_the_stream_with_its_error():
    voice = FakeVoice(fail_on="broken")
    with TestClient(app_for(voice, multi=False)).websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"text": "This one works. This one is broken. This one never speaks. "}))
        messages = received(ws)
    assert messages[-1] == {"close": 1011} and "broken" in messages[-2]["message"]
    assert pcm(messages).size == len("This one works.") * SAMPLES_PER_CHAR
    assert voice.running == 0


def test_utterance_cancel_ends_every_request():
    async def run():
        voice = FakeVoice(delay_s=0.05)
        sent = []

        async def send(chunk):
            sent.append(chunk)

        async def spoken(text, samples):
            pass

        async def failed(exc):
            raise AssertionError(exc)

        utterance = Utterance(voice.stream, None, send, spoken, failed)
        utterance.add("One sentence here. Another one there. A third one too. ")
        await asyncio.sleep(0.08)
        await utterance.cancel()
        return voice, sent
    voice, sent = asyncio.run(run())
    assert voice.running == 0 and voice.started and all(chunk is not None for chunk in sent)


def test_a_piece_refused_as_overloaded_is_asked_again():
    voice = FakeVoice(refusals=3)
    with TestClient(app_for(voice, multi=False)).websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"text": "Refused three times, then spoken. "}))
        ws.send_text(json.dumps({"text": ""}))
        messages = received(ws)
    assert messages[-2:] == [{"isFinal": True}, {"close": 1000}]
    assert pcm(messages).size == len("Refused three times, then spoken.") * SAMPLES_PER_CHAR


def test_close_reasons_fit_a_close_frame():
    from cosyserve.api.text_stream import close_reason

    assert close_reason("short") == "short"
    reason = close_reason("未知的声音" * 40)  # 3 bytes a character
    assert len(reason.encode()) <= 123 and reason.startswith("未知的声音")
