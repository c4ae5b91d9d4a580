"""What every entry point shares, and nothing more (a leaf: loading one model must not import
another's stack): the bundle's directory layout, the device and dtype to run on, how long an idle
stream is kept.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .errors import InvalidInputError

COSYVOICE2_DIR = "CosyVoice2-0.5B"
LLM_DIR = "cosyvoice2_llm"
COSYVOICE3_DIR = "Fun-CosyVoice3-0.5B-2512"
COSYVOICE3_LLM_DIR = "cosyvoice3_llm"
STEP_AUDIO2_DIR = "Step-Audio-2-mini/token2wav"  # the token2wav/ folder of stepfun-ai/Step-Audio-2-mini
SPK2INFO = "spk2info.pt"
STREAM_IDLE_TIMEOUT_S = 600.0

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` = CUDA when available, else CPU; ``cpu``, ``cuda``, ``cuda:N`` as given."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} was requested but CUDA is not available")
    return device


def resolve_device_dtype(device: str | torch.device, dtype: torch.dtype | str | None) -> tuple[torch.device, torch.dtype]:
    """Default dtype: bfloat16 on GPU, float32 on CPU; dtype names like "bf16" are accepted."""
    device = torch.device(device)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise InvalidInputError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def host_to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a list or a CPU tensor) on ``device`` without waiting for the device's queue.

    ``torch.tensor(values, device=cuda)`` and a blocking ``copy_`` from the host wait until every
    kernel queued on the stream has run before they copy: in a loop that launches GPU work, each one
    stalls the host behind the GPU, and the GPU then idles while the host builds the next call. An
    asynchronous copy from *pageable* memory may wait the same way (the driver stages it, and may
    synchronise with the stream to do so: on an H200 a new voice's prompt pieces waited ~120 ms for
    the GPU's queue that way), so the values go through pinned memory (torch's caching host
    allocator: the block is reused only once its copy is done) and the copy runs in stream order."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def device_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, copied in the current stream's order (waits for it).

    ``.cpu()`` or ``.tolist()`` of a CUDA tensor copies into *pageable* memory: the driver then waits
    for the stream inside the copy, and every other thread's CUDA calls wait with it (a trace of 8
    new clips on an H100: the loop's and the voice preparation's launches each stalled 1.5-18 ms
    behind the LLM thread's token read-backs). So the values go through pinned memory (torch's
    caching host allocator) and the wait is on an event, which holds no such lock."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensor.device))
    copied.synchronize()
    return host


# A burst: work that keeps arriving within BURST_GAP_S of the last, for at most BURST_MAX_S after the
# first, is taken together (new clips by the front end's featurizer; the engine's preparation thread
# gathers wider bursts, engine.preparer.PREPARE_GAP_S). A burst's callers reach them one after another
# under the GIL, ~1 ms apart; one packed call costs much less than several one after the other, and a
# lone item waits BURST_GAP_S.
BURST_GAP_S = 0.002
BURST_MAX_S = 0.012


def bucket(value: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``value`` (a captured shape), None past them."""
    return next((size for size in sizes if value <= size), None)


# The role (role_stream) of the engine loop's CUDA graphs: the flow's chunk steps and full passes, the
# vocoder's (the loop replays them on its own stream).
LOOP_ROLE = "main"
# Roles whose streams have a priority other than the default 0 (torch's: lower runs first). A role
# ending in HIGH_PRIORITY has the highest (-1): while its kernels and other roles' wait for the
# device, its own run first.
HIGH_PRIORITY = ":high-priority"
# Streams asked of torch's pool before giving up on one no other role has (the pool holds 32 per
# priority and hands them out in turn).
_STREAM_TRIES = 64
_role_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_role_streams_lock = threading.Lock()


def role_stream(device: torch.device | str, role: str) -> torch.cuda.Stream:
    """The CUDA stream of ``role`` on ``device``: one per role, made on first use (of priority -1 for
    a role ending in :data:`HIGH_PRIORITY`, else 0), and never the same CUDA stream as another role's
    (torch's pool hands its 32 streams of each priority out in turn).

    Every family of CUDA graphs whose replays may overlap another's is captured on a role's stream
    of its own (the LLM's steps, new voices' prompts, the loop's steps and vocoder, each front-end
    model). Why: torch keys cuBLAS workspaces by (the thread's handle, the stream), and a graph
    keeps the workspace of the stream it was captured on; graphs captured on one stream by one
    thread (as every ``torch.cuda.graph`` without a stream is, on torch's one default capture
    stream) share one workspace, so two of them replayed at once on two streams write each other's
    split-K partials, and destroying one frees that workspace under all the others. (The likely
    cause of the CUDA "illegal instruction" that ended three runs of 8 new clips on an H100: the
    LLM's prefill graphs ran beside new voices' prompt-encoder graphs, all captured on the default
    capture stream.)"""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _role_streams_lock:
        stream = _role_streams.get((index, role))
        if stream is None:
            taken = {s.cuda_stream for (i, _), s in _role_streams.items() if i == index}
            for _ in range(_STREAM_TRIES):
                stream = torch.cuda.Stream(index, priority=-1 if role.endswith(HIGH_PRIORITY) else 0)
                if stream.cuda_stream not in taken:
                    break
            else:
                raise RuntimeError(f"no CUDA stream left for role {role!r}: {len(taken)} roles hold one each")
            _role_streams[(index, role)] = stream
        return stream
