"""Summaries of benchmark runs: latency percentiles, throughput, goodput, cache hits, ratios."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvrelay.bench.request import RequestRecord

MAX_ERRORS_SHOWN = 3


@dataclass(slots=True)
class Slo:
    """A request is `good` when it succeeded within both bounds (None: no bound)."""

    ttft_ms: float | None = None
    itl_ms: float | None = None  # compared with the request's TPOT (mean inter-token latency)

    @property
    def active(self) -> bool:
        return self.ttft_ms is not None or self.itl_ms is not None

    def met(self, rec: RequestRecord) -> bool:
        if rec.error is not None:
            return False
        if self.ttft_ms is not None and (rec.ttft_s is None or rec.ttft_s * 1e3 > self.ttft_ms):
            return False
        tpot = rec.tpot_s
        return self.itl_ms is None or tpot is None or tpot * 1e3 <= self.itl_ms


@dataclass(slots=True)
class Dist:
    """Mean and percentiles of one latency, in milliseconds (None when nothing was measured)."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


@dataclass(slots=True)
class TurnSummary:
    """The requests of one turn of every conversation (multi-turn: the n-th request of each;
    doc-qa: the n-th ask of each document): what a session's pages buy its next turn."""

    turn: int
    num_ok: int
    prompt_tokens: int
    cached_tokens: int | None  # None: the server never reported prompt_tokens_details
    cached_ratio: float | None
    ttft_ms: Dist = field(default_factory=Dist)


@dataclass(slots=True)
class Summary:
    """One server at one sweep point, pooled over its rounds."""

    server: str
    url: str
    mode: str  # concurrency | rate
    point: float
    rounds: int
    num_requests: int
    num_ok: int
    num_errors: int
    duration_s: float
    request_throughput: float  # successful requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # prompt + output tokens per second
    goodput: float | None  # requests per second within the SLO (None without an SLO)
    num_good: int | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None  # None: the server never reported prompt_tokens_details
    cached_ratio: float | None
    ttft_ms: Dist = field(default_factory=Dist)
    tpot_ms: Dist = field(default_factory=Dist)
    itl_ms: Dist = field(default_factory=Dist)
    e2e_ms: Dist = field(default_factory=Dist)
    by_turn: list[TurnSummary] = field(default_factory=list)  # when requests have turns
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default does."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist_ms(seconds: Sequence[float]) -> Dist:
    """`seconds` summarized in milliseconds, rounded to 0.01 ms."""
    if not seconds:
        return Dist()
    ms = [s * 1e3 for s in seconds]

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 2)

    return Dist(
        len(ms),
        r(sum(ms) / len(ms)),
        r(percentile(ms, 50)),
        r(percentile(ms, 90)),
        r(percentile(ms, 99)),
    )


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slo: Slo,
    *,
    server: str,
    url: str,
    mode: str,
    point: float,
    rounds: int,
) -> Summary:
    """The summary of `records` that took `duration_s` of wall time in all."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached, cached_ratio = _cached(ok)
    num_good = sum(slo.met(r) for r in records) if slo.active else None
    errors: list[str] = []
    for r in records:
        if r.error is not None and r.error not in errors and len(errors) < MAX_ERRORS_SHOWN:
            errors.append(r.error)

    def rate(n: float) -> float:
        return round(n / duration_s, 3) if duration_s > 0 else 0.0

    return Summary(
        server=server,
        url=url,
        mode=mode,
        point=point,
        rounds=rounds,
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        duration_s=round(duration_s, 3),
        request_throughput=rate(len(ok)),
        output_throughput=rate(out_tokens),
        total_token_throughput=rate(out_tokens + prompt_tokens),
        goodput=None if num_good is None else rate(num_good),
        num_good=num_good,
        prompt_tokens=prompt_tokens,
        output_tokens=out_tokens,
        cached_tokens=cached,
        cached_ratio=cached_ratio,
        ttft_ms=dist_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=dist_ms([t for r in ok if (t := r.tpot_s) is not None]),
        itl_ms=dist_ms([g for r in ok for g in r.itl_s]),
        e2e_ms=dist_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        errors=errors,
        by_turn=by_turn(ok),
    )


def _cached(ok: list[RequestRecord]) -> tuple[int | None, float | None]:
    """Cached prompt tokens of `ok` and their share of the prompt tokens (of the requests
    whose server reported them); (None, None) when none did."""
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None, None
    cached = sum(r.cached_tokens or 0 for r in reported)
    return cached, round(cached / sum(r.prompt_tokens or 0 for r in reported), 4)


def by_turn(ok: list[RequestRecord]) -> list[TurnSummary]:
    """Per-turn summaries of the successful requests; empty when they all are turn 0."""
    turns = sorted({r.turn for r in ok})
    if turns in ([], [0]):
        return []
    out = []
    for turn in turns:
        recs = [r for r in ok if r.turn == turn]
        cached, ratio = _cached(recs)
        out.append(
            TurnSummary(
                turn=turn,
                num_ok=len(recs),
                prompt_tokens=sum(r.prompt_tokens or 0 for r in recs),
                cached_tokens=cached,
                cached_ratio=ratio,
                ttft_ms=dist_ms([r.ttft_s for r in recs if r.ttft_s is not None]),
            )
        )
    return out


def _ratio(b: float | None, a: float | None) -> float | None:
    return round(b / a, 3) if a and b is not None else None


def compare(a: Summary, b: Summary) -> dict:
    """B (--compare) over A (--url) at one point: >1 means B has more throughput / latency."""
    return {
        "point": a.point,
        "output_throughput_ratio": _ratio(b.output_throughput, a.output_throughput),
        "request_throughput_ratio": _ratio(b.request_throughput, a.request_throughput),
        "ttft_p50_ratio": _ratio(b.ttft_ms.p50, a.ttft_ms.p50),
        "itl_p50_ratio": _ratio(b.itl_ms.p50, a.itl_ms.p50),
        "tpot_p50_ratio": _ratio(b.tpot_ms.p50, a.tpot_ms.p50),
        "e2e_p50_ratio": _ratio(b.e2e_ms.p50, a.e2e_ms.p50),
    }
