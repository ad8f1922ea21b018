"""`kvrelay bench`: load any OpenAI-compatible server (kvrelay, vLLM, llama.cpp) and report TTFT,
inter-token latency, throughput and goodput, optionally against a second server.

Exit status: 0 when every request succeeded, 1 when any failed or a server is unreachable (the
summary is still printed and written), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

from kvrelay.cli.errors import EXIT_FAILURE, CommandError

logger = logging.getLogger(__name__)

DATASET_HELP = (
    "short | shared-prefix (a common ~1,500-token system prompt) | long (~2,000-token prompts) "
    "| long-context (4,000-token prompts, each its own document; --concurrency 8,32 by default) "
    "| multi-turn (conversations of --turns turns after a shared ~1,500-token system prompt, "
    "--think-time between turns) | doc-qa (--documents 3,000-token documents, each asked "
    "again after the others) | grounded (summarize, rewrite or edit a passage or "
    "Python file given in the prompt: answers copy the input, as n-gram speculation needs) "
    '| FILE.jsonl with one {"messages": [...]} or '
    '{"prompt": "..."} per line, optional "max_tokens" (default short)'
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (A)")
    p.add_argument(
        "--compare",
        metavar="URL",
        default=None,
        help="a second server (B) run alternately with the same requests; reports B/A ratios",
    )
    p.add_argument("--model", default=None, help="model name (default: A's first /v1/models id)")
    p.add_argument("--compare-model", default=None, help="B's model (default: B's first id)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),  # the OpenAI clients' variable, not ours
        help="bearer token (default $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions (default) or /v1/completions",
    )
    p.add_argument("--dataset", default="short", help=DATASET_HELP)
    p.add_argument(
        "--turns",
        type=int,
        default=None,
        help="multi-turn: requests per conversation (default 4)",
    )
    p.add_argument(
        "--think-time",
        default=None,
        metavar="S|LOW,HIGH",
        help="multi-turn: seconds before each follow-up, fixed or uniform in LOW..HIGH, seeded "
        "(default 0)",
    )
    p.add_argument(
        "--documents",
        type=int,
        default=None,
        help="doc-qa: documents asked about in turn (default 8)",
    )
    p.add_argument(
        "--concurrency",
        default=None,
        metavar="N[,N...]",
        help="closed loop: requests in flight, or a sweep like 1,8,32 "
        "(default 8; long-context: 8,32)",
    )
    p.add_argument(
        "--request-rate",
        default=None,
        metavar="R[,R...]",
        help="open loop: Poisson arrivals per second (or inf), or a sweep 1,2,4",
    )
    p.add_argument(
        "--num-requests", type=int, default=None, help="requests per point and round (default 64)"
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds per point and round instead of a request count",
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds per point (A, B, A, B...; 1)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (128)")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos and min_tokens so every answer is max-tokens long",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0)")
    p.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling mass (the server's default)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (0)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput bound on TTFT")
    p.add_argument(
        "--slo-itl-ms",
        type=float,
        default=None,
        help="goodput bound on a request's mean inter-token latency (TPOT)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout (600)")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write results.json (every request) and PNG plots here",
    )
    p.add_argument("--json", action="store_true", help="print JSON results instead of tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _points(text: str, flag: str, kind: type) -> list[float]:
    points: list[float] = []
    for part in text.split(","):
        try:
            value = float(part) if kind is float else int(part)
        except ValueError:
            raise CommandError(f"{flag}: {part.strip()!r} is not a number", 2) from None
        if not value > 0 or (kind is int and math.isinf(value)):
            raise CommandError(f"{flag} must be > 0, got {part.strip()}", 2)
        points.append(float(value))
    return points


def _check(args: argparse.Namespace) -> None:
    checks = [
        (args.num_requests, "--num-requests", True),
        (args.duration, "--duration", False),
        (args.rounds, "--rounds", True),
        (args.max_tokens, "--max-tokens", True),
        (args.slo_ttft_ms, "--slo-ttft-ms", False),
        (args.slo_itl_ms, "--slo-itl-ms", False),
        (args.timeout_s, "--timeout-s", False),
    ]
    for value, flag, whole in checks:
        if value is not None and not (value >= 1 if whole else value > 0):
            raise CommandError(f"{flag} must be {'>= 1' if whole else '> 0'}, got {value:g}", 2)
    if args.concurrency is not None and args.request_rate is not None:
        raise CommandError(
            "give --concurrency (closed loop) or --request-rate (open loop), not both", 2
        )
    if args.num_requests is not None and args.duration is not None:
        raise CommandError("give --num-requests or --duration, not both", 2)
    if args.duration is not None and "inf" in (args.request_rate or "").lower():
        raise CommandError("--request-rate inf sends everything at once: give --num-requests", 2)
    if args.temperature < 0:
        raise CommandError(f"--temperature must be >= 0, got {args.temperature:g}", 2)
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise CommandError(f"--top-p must be in (0, 1], got {args.top_p:g}", 2)
    if args.compare_model and not args.compare:
        raise CommandError("--compare-model needs --compare URL", 2)
    for value, flag, dataset in (
        (args.turns, "--turns", "multi-turn"),
        (args.think_time, "--think-time", "multi-turn"),
        (args.documents, "--documents", "doc-qa"),
    ):
        if value is not None and args.dataset != dataset:
            raise CommandError(f"{flag} shapes --dataset {dataset} only", 2)


def _shape(args: argparse.Namespace):
    """The conversation shape the flags give (`kvrelay.bench.datasets.Shape`)."""
    from kvrelay.bench.datasets import DatasetError, Shape, parse_think_time

    think = (0.0, 0.0)
    if args.think_time is not None:
        try:
            think = parse_think_time(args.think_time)
        except DatasetError as exc:
            raise CommandError(f"--think-time: {exc}", 2) from None
    defaults = Shape()
    try:
        return Shape(
            turns=defaults.turns if args.turns is None else args.turns,
            think_s=think,
            documents=defaults.documents if args.documents is None else args.documents,
        )
    except DatasetError as exc:
        raise CommandError(f"--dataset {args.dataset}: {exc}", 2) from None


def base_url(url: str) -> str:
    """`url` without a trailing slash or /v1, so paths can be appended."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def resolve_model(url: str, model: str | None, api_key: str | None) -> str:
    """`model`, or the first id the server lists; a server that cannot be reached fails here."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url + "/v1/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise CommandError(
            f"cannot reach the server at {url} ({type(exc).__name__}: {exc}); is it running?", 1
        ) from None
    if model:
        return model
    try:
        ids = [m["id"] for m in resp.json()["data"]] if resp.status_code == 200 else []
    except (ValueError, KeyError, TypeError):
        ids = []
    if not ids:
        raise CommandError(
            f"{url}/v1/models gave no model (HTTP {resp.status_code}); give --model", 1
        )
    return str(ids[0])


def _config(args: argparse.Namespace):
    from kvrelay.bench.datasets import DatasetError, default_concurrency
    from kvrelay.bench.datasets import load as load_dataset
    from kvrelay.bench.request import RequestOptions, Target
    from kvrelay.bench.stats import Slo
    from kvrelay.bench.sweep import BenchConfig

    _check(args)
    if args.request_rate is not None:
        mode, points = "rate", _points(args.request_rate, "--request-rate", float)
    else:
        concurrency = args.concurrency or default_concurrency(args.dataset)
        mode, points = "concurrency", _points(concurrency, "--concurrency", int)
    shape = _shape(args)
    try:
        load_dataset(args.dataset, args.seed, shape)  # fail on a bad file before touching a server
    except DatasetError as exc:
        raise CommandError(f"--dataset: {exc}", 2) from None
    urls = [base_url(args.url)] + ([base_url(args.compare)] if args.compare else [])
    models = [args.model, args.compare_model]
    targets = [
        Target(label, url, resolve_model(url, model, args.api_key), args.api_key)
        for label, url, model in zip("AB", urls, models, strict=False)
    ]
    num_requests = None if args.duration else (args.num_requests or 64)
    opts = RequestOptions(
        args.endpoint, args.max_tokens, args.ignore_eos, args.temperature, args.top_p
    )
    progress = not args.no_progress and sys.stderr.isatty()
    return BenchConfig(
        targets,
        args.dataset,
        mode,
        points,
        num_requests,
        args.duration,
        args.seed,
        args.rounds,
        opts,
        Slo(args.slo_ttft_ms, args.slo_itl_ms),
        args.timeout_s,
        progress,
        shape,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print tables (or JSON), write --out; 1 when any request failed."""
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CommandError(f"--out: cannot create {out_dir}: {exc.strerror}", 2) from None
    cfg = _config(args)

    from rich.console import Console

    from kvrelay.bench.report import print_tables, results_dict, write_results
    from kvrelay.bench.sweep import run_bench

    result = run_bench(cfg)
    if args.json:
        print(json.dumps(results_dict(cfg, result, with_requests=False), indent=1))
    else:
        width = None if sys.stdout.isatty() else 160
        print_tables(cfg, result, Console(width=width, soft_wrap=False))
    if out_dir is not None:
        from kvrelay.bench.plots import write_plots

        write_results(out_dir / "results.json", cfg, result)
        paths = write_plots(out_dir, cfg, result)
        names = ", ".join(p.name for p in paths)
        print(f"kvrelay bench: wrote {out_dir}/results.json, {names}", file=sys.stderr)
    if result.num_errors:
        raise CommandError(
            f"{result.num_errors} of {len(result.records)} requests failed", EXIT_FAILURE
        )
    return 0
