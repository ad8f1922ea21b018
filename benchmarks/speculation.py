"""Speculative decoding in process: decode tokens/s with and without drafts, and a row's cost.

`--rows` times one decode step of B sequences (600-token contexts) with 1..16 rows per sequence
and prints the fitted cost of a row relative to the step's fixed cost (the speculator's
`row_cost`, engine/speculator.py). The default run serves the prompts of a `kvrelay bench`
dataset one at a time (one stream) to an engine with `--speculation off` and one with
`ngram` (or the given modes) and prints decode tokens/s (first token excluded), steps, drafted
and accepted tokens, and whether the outputs are identical (they must be).

    python benchmarks/speculation.py --dataset grounded --requests 6 --max-tokens 128
    python benchmarks/speculation.py --dataset short --requests 6
    python benchmarks/speculation.py --rows --batches 1,8,32
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def engine(args: argparse.Namespace, **kw):
    from kvrelay.workers.engine.llm_engine import Engine, EngineConfig

    return Engine(
        EngineConfig(
            model=args.model,
            quantization=args.quantization,
            num_threads=args.threads,
            kv_cache_dtype=args.kv_cache_dtype,
            **kw,
        )
    )


def prompts(eng, dataset: str, n: int, seed: int) -> list[list[int]]:
    from kvrelay.bench.datasets import load

    data = load(dataset, seed)
    return [eng.tokenizer.apply_chat_template(data.session(i).messages) for i in range(n)]


def serve_one_stream(eng, prompt_list: list[list[int]], max_tokens: int) -> dict:
    """Each prompt alone, greedy: decode seconds after the first token, tokens, outputs."""
    from kvrelay.core.sampling import SamplingParams

    p = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    decode_s, tokens, outs = 0.0, 0, []
    s0 = eng.stats.num_steps
    for i, prompt in enumerate(prompt_list):
        eng.add_request(f"r{i}", prompt, p)
        got: list[int] = []
        first = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                got.extend(out.new_token_ids)
                if first is None:
                    first = time.perf_counter()
        decode_s += time.perf_counter() - first
        tokens += len(got) - 1
        outs.append(got)
    st = eng.stats
    return {
        "decode_tok_s": tokens / decode_s,
        "tokens": tokens,
        "steps": st.num_steps - s0,
        "drafted": st.num_draft_tokens,
        "accepted": st.num_accepted_tokens,
        "outputs": outs,
    }


def rows_cost(args: argparse.Namespace) -> list[dict]:
    """ms per decode step of B sequences with m rows each; fitted c / T0 per batch."""
    from kvrelay.core.sampling import SamplingParams
    from kvrelay.workers.engine.scheduler import ScheduledSeq

    eng = engine(args, speculation="off")
    g = torch.Generator().manual_seed(0)
    results = []
    for b in [int(x) for x in args.batches.split(",")]:
        for i in range(b):
            ids = torch.randint(100, eng.vocab_size - 100, (600,), generator=g).tolist()
            eng.add_request(f"b{b}-{i}", ids, SamplingParams(max_tokens=1000, ignore_eos=True))
        while any(not s.is_decoding for s in eng._seqs.values()):
            eng.step()
        seqs = list(eng._seqs.values())
        times = {}
        for m in (1, 2, 3, 4, 6, 8, 12, 16):
            sched = []
            for s in seqs:
                assert eng.kv.allocate_slots(s, m)
                sched.append(ScheduledSeq(s, m, [s.token_ids[-1]] * (m - 1)))
            ts = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                eng.runner.run(sched)
                ts.append(time.perf_counter() - t)
            times[m] = sorted(ts)[len(ts) // 2] * 1e3
        # least squares T(rows) = T0 + c * rows over all m
        xs = [b * m for m in times]
        ys = list(times.values())
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        t0 = my - c * mx
        results.append({"batch": b, "ms": times, "t0_ms": t0, "c_ms": c, "row_cost": c / t0})
        for s in seqs:
            eng.abort_request(s.request_id)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="int8-weight-only")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dataset", default="grounded")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="off,ngram", help="speculation modes, first = baseline")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--spec-row-cost", type=float, default=None)
    p.add_argument("--prompt-lookup-min", type=int, default=None)
    p.add_argument("--prompt-lookup-max", type=int, default=None)
    p.add_argument("--rows", action="store_true", help="time rows per step instead")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.rows:
        res = rows_cost(args)
        for r in res:
            ms = "  ".join(f"{m}:{t:.1f}" for m, t in r["ms"].items())
            print(f"B={r['batch']:>3}  rows/seq->ms {ms}  T0 {r['t0_ms']:.2f} ms  "
                  f"c {r['c_ms']:.3f} ms  c/T0 {r['row_cost']:.4f}")  # fmt: skip
    else:
        res, base = [], None
        for mode in args.modes.split(","):
            kw = {"speculation": mode}
            for name in ("num_speculative_tokens", "spec_row_cost", "prompt_lookup_min",
                         "prompt_lookup_max"):  # fmt: skip
                if getattr(args, name) is not None:
                    kw[name] = getattr(args, name)
            eng = engine(args, **kw)
            r = serve_one_stream(eng, prompts(eng, args.dataset, args.requests, args.seed),
                                 args.max_tokens)  # fmt: skip
            base = base or {**r}
            same = r["outputs"] == base["outputs"]
            print(f"{mode:>6}: {r['decode_tok_s']:7.1f} decode tok/s ({r['decode_tok_s'] / base['decode_tok_s']:.2f}x)  "  # noqa: E501
                  f"{r['tokens']} tokens in {r['steps']} steps, drafted {r['drafted']} "
                  f"accepted {r['accepted']}  identical: {same}")  # fmt: skip
            r.pop("outputs")
            res.append({"mode": mode, **r, "identical": same})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
