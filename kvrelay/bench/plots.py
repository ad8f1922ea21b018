"""PNG plots of a bench run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from kvrelay.bench.request import RequestRecord
from kvrelay.bench.stats import TurnSummary
from kvrelay.bench.sweep import BenchConfig, BenchResult


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    xs = sorted(values_ms)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def latency_cdfs(path: Path, cfg: BenchConfig, result: BenchResult) -> None:
    """TTFT, ITL and E2E CDFs, one line per (server, sweep point)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    groups: dict[tuple[str, float], list[RequestRecord]] = {}
    for rec in result.records:
        if rec.ok:
            groups.setdefault((rec.server, rec.point), []).append(rec)
    metrics = (
        ("TTFT (ms)", lambda rs: [r.ttft_s * 1e3 for r in rs if r.ttft_s is not None]),
        ("ITL: gap between tokens (ms)", lambda rs: [g * 1e3 for r in rs for g in r.itl_s]),
        ("E2E latency (ms)", lambda rs: [r.e2e_s * 1e3 for r in rs if r.e2e_s is not None]),
    )
    for ax, (title, values) in zip(axes, metrics, strict=True):
        for (server, point), recs in sorted(groups.items()):
            _cdf(ax, values(recs), f"{server} {cfg.mode}={point:g}")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if "ITL" not in title else "fraction of gaps")
    finish(plt, fig, axes, f"kvrelay bench: {cfg.dataset}, latency CDFs", path)


def finish(plt, fig, axes, title: str, path: Path) -> None:
    """Grid and legend on each axis, the title, then write the PNG and free the figure."""
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep_plot(path: Path, cfg: BenchConfig, result: BenchResult) -> None:
    """Output tok/s and TTFT/ITL p50 against concurrency or request rate, one line per server."""
    plt = pyplot()
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(12, 4.5))
    for target in cfg.targets:
        rows = [s for s in result.summaries if s.server == target.label]
        xs = [s.point for s in rows]
        ax_t.plot(xs, [s.output_throughput for s in rows], marker="o", label=target.label)
        for name, attr in (("TTFT p50", "ttft_ms"), ("ITL p50", "itl_ms")):
            ys = [getattr(s, attr).p50 for s in rows]
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if pts:
                ax_l.plot(*zip(*pts, strict=True), marker="o", label=f"{target.label} {name}")
    ax_t.set_ylabel("output tokens/s")
    ax_l.set_ylabel("latency (ms)")
    if ax_l.has_data():
        ax_l.set_yscale("log")
    for ax in (ax_t, ax_l):
        ax.set_xlabel("concurrency" if cfg.mode == "concurrency" else "request rate (req/s)")
        if max(cfg.points) >= 8 * min(cfg.points):  # 1,8,32: equal room for each point
            ax.set_xscale("log", base=2)
    finish(plt, fig, (ax_t, ax_l), f"kvrelay bench: {cfg.dataset}, {cfg.mode} sweep", path)


def plot_by_turn(
    ax_ttft, ax_cached, label: str, turns: list[TurnSummary], percentiles: tuple[str, ...]
) -> None:
    """One line per TTFT percentile (`p50`, `p90`) on `ax_ttft` and one of the cached prompt %
    on `ax_cached` (where the server reported it), against the turn."""
    xs = [t.turn for t in turns]
    for name in percentiles:
        pts = [(x, getattr(t.ttft_ms, name)) for x, t in zip(xs, turns, strict=True)]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax_ttft.plot(*zip(*pts, strict=True), marker="o", label=f"{label} TTFT {name}")
    cached = [(x, 100 * t.cached_ratio) for x, t in zip(xs, turns, strict=True)
              if t.cached_ratio is not None]  # fmt: skip
    if cached:
        ax_cached.plot(*zip(*cached, strict=True), marker="o", label=label)
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_cached.set_ylabel("cached prompt tokens (%)")
    for ax in (ax_ttft, ax_cached):
        ax.xaxis.get_major_locator().set_params(integer=True)  # turns are whole numbers


def turns_plot(path: Path, cfg: BenchConfig, result: BenchResult) -> None:
    """TTFT p50/p90 and cached prompt % against the turn, one line per (server, point)."""
    plt = pyplot()
    fig, (ax_l, ax_c) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in result.summaries:
        if s.by_turn:
            label = f"{s.server} {cfg.mode}={s.point:g}"
            plot_by_turn(ax_l, ax_c, label, s.by_turn, ("p50", "p90"))
    for ax in (ax_l, ax_c):
        ax.set_xlabel("turn" if cfg.dataset != "doc-qa" else "ask of a document")
    finish(plt, fig, (ax_l, ax_c), f"kvrelay bench: {cfg.dataset}, by turn", path)


def write_plots(out_dir: Path, cfg: BenchConfig, result: BenchResult) -> list[Path]:
    """latency_cdf.png always; sweep.png when there is more than one point; turns.png when
    requests have turns (multi-turn, doc-qa). Returns the paths."""
    paths = [out_dir / "latency_cdf.png"]
    latency_cdfs(paths[0], cfg, result)
    if len(cfg.points) > 1:
        paths.append(out_dir / "sweep.png")
        sweep_plot(paths[-1], cfg, result)
    if any(s.by_turn for s in result.summaries):
        paths.append(out_dir / "turns.png")
        turns_plot(paths[-1], cfg, result)
    return paths
