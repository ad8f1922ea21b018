"""A model through kvrelay against transformers on the same weights: perplexity and greedy tokens.

Both read the same weights in fp32 (kvrelay dequantizes a GGUF at load; transformers reads the
fp32 safetensors `prepare_hf_checkpoint` writes from it once). The text (benchmarks/data, as
quality.py) is tokenized whole; non-overlapping chunks of `--ctx` tokens each run from an
empty cache, and the second half of each chunk is scored (llama-perplexity's rule, as
quality.py). With a ctx past a model's sliding window (Gemma 3: 512) the local layers' windows
decide the score.

    python benchmarks/model_parity.py --model /path/gemma-3-270m-q4_k_m.gguf --ctx 1024
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.quality import TEXT, perplexity  # noqa: E402
from kvrelay.workers.model.loader import load_model, prepare_hf_checkpoint  # noqa: E402


@torch.inference_mode()
def transformers_perplexity(directory: Path, token_ids: list[int], ctx: int) -> float:
    """The same score from transformers' own model class on the converted checkpoint."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    hf.eval()
    first = ctx // 2
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - ctx + 1, ctx):
        chunk = torch.tensor(token_ids[start : start + ctx], dtype=torch.long)
        logits = hf(chunk[None]).logits[0, first : ctx - 1]
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        nll -= float(logprobs.gather(1, chunk[first + 1 :, None]).sum())
        count += ctx - 1 - first
    return math.exp(nll / count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model name or path (default: SmolLM2)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=4, help="chunks scored (0: the whole text)")
    ap.add_argument("--quantization", default="none")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    loaded = load_model(args.model, dtype="float32", device="cpu", progress=True,
                        quantization=args.quantization)  # fmt: skip
    ids = loaded.tokenizer.encode(TEXT.read_text())
    if args.chunks:
        ids = ids[: args.chunks * args.ctx]
    start = time.monotonic()
    ours, scored = perplexity(loaded, ids, args.ctx)
    ours_s = time.monotonic() - start
    start = time.monotonic()
    ref = transformers_perplexity(prepare_hf_checkpoint(args.model), ids, args.ctx)
    ref_s = time.monotonic() - start
    result = {
        "model": loaded.name,
        "model_type": loaded.config.model_type,
        "quantization": args.quantization,
        "ctx": args.ctx,
        "scored_tokens": scored,
        "kvrelay_ppl": round(ours, 4),
        "transformers_ppl": round(ref, 4),
        "relative_difference": round(ours / ref - 1, 6),
        "kvrelay_s": round(ours_s, 1),
        "transformers_s": round(ref_s, 1),
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
