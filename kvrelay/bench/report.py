"""`kvrelay bench` output: tables for people (rich) and JSON for programs (results.json)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvrelay.bench.request import RequestRecord
from kvrelay.bench.stats import Dist, Summary
from kvrelay.bench.sweep import BenchConfig, BenchResult


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _dist(d: Dist) -> str:
    return "-" if d.count == 0 else f"{_num(d.p50)} / {_num(d.p90)} / {_num(d.p99)}"


def _point(cfg: BenchConfig, s: Summary) -> str:
    return f"{s.point:g}"


def _throughput_table(cfg: BenchConfig, result: BenchResult) -> Table:
    t = Table(title=f"kvrelay bench: {cfg.dataset}, {cfg.mode} sweep, throughput")
    for col in ("server", cfg.mode, "requests", "errors", "seconds", "req/s", "output tok/s"):
        t.add_column(col, justify="left" if col == "server" else "right")
    slo = cfg.slo.active
    cached = any(s.cached_ratio is not None for s in result.summaries)
    if slo:
        t.add_column("goodput req/s (good/all)", justify="right")
    if cached:
        t.add_column("cached prompt %", justify="right")
    for s in result.summaries:
        row = [
            s.server,
            _point(cfg, s),
            str(s.num_requests),
            str(s.num_errors),
            _num(s.duration_s, 2),
            _num(s.request_throughput, 2),
            _num(s.output_throughput),
        ]
        if slo:
            row.append(f"{_num(s.goodput, 2)} ({s.num_good}/{s.num_requests})")
        if cached:
            row.append("-" if s.cached_ratio is None else f"{100 * s.cached_ratio:.1f}")
        t.add_row(*row)
    return t


def _latency_table(cfg: BenchConfig, result: BenchResult) -> Table:
    t = Table(title="latency, ms: p50 / p90 / p99")
    for col in ("server", cfg.mode, "TTFT", "TPOT", "ITL", "E2E"):
        t.add_column(col, justify="left" if col == "server" else "right")
    for s in result.summaries:
        t.add_row(
            s.server,
            _point(cfg, s),
            _dist(s.ttft_ms),
            _dist(s.tpot_ms),
            _dist(s.itl_ms),
            _dist(s.e2e_ms),
        )
    return t


def _turn_table(cfg: BenchConfig, result: BenchResult) -> Table:
    t = Table(title="by turn (doc-qa: by ask of a document): TTFT ms p50 / p90, cached prompt %")
    for col in ("server", cfg.mode, "turn", "requests", "prompt tokens", "TTFT", "cached %"):
        t.add_column(col, justify="left" if col == "server" else "right")
    for s in result.summaries:
        for turn in s.by_turn:
            ratio = turn.cached_ratio
            t.add_row(
                s.server,
                _point(cfg, s),
                str(turn.turn),
                str(turn.num_ok),
                f"{turn.prompt_tokens:,}",
                "-"
                if turn.ttft_ms.count == 0
                else f"{_num(turn.ttft_ms.p50)} / {_num(turn.ttft_ms.p90)}",
                "-" if ratio is None else f"{100 * ratio:.1f}",
            )
    return t


def _compare_table(cfg: BenchConfig, result: BenchResult) -> Table:
    a, b = cfg.targets[0].url, cfg.targets[1].url
    t = Table(title=f"B / A: B = {b}, A = {a} (throughput > 1: B faster; latency > 1: B slower)")
    cols = ("output tok/s", "req/s", "TTFT p50", "ITL p50", "TPOT p50", "E2E p50")
    keys = (
        "output_throughput_ratio",
        "request_throughput_ratio",
        "ttft_p50_ratio",
        "itl_p50_ratio",
        "tpot_p50_ratio",
        "e2e_p50_ratio",
    )
    t.add_column(cfg.mode, justify="right")
    for col in cols:
        t.add_column(col, justify="right")
    for c in result.comparisons:
        t.add_row(f"{c['point']:g}", *(_num(c[k], 3) for k in keys))
    return t


def print_tables(cfg: BenchConfig, result: BenchResult, console: Console) -> None:
    """The human report: throughput, latency, B/A ratios and the first errors."""
    console.print(_throughput_table(cfg, result))
    console.print(_latency_table(cfg, result))
    if any(s.by_turn for s in result.summaries):
        console.print(_turn_table(cfg, result))
    if result.comparisons:
        console.print(_compare_table(cfg, result))
    console.print(
        "TTFT: to the first token; TPOT: per output token after the first, per "
        "request; ITL: gaps between streamed tokens; E2E: whole request."
    )
    for s in result.summaries:
        if s.num_errors:
            head = f"{s.server} {cfg.mode} {s.point:g}: {s.num_errors} of {s.num_requests} failed"
            console.print(head + "; first errors:", markup=False, highlight=False, soft_wrap=True)
            for err in s.errors:
                console.print(f"  {err}", markup=False, highlight=False, soft_wrap=True)


def record_dict(rec: RequestRecord) -> dict:
    """One request as results.json stores it (seconds, rounded to microseconds)."""
    d = asdict(rec)
    for k in ("start_s", "scheduled_s", "ttft_s", "e2e_s"):
        if d[k] is not None:
            d[k] = round(d[k], 6)
    d["itl_s"] = [round(g, 6) for g in rec.itl_s]
    tpot = rec.tpot_s
    d["tpot_s"] = None if tpot is None else round(tpot, 6)
    return d


def results_dict(cfg: BenchConfig, result: BenchResult, with_requests: bool) -> dict:
    """The JSON results: config, summaries, comparisons (B/A) and, optionally, every request."""
    out = {
        "config": cfg.to_dict(),
        "summaries": [s.to_dict() for s in result.summaries],
        "comparisons": result.comparisons,
        "num_errors": result.num_errors,
    }
    if with_requests:
        out["requests"] = [record_dict(r) for r in result.records]
    return out


def write_results(path: Path, cfg: BenchConfig, result: BenchResult) -> None:
    """results.json with every request."""
    path.write_text(json.dumps(results_dict(cfg, result, True), indent=1) + "\n")
