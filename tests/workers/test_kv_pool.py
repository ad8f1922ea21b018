"""The CPU KV pool: zeroed, writable, and advised for transparent huge pages."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvrelay.workers.model.llama import allocate_kv_pool

CONFIG = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vma_of(address: int) -> list[str]:
    """The /proc/self/smaps lines of the mapping holding `address`."""
    vma: list[str] = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if (head := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)) is not None:
            if vma:
                return vma
            if int(head[1], 16) <= address < int(head[2], 16):
                vma.append(line)
        elif vma:
            vma.append(line)
    assert vma, f"no mapping holds {address:#x}"
    return vma


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_is_zeroed_shaped_and_writable(dtype):
    pool = allocate_kv_pool(CONFIG, 5, 16, dtype)
    assert pool.shape == (5, 30, 2, 16, 3, 64)
    assert pool.dtype == dtype and pool.is_contiguous() and pool.device.type == "cpu"
    assert int(torch.count_nonzero(pool)) == 0
    pool[4, 29, 1, 15, 2, 63] = 1.5
    assert pool.view(-1)[-1].item() == 1.5 and int(torch.count_nonzero(pool)) == 1


def test_empty_pool():
    assert allocate_kv_pool(CONFIG, 0, 16, torch.bfloat16).shape == (0, 30, 2, 16, 3, 64)


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_pool_is_eligible_for_huge_pages():
    pool = allocate_kv_pool(CONFIG, 64, 16, torch.bfloat16)  # 23.6 MB
    vma = _vma_of(pool.data_ptr())
    eligible = [line for line in vma if line.startswith("THPeligible:")]
    if not eligible:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert eligible[0].split()[1] == "1", vma


def test_pool_pages_are_faulted_in_behind_the_caller_keeping_what_it_wrote():
    """The pool's pages are mapped by a thread (no pass of zeros at start), without touching
    what the worker wrote meanwhile."""
    import threading

    pool = allocate_kv_pool(CONFIG, 64, 16, torch.bfloat16)  # 23.6 MB
    pool[0, 0, 0, 0, 0, 0] = 2.0
    pool[63, 29, 1, 15, 2, 63] = -3.0
    for thread in threading.enumerate():
        if thread.name == "kv-pool-populate":
            thread.join()
    rss = [line for line in _vma_of(pool.data_ptr()) if line.startswith("Rss:")]
    assert int(rss[0].split()[1]) * 1024 >= pool.numel() * pool.element_size()
    assert int(torch.count_nonzero(pool)) == 2
    assert (pool[0, 0, 0, 0, 0, 0].item(), pool[63, 29, 1, 15, 2, 63].item()) == (2.0, -3.0)
