"""cProfile of the in-process engine's decode steps at one batch size (any device).

Where a step's wall time goes outside the model's kernels: the Python of the scheduler, input
preparation, sampler and detokenizer grows with the batch, the kernels' launches do not (a CUDA
graph replays them). Prints ms per step and the functions with the most own time.

    python benchmarks/step_profile.py --batch 256 --device cuda
    python benchmarks/step_profile.py --batch 32 --steps 8          # CPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)

    import torch

    from kvrelay.core.sampling import SamplingParams
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            max_num_seqs=args.batch,
            max_num_batched_tokens=max(2048, args.prompt_len),
            kv_cache_bytes=1 << 30,
            speculation="off",
            save_to_store=False,
        )
    )
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        prompt = torch.randint(100, engine.vocab_size - 100, (args.prompt_len,), generator=g)
        engine.add_request(f"p{i}", prompt.tolist(), params)
    while engine.stats.num_generated_tokens < args.batch:  # prefill: every request's first token
        engine.step()
    for _ in range(4):  # warm-up (graph capture)
        engine.step()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    ms = (time.perf_counter() - start) / args.steps * 1e3
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(
        f"decode batch {args.batch} on {engine.loaded.device}: {ms:.2f} ms/step "
        f"({args.batch / ms * 1e3:.0f} tok/s, profiled)"
    )
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
