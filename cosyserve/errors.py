"""Error types shared by the whole package.

Every error caused by a bad request derives from :class:`InvalidInputError` so that
servers can turn it into a per-request error (HTTP 400 / Triton error response) without
touching other requests. Errors in model files derive from :class:`ModelLoadError`.
"""


class CosyServeError(Exception):
    """Base class of every error raised on purpose by this package."""


class InvalidInputError(CosyServeError, ValueError):
    """The caller passed something unusable (bad audio, empty text, bad shape...)."""


class ModelLoadError(CosyServeError, RuntimeError):
    """A model directory or checkpoint is missing, malformed or does not match the code."""


class RequestCancelledError(CosyServeError):
    """A request was cancelled (client disconnect, deadline) while it was running."""


class RequestTimeoutError(RequestCancelledError):
    """A request ran past its time limit (the front door's ``request_timeout_s``) and was stopped."""


class CapacityError(CosyServeError, RuntimeError):
    """The server cannot take this request now (state memory full, queue full); retrying later may work."""


# How a refusal for capacity reads in an error message, lower-cased, whoever raised it: Triton past a
# model's instances + queue, or past BLS_MAX_QUEUE_MS in its queue; the engine's admission by playback
# (ADMISSION_MIN_BUFFER_S); the token2wav engine's state memory. A client may retry such a request
# later or elsewhere; any other error is the request's own.
OVERLOAD_MARKERS = ("exceeds maximum queue size", "resource exhausted", "too many requests",
                    "request timeout expired", "overloaded:", "state pool is full")


def is_overload(message: str) -> bool:
    """True when ``message`` (any case) is a refusal for capacity (:data:`OVERLOAD_MARKERS`)."""
    lowered = message.lower()
    return any(marker in lowered for marker in OVERLOAD_MARKERS)
