"""`sample_rows` (csrc/sampling.cpp): the draw of each sampled row, exact tokens against a
float64 reference of its rules, and the same token alone, in any batch and thread count."""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.kernels import KernelError, sample_rows
from kvrelay.kernels.cpu_build import load

if load() is None:
    pytest.skip("the C++ CPU kernels are not built", allow_module_level=True)


def settings(*rows: tuple[float, float, float, float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def reference(x: list[float], t: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """The kernel's rules in float64 (ties: lower id first): exact away from rounding edges."""
    m = max(x)
    w = [math.exp((v - m) / t) for v in x]
    w = [v if v >= min_p else 0.0 for v in w]
    order = sorted((i for i in range(len(x)) if w[i] > 0), key=lambda i: (-w[i], i))
    if top_k > 0:
        order = order[:top_k]
    if top_k > 0 or top_p < 1.0:
        mass = top_p * sum(w[i] for i in order) if top_k > 0 else top_p * sum(w)
        kept, run = [], 0.0
        for i in order:
            if run >= mass:
                break
            kept.append(i)
            run += w[i]
        order = kept
    else:
        order = list(range(len(x)))
    target, run = u * sum(w[i] for i in order), 0.0
    for i in order:
        run += w[i]
        if run > target:
            return i
    return order[-1]


CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (0.7, 0, 0.5, 0.0),
    (1.3, 40, 1.0, 0.0),
    (0.8, 40, 0.8, 0.0),
    (1.0, 0, 0.95, 0.05),
    (0.5, 5, 1.0, 0.2),
]


@pytest.mark.parametrize(("t", "top_k", "top_p", "min_p"), CASES)
def test_tokens_follow_the_rules(t, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(int(t * 10) + top_k)
    logits = torch.randn(24, 3000, generator=g) * 3
    us = torch.rand(24, generator=g).tolist()
    got = sample_rows(
        logits, settings(*[(t, top_p, min_p, u) for u in us]), torch.full((24,), top_k)
    ).tolist()
    want = [reference(logits[i].tolist(), t, top_k, top_p, min_p, us[i]) for i in range(24)]
    assert got == want


def test_the_prefix_does_not_depend_on_the_threshold_that_found_it():
    # Flat logits: every token has w = 1 and top_p 0.9 needs 2,700 of 3,000 (the last
    # threshold: all); a peaked row finds its prefix above the first threshold.
    flat = torch.zeros(1, 3000)
    peaked = torch.full((1, 3000), -20.0)
    peaked[0, [5, 17, 900]] = torch.tensor([3.0, 2.0, 2.0])
    for u in (0.0, 0.3, 0.899, 0.999):
        s = settings((1.0, 0.9, 0.0, u))
        assert sample_rows(flat, s, torch.zeros(1)).tolist() == [int(u * 2700)]
    # peaked: w = 1, e^-1, e^-1 (ids 17 before 900 on the tie); top_p 0.65 keeps id 5 and 17
    s = settings((1.0, 0.65, 0.0, 0.99))
    assert sample_rows(peaked, s, torch.zeros(1)).tolist() == [17]
    s = settings((1.0, 1.0, 0.0, 0.99))  # no top-p: id order, the last of the three
    assert sample_rows(peaked, s, torch.zeros(1)).tolist() == [900]


def test_top_k_past_every_threshold_and_masked_tokens():
    logits = torch.zeros(1, 500)
    logits[0, 100:] = float("-inf")  # masked (a grammar's mask): never drawn
    for u in (0.0, 0.5, 0.999):
        s = settings((1.0, 1.0, 0.0, u))
        assert sample_rows(logits, s, torch.tensor([300])).tolist() == [int(u * 100)]
    everything_masked = torch.full((1, 500), float("-inf"))
    assert sample_rows(
        everything_masked, settings((1.0, 0.9, 0.0, 0.5)), torch.zeros(1)
    ).tolist() == [0]


@pytest.mark.parametrize("vocab", [49152, 262144 + 3])  # SmolLM2's vocabulary; Gemma 3's, + a tail
def test_a_row_draws_the_same_token_alone_and_in_any_batch(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g) * 4
    params = [CASES[i % len(CASES)] for i in range(9)]
    us = torch.rand(9, generator=g).tolist()
    s = settings(*[(t, p, mp, u) for (t, _, p, mp), u in zip(params, us, strict=True)])
    k = torch.tensor([c[1] for c in params])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = sample_rows(logits, s, k)
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            assert torch.equal(sample_rows(logits, s, k), batch)
            for i in range(9):
                assert (
                    sample_rows(logits[i : i + 1].clone(), s[i : i + 1], k[i : i + 1]) == batch[i]
                )
            assert torch.equal(sample_rows(logits[3:7], s[3:7], k[3:7]), batch[3:7])
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_refused():
    with pytest.raises(KernelError, match=r"need logits \[R, V\], settings \[R, 4\]"):
        sample_rows(torch.zeros(2, 10), settings((1.0, 1.0, 0.0, 0.5)), torch.zeros(2))
