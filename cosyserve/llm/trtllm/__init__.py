"""TensorRT-LLM support: checkpoint conversion (pure torch, testable anywhere) and the fail-fast import.

Nothing here imports ``tensorrt_llm`` at module level; code that needs it calls
:func:`require_tensorrt_llm`, which raises :class:`~cosyserve.llm.BackendUnavailableError` with
the install instructions when the package is missing.
"""

from __future__ import annotations

import importlib

from ..base import BackendUnavailableError

TRTLLM_INSTALL_HINT = (
    "Install TensorRT-LLM on a Linux machine with an NVIDIA GPU: either run inside NVIDIA's container "
    "nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3 (TensorRT-LLM 0.20.0; see Dockerfile.server), "
    "or `sudo apt-get install -y libopenmpi-dev && pip install tensorrt_llm==0.20.0` "
    "(CUDA 12.x driver; the extra `pip install 'cosyserve[trtllm]'` installs the same package). "
    "See docs/deployment.md."
)


def require_tensorrt_llm(what: str):
    """Import and return ``tensorrt_llm``, or raise BackendUnavailableError naming ``what`` needs it."""
    try:
        return importlib.import_module("tensorrt_llm")
    except ImportError as exc:
        raise BackendUnavailableError(f"{what} needs the tensorrt_llm package, which cannot be imported "
                                      f"({exc}). {TRTLLM_INSTALL_HINT}") from exc


__all__ = ["TRTLLM_INSTALL_HINT", "require_tensorrt_llm"]
