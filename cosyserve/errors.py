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
    """A request ran past its time limit (the ``request_timeout_s`` of the BLS) and was stopped."""


class CapacityError(CosyServeError, RuntimeError):
    """The server cannot take this request now (state memory full, queue full); retrying later may work."""
