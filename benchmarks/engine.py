"""Engine throughput vs transformers, same weights, same process (CPU fp32 or CUDA bf16).

Measures prefill tokens/s for single prompts of several lengths and aggregate decode tokens/s at
several batch sizes (greedy, eos ignored, equal-length random prompts so transformers needs no
padding). Prints one JSON line and a table; `--write-docs` updates docs/benchmarks.md.

`--decode-context N` times the engine's decode step instead, with every sequence of a batch
holding N tokens of context (ms/step and tok/s; transformers is left out: its batched prefill of
32 x 2,048 tokens alone would take minutes). The script only uses the engine's public API, so it
also measures an older tree: run it with PYTHONPATH at that tree, `--json` each run, and
`--compare OLD.json NEW.json` prints NEW/OLD.

`--device` (auto: cuda when available) picks the device. On CPU everything is as before: fp32,
transformers with its DynamicCache, batches 1 8 32, 32 new tokens. On CUDA the engine runs its
default CUDA dtype (bf16) and transformers loads the same directory in bf16 on the GPU; its
decode is timed with a DynamicCache and with a StaticCache (`--hf-cache`), `hf_tok_s` being the
better of the two (both are in the JSON); batches default to 1 32 256 with 64 new tokens.
`--hf-compile` also runs the StaticCache decode through torch.compile (reduce-overhead), as
transformers' generate does with a static cache (opt-in: compiling takes minutes).

    python benchmarks/engine.py                      # full run (several minutes on 2 cores)
    python benchmarks/engine.py --quick              # smoke run
    python benchmarks/engine.py --write-docs
    python benchmarks/engine.py --decode-context 2048 --batches 32 --prefill-lens 2048 --json a.json
    python benchmarks/engine.py --compare a.json b.json
    python benchmarks/engine.py --device cuda --json engine_cuda.json   # GPU: bf16, 1/32/256
    python benchmarks/engine.py --device cpu --quick --hf-cache both    # CPU smoke of both caches
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench:engine:begin -->", "<!-- bench:engine:end -->"
# --write-docs on CUDA updates its own section, leaving the CPU one alone
CUDA_BEGIN, CUDA_END = "<!-- bench:engine-cuda:begin -->", "<!-- bench:engine-cuda:end -->"


def random_prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def best_of(fn, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


# ---- kvrelay engine --------------------------------------------------------------------------
def engine_prefill(engine, prompt: list[int]) -> float:
    from kvrelay.core.sampling import SamplingParams

    engine.pool.reset_prefix_cache()
    t = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t


def engine_decode(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for the decode steps after every request has its first token (cold prefix
    cache)."""
    engine.pool.reset_prefix_cache()
    return engine_decode_steps(engine, prompts, new_tokens)[0]


def engine_decode_steps(
    engine, prompts: list[list[int]], new_tokens: int
) -> tuple[float, int, int]:
    """(seconds, steps, tokens) of the steps after every request has its first token.

    The prefix cache is kept: a repeat's prefill is then almost free, and the decode steps read
    the same context either way."""
    from kvrelay.core.sampling import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, sp)
    have_first: set[str] = set()
    while len(have_first) < len(prompts):
        have_first.update(o.request_id for o in engine.step())
    steps = tokens = 0
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    return time.perf_counter() - t, steps, tokens


def kv_cache_bytes(args: argparse.Namespace) -> int:
    """--kv-cache-mib, or (none given) room for the largest decode batch with its context."""
    if args.kv_cache_mib:
        return args.kv_cache_mib << 20
    from kvrelay.core.modelref import converted_dir, read_model_info, resolve_model

    info = read_model_info(converted_dir(resolve_model(args.model)))
    context = (args.decode_context or args.prompt_len) + args.decode_tokens + 16
    # CPU: fp32 as before; CUDA: the pool is bf16 (the model's dtype) unless told otherwise
    default_dtype = "bfloat16" if args.device == "cuda" else "float32"
    need = (
        max(args.batches) * context * info.kv_bytes_per_token(args.kv_cache_dtype or default_dtype)
    )
    return max(512 << 20, int(need * 1.1))


# ---- transformers ----------------------------------------------------------------------------
def sync(device) -> None:
    """Wait for the GPU before reading a timer (nothing on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def hf_prefill(model, prompt: list[int], device="cpu") -> float:
    from transformers import DynamicCache

    ids = torch.tensor([prompt], device=device)
    # CUDA: the last position's logits only, as generate() asks for; CPU: as it always was
    extra = {"logits_to_keep": 1} if torch.device(device).type == "cuda" else {}
    sync(device)
    t = time.perf_counter()
    out = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, **extra)
    out.logits[:, -1].argmax(-1)
    sync(device)
    return time.perf_counter() - t


@torch.inference_mode()
def hf_decode(model, prompts: list[list[int]], new_tokens: int, device="cpu") -> float:
    from transformers import DynamicCache

    ids = torch.tensor(prompts, device=device)
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    t = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    return time.perf_counter() - t


def make_static_cache(model, batch: int, max_len: int, device):
    """transformers' StaticCache for `batch` rows of up to `max_len` tokens: the 5.x signature
    (config, max_cache_len; allocated lazily), else the 4.x one (batch size, device, dtype)."""
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:
        return StaticCache(
            config=model.config,
            max_batch_size=batch,
            max_cache_len=max_len,
            device=device,
            dtype=model.dtype,
        )


class StaticDecoder:
    """Decode with a StaticCache: one cache per batch shape, reset between runs (its buffers
    keep their addresses, as torch.compile's CUDA graphs need); positions passed explicitly
    (and cache_position where this transformers' forward still takes it)."""

    def __init__(self, model, device, compile_forward: bool = False, max_new: int = 0):
        # caches hold prompt + max(new tokens, max_new): the warm-up's short run then uses the
        # timed runs' cache (and, compiled, its CUDA graphs)
        self.model, self.device, self.max_new = model, device, max_new
        self.caches: dict = {}
        self.takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.step_forward = model.forward
        if compile_forward:
            self.step_forward = torch.compile(model.forward, mode="reduce-overhead")

    def _positions(self, start: int, n: int) -> dict:
        pos = torch.arange(start, start + n, device=self.device)
        kw = {"position_ids": pos.unsqueeze(0)}
        if self.takes_cache_position:
            kw["cache_position"] = pos
        return kw

    @torch.inference_mode()
    def __call__(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts, device=self.device)
        batch, plen = ids.shape
        key = (batch, plen + max(new_tokens, self.max_new))
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = make_static_cache(self.model, batch, key[1], self.device)
        else:
            cache.reset()
        out = self.model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **self._positions(0, plen),
        )
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        steps = [self._positions(plen + i, 1) for i in range(new_tokens - 1)]
        sync(self.device)
        t = time.perf_counter()
        for kw in steps:
            out = self.step_forward(input_ids=nxt, past_key_values=cache, use_cache=True, **kw)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(self.device)
        return time.perf_counter() - t


def hf_decoders(args, hf, device) -> dict:
    """name -> fn(prompts, new_tokens) -> seconds, for the transformers decode variants."""
    out = {}
    if args.hf_cache in ("dynamic", "both"):
        out["dynamic"] = lambda p, n: hf_decode(hf, p, n, device)
    if args.hf_cache in ("static", "both"):
        out["static"] = StaticDecoder(hf, device, max_new=args.decode_tokens)
        if args.hf_compile:
            out["static_compiled"] = StaticDecoder(
                hf, device, compile_forward=True, max_new=args.decode_tokens
            )
    return out


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    load_at_start = os.getloadavg()[0]

    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    max_len = max(args.prefill_lens, default=0)
    context = args.decode_context or args.prompt_len
    extra = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}
    if args.attention_precision:
        extra["attention_precision"] = args.attention_precision
    if args.device == "cuda" or torch.cuda.is_available():
        extra["device"] = args.device  # auto would pick CUDA even for --device cpu
    if args.speculation:
        extra["speculation"] = args.speculation
    if args.no_cuda_graphs:
        extra["cuda_graphs"] = False
    try:
        config = EngineConfig(
            model=args.model, max_num_seqs=max(args.batches), num_threads=args.num_threads,
            max_num_batched_tokens=max(max_len, min(context * max(args.batches), 8192)),
            kv_cache_bytes=kv_cache_bytes(args), save_to_store=False,
            quantization=args.quantization, **extra,
        )  # fmt: skip
    except TypeError as exc:  # an older tree without kv_cache_dtype (or device)
        raise SystemExit(f"this kvrelay's EngineConfig rejects {sorted(extra)}: {exc}") from None
    engine = Engine(config)
    device = torch.device(args.device)
    # CPU: fp32 (the baseline, whatever the engine's quantization); CUDA: the engine's dtype
    hf_dtype = engine.loaded.dtype if device.type == "cuda" else torch.float32
    from kvrelay.workers.model.loader import prepare_hf_checkpoint

    hf_dir = prepare_hf_checkpoint(args.model, progress=False)  # a GGUF's fp32 safetensors
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=hf_dtype).to(device).eval()
    decoders = hf_decoders(args, hf, device)
    print(
        f"engine on {engine.loaded.device} ({engine.loaded.dtype}); transformers on {device} "
        f"({hf_dtype}, attn {getattr(hf.config, '_attn_implementation', '?')}), "
        f"decode caches {sorted(decoders)}",
        file=sys.stderr,
    )
    vocab = engine.vocab_size
    results: dict = {"prefill": [], "decode": []}
    for n in args.prefill_lens:
        prompt = random_prompt(n, n, vocab)
        engine_prefill(engine, prompt)  # warm-up
        e = n / best_of(lambda p=prompt: engine_prefill(engine, p), args.repeats)
        row = {"tokens": n, "kvrelay_tok_s": round(e, 1), "hf_tok_s": None, "ratio": None}
        try:
            hf_prefill(hf, prompt, device)
            h = n / best_of(lambda p=prompt: hf_prefill(hf, p, device), args.repeats)
            row.update(hf_tok_s=round(h, 1), ratio=round(e / h, 2))
        except Exception as exc:  # noqa: BLE001 - keep the engine's numbers
            row["hf_error"] = repr(exc)[:500]
        results["prefill"].append(row)
        print(f"prefill {n}: kvrelay {e:.1f} tok/s, transformers {row['hf_tok_s']} tok/s "
              f"{row.get('hf_error', '')}", file=sys.stderr)  # fmt: skip
    for b in args.batches if args.decode_context else ():
        prompts = [random_prompt(context, 1000 + b * 100 + i, vocab) for i in range(b)]
        engine_decode_steps(engine, prompts, 4)  # warm-up (and the prompts' pages cached)
        runs = [
            engine_decode_steps(engine, prompts, args.decode_tokens) for _ in range(args.repeats)
        ]
        secs, steps, tokens = min(runs)
        results["decode"].append(
            {
                "batch": b,
                "context": context,
                "steps": steps,
                "ms_per_step": round(secs / steps * 1000, 2),
                "kvrelay_tok_s": round(tokens / secs, 1),
                "hf_tok_s": None,
                "ratio": None,
            }
        )
        print(
            f"decode batch {b} at {context} tokens: {secs / steps * 1000:.2f} ms/step, "
            f"{tokens / secs:.1f} tok/s",
            file=sys.stderr,
        )
    for b in args.batches if not args.decode_context else ():
        prompts = [random_prompt(args.prompt_len, 1000 + b * 100 + i, vocab) for i in range(b)]
        steps = args.decode_tokens - 1
        engine_decode(engine, prompts, 4)  # warm-up
        e = (
            b
            * steps
            / best_of(lambda p=prompts: engine_decode(engine, p, args.decode_tokens), args.repeats)
        )
        row = {"batch": b, "kvrelay_tok_s": round(e, 1), "hf_tok_s": None, "ratio": None}
        per_cache = {}
        for name, dec in decoders.items():
            try:
                dec(prompts, 4)  # warm-up (and, compiled, the compile)
                h = b * steps / best_of(lambda p=prompts, d=dec: d(p, args.decode_tokens),
                                        args.repeats)  # fmt: skip
                per_cache[name] = round(h, 1)
            except Exception as exc:  # noqa: BLE001 - keep the other numbers
                row[f"hf_{name}_error"] = repr(exc)[:500]
                print(f"decode batch {b}: transformers {name} failed: {exc!r}", file=sys.stderr)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if per_cache:
            best = max(per_cache, key=per_cache.get)
            row.update(hf_tok_s=per_cache[best], ratio=round(e / per_cache[best], 2))
            if len(decoders) > 1 or device.type == "cuda":
                row["hf_cache"] = best
                row.update({f"hf_{k}_tok_s": v for k, v in per_cache.items()})
        results["decode"].append(row)
        print(f"decode batch {b}: kvrelay {e:.1f} tok/s, transformers {row['hf_tok_s']} tok/s "
              f"{per_cache}", file=sys.stderr)  # fmt: skip
    results["config"] = {
        "model": engine.model_name, "dtype": str(engine.loaded.dtype), "threads":
        torch.get_num_threads(), "prompt_len": args.prompt_len, "decode_tokens":
        args.decode_tokens, "repeats": args.repeats, "page_size": engine.config.page_size,
        "load_average_at_start": round(load_at_start, 2),
        "quantization": engine.config.quantization,
        "decode_context": args.decode_context, "kv_cache_dtype": args.kv_cache_dtype,
        "attention_precision": getattr(engine, "attention_precision", "fp32"),
        "kv_cache_bytes": engine.config.kv_cache_bytes,
        "speculation": str(getattr(engine, "speculation", "")),
        "cuda_graphs": getattr(engine.runner, "graphs", None) is not None,
    }  # fmt: skip
    if device.type == "cuda" or args.hf_cache != "dynamic":
        results["config"].update(
            device=str(engine.loaded.device), hf_device=str(device), hf_dtype=str(hf_dtype),
            hf_cache=sorted(decoders), hf_compile=args.hf_compile,
            hf_attn=getattr(hf.config, "_attn_implementation", None),
            gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        )  # fmt: skip

    return results


def table(res: dict) -> str:
    lines = ["| workload | kvrelay tok/s | transformers tok/s | ratio |", "|---|---:|---:|---:|"]
    for r in res["prefill"]:
        lines.append(f"| prefill {r['tokens']} tokens | {r['kvrelay_tok_s']} | {r['hf_tok_s']} "
                     f"| {r['ratio']}x |")  # fmt: skip
    for r in res["decode"]:
        if r.get("context"):
            lines.append(
                f"| decode batch {r['batch']} x {r['context']}-token context: "
                f"{r['ms_per_step']} ms/step | {r['kvrelay_tok_s']} | - | - |"
            )
            continue
        lines.append(f"| decode batch {r['batch']} (aggregate) | {r['kvrelay_tok_s']} | "
                     f"{r['hf_tok_s']} | {r['ratio']}x |")  # fmt: skip
    caches = [
        f"decode batch {r['batch']}: "
        + ", ".join(f"{k[3:-6]} {v}" for k, v in r.items() if k.endswith("_tok_s") and
                    k.startswith("hf_") and k != "hf_tok_s")
        for r in res["decode"] if r.get("hf_cache")
    ]  # fmt: skip
    if caches:
        lines += ["", "transformers tok/s by cache: " + "; ".join(caches)]
    return "\n".join(lines)


def row_key(kind: str, r: dict) -> str:
    if kind == "prefill":
        return f"prefill {r['tokens']} tokens"
    if r.get("context"):
        return f"decode batch {r['batch']} x {r['context']} context"
    return f"decode batch {r['batch']}"


def compare(old: dict, new: dict) -> list[dict]:
    """NEW/OLD for every row both runs have: tok/s ratio (and old/new ms per step)."""
    before = {row_key(k, r): r for k in ("prefill", "decode") for r in old.get(k, [])}
    out = []
    for kind in ("prefill", "decode"):
        for r in new.get(kind, []):
            o = before.get(row_key(kind, r))
            if o is None or not o["kvrelay_tok_s"]:
                continue
            row = {"row": row_key(kind, r), "old_tok_s": o["kvrelay_tok_s"],
                   "new_tok_s": r["kvrelay_tok_s"],
                   "speedup": round(r["kvrelay_tok_s"] / o["kvrelay_tok_s"], 2)}  # fmt: skip
            if o.get("ms_per_step") and r.get("ms_per_step"):
                row.update(old_ms_per_step=o["ms_per_step"], new_ms_per_step=r["ms_per_step"])
            out.append(row)
    return out


def compare_table(rows: list[dict]) -> str:
    lines = ["| row | old tok/s | new tok/s | new / old | old ms/step | new ms/step |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        ms = f"{r.get('old_ms_per_step', '-')} | {r.get('new_ms_per_step', '-')}"
        lines.append(
            f"| {r['row']} | {r['old_tok_s']} | {r['new_tok_s']} | {r['speedup']}x | {ms} |"
        )
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def write_docs(res: dict, command: str) -> None:
    c = res["config"]
    cuda = str(c.get("device", "cpu")).startswith("cuda")
    begin, end = (CUDA_BEGIN, CUDA_END) if cuda else (BEGIN, END)
    title = f"## Engine vs transformers (CUDA, {c['dtype']})" if cuda else (
        "## Engine vs transformers (CPU, fp32)")  # fmt: skip
    hf_note = (
        f"transformers runs the same weights on {c.get('gpu')} in the same process, with "
        "`DynamicCache` and `StaticCache`; its column is the better of the two. "
        if cuda else "transformers runs the same weights with its `DynamicCache` in the same "
        "process. "
    )  # fmt: skip
    section = "\n".join([
        begin, title, "",
        f"Command: `{command}`  ", f"Date: {datetime.date.today().isoformat()}  ",
        f"Machine: {machine()}, {c['threads']} torch threads; load average at start "
        f"{c['load_average_at_start']} (other jobs share the cores: rerun on a quiet machine)  ",
        f"Model: {c['model']} ({c['dtype']}); decode: "
        f"{c.get('decode_context') or c['prompt_len']}-token "
        f"{'contexts (engine only)' if c.get('decode_context') else 'prompts'}, "
        f"{c['decode_tokens']} new tokens, greedy; best of {c['repeats']}.", "",
        hf_note + "Decode "
        "throughput is aggregate (all sequences) and excludes the prefill step.", "",
        table(res), end,
    ])  # fmt: skip
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, text,
                      flags=re.S)  # fmt: skip
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    DOCS.write_text(text)
    print(f"updated {DOCS}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[128, 512, 2048],
                   help="prompt lengths of the prefill rows (none: no prefill rows)")  # fmt: skip
    p.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=None,
        help="decode batch sizes (default: 1 8 32 on CPU, 1 32 256 on CUDA)",
    )
    p.add_argument("--prompt-len", type=int, default=64, help="decode prompts' length")
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=None,
        help="new tokens per decode request (default: 32 on CPU, 64 on CUDA)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda when available",
    )
    p.add_argument(
        "--hf-cache",
        default=None,
        choices=["dynamic", "static", "both"],
        help="transformers' decode cache(s) (default: dynamic on CPU, both on CUDA)",
    )
    p.add_argument(
        "--hf-compile",
        action="store_true",
        help="also time the StaticCache decode under torch.compile (reduce-overhead)",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=None,
        help="the engine's KV pool (default: room for the largest decode batch, >= 512)",
    )
    p.add_argument(
        "--decode-context",
        type=int,
        default=None,
        metavar="N",
        help="time decode steps with N tokens of context per sequence (engine only)",
    )
    p.add_argument(
        "--speculation",
        default=None,
        help="EngineConfig.speculation (passed only when given; off: plain decoding)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="decode steps run eagerly on CUDA (EngineConfig.cuda_graphs False)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="EngineConfig.kv_cache_dtype (passed only when given)",
    )
    p.add_argument(
        "--attention-precision",
        default=None,
        help="EngineConfig.attention_precision (passed only when given)",
    )
    p.add_argument(
        "--json", type=Path, default=None, metavar="OUT", help="also write the results to this file"
    )
    p.add_argument("--compare", type=Path, nargs=2, default=None, metavar=("OLD", "NEW"),
                   help="print NEW/OLD of two --json files and exit")  # fmt: skip
    p.add_argument("--quantization", default="none",
                   choices=["none", "int8", "fp16", "int8-weight-only", "q8_0", "w8a16"],
                   help="the engine's weights (transformers stays fp32: the baseline)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script works")
    p.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.compare:
        old, new = (json.loads(f.read_text()) for f in args.compare)
        rows = compare(old, new)
        print(json.dumps({"benchmark": "engine-compare", "rows": rows}))
        print(compare_table(rows))
        return 0
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    cuda = args.device == "cuda"
    if args.batches is None:
        args.batches = [1, 32, 256] if cuda else [1, 8, 32]
    if args.decode_tokens is None:
        args.decode_tokens = 64 if cuda else 32
    if args.hf_cache is None:
        args.hf_cache = "both" if cuda else "dynamic"
    if args.quick:
        args.prefill_lens, args.batches, args.decode_tokens, args.repeats = [64], [1, 4], 6, 1
        if args.decode_context:
            args.decode_context = min(args.decode_context, 128)
    res = run(args)
    print(json.dumps({"benchmark": "engine", **res}))
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "engine", **res}, indent=1) + "\n")
    if args.write_docs:
        write_docs(res, "python benchmarks/engine.py " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
