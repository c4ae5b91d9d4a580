"""The messages between front doors and an engine process (ZMQ frames, msgpack bodies).

A front door (:class:`~.client.EngineClient`) sends on a DEALER connected to the engine's input
ROUTER; the engine (:mod:`.process`) answers on its output ROUTER, to a DEALER whose routing id is
the client's id. Every message is one msgpack list whose first item names it:

client -> engine
  ``hello``   [HELLO]: announce the client; the engine answers WELCOME (resent until it does: a
              ROUTER drops what it sends to a peer whose connection it has not seen yet)
  ``submit``  [SUBMIT, request_id, [[segment_id, prompt_ids], ...], voice, max_tokens, min_tokens,
              streaming, timeout_s, arrival (CLOCK_MONOTONIC, one clock for every process of the host),
              tokens_from_client]
  ``cancel``  [CANCEL, request_id]
  ``tokens``  [TOKENS, segment_id, [token, ...], end]: speech tokens of a segment whose LLM runs on the
              client's side (a Triton LLM model); ``end`` None, or [reason, error] once it is over
  ``voices``  [VOICES, [voice, ...], ticket]: voices whose state the engine computes and keeps now (just
              uploaded); ``ticket`` None, or a string the engine answers VOICES_DONE with once they are
  ``arriving`` [ARRIVING, [voice, ...]]: new clips' voices whose requests are on their way (the front
              end has just computed them together): a kind that keeps every voice starts on them now
engine -> client
  ``welcome`` [WELCOME, info]: sample rate, model kind, pid, load time and the first stats
  ``pcm``     [PCM, request_id, float32 bytes]
  ``finish``  [FINISH, request_id, error, trace]: error None or [type name, message]; the engine's
              first-chunk stamps (:data:`~.request.FIRST_CHUNK_STAGES`)
  ``stats``   [STATS, stats]: :class:`EngineStats` as a dict, every ``STATS_PERIOD_S``
  ``llm``     [LLM_START, segment_id, prompt_ids, max_tokens, min_tokens] / [LLM_STOP, segment_id]
  ``voices_done`` [VOICES_DONE, ticket]: the loop has prepared the voices of that VOICES message

Errors cross as (type name, message) and come back as the same package error types, so a front door
maps them to status codes as it would in-process (``overloaded: ...`` stays a refusal).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import torch

from ..errors import (CapacityError, CosyServeError, InvalidInputError, ModelLoadError, RequestCancelledError,
                      RequestTimeoutError)
from ..frontend.prompt import PromptFeatures

HELLO, SUBMIT, CANCEL, TOKENS, VOICES, ARRIVING = "hello", "submit", "cancel", "tokens", "voices", "arriving"
WELCOME, PCM, FINISH, STATS, LLM_START, LLM_STOP = "welcome", "pcm", "finish", "stats", "llm", "llm_stop"
VOICES_DONE = "voices_done"

STATS_PERIOD_S = 0.25

_ERRORS = {cls.__name__: cls for cls in (CapacityError, InvalidInputError, RequestTimeoutError,
                                          RequestCancelledError, ModelLoadError, CosyServeError)}


class EngineProcessError(RuntimeError):
    """The engine process a request ran in has gone (crashed or killed) or cannot be reached."""


@dataclass
class EngineStats:
    """What a front door publishes about the engine: requests and streams in it, LLM requests
    generating, the loop's running totals (:class:`~.core.EngineCounters` fields) and the token2wav
    kind's gauges (name -> (help, value))."""

    requests: int = 0
    streams: int = 0
    generating: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, tuple[str, float]] = field(default_factory=dict)


def remove_socket_files(address: str) -> None:
    """Delete the files of an ``ipc://`` endpoint pair (``<address>-in`` / ``-out``). libzmq leaves
    them behind when the bound sockets close (and a killed engine closes nothing), so whoever ends
    an engine removes them; other transports have none."""
    if not address.startswith("ipc://"):
        return
    for suffix in ("-in", "-out"):
        Path(address[len("ipc://"):] + suffix).unlink(missing_ok=True)


def pack(*items) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


def unpack(frame: bytes) -> list:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def pack_voice(features: PromptFeatures) -> dict:
    """A voice's prompt features as plain bytes (a 3 s voice: ~48 KB, mostly its prompt mel)."""
    feat = features.speech_feat.detach().cpu().float().contiguous()
    return {"tokens": features.speech_tokens.detach().cpu().to(torch.int32).contiguous().numpy().tobytes(),
            "feat": feat.numpy().tobytes(), "feat_shape": list(feat.shape),
            "embedding": features.embedding.detach().cpu().float().contiguous().numpy().tobytes()}


def unpack_voice(voice: dict) -> PromptFeatures:
    tokens = np.frombuffer(voice["tokens"], np.int32).copy()
    feat = np.frombuffer(voice["feat"], np.float32).reshape(voice["feat_shape"]).copy()
    embedding = np.frombuffer(voice["embedding"], np.float32).copy()
    return PromptFeatures(torch.from_numpy(tokens), torch.from_numpy(feat), torch.from_numpy(embedding))


def pack_error(error: BaseException | None) -> list | None:
    if error is None:
        return None
    return [type(error).__name__, str(error)]


def unpack_error(error: list | None) -> BaseException | None:
    if error is None:
        return None
    name, message = error
    return _ERRORS.get(name, RuntimeError)(message)


def pack_stats(stats: EngineStats) -> dict:
    return {**asdict(stats), "gauges": {name: list(value) for name, value in stats.gauges.items()}}


def unpack_stats(stats: dict) -> EngineStats:
    return EngineStats(stats["requests"], stats["streams"], stats["generating"], dict(stats["counters"]),
                       {name: (text, value) for name, (text, value) in stats["gauges"].items()})
