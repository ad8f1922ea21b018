"""Per-call cost of kvrelay's paged attention vs torch SDPA on contiguous K/V (one layer).

Usage: python benchmarks/kernels.py [--impl auto|torch|triton|cpp] [--device cpu|cuda]
       [--repeat N] [--suite all|ops|cpu]
Prints one JSON line, then a table. Shapes are SmolLM2-135M's (9 heads, 3 KV heads, head_dim 64,
page 16); multiply per-call times by 30 for a whole forward pass. The `cpu` suite compares the
torch and C++ CPU paths: batch-32 decode at context 64/512/2048, 8 sequences sharing a
1,500-token prefix (shared block ids vs the same contexts in private blocks), and a 512-token
prefill.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from kvrelay.kernels import AttentionMetadata, paged_attention, write_kv

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def _time(fn, repeat: int, device: str) -> float:
    """Fastest of `repeat` calls in milliseconds (the machine is shared: the minimum is stable)."""
    fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def _setup(ctx_lens, query_lens, layers, device, dtype):
    """A pool holding each sequence's context, metadata for its last query_lens rows."""
    pages = [-(-c // PAGE) for c in ctx_lens]
    num_blocks = sum(pages) + 1
    pool = torch.zeros(num_blocks, layers, 2, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(perm[at : at + n])
        at += n
    width = max(pages)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def meta(qlens):
        slots = [
            t[p // PAGE] * PAGE + p % PAGE
            for t, c, n in zip(tables, ctx_lens, qlens, strict=True)
            for p in range(c - n, c)
        ]
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=bt.to(device),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            max_query_len=max(qlens),
            max_context_len=max(ctx_lens),
        )

    full = meta(ctx_lens)
    total = sum(ctx_lens)
    kv = torch.randn(2, total, KV_HEADS, HEAD_DIM, device=device).to(dtype)
    layer = layers // 2
    write_kv(pool, layer, kv[0], kv[1], full.slot_mapping)
    m = meta(query_lens)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, device=device).to(dtype)
    return pool, layer, m, q, kv


def bench_decode(batch, ctx, args) -> dict:
    ctx_lens = [ctx - batch // 2 + i for i in range(batch)]  # ragged around ctx
    pool, layer, meta, q, _ = _setup(ctx_lens, [1] * batch, args.layers, args.device, args.dtype)
    ours = _time(
        lambda: paged_attention(q, pool, layer, meta, 0.125, impl=args.impl),
        args.repeat,
        args.device,
    )
    fresh = _time(
        lambda: paged_attention(
            q,
            pool,
            layer,
            AttentionMetadata(*[getattr(meta, f) for f in _FIELDS]),
            0.125,
            impl=args.impl,
        ),
        args.repeat,
        args.device,
    )
    k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device=args.device).to(args.dtype)
    v = torch.randn_like(k)
    qs = torch.randn(batch, HEADS, 1, HEAD_DIM, device=args.device).to(args.dtype)
    new = torch.randn(batch, KV_HEADS, 1, HEAD_DIM, device=args.device).to(args.dtype)
    sdpa = _time(
        lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True), args.repeat, args.device
    )

    def dynamic_cache_step():
        # What transformers' DynamicCache + SDPA does per layer and step: cat, then attend.
        kk, vv = torch.cat([k, new], 2), torch.cat([v, new], 2)
        return F.scaled_dot_product_attention(qs, kk, vv, enable_gqa=True)

    hf = _time(dynamic_cache_step, args.repeat, args.device)
    return {
        "case": f"decode b{batch} ctx~{ctx}",
        "ours_ms": ours,
        "ours_with_plan_ms": fresh,
        "sdpa_ms": sdpa,
        "cat_sdpa_ms": hf,
    }


def bench_prefill(tokens, args) -> dict:
    pool, layer, meta, q, kv = _setup([tokens], [tokens], args.layers, args.device, args.dtype)
    ours = _time(
        lambda: paged_attention(q, pool, layer, meta, 0.125, impl=args.impl),
        args.repeat,
        args.device,
    )
    qs = q.transpose(0, 1).unsqueeze(0)
    k, v = kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0)
    sdpa = _time(
        lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True),
        args.repeat,
        args.device,
    )
    return {"case": f"prefill {tokens}", "ours_ms": ours, "sdpa_ms": sdpa, "cat_sdpa_ms": sdpa}


def bench_cpu_decode(ctx: int, args) -> dict:
    ctx_lens = [ctx - 16 + i for i in range(32)]
    pool, layer, meta, q, _ = _setup(ctx_lens, [1] * 32, 4, "cpu", torch.float32)
    times = {
        impl: _time(
            lambda i=impl: paged_attention(q, pool, layer, meta, 0.125, impl=i), args.repeat, "cpu"
        )
        for impl in ("torch", "cpp")
    }
    return {"case": f"decode b32 ctx~{ctx}", "torch_ms": times["torch"], "cpp_ms": times["cpp"]}


def bench_cpu_prefill(tokens: int, args) -> dict:
    """One sequence's prompt of `tokens` rows at once (causal): compute-bound."""
    pool, layer, meta, q, _ = _setup([tokens], [tokens], 4, "cpu", torch.float32)
    times = {
        impl: _time(
            lambda i=impl: paged_attention(q, pool, layer, meta, 0.125, impl=i), args.repeat, "cpu"
        )
        for impl in ("torch", "cpp")
    }
    return {"case": f"prefill {tokens}", "torch_ms": times["torch"], "cpp_ms": times["cpp"]}


def bench_shared_prefix(args, prefix: int = 1500, tail: int = 100, batch: int = 8) -> dict:
    """cpp on 8 sequences whose first 1,500 tokens are the same blocks vs private copies."""
    ctx = prefix + tail
    pages = -(-ctx // PAGE)
    shared_pages = prefix // PAGE  # whole pages only can be shared
    num_blocks = shared_pages + batch * (pages - shared_pages) + batch * pages + 1
    pool = torch.randn(num_blocks, 4, 2, PAGE, KV_HEADS, HEAD_DIM)
    free = list(range(1, num_blocks))
    common = [free.pop() for _ in range(shared_pages)]
    shared = [common + [free.pop() for _ in range(pages - shared_pages)] for _ in range(batch)]
    private = [[free.pop() for _ in range(pages)] for _ in range(batch)]
    q = torch.randn(batch, HEADS, HEAD_DIM)
    ctx_lens = [ctx - i for i in range(batch)]

    def meta(tables):
        return AttentionMetadata(
            slot_mapping=torch.zeros(batch, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            max_query_len=1,
            max_context_len=ctx,
        )

    ms, mp = meta(shared), meta(private)
    row = {"case": f"shared {prefix} b{batch}"}
    row["torch_ms"] = _time(
        lambda: paged_attention(q, pool, 1, ms, 0.125, impl="torch"), args.repeat, "cpu"
    )
    row["cpp_ms"] = _time(
        lambda: paged_attention(q, pool, 1, ms, 0.125, impl="cpp"), args.repeat, "cpu"
    )
    row["cpp_private_ms"] = _time(
        lambda: paged_attention(q, pool, 1, mp, 0.125, impl="cpp"), args.repeat, "cpu"
    )
    return row


def cpu_suite(args) -> None:
    rows = [bench_cpu_decode(c, args) for c in (64, 512, 2048)] + [bench_shared_prefix(args)]
    rows.append(bench_cpu_prefill(512, args))
    for r in rows:
        r["speedup"] = r["torch_ms"] / r["cpp_ms"]
    print(json.dumps({"bench": "kernels_cpu", "threads": torch.get_num_threads(), "rows": rows}))
    print(f"{'case':<22}{'torch ms':>10}{'cpp ms':>10}{'speedup':>9}{'cpp private ms':>16}")
    for r in rows:
        private = f"{r['cpp_private_ms']:>16.3f}" if "cpp_private_ms" in r else ""
        print(
            f"{r['case']:<22}{r['torch_ms']:>10.3f}{r['cpp_ms']:>10.3f}{r['speedup']:>9.2f}{private}"
        )


_FIELDS = (
    "slot_mapping",
    "block_tables",
    "context_lens",
    "query_start_loc",
    "max_query_len",
    "max_context_len",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default="auto", choices=["auto", "torch", "triton", "cpp"])
    p.add_argument("--suite", default="all", choices=["all", "ops", "cpu"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.suite in ("all", "cpu") and args.device == "cpu":
        cpu_suite(args)
    if args.suite == "cpu":
        return
    rows = [bench_decode(32, 600, args), bench_decode(8, 600, args), bench_decode(1, 600, args)]
    rows += [bench_prefill(n, args) for n in (128, 512, 2048)]
    for r in rows:
        r["ratio_vs_cat_sdpa"] = r["cat_sdpa_ms"] / r["ours_ms"]
    print(
        json.dumps(
            {
                "bench": "kernels",
                "device": args.device,
                "impl": args.impl,
                "threads": torch.get_num_threads(),
                "rows": rows,
            }
        )
    )
    print(f"{'case':<22}{'ours ms':>10}{'sdpa ms':>10}{'cat+sdpa':>10}{'speedup':>9}")
    for r in rows:
        print(
            f"{r['case']:<22}{r['ours_ms']:>10.3f}{r['sdpa_ms']:>10.3f}{r['cat_sdpa_ms']:>10.3f}"
            f"{r['ratio_vs_cat_sdpa']:>9.2f}"
        )


if __name__ == "__main__":
    main()
