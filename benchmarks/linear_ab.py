"""Two builds of `w8a16_linear` in one process beside torch's oneDNN bf16 GEMM, calls
alternated: A/B timing of the AMX linears on SmolLM2's shapes.

The host's speed drifts between runs and processes (see attention_ab.py), so both builds are
loaded side by side and each case runs A, B, oneDNN in rotating order on the same inputs; each
row gives min and median ms and whether A and B give the same bits. oneDNN's GEMM (torch
`linear` on bf16 x and bf16 weights, bf16 out) is the peer's tile path on the same shape, not
our numbers: it rounds its output to bf16 and its rows are not batch-invariant.

    python benchmarks/linear_ab.py --a /tmp/old-tree --b . --rows 512,2048 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.attention_ab import kernel_path, load
from kvrelay.kernels import ops

# name, outputs, inputs (SmolLM2-135M: hidden 576, 9 + 2 x 3 heads of 64, MLP 1,536)
SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="tree or .so of build A")
    p.add_argument("--b", required=True, help="tree or .so of build B")
    p.add_argument("--rows", default="512", help="comma-separated row counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    a, b = load(kernel_path(args.a)), load(kernel_path(args.b))
    if not (a.w8a16_available() and b.w8a16_available()):  # also asks Linux for the tiles
        raise SystemExit("w8a16_linear needs the amx kernel variant and AMX-BF16 tiles")
    g = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}; min / median ms; GF/s from the min")
    print("| shape | rows | A | B | B/A | oneDNN bf16 | A/oneDNN | B/oneDNN | same bits |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, n, k in SHAPES:
            case(a, b, name, rows, n, k, args.rounds, g)


def case(a, b, name: str, rows: int, n: int, k: int, rounds: int, g: torch.Generator) -> None:
    """One table row: builds a and b and oneDNN on a [rows, k] x [n, k] linear."""
    w = torch.randn(n, k, generator=g) * 0.05
    packed = ops.pack_w8a16_weight(*ops.quantize_channel_weight(w))
    x = torch.randn(rows, k, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()
    calls = {
        "a": lambda: a.w8a16_linear(x, packed.packed, packed.scales, None, n),
        "b": lambda: b.w8a16_linear(x, packed.packed, packed.scales, None, n),
        "d": lambda: torch.nn.functional.linear(xb, wb),
    }
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {key: [] for key in calls}
    order = list(calls)
    for r in range(rounds):
        for key in order[r % 3 :] + order[: r % 3]:
            t = time.perf_counter()
            calls[key]()
            times[key].append(time.perf_counter() - t)
    same = torch.equal(calls["a"](), calls["b"]())
    best = {key: min(v) for key, v in times.items()}
    med = {key: statistics.median(v) for key, v in times.items()}
    flops = 2 * rows * n * k
    cells = {
        key: f"{best[key] * 1e3:.3f} / {med[key] * 1e3:.3f} ({flops / best[key] / 1e9:.0f})"
        for key in calls
    }
    print(
        f"| {name} | {rows} | {cells['a']} | {cells['b']} | {best['b'] / best['a']:.3f} | "
        f"{cells['d']} | {best['a'] / best['d']:.2f} | {best['b'] / best['d']:.2f} | "
        f"{'yes' if same else 'NO'} |"
    )


if __name__ == "__main__":
    main()
