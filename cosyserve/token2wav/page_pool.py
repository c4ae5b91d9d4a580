"""The incremental flow's state pages (:mod:`.flow_engine`): fixed pages of per-step estimator
keys/values, allocated once and refcounted (a voice's prompt pages are shared by its streams)."""

from __future__ import annotations

import threading

import numpy as np
import torch


class PagePool:
    """Fixed pages of per-step estimator state, allocated once (no allocation while serving).

    ``data`` (pages, steps, layers, 2 CFG rows, page_frames, 2 * inner). Pages are refcounted: a
    voice prefix's pages are shared by its streams.
    """

    def __init__(self, pages: int, steps: int, layers: int, page_frames: int, width: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.page_frames = page_frames
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
