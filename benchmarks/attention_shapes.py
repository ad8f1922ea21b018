"""C++ paged attention by head shape: Gemma 3 270M's (4 query heads on 1 KV head, head_dim 256)
against SmolLM2's (9 heads, 3 KV heads, head_dim 64), two builds A/B in one process.

    python benchmarks/attention_shapes.py --a /tmp/old-tree --b .             # trees
    python benchmarks/attention_shapes.py --a OLD.so --b NEW.so --threads 1 2 --pools fp32 bf16
    python benchmarks/attention_shapes.py --b . --isa avx2                    # B alone

A tree is a checkout of this repository whose kernels a child process builds (or finds in the
cache) with `KVRELAY_KERNELS_ISA=--isa`. Both builds run on the same inputs, calls alternated
(A B B A ...), and the table gives the min over `--rounds` calls of each (a shared host: the min
is the least disturbed call) and whether both gave the same bits. Cases: decode of 1, 8 and 32
sequences at 512 and 4,096 keys, a 512-row prefill chunk at 4,096 and decode with a 512-key
window (Gemma's local layers), pages of 16; `--precision bf16` runs the AMX bf16 attention
(a bf16 pool, the amx build).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.attention_ab import kernel_path, load, make_case
from kvrelay.kernels.cpu_paged import get_plan

SHAPES = {  # name: heads, kv heads, head_dim
    "gemma3": (4, 1, 256),
    "mqa128": (4, 1, 128),
    "smollm2": (9, 3, 64),
    "mha128": (8, 8, 128),  # Llama 2 7B's heads (no GQA): single-row tiles
}
CASES = (  # name, context lengths, query lengths, window
    ("decode 1 x 512", [512], [1], 0),
    ("decode 8 x 512", [512] * 8, [1] * 8, 0),
    ("decode 32 x 512", [512] * 32, [1] * 32, 0),
    ("decode 1 x 4,096", [4096], [1], 0),
    ("decode 8 x 4,096", [4096] * 8, [1] * 8, 0),
    ("decode 32 x 4,096", [4096] * 32, [1] * 32, 0),
    ("decode 8 x 4,096, window 512", [4096] * 8, [1] * 8, 512),
    ("prefill chunk 512 at 4,096", [4096], [512], 0),
    ("prefill chunk 512 at 4,096, window 512", [4096], [512], 512),
)


def run(ext, q, pool, meta, bf16: bool, window: int) -> torch.Tensor:
    plan = get_plan(meta, pool.shape[3], pool.shape[0], q.shape[0], window)
    return ext.paged_attention(q, pool, 0, *plan.args(), q.shape[2] ** -0.5, bf16, window)


def best(exts, call, rounds: int) -> list[float]:
    """Min seconds of `call(ext)` per build, `rounds` calls each, alternated A B B A ..."""
    times = [float("inf")] * len(exts)
    for r in range(rounds):
        order = range(len(exts)) if r % 2 == 0 else reversed(range(len(exts)))
        for i in order:
            t = time.perf_counter()
            call(exts[i])
            times[i] = min(times[i], time.perf_counter() - t)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", help="baseline: a tree or a kernel .so (omit: B alone)")
    p.add_argument("--b", required=True, help="candidate: a tree or a kernel .so")
    p.add_argument("--isa", default="auto", help="KVRELAY_KERNELS_ISA for trees")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="fp32")
    p.add_argument("--pools", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"))
    p.add_argument("--shapes", nargs="+", default=["gemma3", "smollm2"], choices=SHAPES)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--cases", default="", help="only cases whose name contains this")
    p.add_argument("--rounds", type=int, default=7, help="calls of each build per case")
    args = p.parse_args(argv)
    paths = ([args.a] if args.a else []) + [args.b]
    exts = [load(kernel_path(w, args.isa)) for w in paths]
    bf16 = args.precision == "bf16"
    pools = ["bf16"] if bf16 else args.pools
    print(f"builds {', '.join(e.__name__ for e in exts)}; {args.precision} attention")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cols = " | ".join(["A ms", "B ms", "B/A", "same"] if args.a else ["ms"])
    print(f"| shape | pool | threads | case | {cols} |")
    print("|---" * (4 + (4 if args.a else 1)) + "|")
    for shape in args.shapes:
        for pool_name in pools:
            dtype = torch.bfloat16 if pool_name == "bf16" else torch.float32
            for name, lens, qlens, window in CASES:
                if args.cases not in name:
                    continue
                q, pool, meta = make_case(lens, qlens, 1, dtype, SHAPES[shape])
                outs = [run(e, q, pool, meta, bf16, window) for e in exts]
                same = all(torch.equal(outs[0], o) for o in outs[1:])
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    case = (q, pool, meta, bf16, window)
                    t = best(exts, lambda e, case=case: run(e, *case), args.rounds)
                    ms = [f"{x * 1e3:.3f}" for x in t]
                    extra = [f"{t[1] / t[0]:.2f}", "yes" if same else "NO"] if args.a else []
                    cells = " | ".join(ms + extra)
                    print(f"| {shape} | {pool_name} | {threads} | {name} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
