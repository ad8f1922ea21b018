"""Quality of the `--quantization` schemes vs fp32: perplexity on a held-out text, greedy agreement.

Perplexity follows llama.cpp's `llama-perplexity` (tools/perplexity/perplexity.cpp) so the
numbers compare: the text is tokenized whole (no BOS: the GGUF's add_bos_token is false), cut
into non-overlapping chunks of `--ctx` tokens (a partial last chunk is dropped), each chunk runs
from an empty cache, and only the second half is scored: the logits at positions ctx/2 .. ctx-2
predict tokens ctx/2+1 .. ctx-1 (ctx/2 - 1 tokens per chunk); PPL = exp(mean NLL).
When a `llama-perplexity` binary is found, llama.cpp's number for the bundled Q4_1 GGUF (the
source of our weights) is measured on the same text with `-c ctx -b ctx`.

Greedy agreement: 50 chat prompts, `--max-tokens` new tokens each at temperature 0 through the
engine; a prompt agrees when its sequence equals fp32's; "prefix" is the mean fraction of
tokens equal to fp32's up to the first difference.

    python benchmarks/quality.py [--ctx 512] [--max-tokens 64] [--llama-perplexity PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvrelay.core.modelref import resolve_model
from kvrelay.core.sampling import SamplingParams
from kvrelay.kernels import AttentionMetadata
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
from kvrelay.workers.model.loader import load_model

TEXT = Path(__file__).parent / "data" / "kjv_ruth_jonah_esther.txt"
LLAMA_PERPLEXITY = Path(
    "/work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-perplexity"
)
SUBJECTS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes",
    "how vaccines work", "the internet", "compound interest", "climate change", "honey bees",
    "the Roman Empire", "electric cars", "sleep", "the Moon landing", "recycling",
    "prime numbers", "earthquakes", "the human heart", "coffee", "the printing press",
    "rainbows", "machine learning", "chess", "the Great Wall of China", "tides",
]  # fmt: skip
TEMPLATES = ["Explain {} in simple terms.", "Write three short facts about {}."]


def prompts() -> list[str]:
    """The 50 fixed prompts: every subject in both templates."""
    return [t.format(s) for t in TEMPLATES for s in SUBJECTS]


@torch.inference_mode()
def perplexity(
    loaded, token_ids: list[int], ctx: int, kv_dtype: str | None = None, attention: str = "fp32"
) -> tuple[float, int]:
    """(PPL, scored tokens) with llama-perplexity's chunking (see the module docstring); K/V in
    `kv_dtype` pages (None: the model's dtype), attention dot products in `attention`."""
    model, page = loaded.model, 16
    dtype = getattr(torch, kv_dtype) if kv_dtype else None
    pool = model.allocate_kv_pool(-(-ctx // page), page, dtype)
    first = ctx // 2
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - ctx + 1, ctx):
        chunk = torch.tensor(token_ids[start : start + ctx], dtype=torch.long)
        pos = torch.arange(ctx, dtype=torch.long)
        meta = AttentionMetadata(
            slot_mapping=pos.clone(),
            block_tables=torch.arange(pool.shape[0], dtype=torch.int32)[None],
            context_lens=torch.tensor([ctx], dtype=torch.int32),
            query_start_loc=torch.tensor([0, ctx], dtype=torch.int32),
            max_query_len=ctx,
            max_context_len=ctx,
            precision=attention,
        )
        rows = torch.arange(first, ctx - 1)
        logits = model(chunk, pos, pool, meta, rows)
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        nll -= float(logprobs.gather(1, chunk[first + 1 :, None]).sum())
        count += int(rows.shape[0])
    return math.exp(nll / count), count


def greedy(
    loaded, quantization: str, max_tokens: int, kv_dtype: str | None, attention: str
) -> list[list[int]]:
    """Greedy outputs of the 50 prompts, batched by the engine (`kv_dtype` None: its auto)."""
    engine = Engine(EngineConfig(quantization=quantization, kv_cache_bytes=256 << 20,
                                 kv_cache_dtype=kv_dtype or "auto",
                                 attention_precision=attention), loaded=loaded)  # fmt: skip
    ids = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
           for p in prompts()]  # fmt: skip
    outs = engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [o.output_token_ids for o in outs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    """(sequences identical to ref, mean fraction of tokens equal up to the first difference)."""
    exact, fractions = 0, []
    for a, b in zip(ref, got, strict=True):
        exact += a == b
        same = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        fractions.append(same / max(len(a), 1))
    return exact, sum(fractions) / len(fractions)


def llama_cpp_perplexity(binary: Path, ctx: int, threads: int) -> float | None:
    """llama-perplexity's final estimate on TEXT with the bundled GGUF (None: no binary)."""
    if not binary.is_file():
        return None
    gguf = resolve_model(None).source
    cmd = [str(binary), "-m", str(gguf), "-f", str(TEXT), "-c", str(ctx), "-b", str(ctx),
           "-t", str(threads)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if match is None:
        print(f"llama-perplexity failed ({run.returncode}): {run.stderr[-500:]}", file=sys.stderr)
        return None
    return float(match.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-perplexity", type=Path, default=None,
                    help="llama.cpp binary (default: on PATH, else the peers' build)")  # fmt: skip
    ap.add_argument("--variants", default="",
                    help="comma-separated subset (fp32 always runs: the reference)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    binary = args.llama_perplexity or Path(shutil.which("llama-perplexity") or LLAMA_PERPLEXITY)
    # name -> (flag value, quantize the LM head, KV page dtype for the perplexity (None: the
    # model's; the greedy engine's auto), attention precision)
    variants: dict[str, tuple[str, bool, str | None, str]] = {
        "fp32": ("none", False, None, "fp32"),
        "int8": ("int8", True, None, "fp32"),
        "int8, fp32 lm_head": ("int8", False, None, "fp32"),
        "fp16": ("fp16", True, None, "fp32"),
        "int8-weight-only": ("int8-weight-only", True, None, "fp32"),
        "q8_0": ("q8_0", True, None, "fp32"),
        "bf16-kv": ("none", False, "bfloat16", "fp32"),
        "bf16-attention": ("none", False, "bfloat16", "bf16"),
        "q8_0+bf16-attention": ("q8_0", True, "bfloat16", "bf16"),
        "w8a16+bf16-attention": ("w8a16", True, "bfloat16", "bf16"),
    }
    if args.variants:
        wanted = ["fp32", *(v.strip() for v in args.variants.split(",") if v.strip() != "fp32")]
        unknown = [v for v in wanted if v not in variants]
        if unknown:
            ap.error(f"unknown variants {unknown}; choose from {list(variants)}")
        variants = {v: variants[v] for v in wanted}
    results, reference = [], None
    for name, (quantization, lm_head, kv_dtype, attention) in variants.items():
        loaded = load_model(progress=False, dtype="float32", device="cpu")
        if quantization != "none":
            loaded.model.quantize(quantization, lm_head=lm_head)
            loaded.quantization = quantization
        start = time.perf_counter()
        token_ids = loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
        ppl, scored = perplexity(loaded, token_ids, args.ctx, kv_dtype, attention)
        outputs = greedy(loaded, quantization, args.max_tokens, kv_dtype, attention)
        reference = reference or outputs
        exact, prefix = agreement(reference, outputs)
        results.append({"variant": name, "ppl": round(ppl, 4), "scored_tokens": scored,
                        "text_tokens": len(token_ids), "greedy_exact": exact,
                        "greedy_prompts": len(outputs), "greedy_prefix": round(prefix, 4),
                        "seconds": round(time.perf_counter() - start, 1)})  # fmt: skip
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        del loaded
    ref_ppl = llama_cpp_perplexity(binary, args.ctx, args.threads)
    if ref_ppl is not None:
        results.append({"variant": "llama.cpp Q4_1 GGUF", "ppl": ref_ppl})
    print(json.dumps({"benchmark": "quality", "text": TEXT.name, "ctx": args.ctx,
                      "max_tokens": args.max_tokens, "results": results}))  # fmt: skip
    print(f"\n{'variant':22} {'PPL':>8} {'greedy exact':>13} {'greedy prefix':>14}")
    for r in results:
        exact = f"{r['greedy_exact']}/{r['greedy_prompts']}" if "greedy_exact" in r else "-"
        prefix = f"{r['greedy_prefix']:.3f}" if "greedy_prefix" in r else "-"
        print(f"{r['variant']:22} {r['ppl']:8.3f} {exact:>13} {prefix:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
