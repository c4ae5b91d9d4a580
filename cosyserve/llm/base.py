"""The interface every LLM back end implements, and the error of one that cannot run here.

A leaf of :mod:`cosyserve.llm`: the back ends import it, the factory (:mod:`.backends`) imports
the back ends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..errors import CosyServeError
from .sampling import SamplingParams
from .stream import TokenStream


class BackendUnavailableError(CosyServeError, RuntimeError):
    """The backend cannot run here: a package it needs is not installed."""


class LLMBackend(ABC):
    """Thread-safe: many callers may stream at once (the torch engine batches them together)."""

    name: str

    @abstractmethod
    def generate_stream(self, prompt_ids: list[int], params: SamplingParams,
                        request_id: str | None = None) -> TokenStream:
        """Start a request; iterate the stream for raw speech tokens 0..6560 (eos not yielded).

        Bad requests raise InvalidInputError here, before anything is queued."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> list[int]:
        return list(self.generate_stream(prompt_ids, params, request_id))

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Stop a request (its reader gets RequestCancelledError); False if it is not active."""

    @abstractmethod
    def register_prefix(self, key: str, ids: list[int]) -> None:
        """Precompute the KV of a shared prompt prefix (a voice's ``<|sos|>{prompt_text}``)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the backend's threads and release its memory."""

    def __enter__(self) -> "LLMBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
