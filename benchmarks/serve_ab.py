"""Two engine configurations serve the same requests in one process, their steps alternated.

This host's speed drifts by 5-20% between processes and within minutes, which hides changes of
that size when each configuration runs on its own. Here two `Engine`s (the same code, each
with its own `EngineConfig` overrides and, optionally, its own speculation cost model) get the
same requests of a `kvrelay bench` dataset, all at once, and step in turn (A, B, B, A, ...)
until both are done, so drifts fall on both; each one's time is the sum of its own steps. The
outputs must be identical whatever the two differ in (speculation never changes them): the
script says whether they are.

    python benchmarks/serve_ab.py --dataset long-context --streams 8 --a-step-cost row_cost=0.25
    python benchmarks/serve_ab.py --dataset short --streams 32 --a '{"speculation": "off"}'

`--a-kernels TREE` / `--b-kernels TREE` run that engine on the C++ kernels built from another
checkout (each build loads under its own module name; the engine's decoder and every op it
calls use its build while it steps), so two kernel builds compare at engine level:

    python benchmarks/serve_ab.py --dataset long-context --streams 8 --a-kernels /tmp/old-tree

Defaults: `kvrelay up`'s choices on an AMX host (w8a16 weights, bf16 K/V and attention, 2
threads), 128 new tokens per request (greedy, ignore_eos). `--a-step-cost` / `--b-step-cost`
replace that engine's `speculator.StepCost` (`row_cost=0.25` is the rule before 2026-12-01:
no context term, no free rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attention_ab import kernel_path, load  # noqa: E402

from kvrelay.bench.datasets import builtin  # noqa: E402
from kvrelay.core.sampling import SamplingParams  # noqa: E402
from kvrelay.kernels import cpu_build  # noqa: E402
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig  # noqa: E402
from kvrelay.workers.engine.speculator import StepCost  # noqa: E402


def make_engine(overrides: dict, kv_bytes: int) -> Engine:
    config = {"quantization": "w8a16", "attention_precision": "bf16", "kv_cache_dtype": "bf16",
              "kv_cache_bytes": kv_bytes, "save_to_store": False, "num_threads": 2}  # fmt: skip
    config.update(overrides)
    return Engine(EngineConfig(**config))


def step_cost(spec: str) -> StepCost:
    """`row_cost=0.25,free_rows=0` -> StepCost(...)."""
    fields = dict(item.split("=", 1) for item in spec.split(",") if item)
    return StepCost(
        row_cost=float(fields.get("row_cost", 0.25)),
        free_rows=int(fields.get("free_rows", 0)),
        fixed_bytes=float(fields.get("fixed_bytes", "inf")),
        kv_bytes_per_token=int(fields.get("kv_bytes_per_token", 0)),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="long-context")
    p.add_argument("--streams", type=int, default=8, help="requests, all submitted at once")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=4, help="the dataset's seed")
    p.add_argument("--a", default="{}", help="EngineConfig overrides of A (JSON)")
    p.add_argument("--b", default="{}", help="EngineConfig overrides of B (JSON)")
    p.add_argument("--a-step-cost", default=None, help="A's speculation cost, e.g. row_cost=0.25")
    p.add_argument("--b-step-cost", default=None, help="B's speculation cost")
    p.add_argument("--a-kernels", default=None, help="a checkout whose C++ kernels A runs on")
    p.add_argument("--b-kernels", default=None, help="a checkout whose C++ kernels B runs on")
    args = p.parse_args(argv)
    data = builtin(args.dataset, args.seed)
    kv_bytes = int(args.streams * (data_tokens(args.dataset) + args.max_tokens + 64) * 23040 * 1.2)
    kernels = {"a": kernels_of(args.a_kernels), "b": kernels_of(args.b_kernels)}
    engines = {}
    for key, overrides in (("a", args.a), ("b", args.b)):
        with kernels[key]():
            engines[key] = make_engine(json.loads(overrides), kv_bytes)
    for key, spec in (("a", args.a_step_cost), ("b", args.b_step_cost)):
        if spec is not None:
            speculator = engines[key].speculator
            if speculator is None:
                raise SystemExit(f"--{key}-step-cost: engine {key.upper()} does not speculate")
            speculator.cost = step_cost(spec)
    tokenizer = engines["a"].tokenizer
    prompts = [tokenizer.apply_chat_template(data.session(i).messages) for i in range(args.streams)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    busy = {"a": 0.0, "b": 0.0}
    steps = {"a": 0, "b": 0}
    tokens: dict[str, dict[str, list[int]]] = {"a": {}, "b": {}}
    for key, eng in engines.items():  # warm-up, then a cold prefix cache
        with kernels[key]():
            eng.generate([prompts[0][:256]], SamplingParams(max_tokens=4, ignore_eos=True))
        eng.pool.reset_prefix_cache()
        for i, prompt in enumerate(prompts):
            eng.add_request(f"r{i}", prompt, params)
    i = 0
    while any(eng.has_unfinished_requests() for eng in engines.values()):
        for key in ("a", "b") if i % 2 == 0 else ("b", "a"):
            eng = engines[key]
            if not eng.has_unfinished_requests():
                continue
            with kernels[key]():
                t = time.perf_counter()
                outs = eng.step()
                busy[key] += time.perf_counter() - t
            steps[key] += 1
            for out in outs:
                tokens[key].setdefault(out.request_id, []).extend(out.new_token_ids)
        i += 1
    total = sum(len(v) for v in tokens["a"].values())
    for key, eng in engines.items():
        st = eng.stats
        cost = eng.speculator.cost if eng.speculator else None
        print(
            f"{key.upper()}: {busy[key]:.2f} s, {total / busy[key]:.1f} tok/s, {steps[key]} "
            f"steps, drafted {st.num_draft_tokens}, accepted {st.num_accepted_tokens}; {cost}"
        )
    same = tokens["a"] == tokens["b"]
    print(f"B/A time {busy['b'] / busy['a']:.3f}; outputs identical: {same}")
    return 0 if same else 1


def kernels_of(tree: str | None) -> Callable[[], contextlib.AbstractContextManager]:
    """Contexts in which `cpu_build.load()` (so the engine built or stepping inside one, and
    every op it calls) is the build of `tree`'s C++ kernels; this process's own without one."""
    if tree is None:
        return contextlib.nullcontext
    isa = cpu_build.loaded_isa()
    if isa is None:
        raise SystemExit("--a-kernels / --b-kernels: this process runs without the C++ kernels")
    module = load(kernel_path(tree))  # the variant this host chooses, built from `tree`
    return lambda: cpu_build.use_module(module, isa)


def data_tokens(dataset: str) -> int:
    """Prompt tokens to size the K/V pools for (the longest built-in prompts)."""
    from kvrelay.bench.datasets import GROUNDED_MAX_TOKENS, LONG_CONTEXT_TOKENS

    return {"long-context": LONG_CONTEXT_TOKENS, "grounded": GROUNDED_MAX_TOKENS}.get(dataset, 2048)


if __name__ == "__main__":
    sys.exit(main())
