"""Two builds of the C++ paged attention in one process, calls alternated: A/B timing.

This host's speed drifts by 5-20% between runs (and between processes), which hides kernel
changes of that size when each build runs in its own process. Here both builds are loaded
side by side (their module names differ by their sources' hash) and each case runs A, B, B,
A, ... on the same inputs, so drifts fall on both; it also checks that both give the same
bits (a change meant to keep them must print same=True).

    python benchmarks/attention_ab.py --a /tmp/old-tree --b .            # trees (built once)
    python benchmarks/attention_ab.py --a OLD.so --b NEW.so --precision fp32 --rounds 30

A tree is a checkout of this repository: its kernels are built (or found in the cache) by a
child process with that tree first on PYTHONPATH. Cases: a 512-row prefill chunk at 4,096, a
2,048-token prompt in one shot, decode 32 x 2,048, decode 8 x 4,096 over a 30-layer pool (the
bytes come from memory, as in the engine), 3 x 700 prompts, a mixed step (a 496-row chunk at
3,000 beside 16 decodes at 4,096, 30 layers); SmolLM2 shapes (9 heads, 3 KV heads, head_dim
64, pages of 16), 2 threads by default. The last row times the fused RoPE + K/V write
(`rope_write_kv`) of a 496-token chunk, the op beside attention in each layer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from kvrelay.kernels import AttentionMetadata, cpu_build
from kvrelay.kernels.cpu_paged import get_plan

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
CASES = (  # name, context lengths, query lengths, layers in the pool
    ("prefill chunk 512 at 4,096", [4096], [512], 1),
    ("prefill 2,048 one shot", [2048], [2048], 1),
    ("decode 32 x 2,048", [2048] * 32, [1] * 32, 1),
    ("decode 8 x 4,096, 30 layers", [4096] * 8, [1] * 8, 30),
    ("prefill 3 x 700", [700] * 3, [700] * 3, 1),
    # a mixed step of a long-context run: a prefill chunk beside 16 decoding sequences
    (
        "mixed: 496 at 3,000 + 16 x 4,096 decode, 30 layers",
        [3000] + [4096] * 16,
        [496] + [1] * 16,
        30,
    ),
)


def kernel_path(where: str, isa: str | None = None) -> str:
    """The extension file for `where`: a built .so, or a tree whose kernels a child builds
    (the variant `isa` where given: KVRELAY_KERNELS_ISA, else this host's)."""
    if where.endswith(".so"):
        return where
    tree = str(Path(where).resolve())
    code = "from kvrelay.kernels import cpu_build; print(cpu_build.load().__file__)"
    env = dict(os.environ, PYTHONPATH=tree)
    if isa:
        env["KVRELAY_KERNELS_ISA"] = isa
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines or not lines[-1].endswith(".so"):
        raise SystemExit(f"no kernel build for {tree}: {out.stderr.strip()[-800:]}")
    return lines[-1]


def load(path: str):
    """The extension at `path` under its own module name (the names differ by build)."""
    return cpu_build._import(Path(path).name.split(".")[0], Path(path))


def make_case(
    lens: list[int],
    qlens: list[int],
    layers: int,
    dtype: torch.dtype,
    shape: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
):
    """(query, pool, metadata) of sequences with context `lens` and `qlens` new rows each, for
    `shape` = (heads, kv heads, head_dim); random values (seed 0)."""
    heads, kv_heads, head_dim = shape
    g = torch.Generator().manual_seed(0)
    pages = [(n + PAGE - 1) // PAGE for n in lens]
    pool_shape = (sum(pages), layers, 2, PAGE, kv_heads, head_dim)
    pool = torch.randn(pool_shape, generator=g).to(dtype)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        tables[i, :n] = torch.arange(start, start + n)
        start += n
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64),
        block_tables=tables,
        context_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(qlens),
        max_context_len=max(lens),
    )
    return torch.randn(qsl[-1], heads, head_dim, generator=g), pool, meta


def run(ext, q, pool, meta, layer: int, bf16: bool) -> torch.Tensor:
    plan = get_plan(meta, pool.shape[3], pool.shape[0], q.shape[0])
    return ext.paged_attention(
        q, pool, layer, plan.block_tables, plan.items, plan.entries, plan.positions,
        plan.chunk_offsets, plan.chunk_pages, HEAD_DIM**-0.5, bf16,
    )  # fmt: skip


def rope_case(dtype: torch.dtype):
    """`rope_write_kv`'s arguments for a 496-token chunk at positions 1,000.. (one layer)."""
    g = torch.Generator().manual_seed(0)
    tokens, half = 496, HEAD_DIM // 2
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
    positions = torch.arange(1000, 1000 + tokens, dtype=torch.int64)
    cos, sin = torch.randn(8192, half, generator=g), torch.randn(8192, half, generator=g)
    pool = torch.zeros(tokens // PAGE + 1, 30, 2, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype)
    slots = torch.arange(tokens, dtype=torch.int64)
    return qkv, positions, cos, sin, pool, 3, slots, HEADS


def alternate(a, b, call, rounds: int) -> tuple[list[float], list[float]]:
    """Seconds of `call(ext)` for builds a and b, `rounds` each, in the order A B B A A B ..."""
    times: dict[str, list[float]] = {"a": [], "b": []}
    for r in range(rounds):
        for key in ("a", "b") if r % 2 == 0 else ("b", "a"):
            t = time.perf_counter()
            call(a if key == "a" else b)
            times[key].append(time.perf_counter() - t)
    return times["a"], times["b"]


def print_row(name: str, times: tuple[list[float], list[float]], same: bool, digits: int) -> None:
    """A table row: min / median ms of A and B, B/A of both, whether the bits match."""
    ta, tb = times
    ma, mb = min(ta) * 1e3, min(tb) * 1e3
    da, db = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
    print(
        f"| {name} | {ma:.{digits}f} / {da:.{digits}f} | {mb:.{digits}f} / {db:.{digits}f} | "
        f"{mb / ma:.3f} / {db / da:.3f} | {'yes' if same else 'NO'} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="baseline: a tree or a kernel .so")
    p.add_argument("--b", required=True, help="candidate: a tree or a kernel .so")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--rounds", type=int, default=16, help="calls of each build per case")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    a, b = load(kernel_path(args.a)), load(kernel_path(args.b))
    torch.set_num_threads(args.threads)
    bf16 = args.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    print(f"A {a.__name__}, B {b.__name__}; {args.precision}, {args.threads} threads")
    print("| case | A min / median (ms) | B min / median (ms) | B/A min / median | same bits |")
    print("|---|---:|---:|---:|---|")
    for name, lens, qlens, layers in CASES:
        q, pool, meta = make_case(lens, qlens, layers, dtype)
        same = torch.equal(run(a, q, pool, meta, 0, bf16), run(b, q, pool, meta, 0, bf16))

        def layers_of(ext, q=q, pool=pool, meta=meta, layers=layers) -> None:
            for layer in range(layers):
                run(ext, q, pool, meta, layer, bf16)

        print_row(name, alternate(a, b, layers_of, args.rounds), same, 2)
    rope = rope_case(dtype)
    pool_a, pool_b = rope[4].clone(), rope[4].clone()
    q_a = a.rope_write_kv(*rope[:4], pool_a, *rope[5:])
    q_b = b.rope_write_kv(*rope[:4], pool_b, *rope[5:])
    same = torch.equal(q_a, q_b) and torch.equal(pool_a, pool_b)
    times = alternate(a, b, lambda ext: ext.rope_write_kv(*rope), 10 * args.rounds)
    print_row("rope_write_kv, 496 tokens", times, same, 3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
