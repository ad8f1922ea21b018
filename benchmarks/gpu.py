"""GPU bandwidth figures: copies, kvrelay's paged decode attention, KV page transfers.

Sections (`--sections`, comma-separated; default all):

- copy: device-to-device copy GB/s (bytes read + written) of a 2 GiB bf16 tensor; host<->device
  GB/s from a pinned 1 GiB tensor (H2D, D2H) and from pageable memory (for reference).
- attention: kvrelay's paged decode attention (bf16, SmolLM2 shapes: 9 heads, 3 KV heads,
  head_dim 64, page 16; one layer) over a (batch, context) grid: ms per call, GB/s of the K/V
  read (+ q/out) and that as a fraction of the measured device copy GB/s; "warm" is a loop of
  calls (small cases run from L2), "cold" flushes L2 before each timed call. On CUDA it also
  sweeps the Triton launch (num_warps x num_stages) and reports each against the default.
- pages: KV page moves between a GPU pool and host memory as kvrelay's store connector does
  them (a `copy_` per page from an mmap'd file registered with cudaHostRegister, slots laid
  out like kvstore/arena.py), the same pages as one batched copy through a contiguous staging
  tensor (gather_pages/scatter_pages), the pinned-tensor ceiling, and whether page copies on a
  side stream overlap bf16 matmuls on the default stream.

Every section runs in its own try/except: an error is recorded in the JSON and the next
section runs. The JSON file is rewritten after each section, so a run cut short keeps what
it measured.

    python benchmarks/gpu.py --json gpu.json                 # CUDA, full sizes
    python benchmarks/gpu.py --device cpu --quick --json x.json   # tiny CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 30
SECTIONS = ("copy", "attention", "pages")
GB = 1e9


def log(msg: str) -> None:
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int, inner: int = 1, before=None) -> dict:
    """ms per call of `fn`: `reps` samples of `inner` back-to-back calls each (CUDA events on
    CUDA, wall clock on CPU), after one warm-up call. `before` runs untimed before each sample
    (an L2 flush). Returns best and median."""
    fn()
    sync(device)
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return {"best_ms": min(samples), "median_ms": statistics.median(samples)}


def graphed(fn, calls: int):
    """A replay of `calls` back-to-back calls of fn captured as one CUDA graph: the kernels'
    time without Python's launch cost (the decode step runs as a CUDA graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def wall(fn, device: str, reps: int) -> float:
    """Best wall-clock ms of fn() + synchronize (Python issue cost included), after a warm-up."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def gbps(nbytes: float, ms: float) -> float:
    return round(nbytes / (ms / 1e3) / GB, 2) if ms > 0 else float("nan")


def free(device: str) -> None:
    if device == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- copy -------------------------------------------------------------------------------------
def section_copy(args, result: dict) -> None:
    copy_d2d(args, result)
    free(args.device)
    if args.device != "cuda":
        result["host_device"] = "skipped: needs CUDA"
        return
    copy_host(args, result)
    free(args.device)


def copy_d2d(args, result: dict) -> None:
    dev = args.device
    reps = 3 if args.quick else 10
    numel = (1 << 30) if not args.quick else (4 << 20)  # bf16: 2 GiB / 8 MiB
    src = torch.empty(numel, device=dev, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    t = timed(lambda: dst.copy_(src), dev, reps)
    result["d2d"] = {"bytes": nbytes, **t, "gb_s": gbps(2 * nbytes, t["best_ms"])}
    log(f"copy d2d {nbytes >> 20} MiB: {result['d2d']['gb_s']} GB/s (read + write)")
    t = timed(lambda: src.clone(), dev, reps)
    result["d2d_clone"] = {"bytes": nbytes, **t, "gb_s": gbps(2 * nbytes, t["best_ms"])}


def copy_host(args, result: dict) -> None:
    dev = args.device
    reps = 3 if args.quick else 10
    hnumel = (512 << 20) if not args.quick else (4 << 20)  # bf16: 1 GiB
    hbytes = hnumel * 2
    gpu = torch.empty(hnumel, device="cuda", dtype=torch.bfloat16)
    pinned = torch.empty(hnumel, dtype=torch.bfloat16).pin_memory()
    pageable = torch.ones(hnumel, dtype=torch.bfloat16)
    cases = (
        ("h2d_pinned", lambda: gpu.copy_(pinned, non_blocking=True), True),
        ("d2h_pinned", lambda: pinned.copy_(gpu, non_blocking=True), True),
        ("h2d_pageable", lambda: gpu.copy_(pageable), False),
        ("d2h_pageable", lambda: pageable.copy_(gpu), False),
    )
    for name, fn, events in cases:
        try:
            if events:
                t = timed(fn, dev, reps)
            else:  # synchronous copies: wall clock
                t = {"best_ms": wall(fn, dev, min(reps, 5))}
            result[name] = {"bytes": hbytes, **t, "gb_s": gbps(hbytes, t["best_ms"])}
            log(f"copy {name}: {result[name]['gb_s']} GB/s")
        except Exception as exc:  # noqa: BLE001
            result[name] = {"error": repr(exc)[:500]}
            log(f"copy {name}: {exc!r}")


# ---- attention --------------------------------------------------------------------------------
def decode_case(batch: int, ctx: int, device: str, dtype):
    """A one-layer pool holding `batch` contexts of `ctx` tokens in scattered blocks, and
    decode metadata (one query row per sequence, at the last position)."""
    from kvrelay.kernels import AttentionMetadata

    pages = -(-ctx // PAGE)
    num_blocks = batch * pages + 1
    pool = torch.empty(num_blocks, 1, 2, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    pool.normal_()
    perm = torch.randperm(num_blocks, device=device)[: batch * pages]
    tables = perm.view(batch, pages).to(torch.int32).contiguous()
    last = ctx - 1
    slots = tables[:, last // PAGE].to(torch.int64) * PAGE + last % PAGE
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        context_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_query_len=1,
        max_context_len=ctx,
    )
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device).to(dtype)
    return pool, meta, q


def section_attention(args, result: dict, copy_gb_s: float | None) -> None:
    from kvrelay.kernels import paged_attention

    dev = args.device
    cuda = dev == "cuda"
    dtype = torch.bfloat16
    if args.quick:
        grid = [(1, 256), (4, 128), (8, 512)]
    else:
        grid = [(1, 4096), (1, 32768), (4, 8192), (32, 2048), (32, 8192), (128, 4096),
                (256, 4096), (256, 8192), (512, 8192), (16, 32768)]  # fmt: skip
    reps = 3 if args.quick else 20
    # (name, launch keywords of triton_attention.paged_attention); None: ops.paged_attention
    configs: list[tuple[str, dict | None]] = [("default", None)]
    triton_attention = None
    if cuda:
        from kvrelay.kernels import triton_attention

        configs += [("default_direct", {})]
        # the two launches (same rows), then other splits and launch shapes (other last bits
        # where the split or the tile differs)
        configs += [("one_pass", {"split_k": False}), ("split_k", {"split_k": True})]
        configs += [(f"split{k}", {"split_k": True, "split_keys": k}) for k in (128, 512, 1024)]
        configs += [(f"w{w}_s{s}", {"num_warps": w, "num_stages": s})
                    for w in (4, 8) for s in (2, 3, 4)]  # fmt: skip
        if not args.quick:  # 128 keys per tile
            configs += [("w2_s2", {"num_warps": 2, "num_stages": 2})]
            configs += [(f"w{w}_s{s}_n128", {"num_warps": w, "num_stages": s, "block_n": 128})
                        for w in (4, 8) for s in (2, 3)]  # fmt: skip
    else:
        import inspect

        try:
            from kvrelay.kernels import triton_attention as ta

            params = inspect.signature(ta.paged_attention).parameters
            result["default_launch"] = {"BLOCK_M": ta.BLOCK_M, "BLOCK_N": ta.BLOCK_N}
            result["launch_sweep"] = (
                "skipped: needs CUDA (triton_attention.paged_attention takes "
                f"num_warps={'num_warps' in params}, num_stages={'num_stages' in params})"
            )
        except Exception as exc:  # noqa: BLE001
            result["launch_sweep"] = f"skipped: needs CUDA ({exc!r})"
    flush_buf = torch.empty(256 << 20, dtype=torch.int8, device=dev) if cuda else None
    result["copy_d2d_gb_s"] = copy_gb_s
    if triton_attention is not None:
        result["default_launch"] = {
            "BLOCK_M": triton_attention.BLOCK_M,
            "BLOCK_N": triton_attention.BLOCK_N,
            "NUM_WARPS": triton_attention.NUM_WARPS,
            "NUM_STAGES": triton_attention.NUM_STAGES,
        }
    rows = result.setdefault("rows", [])
    for batch, ctx in grid:
        row: dict = {"batch": batch, "context": ctx}
        rows.append(row)
        try:
            pool, meta, q = decode_case(batch, ctx, dev, dtype)
            kv_bytes = batch * ctx * 2 * KV_HEADS * HEAD_DIM * pool.element_size()
            io_bytes = 2 * q.numel() * q.element_size() + meta.block_tables.numel() * 4
            nbytes = kv_bytes + io_bytes
            row.update(kv_bytes=kv_bytes, bytes=nbytes, pool_bytes=pool.numel() * 2)
            # enough calls per sample that launch latency does not dominate tiny cases
            inner = 1 if args.quick else max(1, min(50, (64 << 20) // max(kv_bytes, 1)))
            ref = None
            for key, kwargs in configs:
                try:
                    if kwargs is None:

                        def fn(q=q, pool=pool, meta=meta):
                            return paged_attention(q, pool, 0, meta, 0.125)
                    else:

                        def fn(q=q, pool=pool, meta=meta, kwargs=kwargs):
                            return triton_attention.paged_attention(
                                q, pool, 0, meta, 0.125, **kwargs
                            )

                    out = fn()
                    sync(dev)
                    entry: dict = {}
                    if ref is None:
                        ref = out
                    else:
                        entry["max_abs_diff_vs_default"] = float((out - ref).abs().max())
                    warm = timed(fn, dev, reps, inner=inner)
                    entry["warm_ms"] = round(warm["best_ms"], 5)
                    entry["warm_median_ms"] = round(warm["median_ms"], 5)
                    entry["warm_gb_s"] = gbps(nbytes, warm["best_ms"])
                    if cuda:
                        cold = timed(fn, dev, reps, before=flush_buf.zero_)
                        entry["cold_ms"] = round(cold["best_ms"], 5)
                        entry["cold_gb_s"] = gbps(nbytes, cold["best_ms"])
                        # as the decode step runs them: in a CUDA graph (20 calls per replay
                        # warm; one call after an L2 flush cold)
                        ms = timed(graphed(fn, 20), dev, reps)["best_ms"] / 20
                        entry["graph_ms"] = round(ms, 5)
                        entry["graph_gb_s"] = gbps(nbytes, ms)
                        ms = timed(graphed(fn, 1), dev, reps, before=flush_buf.zero_)["best_ms"]
                        entry["graph_cold_gb_s"] = gbps(nbytes, ms)
                    if copy_gb_s:
                        entry["warm_frac_of_copy"] = round(entry["warm_gb_s"] / copy_gb_s, 3)
                        for k in ("cold", "graph", "graph_cold"):
                            if f"{k}_gb_s" in entry:
                                entry[f"{k}_frac_of_copy"] = round(
                                    entry[f"{k}_gb_s"] / copy_gb_s, 3
                                )
                    row[key] = entry
                except Exception as exc:  # noqa: BLE001
                    row[key] = {"error": repr(exc)[:500]}
            best = min(
                (k for k in row if isinstance(row[k], dict) and "warm_ms" in row[k]),
                key=lambda k: row[k]["warm_ms"],
                default=None,
            )
            row["best_config"] = best
            if best is not None:
                row["best_warm_gb_s"] = row[best]["warm_gb_s"]
            d = row.get("default", {})
            log(
                f"attention b{batch} ctx{ctx}: default {d.get('warm_ms')} ms "
                f"{d.get('warm_gb_s')} GB/s (cold {d.get('cold_gb_s')}), best {best}"
            )
            pool = meta = q = ref = out = fn = None  # free before the next case
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:500]
            log(f"attention b{batch} ctx{ctx}: {exc!r}")
        free(dev)


# ---- pages ------------------------------------------------------------------------------------
class MappedArena:
    """A tmp file mmap'd like kvstore/arena.py: `n` page slots (header + payload, 4 KiB
    aligned) after a 4 KiB arena header, then one contiguous staging region of `n` pages."""

    def __init__(self, n: int, page_bytes: int):
        from kvrelay.kvstore.arena import ARENA_HEADER, slot_stride
        from kvrelay.kvstore.page import HEADER_BYTES

        self.n, self.page_bytes = n, page_bytes
        self.stride = slot_stride(page_bytes)
        self.header, self.slot_header = ARENA_HEADER, HEADER_BYTES
        self.contig_at = ARENA_HEADER + n * self.stride
        self.size = self.contig_at + n * page_bytes
        # /dev/shm as the arena uses, when it has room (a small container /dev/shm would
        # SIGBUS on first touch: posix_fallocate reserves the space up front or raises).
        fd, path = -1, ""
        for where in ("/dev/shm", None):
            if where and not (os.path.isdir(where) and os.access(where, os.W_OK)):
                continue
            fd, path = tempfile.mkstemp(prefix="kvrelay-gpu-bench-", dir=where)
            try:
                os.ftruncate(fd, self.size)
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, self.size)
                break
            except OSError:
                os.close(fd)
                os.unlink(path)
                fd = -1
        if fd < 0:
            raise OSError(f"no room for a {self.size}-byte host buffer")
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, self.size, flags=flags)
        finally:
            os.close(fd)
            os.unlink(path)
        self.path = path
        self.registered = False
        self.ptr = None

    def register(self) -> str | None:
        """cudaHostRegister the whole mapping (as HostArena.register_cuda); error text or None."""
        import numpy as np

        self.ptr = np.frombuffer(self.mm, dtype=np.uint8).ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(self.ptr, self.size, 0)
        code = int(getattr(err, "value", err))
        if code != 0:
            return f"cudaHostRegister failed: {err}"
        self.registered = True
        return None

    def unregister(self) -> str | None:
        """cudaHostUnregister (if registered); error text or None."""
        if not self.registered:
            return None
        try:
            torch.cuda.synchronize()
            err = torch.cuda.cudart().cudaHostUnregister(self.ptr)
            code = int(getattr(err, "value", err))
        except Exception as exc:  # noqa: BLE001
            return f"cudaHostUnregister failed: {exc!r}"
        if code != 0:
            return f"cudaHostUnregister failed: {err}"
        self.registered = False
        return None

    def slot(self, i: int, dtype, shape) -> torch.Tensor:
        start = self.header + i * self.stride + self.slot_header
        view = memoryview(self.mm)[start : start + self.page_bytes]
        return torch.frombuffer(view, dtype=dtype).view(shape)

    def contiguous(self, dtype, shape) -> torch.Tensor:
        view = memoryview(self.mm)[self.contig_at : self.contig_at + self.n * self.page_bytes]
        return torch.frombuffer(view, dtype=dtype).view(self.n, *shape)


def section_pages(args, result: dict) -> None:
    from kvrelay.kernels import gather_pages, scatter_pages

    dev = args.device
    cuda = dev == "cuda"
    dtype = torch.bfloat16
    layers = LAYERS
    n = 256 if not args.quick else 8
    reps = 5 if not args.quick else 2
    shape = (layers, 2, PAGE, KV_HEADS, HEAD_DIM)
    page_numel = layers * 2 * PAGE * KV_HEADS * HEAD_DIM
    page_bytes = page_numel * 2
    total = n * page_bytes
    num_blocks = 2 * n + 1
    result.update(pages=n, page_bytes=page_bytes, bytes=total, layers=layers)
    pool = torch.randn(num_blocks, *shape, device=dev).to(dtype)
    block_list = torch.randperm(num_blocks)[:n].tolist()
    block_ids = torch.tensor(block_list, dtype=torch.int64, device=dev)
    arena = MappedArena(n, page_bytes)
    result["host_file"] = arena.path
    try:
        if cuda:
            err = arena.register()
            result["cuda_host_register"] = err or "ok"
        slots = [arena.slot(i, dtype, shape) for i in range(n)]
        for s in slots:
            s.normal_()
        contig = arena.contiguous(dtype, shape)
        contig.normal_()
        nb = arena.registered

        def h2d_pages():
            for s, b in zip(slots, block_list, strict=True):
                pool[b].copy_(s, non_blocking=nb)

        def d2h_pages():
            for s, b in zip(slots, block_list, strict=True):
                s.copy_(pool[b], non_blocking=nb)

        staging = torch.empty(n, *shape, device=dev, dtype=dtype)

        def h2d_batched():
            staging.copy_(contig, non_blocking=nb)
            scatter_pages(pool, block_ids, staging)

        def d2h_batched():
            contig.copy_(gather_pages(pool, block_ids), non_blocking=nb)

        cases = {
            "h2d_page_by_page": h2d_pages,
            "d2h_page_by_page": d2h_pages,
            "h2d_batched": h2d_batched,
            "d2h_batched": d2h_batched,
            "scatter_only": lambda: scatter_pages(pool, block_ids, staging),
            "gather_only": lambda: gather_pages(pool, block_ids),
            "h2d_contiguous_registered": lambda: staging.copy_(contig, non_blocking=nb),
            "d2h_contiguous_registered": lambda: contig.copy_(staging, non_blocking=nb),
        }
        if cuda:
            pinned = torch.empty(n, *shape, dtype=dtype).pin_memory()
            cases["h2d_pinned_ceiling"] = lambda: staging.copy_(pinned, non_blocking=True)
            cases["d2h_pinned_ceiling"] = lambda: pinned.copy_(staging, non_blocking=True)
        for name, fn in cases.items():
            try:
                ms = wall(fn, dev, reps)
                entry = {"wall_ms": round(ms, 4), "gb_s": gbps(total, ms)}
                if cuda:
                    ev = timed(fn, dev, reps)
                    entry["gpu_ms"] = round(ev["best_ms"], 4)
                    entry["gpu_gb_s"] = gbps(total, ev["best_ms"])
                result[name] = entry
                log(f"pages {name}: {entry}")
            except Exception as exc:  # noqa: BLE001
                result[name] = {"error": repr(exc)[:500]}
                log(f"pages {name}: {exc!r}")
        # page-by-page without cudaHostRegister: what the connector does when registering fails
        if cuda and arena.registered:
            try:
                err = arena.unregister()
                if err:
                    raise RuntimeError(err)
                nb = False
                for name, fn in (("h2d_page_by_page_unregistered", h2d_pages),
                                 ("d2h_page_by_page_unregistered", d2h_pages)):  # fmt: skip
                    ms = wall(fn, dev, reps)
                    result[name] = {"wall_ms": round(ms, 4), "gb_s": gbps(total, ms)}
                    log(f"pages {name}: {result[name]}")
                err = arena.register()
                nb = arena.registered
                if err:
                    result["reregister"] = err
            except Exception as exc:  # noqa: BLE001
                result["unregistered_error"] = repr(exc)[:500]
        try:
            result["overlap"] = overlap(args, pool, h2d_pages, d2h_pages, h2d_batched, d2h_batched)
        except Exception as exc:  # noqa: BLE001
            result["overlap"] = {"error": repr(exc)[:500], "trace": traceback.format_exc()[-1500:]}
    finally:
        arena.unregister()
        free(dev)


def overlap(args, pool, h2d_pages, d2h_pages, h2d_batched, d2h_batched) -> dict:
    """bf16 matmuls on the default stream vs page copies on a side stream: alone and together
    (wall clock, everything issued first, then one synchronize)."""
    dev = args.device
    if dev != "cuda":
        return {"skipped": "needs CUDA (streams)"}
    size = 8192 if not args.quick else 1024
    a = torch.randn(size, size, device="cuda").to(torch.bfloat16)
    b = torch.randn(size, size, device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    reps = 5 if not args.quick else 2
    out: dict = {"matmul_size": size}
    one_mm = timed(lambda: a @ b, "cuda", 5)["best_ms"]
    out["matmul_ms"] = round(one_mm, 4)
    out["matmul_tflops"] = round(2 * size**3 / (one_mm / 1e3) / 1e12, 1)
    for label, copies in (("page_by_page", (h2d_pages, d2h_pages)),
                          ("batched", (h2d_batched, d2h_batched))):  # fmt: skip

        def copy_all(copies=copies):
            with torch.cuda.stream(side):
                for fn in copies:
                    fn()

        copy_ms = wall(copy_all, "cuda", reps)
        k = max(1, min(400, round(copy_ms / max(one_mm, 1e-3))))

        def compute(k=k):
            for _ in range(k):
                a @ b

        def both(k=k, copy_all=copy_all):
            compute(k)  # enqueue the matmuls first (async), then the copies on the side stream
            copy_all()

        compute_ms = wall(compute, "cuda", reps)
        both_ms = wall(both, "cuda", reps)
        hidden = compute_ms + copy_ms - both_ms
        out[label] = {
            "matmuls": k,
            "compute_ms": round(compute_ms, 3),
            "copies_ms": round(copy_ms, 3),
            "together_ms": round(both_ms, 3),
            "overlap": round(hidden / min(compute_ms, copy_ms), 3),
        }
        log(f"overlap {label}: {out[label]}")
    return out


# ---- driver -----------------------------------------------------------------------------------
def environment(device: str) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": device,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        env["triton"] = f"unavailable: {exc!r}"
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = p.name
        env["gpu_memory_gib"] = round(p.total_memory / (1 << 30), 1)
        env["sm_count"] = p.multi_processor_count
    return env


def print_table(res: dict) -> None:
    c = res["sections"].get("copy", {})
    if c:
        print("copy GB/s:")
        for k in ("d2d", "d2d_clone", "h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
            v = c.get(k)
            if isinstance(v, dict):
                print(f"  {k:<16}{v.get('gb_s', v.get('error'))}")
        if "error" in c:
            print(f"  error: {c['error']}")
    a = res["sections"].get("attention", {})
    if a:
        print("attention (decode, bf16, default launch): batch x context")
        print(f"  {'case':<16}{'ms':>10}{'GB/s':>10}{'of copy':>9}{'cold GB/s':>11}"
              f"{'graph':>8}{'cold':>7}  best config")  # fmt: skip
        for r in a.get("rows", []):
            d = r.get("default", {})
            frac = d.get("warm_frac_of_copy")
            print(
                f"  {r['batch']:>4} x {r['context']:<9}{d.get('warm_ms', '-')!s:>10}"
                f"{d.get('warm_gb_s', '-')!s:>10}{frac if frac is not None else '-'!s:>9}"
                f"{d.get('cold_gb_s', '-')!s:>11}{d.get('graph_frac_of_copy', '-')!s:>8}"
                f"{d.get('graph_cold_frac_of_copy', '-')!s:>7}  {r.get('best_config')}"
                + (f"  ERROR {r['error'] or d.get('error')}" if "error" in r else "")
            )
        if "error" in a:
            print(f"  error: {a['error']}")
    p = res["sections"].get("pages", {})
    if p:
        print(f"pages ({p.get('pages')} x {p.get('page_bytes')} B):")
        for k, v in p.items():
            if isinstance(v, dict) and ("gb_s" in v or "error" in v):
                gpu_s = f"  {v['gpu_gb_s']} GB/s gpu" if "gpu_gb_s" in v else ""
                print(f"  {k:<32}{v.get('gb_s', v.get('error'))!s:>10} GB/s wall{gpu_s}")
        ov = p.get("overlap", {})
        for k in ("page_by_page", "batched"):
            if isinstance(ov.get(k), dict):
                print(f"  overlap {k}: {ov[k]}")
        if ov.get("error") or ov.get("skipped"):
            print(f"  overlap: {ov.get('error') or ov.get('skipped')}")
        if "error" in p:
            print(f"  error: {p['error']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the code paths")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {SECTIONS}")
    torch.manual_seed(0)
    res: dict = {"bench": "gpu", "quick": args.quick, "sections": {}}
    try:
        res["env"] = environment(args.device)
    except Exception as exc:  # noqa: BLE001
        res["env"] = {"error": repr(exc)}
    log(f"env: {res['env']}")

    def save() -> None:
        if args.json:
            try:
                args.json.write_text(json.dumps(res, indent=1, default=str) + "\n")
            except Exception as exc:  # noqa: BLE001
                log(f"could not write {args.json}: {exc!r}")

    for name in wanted:
        section: dict = {}
        res["sections"][name] = section
        section["status"] = "running"  # left in the file if the process dies in the section
        save()
        log(f"section {name} ...")
        t0 = time.perf_counter()
        try:
            if name == "copy":
                section_copy(args, section)
            elif name == "attention":
                d2d = res["sections"].get("copy", {}).get("d2d", {})
                section_attention(args, section, d2d.get("gb_s") if isinstance(d2d, dict) else None)
            elif name == "pages":
                section_pages(args, section)
        except Exception as exc:  # noqa: BLE001
            section["error"] = repr(exc)[:1000]
            section["trace"] = traceback.format_exc()[-3000:]
            log(f"section {name} failed: {exc!r}")
        section["status"] = "error" if "error" in section else "done"
        section["seconds"] = round(time.perf_counter() - t0, 2)
        free(args.device)
        save()
    print(json.dumps(res, default=str))
    try:
        print_table(res)
    except Exception as exc:  # noqa: BLE001
        log(f"table failed: {exc!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
