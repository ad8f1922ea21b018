"""A whole `kvrelay bench`: every sweep point, every round, each server in turn (A, B, A, B...).

Servers alternate so that load drift on the machine hits both; at each point and round both
get the same requests (same prompts, same Poisson arrival times), built from a seed derived
from (seed, point, round), so rounds differ from each other and hit no cache of a previous
round.
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvrelay.bench.datasets import Shape
from kvrelay.bench.datasets import load as load_dataset
from kvrelay.bench.request import RequestOptions, RequestRecord, Target
from kvrelay.bench.runner import Load, run_load
from kvrelay.bench.stats import Slo, Summary, compare, summarize


@dataclass(slots=True)
class BenchConfig:
    """Everything a bench run needs, as parsed from the command line."""

    targets: list[Target]
    dataset: str
    mode: str  # concurrency | rate
    points: list[float]
    num_requests: int | None
    duration_s: float | None
    seed: int = 0
    rounds: int = 1
    opts: RequestOptions = field(default_factory=RequestOptions)
    slo: Slo = field(default_factory=Slo)
    timeout_s: float = 600.0
    progress: bool = False
    shape: Shape = field(default_factory=Shape)

    def to_dict(self) -> dict:
        return {
            "servers": {t.label: {"url": t.url, "model": t.model} for t in self.targets},
            "dataset": self.dataset,
            "mode": self.mode,
            "points": self.points,
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "seed": self.seed,
            "rounds": self.rounds,
            "endpoint": self.opts.endpoint,
            "max_tokens": self.opts.max_tokens,
            "ignore_eos": self.opts.ignore_eos,
            "temperature": self.opts.temperature,
            "top_p": self.opts.top_p,
            "slo": {"ttft_ms": self.slo.ttft_ms, "itl_ms": self.slo.itl_ms},
            "turns": self.shape.turns,
            "think_s": list(self.shape.think_s),
            "documents": self.shape.documents,
        }


@dataclass(slots=True)
class BenchResult:
    """Summaries per (server, point), B/A comparisons per point, and every request."""

    summaries: list[Summary]
    comparisons: list[dict]
    records: list[RequestRecord]

    @property
    def num_errors(self) -> int:
        return sum(s.num_errors for s in self.summaries)


def derived_seed(seed: int, point_index: int, round_: int) -> int:
    """The seed of one (point, round): the prompts and arrival times A and B both get."""
    return random.Random(f"{seed}:{point_index}:{round_}").randrange(2**31)


def _load(cfg: BenchConfig, point: float, seed: int) -> Load:
    if cfg.mode == "concurrency":
        return Load(
            concurrency=int(point),
            num_requests=cfg.num_requests,
            duration_s=cfg.duration_s,
            seed=seed,
        )
    return Load(rate=point, num_requests=cfg.num_requests, duration_s=cfg.duration_s, seed=seed)


async def _run_all(cfg: BenchConfig, progress: Progress | None) -> BenchResult:
    summaries: list[Summary] = []
    comparisons: list[dict] = []
    records: list[RequestRecord] = []
    for pi, point in enumerate(cfg.points):
        runs: dict[str, tuple[list[RequestRecord], float]] = {
            t.label: ([], 0.0) for t in cfg.targets
        }
        for round_ in range(cfg.rounds):
            seed = derived_seed(cfg.seed, pi, round_)
            dataset = load_dataset(cfg.dataset, seed, cfg.shape)
            for target in cfg.targets:
                label = f"{target.label} {cfg.mode} {point:g} round {round_ + 1}/{cfg.rounds}"
                task = progress.add_task(label, total=cfg.num_requests) if progress else None

                def done(_rec: RequestRecord, task=task) -> None:
                    if progress is not None and task is not None:
                        progress.advance(task)

                result = await run_load(
                    target, dataset, _load(cfg, point, seed), cfg.opts, round_, done, cfg.timeout_s
                )
                if progress is not None and task is not None:
                    progress.update(task, visible=False)
                prev, wall = runs[target.label]
                runs[target.label] = (prev + result.records, wall + result.duration_s)
        by_label: dict[str, Summary] = {}
        for target in cfg.targets:
            recs, wall = runs[target.label]
            records += recs
            by_label[target.label] = summarize(
                recs,
                wall,
                cfg.slo,
                server=target.label,
                url=target.url,
                mode=cfg.mode,
                point=point,
                rounds=cfg.rounds,
            )
            summaries.append(by_label[target.label])
        if "B" in by_label:
            comparisons.append(compare(by_label["A"], by_label["B"]))
    return BenchResult(summaries, comparisons, records)


def run_bench(cfg: BenchConfig) -> BenchResult:
    """Run every point and round; a progress bar on stderr when `cfg.progress`."""
    if not cfg.progress:
        return asyncio.run(_run_all(cfg, None))
    console = Console(file=sys.stderr)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        return asyncio.run(_run_all(cfg, progress))
