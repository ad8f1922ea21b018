"""32 chat requests x 128 tokens as whole processes: `kvrelay generate` vs transformers.

Each side is one fresh process timed from start to exit (interpreter, imports, model load and
generation), as a user running a batch job sees it. Both read the same converted fp32 weights,
use the same threads, greedy, and produce exactly `--tokens` tokens per request (`ignore_eos`
for kvrelay, `min_new_tokens` for transformers, which pads the batch on the left and runs
`generate` with its default DynamicCache). Runs alternate; the best of `--repeats` counts.

    python benchmarks/whole_process.py [--requests 32 --tokens 128 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL = "smollm2-135m-instruct"
QUESTIONS = ["What is the capital of France?", "Explain photosynthesis briefly.",
             "Write a haiku about rain.", "How do magnets work?", "Name three primes.",
             "Why is the sky blue?", "Give me a pasta recipe.",
             "What is a black hole?"]  # fmt: skip

HF_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, n_tok, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
chats = [json.loads(line)["messages"] for line in open(sys.argv[4])]
tok = AutoTokenizer.from_pretrained(d)
tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
with torch.inference_mode():
    out = model.generate(**batch, max_new_tokens=n_tok, min_new_tokens=n_tok, do_sample=False,
                         pad_token_id=tok.pad_token_id)
print(json.dumps({"tokens": int((out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0])}))
"""


def batch_file(path: Path, requests: int, tokens: int) -> None:
    with path.open("w") as f:
        for i in range(requests):
            q = f"{QUESTIONS[i % len(QUESTIONS)]} (question {i})"
            line = {"id": f"r{i}", "messages": [{"role": "user", "content": q}],
                    "max_tokens": tokens, "temperature": 0, "ignore_eos": True}  # fmt: skip
            f.write(json.dumps(line) + "\n")


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quantization", default="none", choices=["none", "int8", "fp16"])
    args = p.parse_args(argv)
    from kvrelay.workers.model.loader import prepare_hf_checkpoint

    model_dir = str(prepare_hf_checkpoint(MODEL, progress=False))  # transformers': safetensors
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "batch.jsonl"
        batch_file(jsonl, args.requests, args.tokens)
        ours = [sys.executable, "-m", "kvrelay.cli.main", "generate", "--batch-file",
                str(jsonl), "--json", "--num-threads", str(args.threads),
                "--max-num-seqs", str(args.requests),
                "--quantization", args.quantization]  # fmt: skip
        hf = [sys.executable, "-c", HF_SCRIPT, model_dir, str(args.tokens), str(args.threads),
              str(jsonl)]  # fmt: skip
        times: dict[str, list[float]] = {"kvrelay": [], "transformers": []}
        for _ in range(args.repeats):
            times["kvrelay"].append(timed(ours, env))
            times["transformers"].append(timed(hf, env))
    total = args.requests * args.tokens
    best = {k: min(v) for k, v in times.items()}
    res = {
        "requests": args.requests, "tokens": args.tokens, "threads": args.threads,
        "quantization": args.quantization,
        "seconds": {k: [round(t, 2) for t in v] for k, v in times.items()},
        "tok_s": {k: round(total / t, 1) for k, t in best.items()},
        "ratio": round(best["transformers"] / best["kvrelay"], 2),
    }  # fmt: skip
    print(json.dumps(res))
    print("| process | best s | output tok/s |\n|---|---:|---:|")
    for k, t in best.items():
        print(f"| {k} | {t:.2f} | {total / t:.1f} |")
    print(f"kvrelay / transformers: {res['ratio']}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
