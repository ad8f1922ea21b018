"""Decode throughput with LoRA adapters vs the base model, in one engine, rounds alternated.

    python benchmarks/lora.py                        # 8 streams, 4 adapters, rank 8, 7 modules
    python benchmarks/lora.py --streams 8 --adapters 4 --rank 8 --max-lora-rank 16 --rounds 4

Each round runs `--streams` requests of the same prompts (greedy, ignore_eos) twice: all on
the base model, then spread over `--adapters` random adapters (request i on adapter i mod n),
base and LoRA rounds alternating so the host's drift falls on both. Prints the median
tokens/s of each and their ratio (target >= 0.8) as a JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from safetensors.torch import save_file

from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
from kvrelay.workers.model.lora import TARGETS

PROMPT = "Write a long story about a lighthouse keeper and the sea, in many short chapters."


def write_adapter(
    directory: Path, config, seed: int, rank: int, targets: tuple[str, ...] = tuple(TARGETS)
) -> Path:
    """A random PEFT-format adapter on the `targets` projections of `config`."""
    c = config
    shapes = {
        "q_proj": (c.q_size, c.hidden_size), "k_proj": (c.kv_size, c.hidden_size),
        "v_proj": (c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size),
        "gate_proj": (c.intermediate_size, c.hidden_size),
        "up_proj": (c.intermediate_size, c.hidden_size),
        "down_proj": (c.hidden_size, c.intermediate_size),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_layers):
        for module, (out, inp) in shapes.items():
            if module not in targets:
                continue
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
               "target_modules": sorted(targets)}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(adapter))
    return directory


def run_round(engine: Engine, prompt: list[int], loras: list[str], tokens: int, tag: str) -> float:
    """Generated tokens per second of one batch (the prompts' prefill included)."""
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, lora in enumerate(loras):
        engine.add_request(f"{tag}-{i}", prompt, sampling, lora=lora)
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return generated / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=None, help="default: --rank")
    p.add_argument("--targets", default=",".join(TARGETS), help="projections, comma-separated")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        probe = Engine(EngineConfig(num_blocks=16, num_threads=args.threads))
        names = [f"bench{k}" for k in range(args.adapters)]
        targets = tuple(t for t in args.targets.split(",") if t)
        modules = tuple(
            f"{name}={write_adapter(Path(tmp) / name, probe.loaded.config, k, args.rank, targets)}"
            for k, name in enumerate(names)
        )
        engine = Engine(
            EngineConfig(
                num_threads=args.threads,
                enable_prefix_caching=False,  # every round computes its prompts
                speculation="off",  # the same steps in both (drafts depend on the tokens)
                lora_modules=modules,
                max_loras=max(4, args.adapters),
                max_lora_rank=args.max_lora_rank or args.rank,
            ),
            loaded=probe.loaded,
        )
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
        base_loras = [""] * args.streams
        lora_loras = [names[i % len(names)] for i in range(args.streams)]
        run_round(engine, prompt, base_loras, 8, "warm-base")
        run_round(engine, prompt, lora_loras, 8, "warm-lora")
        base, lora = [], []
        for r in range(args.rounds):
            base.append(run_round(engine, prompt, base_loras, args.tokens, f"b{r}"))
            lora.append(run_round(engine, prompt, lora_loras, args.tokens, f"l{r}"))
    b, lo = statistics.median(base), statistics.median(lora)
    result = {
        "bench": "lora", "streams": args.streams, "adapters": args.adapters, "rank": args.rank,
        "max_lora_rank": args.max_lora_rank or args.rank, "targets": args.targets,
        "tokens": args.tokens, "rounds": args.rounds, "base_tok_s": round(b, 1),
        "lora_tok_s": round(lo, 1), "ratio": round(lo / b, 3),
    }  # fmt: skip
    print(json.dumps(result))
    print(f"{'':>8} {'tok/s (median)':>15} {'rounds':>30}")
    print(f"{'base':>8} {b:15.1f} {' '.join(f'{x:.1f}' for x in base):>30}")
    print(f"{'lora':>8} {lo:15.1f} {' '.join(f'{x:.1f}' for x in lora):>30}")
    print(f"ratio lora/base: {lo / b:.3f}")


if __name__ == "__main__":
    main()
