"""The token2wav page pool's page moves (PageCopy) both ways, with PyTorch ops and with the Triton kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyserve.token2wav.page_pool import PageCopy, PagePool

PAGES, STEPS, LAYERS, FRAMES, WIDTH, KEYS = 6, 3, 2, 4, 8, 40


def check_copies(kernels: str, device: str = "cpu") -> None:
    """read fills exactly each page's CFG rows' keys of every layer at the step; write fills exactly
    those pages at the step; every other key, page and step is left as it was."""
    g = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=g).half().to(device)

    pool = PagePool(PAGES, STEPS, LAYERS, FRAMES, WIDTH, torch.device(device), torch.float16, kernels=kernels)
    assert pool.kernels == kernels
    pool.data.copy_(randn(*pool.data.shape))
    pages, starts = [4, 1, 2], np.array([[0, 20], [4, 24], [12, 32]])
    for step in range(STEPS):
        kv = randn(LAYERS, KEYS, WIDTH)
        before_kv, before_data = kv.clone(), pool.data.clone()
        copy = PageCopy(pool, pages, starts, kv)
        copy.read(step)
        expected = before_kv.clone()
        for page, (cond, uncond) in zip(pages, starts):
            expected[:, cond:cond + FRAMES] = before_data[page, step, :, 0]
            expected[:, uncond:uncond + FRAMES] = before_data[page, step, :, 1]
        assert torch.equal(kv, expected)
        assert torch.equal(pool.data, before_data)

        kv.copy_(randn(LAYERS, KEYS, WIDTH))
        copy.write(step)
        expected = before_data.clone()
        for page, (cond, uncond) in zip(pages, starts):
            expected[page, step, :, 0] = kv[:, cond:cond + FRAMES]
            expected[page, step, :, 1] = kv[:, uncond:uncond + FRAMES]
        assert torch.equal(pool.data, expected)


def test_pages_move_both_ways_with_torch_ops():
    check_copies("torch")


def test_a_buffer_without_contiguous_keys_is_refused():
    pool = PagePool(PAGES, STEPS, LAYERS, FRAMES, WIDTH, torch.device("cpu"), torch.float16, kernels="torch")
    kv = torch.zeros(LAYERS, WIDTH, KEYS, dtype=torch.float16).transpose(1, 2)
    with pytest.raises(ValueError, match="contiguously"):
        PageCopy(pool, [0], np.array([[0, 8]]), kv)


def test_pages_move_both_ways_with_the_triton_kernel_under_the_interpreter():
    """The GPU path (one Triton launch per move), run by Triton's CPU interpreter."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    script = "import tests.test_page_pool as t\nt.check_copies('triton')\nprint('ok')\n"
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root)))
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_pages_move_both_ways_with_the_triton_kernel():
    assert PagePool(1, 1, 1, 1, 1, torch.device("cuda"), torch.float16).kernels == "triton"
    check_copies("triton", "cuda")
