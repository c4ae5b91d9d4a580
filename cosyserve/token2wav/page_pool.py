"""The incremental flow's state pages (:mod:`.flow_engine`): fixed pages of per-step estimator
keys/values, allocated once and refcounted (a voice's prompt pages are shared by its streams)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..runtime import host_to_device


class PagePool:
    """Fixed pages of per-step estimator state, allocated once (no allocation while serving).

    ``data`` (pages, steps, layers, 2 CFG rows, page_frames, 2 * inner). Pages are refcounted: a
    voice prefix's pages are shared by its streams.
    """

    def __init__(self, pages: int, steps: int, layers: int, page_frames: int, width: int,
                 device: torch.device, dtype: torch.dtype, kernels: str = "auto") -> None:
        self.page_frames = page_frames
        if kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be auto, triton or torch, got {kernels!r}")
        # how pages move to and from a step's buffer (PageCopy): one Triton kernel, or PyTorch ops
        self.kernels = kernels if kernels != "auto" else "triton" if device.type == "cuda" else "torch"
        # never read before written (a window writes every frame of its new pages at every step), so
        # not zeroed: on the CPU the memory is then only taken as pages are used
        self.data = torch.empty(pages, steps, layers, 2, page_frames, width, device=device, dtype=dtype)
        self._free = list(range(pages - 1, -1, -1))
        self._refs = np.zeros(pages, dtype=np.int64)
        self._lock = threading.Lock()

    @staticmethod
    def page_bytes(steps: int, layers: int, page_frames: int, width: int, dtype: torch.dtype) -> int:
        return steps * layers * 2 * page_frames * width * torch.empty((), dtype=dtype).element_size()

    @property
    def pages(self) -> int:
        return self.data.size(0)

    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` pages (refcount 1), or None when fewer are free."""
        with self._lock:
            if count > len(self._free):
                return None
            pages = [self._free.pop() for _ in range(count)]
            self._refs[pages] = 1
            return pages

    def share(self, pages: list[int]) -> None:
        with self._lock:
            self._refs[pages] += 1

    def release(self, pages: list[int]) -> None:
        with self._lock:
            for page in pages:
                self._refs[page] -= 1
                if self._refs[page] == 0:
                    self._free.append(page)


class PageCopy:
    """Whole pages moved between a :class:`PagePool` and a flow step's key/value buffer ``kv``
    (layers, keys, width), both ways at any step: page ``pages[i]``'s CFG row c holds the frames of
    keys ``key_starts[i, c]`` .. + ``page_frames`` of every layer. Built once per solve (its indices
    go to the device then), used at each step: :meth:`read` fills the keys from the pages (a
    window's context), :meth:`write` the pages from the keys (the blocks it completes)."""

    def __init__(self, pool: PagePool, pages: list[int], key_starts: np.ndarray, kv: torch.Tensor) -> None:
        data, frames = pool.data, pool.page_frames
        if kv.stride(2) != 1 or kv.stride(1) != kv.size(2) or kv.size(2) != data.size(-1):
            raise ValueError("the key/value buffer must hold each key's values contiguously, as wide as a page's")
        self.pool, self.kv, self.count = pool, kv, len(pages)
        self.triton = pool.kernels == "triton"
        device = data.device
        if self.triton:
            # element offsets (at step 0, layer 0) of each page's CFG rows in the pool, and of their keys in kv
            rows = np.asarray(pages, dtype=np.int64)[:, None] * data.stride(0) + np.arange(2) * data.stride(3)
            self._page_starts = host_to_device(rows.reshape(-1), device)
            self._key_starts = host_to_device(np.asarray(key_starts, dtype=np.int64).reshape(-1) * kv.stride(1),
                                              device)
        else:
            self._pages = host_to_device(torch.tensor(pages, dtype=torch.long), device)
            keys = np.asarray(key_starts, dtype=np.int64).reshape(-1, 1) + np.arange(frames)
            self._keys = host_to_device(torch.from_numpy(keys.reshape(-1)), device)

    def read(self, step: int) -> None:
        """kv's keys <- the pages at ``step``."""
        data, kv = self.pool.data, self.kv
        if self.triton:
            from .page_copy_triton import copy_runs
            copy_runs(data, self._page_starts, step * data.stride(1), data.stride(2),
                      kv, self._key_starts, 0, kv.stride(0), kv.size(0), data.stride(3))
        else:
            context = data[self._pages, step]  # (pages, layers, 2, page, width)
            kv.index_copy_(1, self._keys, context.transpose(0, 1).reshape(kv.size(0), -1, kv.size(2)))

    def write(self, step: int) -> None:
        """The pages at ``step`` <- kv's keys."""
        data, kv = self.pool.data, self.kv
        if self.triton:
            from .page_copy_triton import copy_runs
            copy_runs(kv, self._key_starts, 0, kv.stride(0),
                      data, self._page_starts, step * data.stride(1), data.stride(2), kv.size(0), data.stride(3))
        else:
            blocks = kv.index_select(1, self._keys).unflatten(1, (self.count, 2, self.pool.page_frames))
            data[self._pages, step] = blocks.transpose(0, 1)
