"""Batch invariance: a token's logits and KV are bitwise identical however it is scheduled."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import gather_pages, scatter_pages
from kvrelay.workers.model.llama import padded_rows
from tests.workers.conftest import SeqChunk, make_batch, run_batch

PAGE = 16


@pytest.fixture(scope="module")
def seqs(loaded_model):
    tok = loaded_model.tokenizer
    a = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe. 🌊"}])
    b = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    c = tok.encode("Once upon a time, in a land far away, there lived a dragon who")
    return a + tok.encode("The Danube, the Rhine"), b, c


@pytest.fixture(scope="module")
def reference(loaded_model, seqs):
    """Sequence A prefilled alone in one chunk: its logits at every position and its pages."""
    a = seqs[0]
    pool = loaded_model.model.allocate_kv_pool(8, PAGE)
    blocks = [0, 1, 2, 3]
    logits = run_batch(loaded_model.model, pool, [SeqChunk(blocks, 0, a)], PAGE)
    return {p: logits[(0, p)] for p in range(len(a))}, pool[blocks].clone()


def _pages(pool, blocks):
    return pool[blocks]


def _run_schedule(model, pool, blocks, tokens, sizes, ref_logits, start=0):
    """Feed `tokens[start:]` in chunks of `sizes` (0 = the rest); check every row's logits."""
    for size in sizes:
        n = size or len(tokens) - start
        got = run_batch(model, pool, [SeqChunk(blocks, start, tokens[start : start + n])], PAGE)
        for p in range(start, start + n):
            assert torch.equal(got[(0, p)], ref_logits[p]), (sizes, p)
        start += n
    assert start == len(tokens)


def test_padded_rows():
    assert [padded_rows(n) for n in (0, 1, 3, 4, 5, 17, 33, 512)] == [4, 4, 4, 4, 8, 20, 36, 512]


def test_same_logits_alone_and_in_mixed_batch(loaded_model, seqs, reference):
    a, b, c = seqs
    ref_logits, ref_pages = reference
    model = loaded_model.model
    pool = model.allocate_kv_pool(16, PAGE)
    a_blocks, b_blocks, c_blocks = [9, 4, 12, 1], [2, 3], [7, 8, 10]
    run_batch(model, pool, [SeqChunk(c_blocks, 0, c[:-1], all_logits=False)], PAGE)
    # B prefills, A prefills in one chunk, C decodes: all in one forward.
    chunks = [
        SeqChunk(b_blocks, 0, b),
        SeqChunk(a_blocks, 0, a),
        SeqChunk(c_blocks, len(c) - 1, c[-1:]),
    ]
    got = run_batch(model, pool, chunks, PAGE)
    for p in range(len(a)):
        assert torch.equal(got[(1, p)], ref_logits[p]), p
    assert torch.equal(_pages(pool, a_blocks), ref_pages)


@pytest.mark.parametrize(
    "sizes",
    [
        (7, 16, 1, 9, 0),  # uneven prefill chunks over a cached prefix
        (1, 1, 1, 29, 1, 1, 1, 1, 1, 0),  # decode first, prefill, then decode from its KV
        (16, 16, 0),  # page-aligned chunks
    ],
)
def test_same_logits_chunked_prefill_and_decode(loaded_model, seqs, reference, sizes):
    a = seqs[0]
    ref_logits, ref_pages = reference
    pool = loaded_model.model.allocate_kv_pool(8, PAGE)
    blocks = [5, 0, 7, 2]
    _run_schedule(loaded_model.model, pool, blocks, a, sizes, ref_logits)
    assert torch.equal(_pages(pool, blocks), ref_pages)


def test_same_logits_after_pages_move_between_pools(loaded_model, seqs, reference):
    a = seqs[0]
    ref_logits, ref_pages = reference
    model = loaded_model.model
    src = model.allocate_kv_pool(4, PAGE)
    run_batch(model, src, [SeqChunk([0, 1, 2, 3], 0, a[:32], all_logits=False)], PAGE)
    dst = model.allocate_kv_pool(8, PAGE)
    scatter_pages(dst, torch.tensor([6, 3]), gather_pages(src, torch.tensor([0, 1])))
    _run_schedule(model, dst, [6, 3, 1, 4], a, (3, 0), ref_logits, start=32)
    assert torch.equal(_pages(dst, [6, 3, 1, 4]), ref_pages)


def test_same_decode_logits_for_any_batch_size(loaded_model, seqs, reference):
    a, _, c = seqs
    ref_logits, _ = reference
    model = loaded_model.model
    last = len(a) - 1
    base = model.allocate_kv_pool(4 + 2 * 33, PAGE)
    run_batch(model, base, [SeqChunk([0, 1, 2, 3], 0, a[:-1], all_logits=False)], PAGE)
    for batch_size in (1, 6, 33):
        pool = base.clone()
        others = [
            SeqChunk([4 + 2 * k, 5 + 2 * k], 0, c[: 5 + k % 11], all_logits=False)
            for k in range(batch_size - 1)
        ]
        if others:  # the other sequences are prefilled, then all decode together
            run_batch(model, pool, others, PAGE)
        decode = [SeqChunk(o.block_ids, len(o.token_ids), [c[k % 7]]) for k, o in enumerate(others)]
        got = run_batch(model, pool, [*decode, SeqChunk([0, 1, 2, 3], last, [a[-1]])], PAGE)
        assert torch.equal(got[(batch_size - 1, last)], ref_logits[last]), batch_size


def test_same_logits_for_one_and_two_threads(loaded_model, seqs, reference):
    a = seqs[0]
    ref_logits, _ = reference
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            pool = loaded_model.model.allocate_kv_pool(4, PAGE)
            got = run_batch(loaded_model.model, pool, [SeqChunk([0, 1, 2, 3], 0, a)], PAGE)
            for p in range(len(a)):
                assert torch.equal(got[(0, p)], ref_logits[p]), (threads, p)
    finally:
        torch.set_num_threads(before)


def test_every_linear_is_row_invariant(loaded_model):
    """Each weight shape gives the same row for any padded row count (oneDNN packed path)."""
    model = loaded_model.model
    layer = model.layers[0]
    torch.manual_seed(0)
    for linear in (*layer.linears(), model.lm_head):
        in_features = linear.dense_weight().shape[1]
        x = torch.randn(516, in_features)
        ref = linear(x[:4])
        for rows in (8, 12, 36, 132, 516):
            assert torch.equal(linear(x[:rows])[:4], ref), (in_features, rows)
        assert torch.equal(linear(x[512:516]), linear(x)[512:]), in_features


def test_bad_inputs_raise_clear_errors(loaded_model):
    model = loaded_model.model
    pool = model.allocate_kv_pool(2, PAGE)
    batch = make_batch([SeqChunk([0, 1], 0, [1, 2, 3])], PAGE)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 49152\)"):
        model(torch.tensor([1, 2, 49152]), batch.positions, pool, batch.meta, batch.logits_indices)
    with pytest.raises(ValueError, match="must all be"):
        model(batch.input_ids, batch.positions[:2], pool, batch.meta, batch.logits_indices)
    assert torch.count_nonzero(pool) == 0  # nothing written


def test_verification_step_rows_and_rejected_draft_kv(loaded_model, seqs, reference):
    """A speculative verification step (the last token plus a draft, beside another sequence's
    decode) gives the reference rows up to the first wrong draft token; the K/V it wrote for
    the rejected tokens is overwritten when decoding goes on, leaving the reference pages."""
    a, _b, c = seqs
    ref_logits, ref_pages = reference
    model = loaded_model.model
    pool = model.allocate_kv_pool(16, PAGE)
    blocks, c_blocks = [3, 6, 1, 5], [9, 10, 11]
    n0 = 20
    run_batch(model, pool, [SeqChunk(blocks, 0, a[:n0], all_logits=False)], PAGE)
    run_batch(model, pool, [SeqChunk(c_blocks, 0, c[:-1], all_logits=False)], PAGE)
    wrong = [(t + 1) % 1000 for t in a[n0 + 4 : n0 + 7]]
    chunks = [SeqChunk(c_blocks, len(c) - 1, c[-1:]), SeqChunk(blocks, n0, a[n0 : n0 + 4] + wrong)]
    got = run_batch(model, pool, chunks, PAGE)
    for p in range(n0, n0 + 4):  # rows of the last token and the three right draft tokens
        assert torch.equal(got[(1, p)], ref_logits[p]), p
    _run_schedule(model, pool, blocks, a, (1, 2, 0), ref_logits, start=n0 + 4)
    assert torch.equal(_pages(pool, blocks), ref_pages)
