"""Text in as it is generated, audio out as it is ready: ElevenLabs' text-to-speech WebSockets.

* ``/v1/text-to-speech/{voice_id}/stream-input``: one utterance per socket. The first message is
  ``{"text": " "}`` (with optional settings), then ``{"text": "...", "flush": bool}`` pieces, then
  ``{"text": ""}``, which ends the input; the server sends ``{"audio": "<base64>", "isFinal": null,
  ...}`` as audio is ready, ``{"isFinal": true}`` after the last of it, and closes the socket.
* ``/v1/text-to-speech/{voice_id}/multi-stream-input``: several utterances (contexts) on one socket:
  each message names its ``context_id`` (a default context when it does not); ``flush``;
  ``{"context_id", "close_context": true}`` voices what was cut or flushed, then answers
  ``isFinal`` for the context; ``{"close_socket": true}`` does that for every context and closes
  the socket; the replies carry ``contextId``. A new context cancels the closed ones still voicing
  (an agent interrupted by its listener closes its context and opens another).

Text is cut into pieces at sentence ends and, once a piece is long enough, at clause ends (and at
``flush``, and at the end); each piece is a speech request of its own to Triton, started as soon as
it is cut, so the LLM of a piece runs while the one before it is voiced, and its audio is sent
after that piece's, in order (:class:`Utterance`). At most :data:`PIECES_AHEAD` pieces of an
utterance run at once. A piece the server refuses as overloaded (before any of its audio) is asked
again every :data:`OVERLOAD_RETRY_S` for up to :data:`OVERLOAD_WAIT_S`: a socket's client cannot
retry one piece of its utterance. Closing a context, or the socket, cancels its requests under way.

Differences from ElevenLabs': the alignment is estimated and comes per piece (an audio message
without audio after each piece's last audio, its characters sharing the piece's audio evenly: the
model gives no timing per character); ``voice_settings``, ``generation_config`` and ``pronunciation_dictionary_locators`` are
accepted and ignored; text is voiced by sentence (or long clause) as soon as it is complete,
not after ElevenLabs' ``chunk_length_schedule`` of characters.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from ..engine.front_end import MAX_SEGMENT_CHARS
from ..errors import is_overload
from ..schedule import OUTPUT_SAMPLE_RATE
from .triton import Synthesis

# A piece is cut at a clause end (a comma, a colon...) once it holds this many characters; at a
# sentence end whatever its length; without either, at the last space before MAX_PIECE_CHARS.
MIN_CLAUSE_CHARS = 20
MAX_PIECE_CHARS = min(300, MAX_SEGMENT_CHARS)
PIECES_AHEAD = 2  # speech requests of one utterance running at once
OVERLOAD_RETRY_S = 0.2
OVERLOAD_WAIT_S = 10.0
MAX_MESSAGE_BYTES = 64 * 1024
DEFAULT_INACTIVITY_TIMEOUT_S = 20
MAX_INACTIVITY_TIMEOUT_S = 180
DEFAULT_CONTEXT = "default"

_SENTENCE_END = re.compile(r"[.!?;](?=\s)|[。！？；…]|\n")
_CLAUSE_END = re.compile(r"[,:](?=\s)|[，、：]")
_MESSAGE_END = re.compile(r"[.!?]$")

# WebSocket close codes: RFC 6455's, and 4000-4999 for the application's own.
CLOSE_NORMAL, CLOSE_UNSUPPORTED, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_INTERNAL, CLOSE_TRY_LATER = (
    1000, 1003, 1008, 1009, 1011, 1013)
CLOSE_TIMEOUT = 4008


class TextSplitter:
    """Text as it arrives -> the pieces to voice, cut where speech may pause."""

    def __init__(self, min_clause_chars: int = MIN_CLAUSE_CHARS, max_piece_chars: int = MAX_PIECE_CHARS):
        self.min_clause_chars = min_clause_chars
        self.max_piece_chars = max_piece_chars
        self._buffer = ""

    def feed(self, text: str) -> list[str]:
        """The pieces that ``text`` completes. A message that ends with a sentence's end mark ends
        its sentence too (clients that send whole sentences send no space after them)."""
        self._buffer += text
        pieces = []
        while (cut := self._cut()) is not None:
            piece, self._buffer = self._buffer[:cut], self._buffer[cut:]
            if piece.strip():
                pieces.append(piece.strip())
        if _MESSAGE_END.search(self._buffer) and self._buffer.strip():
            pieces.append(self._buffer.strip())
            self._buffer = ""
        return pieces

    def flush(self) -> str | None:
        """Whatever is buffered, as a piece (None if it is blank)."""
        piece, self._buffer = self._buffer.strip(), ""
        return piece or None

    def _cut(self) -> int | None:
        text = self._buffer
        sentence = _SENTENCE_END.search(text)
        if sentence is not None and sentence.end() <= self.max_piece_chars:
            return sentence.end()
        for clause in _CLAUSE_END.finditer(text[:self.max_piece_chars]):
            if len(text[:clause.end()].strip()) >= self.min_clause_chars:
                return clause.end()
        if len(text) > self.max_piece_chars:
            space = text.rfind(" ", 0, self.max_piece_chars)
            return space + 1 if space > 0 else self.max_piece_chars
        return None


class ProtocolError(Exception):
    """A client's message the socket cannot take: closed with ``code`` after an error message."""

    def __init__(self, message: str, code: int = CLOSE_POLICY):
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class _Piece:
    text: str
    audio: asyncio.Queue = field(default_factory=asyncio.Queue)  # float32 chunks, then None or an exception
    task: asyncio.Task | None = None


class Utterance:
    """One context's speech: its pieces' requests (at most ``ahead`` running) and the task that
    sends their audio in order. ``stream(synthesis)`` is the speech request (Triton's chunks);
    ``send(chunk or None at the end)`` takes the audio out; ``spoken(text, samples)`` hears of each
    piece once its audio is all sent; ``failed(exc)`` of a request that failed (the utterance then
    stops)."""

    def __init__(self, stream: Callable[[Synthesis], AsyncIterator[np.ndarray]], speaker_id: str | None,
                 send: Callable[[np.ndarray | None], Awaitable[None]],
                 spoken: Callable[[str, int], Awaitable[None]],
                 failed: Callable[[BaseException], Awaitable[None]], ahead: int = PIECES_AHEAD):
        self._splitter = TextSplitter()
        self._stream, self._speaker_id = stream, speaker_id
        self._send, self._spoken, self._failed = send, spoken, failed
        self._running = asyncio.Semaphore(ahead)
        self._pieces: asyncio.Queue[_Piece | None] = asyncio.Queue()
        self._all: list[_Piece] = []
        self._unsent = 0  # pieces whose audio is not all sent
        self.ended = False  # no more text
        self._speaker = asyncio.create_task(self._speak())

    @property
    def done(self) -> bool:
        """Its last message is sent (or it failed, or was cancelled)."""
        return self._speaker.done()

    @property
    def speaking(self) -> bool:
        """Whether audio is still to come for text already cut into pieces."""
        return self._unsent > 0 and not self._speaker.done()

    def add(self, text: str, flush: bool = False) -> None:
        """Text of the utterance (``flush``: voice everything buffered now)."""
        pieces = self._splitter.feed(text)
        if flush and (rest := self._splitter.flush()) is not None:
            pieces.append(rest)
        for piece in pieces:
            self._start(piece)

    def end(self, voice_buffered: bool = True) -> None:
        """No more text: voice what is buffered (or drop it); the send of None follows the last audio."""
        if not self.ended:
            self.ended = True
            if (rest := self._splitter.flush()) is not None and voice_buffered:
                self._start(rest)
            self._pieces.put_nowait(None)

    async def cancel(self) -> None:
        """Stop at once: every request under way is cancelled, nothing more is sent."""
        self.ended = True
        for task in [self._speaker] + [p.task for p in self._all if p.task is not None]:
            task.cancel()
        await asyncio.gather(self._speaker, *(p.task for p in self._all if p.task is not None),
                             return_exceptions=True)

    def _start(self, text: str) -> None:
        piece = _Piece(text)
        piece.task = asyncio.create_task(self._request(piece))
        self._all.append(piece)
        self._unsent += 1
        self._pieces.put_nowait(piece)

    async def _request(self, piece: _Piece) -> None:
        async with self._running:
            deadline = asyncio.get_running_loop().time() + OVERLOAD_WAIT_S
            while True:
                chunks, sent = self._stream(Synthesis(piece.text, self._speaker_id)), False
                try:
                    async for chunk in chunks:
                        sent = True
                        piece.audio.put_nowait(chunk)
                    piece.audio.put_nowait(None)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the speaker reports it in order
                    if sent or not is_overload(str(exc)) or asyncio.get_running_loop().time() > deadline:
                        piece.audio.put_nowait(exc)
                        return
                finally:
                    await chunks.aclose()  # cancels the Triton request when it did not finish
                await asyncio.sleep(OVERLOAD_RETRY_S)

    async def _speak(self) -> None:
        try:
            while (piece := await self._pieces.get()) is not None:
                samples = 0
                while (item := await piece.audio.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    samples += item.size
                    await self._send(item)
                await self._spoken(piece.text, samples)
                self._unsent -= 1
            await self._send(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            for other in self._all:
                if other.task is not None:
                    other.task.cancel()
            await self._failed(exc)


def parse_message(raw: str | bytes | None) -> dict:
    """A client message as a dict (ProtocolError for anything else)."""
    if raw is None:
        raise ProtocolError("binary messages are not accepted; send JSON text", CLOSE_UNSUPPORTED)
    if len(raw.encode() if isinstance(raw, str) else raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message larger than {MAX_MESSAGE_BYTES} bytes", CLOSE_TOO_BIG)
    try:
        message = json.loads(raw)
    except ValueError:
        raise ProtocolError("messages must be JSON objects", CLOSE_UNSUPPORTED) from None
    if not isinstance(message, dict):
        raise ProtocolError("messages must be JSON objects", CLOSE_UNSUPPORTED)
    text = message.get("text")
    if text is not None and not isinstance(text, str):
        raise ProtocolError("'text' must be a string")
    for key in ("flush", "close_context", "close_socket", "try_trigger_generation"):
        if key in message and not isinstance(message[key], bool):
            raise ProtocolError(f"{key!r} must be true or false")
    context = message.get("context_id")
    if context is not None and (not isinstance(context, str) or not context or len(context) > 128):
        raise ProtocolError("'context_id' must be a non-empty string of at most 128 characters")
    return message


def close_reason(message: str) -> str:
    """``message`` cut to what a close frame carries (123 bytes of UTF-8)."""
    return message.encode()[:120].decode(errors="ignore")


def _reply(payload: dict, context_id: str | None) -> str:
    """A server message as JSON; a multi-context socket's names its context."""
    return json.dumps(payload if context_id is None else {**payload, "contextId": context_id})


def audio_message(data: bytes, context_id: str | None) -> str:
    return _reply({"audio": base64.b64encode(data).decode("ascii"), "isFinal": None, "normalizedAlignment": None,
                   "alignment": None}, context_id)


def alignment(text: str, samples: int) -> dict:
    """ElevenLabs' character alignment of a piece voiced in ``samples`` samples, *estimated*: the
    model gives no timing per character, so the piece's characters (and the space after it, which
    ends its last word for clients that split words at spaces) share its audio evenly."""
    chars = list(text) + [" "]
    total_ms = 1000.0 * samples / OUTPUT_SAMPLE_RATE
    starts = [round(total_ms * i / len(chars)) for i in range(len(chars))]
    ends = starts[1:] + [round(total_ms)]
    return {"chars": chars, "charStartTimesMs": starts, "charDurationsMs": [e - s for s, e in zip(starts, ends)]}


def alignment_message(text: str, samples: int, context_id: str | None) -> str:
    """After a piece's last audio: an audio message without audio that carries the piece's
    alignment, its times counted from the piece's first sample (clients add the alignments up)."""
    aligned = alignment(text, samples)
    return _reply({"audio": "", "isFinal": None, "normalizedAlignment": aligned, "alignment": aligned}, context_id)


def final_message(context_id: str | None) -> str:
    return _reply({"isFinal": True}, context_id)


def error_message(message: str, code: str, context_id: str | None = None) -> str:
    return _reply({"error": code, "message": message}, context_id)


def api_key(value: object) -> str | None:
    """An API key as a client sends it (``Bearer`` prefix or not), or None if there is none."""
    if not isinstance(value, str):
        return None
    if value.lower().startswith("bearer "):
        value = value[7:]
    return value.strip() or None


class SpeechSocket:
    """One accepted WebSocket, single-context (``multi`` False) or multi-context: reads the client's
    messages, runs an :class:`Utterance` per context in the voice ``speaker_id``, sends their audio,
    closes with a code (after ``inactivity_timeout_s`` without a message while nothing is voiced).

    ``stream(synthesis)``: the speech request; ``encoder()``: a new audio encoder (an utterance's);
    ``check_key(key or None)``: raises ProtocolError unless the API key is accepted (called with
    the key of the first message when the connection carried none); ``error_of(exc)``: a failed
    request's (message, code, close code)."""

    def __init__(self, websocket, speaker_id: str | None, inactivity_timeout_s: float, *, multi: bool,
                 stream: Callable[[Synthesis], AsyncIterator[np.ndarray]], encoder: Callable[[], object],
                 check_key: Callable[[str | None], None] | None,
                 error_of: Callable[[BaseException], tuple[str, str, int]]):
        self.websocket, self.speaker_id, self.multi = websocket, speaker_id, multi
        self.inactivity_timeout_s = inactivity_timeout_s
        self._stream, self._encoder, self._check_key, self._error_of = stream, encoder, check_key, error_of
        self._contexts: dict[str | None, Utterance] = {}
        self._send_lock = asyncio.Lock()
        self._finished = asyncio.Event()
        self._close_code, self._close_reason = CLOSE_NORMAL, ""
        self._first = True
        self._ended = False  # single: the input ended; multi: close_socket came

    async def run(self) -> None:
        from starlette.websockets import WebSocketDisconnect

        receive: asyncio.Future | None = None
        try:
            while not self._finished.is_set():
                receive = receive or asyncio.ensure_future(self.websocket.receive())
                finished = asyncio.ensure_future(self._finished.wait())
                done, _ = await asyncio.wait({receive, finished}, timeout=self.inactivity_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                finished.cancel()
                if receive in done:
                    event, receive = receive.result(), None
                    if event["type"] == "websocket.disconnect":
                        return
                    await self._handle(parse_message(event.get("text")))
                elif not done and not any(u.speaking for u in self._contexts.values()):
                    raise ProtocolError(f"no message for {self.inactivity_timeout_s:g} s "
                                        "(inactivity_timeout)", CLOSE_TIMEOUT)
            await self.websocket.close(self._close_code, self._close_reason)
        except ProtocolError as exc:
            await self._close_with_error(str(exc), "invalid_message", exc.code)
        except WebSocketDisconnect:
            pass
        finally:
            if receive is not None:
                receive.cancel()
            await asyncio.gather(*(u.cancel() for u in self._contexts.values()), return_exceptions=True)

    async def _handle(self, message: dict) -> None:
        if self._first:
            self._first = False
            if self._check_key is not None:
                self._check_key(_message_key(message))
        if self.multi:
            await self._handle_multi(message)
        else:
            self._handle_single(message)

    def _handle_single(self, message: dict) -> None:
        text = message.get("text")
        if self._ended:
            raise ProtocolError("text after the end of the input (the message {\"text\": \"\"} ended it)")
        if text is None:
            raise ProtocolError("every message needs 'text' (\" \" first, then the text, then \"\" to end)")
        utterance = self._contexts.get(None) or self._open(None)
        if text == "":
            self._ended = True
            utterance.end()
        else:
            utterance.add(text, flush=message.get("flush", False))

    async def _handle_multi(self, message: dict) -> None:
        context = message.get("context_id") or DEFAULT_CONTEXT
        if message.get("close_socket"):
            self._ended = True
            for utterance in self._contexts.values():
                utterance.end()
            if not self._contexts:
                self._finished.set()
            return
        if message.get("close_context"):
            utterance = self._contexts.get(context)
            if utterance is not None and not utterance.ended:
                utterance.end(voice_buffered=False)  # what was cut or flushed is voiced, then isFinal
            return
        text, flush = message.get("text"), message.get("flush", False)
        if text is None and not flush:
            raise ProtocolError("a message needs 'text', 'flush', 'close_context' or 'close_socket'")
        if self._ended:
            raise ProtocolError("text after close_socket")
        utterance = self._contexts.get(context)
        if utterance is None or utterance.ended:  # a new context (a closed one's id starts a new one)
            if not text and not flush:
                return  # a keep-alive: nothing to keep
            await self._interrupt()
            utterance = self._open(context)
        utterance.add(text or "", flush=flush)  # "" alone keeps the context alive

    async def _interrupt(self) -> None:
        """A new context: the closed ones still voicing are cancelled, each answered isFinal (an
        agent closes its context and opens another when its listener barges in)."""
        for context, utterance in list(self._contexts.items()):
            if utterance.ended and not utterance.done:
                del self._contexts[context]
                await utterance.cancel()
                await self._send_text(final_message(context))

    def _open(self, context: str | None) -> Utterance:
        encoder = self._encoder()
        label = context if self.multi else None
        utterance: Utterance | None = None

        def forget() -> None:  # this utterance's context only (its id may have been opened again)
            if self._contexts.get(context) is utterance:
                del self._contexts[context]
            if not self.multi or (self._ended and not self._contexts):
                self._finished.set()

        async def send(chunk: np.ndarray | None) -> None:
            data = encoder.encode(chunk) if chunk is not None else encoder.finish()
            if data:
                await self._send_text(audio_message(data, label))
            if chunk is None:
                await self._send_text(final_message(label))
                forget()

        async def spoken(text: str, samples: int) -> None:
            await self._send_text(alignment_message(text, samples, label))

        async def failed(exc: BaseException) -> None:
            message, code, close_code = self._error_of(exc)
            try:
                await self._send_text(error_message(message, code, label))
            except Exception:  # the client is gone (a failed send may be what ended the utterance)
                pass
            if not self.multi or (self._ended and len(self._contexts) <= 1):
                self._close_code, self._close_reason = close_code, close_reason(message)
            forget()

        utterance = self._contexts[context] = Utterance(self._stream, self.speaker_id, send, spoken, failed)
        return utterance

    async def _send_text(self, text: str) -> None:
        async with self._send_lock:
            await self.websocket.send_text(text)

    async def _close_with_error(self, message: str, code: str, close_code: int) -> None:
        try:
            await self._send_text(error_message(message, code))
            await self.websocket.close(close_code, close_reason(message))
        except Exception:  # the client is gone already
            pass


def _message_key(message: dict) -> str | None:
    """The API key a first message carries (``xi_api_key``, ``xi-api-key`` or ``authorization``)."""
    return api_key(message.get("xi_api_key") or message.get("xi-api-key") or message.get("authorization"))
