"""Per-request token streams shared by every backend."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import RequestCancelledError


@dataclass(frozen=True)
class Finished:
    """Last event of a stream. ``stop``: eos sampled; ``length``: max_tokens or the model's
    length limit reached; ``cancelled``/``error``: ``error`` is raised to the reader."""

    reason: str
    error: BaseException | None = None


class TokenStream(Iterator[int]):
    """Raw speech tokens (0..6560) of one request, in order, as the backend produces them.

    Iteration blocks until the next token; it ends after the last token (eos is not yielded)
    and raises the request's error if it failed or was cancelled by someone else. ``close()``
    (or leaving a ``with`` block) cancels a request that is still running.
    """

    def __init__(self, request_id: str, on_close: Callable[[], object]):
        self.request_id = request_id
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._end: Finished | None = None  # the last event, once read ahead by available()
        self._on_close = on_close

    # Producer side (the backend's thread).
    def put(self, event: int | Finished) -> None:
        self._events.put(event)

    # Reader side.
    def __next__(self) -> int:
        if self.finish_reason is not None:
            raise StopIteration
        event = self._end or self._events.get()
        if isinstance(event, Finished):
            self.finish_reason = event.reason
            if event.error is not None:
                raise event.error
            raise StopIteration
        self.num_tokens += 1
        return event

    def available(self) -> list[int]:
        """The next token (blocking for it) and every token already produced behind it.

        Lets a reader that forwards tokens (the Triton ``llm`` model) send one message per
        burst instead of one per token when it falls behind the engine. Ends (and raises) like
        iteration: [] is never returned; StopIteration after the last token.
        """
        tokens = [next(self)] + self._ready()
        self.num_tokens += len(tokens) - 1
        return tokens

    def drain(self) -> tuple[list[int], Finished | None]:
        """Without blocking: the tokens produced since the last call, and the last event once it
        came (then the stream is over: a failed or cancelled request's event carries its error).
        For a reader polling many streams from one loop (the engine core)."""
        tokens = self._ready()
        self.num_tokens += len(tokens)
        if self._end is not None:
            self.finish_reason = self._end.reason
        return tokens, self._end

    def _ready(self) -> list[int]:
        """The tokens already produced, without blocking; the last event, if it came, is kept in
        ``_end`` (reported by the next read)."""
        tokens: list[int] = []
        while self._end is None:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, Finished):
                self._end = event
            else:
                tokens.append(event)
        return tokens

    def close(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "cancelled"
            self._on_close()

    def __enter__(self) -> "TokenStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def cancelled_error(request_id: str) -> Finished:
    return Finished("cancelled", RequestCancelledError(f"request {request_id!r} was cancelled"))
