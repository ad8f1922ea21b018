"""Sampled against greedy decoding through one running stack, in one run.

Each stack (`kvrelay up` with speculation off, then with its default speculation) serves the
same 128-token chats greedy (temperature 0) and sampled (temperature 0.7, top_p 0.9), the two
alternating round by round so the host's drift falls on both; every answer is `max_tokens`
long (ignore_eos), so both do the same work. Reports output tokens/s, TPOT and sampled/greedy
ratios at each concurrency.

    python benchmarks/sampling.py [--concurrency 1,8] [--rounds 2] [--write-docs]
    python benchmarks/sampling.py --url http://127.0.0.1:8000   # a stack already running
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import KvrelayServer, machine_line, write_section  # noqa: E402

from kvrelay.bench.datasets import builtin  # noqa: E402
from kvrelay.bench.request import RequestOptions, Target  # noqa: E402
from kvrelay.bench.runner import Load, run_load  # noqa: E402
from kvrelay.bench.stats import Slo, summarize  # noqa: E402

MODES = {"greedy": (0.0, None), "sampled": (0.7, 0.9)}


def measure(url: str, model: str, concurrency: int, requests: int, max_tokens: int, mode: str):
    """(output tokens/s, TPOT p50 ms, errors) of one closed-loop run."""
    temperature, top_p = MODES[mode]
    opts = RequestOptions("chat", max_tokens, True, temperature, top_p)
    target = Target(mode, url, model)
    load = Load(concurrency=concurrency, num_requests=requests)
    res = asyncio.run(run_load(target, builtin("short", seed=concurrency), load, opts, 0,
                               lambda _rec: None))  # fmt: skip
    s = summarize(res.records, res.duration_s, Slo(), server=mode, url=url,
                  mode="concurrency", point=concurrency, rounds=1)  # fmt: skip
    return s.output_throughput, s.tpot_ms.p50, s.num_errors


def run_stack(url: str, args) -> list[dict]:
    rows = []
    for mode in MODES:  # warm-up, not counted: a new stack's first steps are slow
        measure(url, args.model, max(args.concurrency), max(args.concurrency), 16, mode)
    for c in args.concurrency:
        n = max(args.requests_per_stream * c, 4)
        tok_s: dict[str, list[float]] = {m: [] for m in MODES}
        tpot: dict[str, list[float]] = {m: [] for m in MODES}
        errors = 0
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                t, p, e = measure(url, args.model, c, n, args.max_tokens, mode)
                tok_s[mode].append(t)
                tpot[mode].append(p or 0.0)
                errors += e
        g, s = statistics.mean(tok_s["greedy"]), statistics.mean(tok_s["sampled"])
        rows.append({
            "concurrency": c, "requests": n, "rounds": args.rounds, "errors": errors,
            "greedy_tok_s": round(g, 1), "sampled_tok_s": round(s, 1),
            "ratio": round(s / g, 3) if g else None,
            "greedy_tpot_ms": round(statistics.mean(tpot["greedy"]), 1),
            "sampled_tpot_ms": round(statistics.mean(tpot["sampled"]), 1),
            "greedy_rounds": [round(x, 1) for x in tok_s["greedy"]],
            "sampled_rounds": [round(x, 1) for x in tok_s["sampled"]],
        })  # fmt: skip
    return rows


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| speculation | streams | greedy tok/s | sampled tok/s | sampled/greedy | TPOT ms "
        "greedy / sampled | rounds (greedy; sampled) |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec, rows in results.items():
        for r in rows:
            lines.append(
                f"| {spec} | {r['concurrency']} | {r['greedy_tok_s']} | {r['sampled_tok_s']} | "
                f"{r['ratio']}x | {r['greedy_tpot_ms']} / {r['sampled_tpot_ms']} | "
                f"{r['greedy_rounds']}; {r['sampled_rounds']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="measure this running stack instead of starting stacks")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--requests-per-stream", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--speculation", default="off,auto", help="stacks to start (--url: ignored)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: dict[str, list[dict]] = {}
    if args.url:
        results["as running"] = run_stack(args.url.rstrip("/"), args)
    else:
        for spec in args.speculation.split(","):
            args.kvrelay_extra = ["--speculation", spec]
            server = KvrelayServer(args, slots=max(args.concurrency), ctx_per_slot=512)
            server.start()
            try:
                results[spec] = run_stack(server.url, args)
            finally:
                server.stop()
    print(json.dumps({"started": started, "machine": machine_line(), "results": results}))
    text = table(results)
    print(text)
    if args.write_docs:
        command = "python benchmarks/sampling.py " + " ".join(argv or sys.argv[1:])
        write_section(
            "sampling",
            f"Started {started}; {machine_line()}: `{command.strip()}`.\n\n{text}\n",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
