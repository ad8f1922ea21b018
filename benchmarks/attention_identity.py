"""Bitwise identity of the C++ CPU paged attention with a reference revision's kernel.

Usage: python benchmarks/attention_identity.py [--ref REV] [--cases N] [--seed S]
Builds the reference revision's kernels (`git show REV:kvrelay/kernels/csrc/...`) under their own
module name (cached next to the current build), runs both on random cases (decode batches with
and without shared prefix pages, prefill chunks, odd lengths, page boundaries, head_dim 8..128,
GQA groups 1..7, page sizes 1..32, 1 and 2 threads, some inf/NaN keys) and requires every output
float to have the same bits (NaN counts as equal to NaN). The default reference is 8f4298d, the
kernel before the GQA row tiles and L2 prefetching of issue #9. Exit status 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvrelay.kernels import cpu_build

REPO = Path(__file__).resolve().parents[1]
CSRC = "kvrelay/kernels/csrc"


def build_reference(rev: str):
    """The kernels of revision `rev`, built once into the kernel cache."""
    from torch.utils import cpp_extension

    # files added since `rev` (wint8.cpp, kv_types.h, ...) are not used by its sources
    names = [n for n in (*cpu_build.SOURCES, *cpu_build.HEADERS) if _exists(rev, n)]
    files = {n: _git_show(rev, f"{CSRC}/{n}") for n in names}
    digest = hashlib.sha256(b"".join(n.encode() + files[n] for n in sorted(files))).hexdigest()
    name = f"kvrelay_cpu_ref_{digest[:12]}"
    build_dir = cpu_build.cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    src = build_dir / "src"  # a fixed path: ninja rebuilds nothing the second time
    src.mkdir(exist_ok=True)
    for n, data in files.items():
        if not (src / n).exists() or (src / n).read_bytes() != data:
            (src / n).write_bytes(data)
    return cpp_extension.load(
        name=name,
        sources=[str(src / s) for s in cpu_build.SOURCES if s in files],
        extra_cflags=list(cpu_build.CFLAGS),
        build_directory=str(build_dir),
    )


def _exists(rev: str, name: str) -> bool:
    args = ["git", "cat-file", "-e", f"{rev}:{CSRC}/{name}"]
    return subprocess.run(args, cwd=REPO, check=False, capture_output=True).returncode == 0


def _git_show(rev: str, path: str) -> bytes:
    return subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True
    ).stdout


def random_case(g: torch.Generator) -> dict:
    """One batch: pool, block tables (maybe sharing prefix blocks), query rows, plan inputs."""

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    head_dim, group, kv_heads = pick((8, 16, 32, 64, 128)), pick((1, 2, 3, 4, 5, 7)), rand(1, 3)
    page = pick((1, 3, 4, 5, 8, 16, 16, 32))
    kind = pick(("decode", "decode", "shared", "prefill", "mixed"))
    n_seqs = rand(1, 12) if kind in ("decode", "shared") else rand(1, 3)
    budget = 4_000_000 // (4 * kv_heads * head_dim)  # pool floats stay around 4M
    max_ctx = max(2, min(900, budget // n_seqs))
    ctx = [rand(1, max_ctx) for _ in range(n_seqs)]
    if kind in ("decode", "shared"):
        qlen = [1] * n_seqs
    else:
        qlen = [rand(1, min(c, 70)) for c in ctx]
        if kind == "mixed":
            qlen = [q if i % 2 else 1 for i, q in enumerate(qlen)]
    pages = [-(-c // page) for c in ctx]
    shared = 0
    if kind == "shared" or (n_seqs > 1 and rand(0, 3) == 0):
        shared = rand(1, min(pages))
        ctx = [max(c, shared * page) for c in ctx]  # every sharer covers the shared pages
        pages = [-(-c // page) for c in ctx]
    num_blocks = shared + sum(p - shared for p in pages) + rand(1, 5)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    common, at, tables = perm[:shared], shared, []
    for p in pages:
        tables.append(common + perm[at : at + p - shared])
        at += p - shared
    width = max(pages) + rand(0, 2)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    pool = torch.randn(num_blocks, 2, 2, page, kv_heads, head_dim, generator=g)
    pool *= torch.rand(num_blocks, 1, 1, page, kv_heads, 1, generator=g) * 4
    if rand(0, 9) == 0:  # a few inf/NaN keys and signed zeros: every input, not just nice ones
        flat = pool.view(-1)
        idx = torch.randint(flat.numel(), (4,), generator=g)
        flat[idx] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    q = torch.randn(sum(qlen), group * kv_heads, head_dim, generator=g) * (1 + rand(0, 3))
    qsl = torch.tensor([0] + torch.tensor(qlen).cumsum(0).tolist(), dtype=torch.int32)
    desc = f"{kind} hd{head_dim} g{group} kv{kv_heads} page{page} ctx{ctx} q{qlen} shared{shared}"
    return {
        "pool": pool,
        "tables": bt,
        "ctx": torch.tensor(ctx, dtype=torch.int32),
        "qsl": qsl,
        "q": q,
        "page": page,
        "scale": float(head_dim) ** -0.5,
        "desc": desc,
    }


def run(ext, case: dict, layer: int) -> torch.Tensor:
    page, q = case["page"], case["q"]
    chunk_pages = max(1, 256 // page)
    items, entries, positions, offsets = ext.build_plan(
        case["tables"], case["ctx"], case["qsl"], q.shape[0], page, chunk_pages,
        case["pool"].shape[0],
    )  # fmt: skip
    args = (q, case["pool"], layer, case["tables"], items, entries, positions, offsets,
            chunk_pages, case["scale"])  # fmt: skip
    try:
        return ext.paged_attention(*args, False)  # fp32 dot products (not bf16 on AMX tiles)
    except TypeError:  # a build from before the precision argument
        return ext.paged_attention(*args)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every float has the same bits; any NaN equals any NaN."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", default="8f4298d", help="git revision of the reference kernel")
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    ref, new = build_reference(args.ref), cpu_build.load()
    if new is None:
        sys.exit("the current C++ kernels are unavailable (see the log)")
    g = torch.Generator().manual_seed(args.seed)
    t0, failures, compared = time.perf_counter(), [], 0
    for i in range(args.cases):
        case = random_case(g)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for layer in (0, 1):
                compared += 1
                if not same_bits(run(ref, case, layer), run(new, case, layer)):
                    failures.append(f"case {i} threads {threads} layer {layer}: {case['desc']}")
    for f in failures[:20]:
        print("DIFFERENT", f)
    print(
        json.dumps(
            {
                "bench": "attention_identity",
                "ref": args.ref,
                "cases": args.cases,
                "compared": compared,
                "different": len(failures),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
