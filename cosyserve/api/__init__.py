"""OpenAI-compatible HTTP API in front of Triton (``python -m cosyserve.api``); docs/api.md."""
