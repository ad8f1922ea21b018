"""int8_linear, q8_linear, silu_mul and rms_norm per ISA variant of the C++ CPU kernels.

Usage: python benchmarks/kernel_isa.py [--repeat N] [--rows 1,8,32,128,512] [--threads T]
Loads every variant this CPU runs side by side (`cpu_build.load_variant`), checks that their
outputs have the same bits, and times each op at SmolLM2-135M's shapes (the LM head only up to
32 rows: it runs on the sampled rows). Prints one JSON line, then a table of milliseconds per
call and the speedup of each variant over avx2 measured in the same run (higher is faster).
q8_linear (`--quantization q8_0`) runs beside int8_linear on the same weights: on the amx
variant its integer sums run on AMX tiles from 16 rows on.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

from kvrelay.kernels import cpu_build, pack_int8_weight, pack_q8_weight, quantize_int8_weight

# (name, in_features, out_features) of SmolLM2-135M's linears
SHAPES = (
    ("qkv", 576, 960),
    ("o", 576, 576),
    ("gate_up", 576, 3072),
    ("down", 1536, 576),
    ("lm_head", 576, 49152),
)
LM_HEAD_MAX_ROWS = 32


def _time(fn, repeat: int) -> float:
    """Fastest of `repeat` calls in milliseconds (the machine is shared: the minimum is stable)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _int8_linear(mod, x: torch.Tensor, w) -> torch.Tensor:
    return mod.int8_linear(x, w.packed, w.scales, None, w.out_features)


def _q8_linear(mod, x: torch.Tensor, w) -> torch.Tensor:
    return mod.q8_linear(x, w.packed, w.scales, w.comp, None, w.out_features)


def _rms_norm(mod, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return mod.rms_norm(x, weight, 1e-5)


def _compare(row: dict, mods: dict, call, repeat: int) -> dict:
    """Time `call(module)` for each variant into `row`; same_bits: every output equals avx2's."""
    outs = {v: call(mod) for v, mod in mods.items()}
    for v, mod in mods.items():
        row[f"{v}_ms"] = _time(lambda mod=mod: call(mod), repeat)
    row["same_bits"] = all(torch.equal(o, outs["avx2"]) for o in outs.values())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rows", default="1,8,32,128,512")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = cpu_build.supported_variants()
    mods = {v: cpu_build.load_variant(v) for v in variants}
    row_counts = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    results = []
    for name, k, n in SHAPES:
        q, scales = quantize_int8_weight(torch.randn(n, k, generator=g) * 0.05)
        w, w8 = pack_int8_weight(q, scales), pack_q8_weight(q, scales)
        for m in row_counts:
            if name == "lm_head" and m > LM_HEAD_MAX_ROWS:
                continue
            x = torch.randn(m, k, generator=g)
            row = {"op": f"int8_linear {name}", "shape": f"{m}x{k}->{n}"}
            call = partial(_int8_linear, x=x, w=w)
            results.append(_compare(row, mods, call, args.repeat))
            row = {"op": f"q8_linear {name}", "shape": f"{m}x{k}->{n}"}
            results.append(_compare(row, mods, partial(_q8_linear, x=x, w=w8), args.repeat))
    for m in row_counts:
        gu = torch.randn(m, 2 * 1536, generator=g) * 3
        x, wn = torch.randn(m, 576, generator=g), torch.randn(576, generator=g)
        row = {"op": "silu_mul", "shape": f"{m}x3072"}
        results.append(_compare(row, mods, lambda mod, gu=gu: mod.silu_mul(gu), args.repeat))
        row = {"op": "rms_norm", "shape": f"{m}x576"}
        call = partial(_rms_norm, x=x, weight=wn)
        results.append(_compare(row, mods, call, args.repeat))
    for row in results:
        for v in variants:
            row[f"{v}_speedup"] = row["avx2_ms"] / row[f"{v}_ms"]
    print(json.dumps({"threads": torch.get_num_threads(), "variants": variants, "rows": results}))
    header = f"{'op':<20} {'shape':<16}" + "".join(f" {v + ' ms':>11}" for v in variants)
    print(header + "".join(f" {v + ' x':>9}" for v in variants[1:]) + "  same bits")
    for row in results:
        line = f"{row['op']:<20} {row['shape']:<16}"
        line += "".join(f" {row[f'{v}_ms']:>11.4f}" for v in variants)
        line += "".join(f" {row[f'{v}_speedup']:>9.2f}" for v in variants[1:])
        print(line + f"  {row['same_bits']}")


if __name__ == "__main__":
    main()
