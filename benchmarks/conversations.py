"""peers.py's conversation workloads, multi-turn chats and doc-qa re-asks, reported by turn.

A level runs `kvrelay bench`'s session runner (kvrelay.bench.runner) against one server, on its
datasets (kvrelay.bench.datasets): `multi-turn` is --users conversations at once, each --turns
turns after the shared ~1,500-token system prompt with a seeded --think-time before every
follow-up, which carries that server's own previous answer; `doc-qa` asks about --documents
3,000-token documents in turn, --turns times each, min(--users, --documents) asks at once and in
order, so each re-ask is sent after every other document was asked. Every server of a round gets
the same conversations. Every request names its conversation in `prompt_cache_key` (kvrelay
keeps the session's pages; vLLM and llama-server ignore the field); a cold column also gives each
request a `cache_salt` of its own, so no page of an earlier turn (or of the shared system prompt)
matches.

Per column: TTFT p50/p90 and the prompt tokens served from cache by turn (the final usage
chunk's `prompt_tokens_details.cached_tokens`: kvrelay's, vLLM's with
--enable-prompt-tokens-details, llama-server's slot cache), the follow-ups' TTFT p90 (turns >= 2)
and output tok/s over the run; each kvrelay column against the best peer column on each, and
each cold column against its warm twin turn by turn. Turns count from 1 here (doc-qa: the n-th
ask of a document).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from benchmarks.common import div
from kvrelay.bench.datasets import DOC_QA_TOKENS, DatasetError, Shape, builtin, parse_think_time
from kvrelay.bench.request import RequestOptions, RequestRecord, Target
from kvrelay.bench.runner import Load, RunResult, run_load
from kvrelay.bench.stats import Dist, TurnSummary, by_turn, dist_ms

CONVERSATIONS = ("multi-turn", "doc-qa")
# Prompt tokens of a multi-turn conversation's first request (SmolLM2: 1,538 with the chat
# template) and what each follow-up adds besides the answer (SmolLM2: 22), with room for other
# tokenizers; a doc-qa request holds one document and its question (SmolLM2: 3,043).
MULTI_TURN_PROMPT, FOLLOW_UP_PROMPT = 1700, 40
DOC_QA_PROMPT = DOC_QA_TOKENS + 64
REQUEST_TIMEOUT_S = 900  # peers.py's client and kvrelay's request deadline


def shape(turns: int, think_time: str, documents: int) -> Shape:
    """The conversations' shape from peers.py's flags; SystemExit naming them when invalid."""
    try:
        return Shape(turns, parse_think_time(think_time), documents)
    except DatasetError as exc:
        raise SystemExit(f"--turns/--think-time/--documents: {exc}") from None


def concurrency(workload: str, users: int, conv: Shape) -> int:
    """Requests in flight at once: every user (doc-qa: at most one per document)."""
    return users if workload == "multi-turn" else min(users, conv.documents)


def num_requests(workload: str, users: int, conv: Shape) -> int:
    """Requests of one level: every turn of every conversation (doc-qa: of every document)."""
    return (users if workload == "multi-turn" else conv.documents) * conv.turns


def prompt_tokens(workload: str, turns: int, tokens: int) -> int:
    """The longest prompt of a level: multi-turn's last turn holds every earlier answer."""
    if workload == "multi-turn":
        return MULTI_TURN_PROMPT + (turns - 1) * (tokens + FOLLOW_UP_PROMPT)
    return DOC_QA_PROMPT


def working_set_tokens(workload: str, users: int, conv: Shape, tokens: int) -> int:
    """Prompt tokens a cache holds to serve every turn warm: each conversation at its end
    (doc-qa: each document once)."""
    if workload == "multi-turn":
        return users * prompt_tokens(workload, conv.turns, tokens)
    return conv.documents * DOC_QA_PROMPT


async def run_conversations(
    target: Target,
    workload: str,
    users: int,
    conv: Shape,
    opts: RequestOptions,
    seed: int,
    round_: int,
) -> RunResult:
    """Every conversation of one level against `target`, `concurrency` of them at once; `seed`
    picks the conversations (the same for every server of a round)."""
    load = Load(
        concurrency=concurrency(workload, users, conv),
        num_requests=num_requests(workload, users, conv),
        seed=seed,
    )
    dataset = builtin(workload, seed, conv)
    return await run_load(
        target, dataset, load, opts, round_, lambda _rec: None, timeout_s=REQUEST_TIMEOUT_S
    )


def request_results(records: list[RequestRecord]) -> list[dict]:
    """The records as peers.py's per-request results (what its `summarize` reads)."""
    return [
        {"ttft": r.ttft_s, "latency": r.e2e_s, "tokens": r.output_tokens, "gaps": r.itl_s,
         "prompt_tokens": r.prompt_tokens, "error": r.error}
        for r in records
    ]  # fmt: skip


def turn_fields(records: list[RequestRecord]) -> dict:
    """A column's by-turn report of one level: `by_turn` (TurnSummary dicts, turns from 1),
    `followup_ttft_ms_p90` (turns >= 2) and `cached_reported` (whether the server returned
    prompt_tokens_details.cached_tokens at all)."""
    ok = [r for r in records if r.ok]
    follow_ups = [r.ttft_s for r in ok if r.turn > 0 and r.ttft_s is not None]
    return {
        "by_turn": [{**asdict(t), "turn": t.turn + 1} for t in by_turn(ok)],
        "followup_ttft_ms_p90": dist_ms(follow_ups).p90,
        "cached_reported": any(r.cached_tokens is not None for r in ok),
    }


def turn_summaries(row: dict) -> list[TurnSummary]:
    """A row's `by_turn` dicts as TurnSummary again (for kvrelay.bench.plots)."""
    return [TurnSummary(**{**t, "ttft_ms": Dist(**t["ttft_ms"])}) for t in row["by_turn"]]


def conversation_rows(rows: list[dict]) -> list[dict]:
    """The rows of conversation levels (those with a by-turn report)."""
    return [r for r in rows if "by_turn" in r]


def best_peer_ratios(rows: list[dict], kinds: dict[str, str]) -> list[dict]:
    """Each kvrelay column over the best peer column at each conversation level that has one:
    the follow-ups' TTFT p90 over the lowest peer's, output tok/s over the highest peer's.
    `kinds` maps each column to its server, in run order."""
    out = []
    conv = conversation_rows(rows)
    for workload, streams in dict.fromkeys((r["workload"], r["streams"]) for r in conv):
        at = {r["server"]: r for r in conv if (r["workload"], r["streams"]) == (workload, streams)}
        peers = [at[n] for n, k in kinds.items() if k != "kvrelay" and n in at]
        fast = min((p for p in peers if p["followup_ttft_ms_p90"] is not None),
                   key=lambda p: p["followup_ttft_ms_p90"], default=None)  # fmt: skip
        busy = max((p for p in peers if p["output_tok_s"] is not None),
                   key=lambda p: p["output_tok_s"], default=None)  # fmt: skip
        if fast is None and busy is None:
            continue
        for name in (n for n, k in kinds.items() if k == "kvrelay" and n in at):
            own = at[name]
            out.append({
                "server": name, "workload": workload, "streams": streams,
                "ttft_peer": fast and fast["server"],
                "ttft_p90": fast and div(own["followup_ttft_ms_p90"], fast["followup_ttft_ms_p90"]),
                "throughput_peer": busy and busy["server"],
                "throughput": busy and div(own["output_tok_s"], busy["output_tok_s"]),
            })  # fmt: skip
    return out


def cold_by_turn(rows: list[dict], twins: dict[str, str]) -> list[dict]:
    """Each cold column against its warm twin (`twins`: cold column -> warm column), turn by
    turn at each conversation level both ran: TTFT p90 warm, cold and warm / cold."""
    by = {(r["server"], r["workload"], r["streams"]): r for r in conversation_rows(rows)}
    out = []
    for (name, workload, streams), cold in by.items():
        warm = by.get((twins.get(name, ""), workload, streams))
        if warm is None:
            continue
        warm_turns = {t["turn"]: t for t in warm["by_turn"]}
        for t in cold["by_turn"]:
            if t["turn"] not in warm_turns:
                continue
            w, c = warm_turns[t["turn"]]["ttft_ms"]["p90"], t["ttft_ms"]["p90"]
            out.append({"server": warm["server"], "cold": name, "workload": workload,
                        "streams": streams, "turn": t["turn"], "warm_ttft_ms_p90": w,
                        "cold_ttft_ms_p90": c, "warm_cold": div(w, c)})  # fmt: skip
    return out


def _cell(x: float | str | None) -> str:
    return "-" if x is None else str(x)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio}x"


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}"


def turn_tables(res: dict) -> str:
    """Markdown: by turn per column, the follow-ups per column, kvrelay over the best peer
    and warm over cold; the columns that reported no cached tokens are named."""
    conv = conversation_rows(res["rows"])
    lines = [
        "| workload | users | server | turn | requests | prompt tokens | cached % "
        "| TTFT p50 (ms) | TTFT p90 (ms) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in conv:
        lines += [
            f"| {r['workload']} | {r['streams']} | {r['server']} | {t['turn']} | {t['num_ok']} "
            f"| {t['prompt_tokens']} | {_percent(t['cached_ratio'])} "
            f"| {_cell(t['ttft_ms']['p50'])} | {_cell(t['ttft_ms']['p90'])} |"
            for t in r["by_turn"]
        ]
    lines += [
        "",
        "| workload | users | server | output tok/s | TTFT p90, turns >= 2 (ms) |",
        "|---|---:|---|---:|---:|",
    ]
    lines += [
        f"| {r['workload']} | {r['streams']} | {r['server']} | {_cell(r['output_tok_s'])} "
        f"| {_cell(r['followup_ttft_ms_p90'])} |"
        for r in conv
    ]
    if res["turn_ratios"]:
        lines += [
            "",
            "| workload | users | ratio | TTFT p90, turns >= 2 | output tok/s |",
            "|---|---:|---|---:|---:|",
        ]
        lines += [
            f"| {q['workload']} | {q['streams']} | {q['server']} / best peer "
            f"| {_times(q['ttft_p90'])} ({_cell(q['ttft_peer'])}) "
            f"| {_times(q['throughput'])} ({_cell(q['throughput_peer'])}) |"
            for q in res["turn_ratios"]
        ]
    if res["cold_turns"]:
        lines += [
            "",
            "| workload | users | turn | warm | cold | TTFT p90 warm (ms) | TTFT p90 cold (ms) "
            "| warm / cold |",
            "|---|---:|---:|---|---|---:|---:|---:|",
        ]
        lines += [
            f"| {q['workload']} | {q['streams']} | {q['turn']} | {q['server']} | {q['cold']} "
            f"| {_cell(q['warm_ttft_ms_p90'])} | {_cell(q['cold_ttft_ms_p90'])} "
            f"| {_times(q['warm_cold'])} |"
            for q in res["cold_turns"]
        ]
    silent = sorted({r["server"] for r in conv if not r["cached_reported"]})
    unreported = f"; reported none (-): {', '.join(silent)}" if silent else ""
    lines += [
        "",
        "Cached %: prompt tokens served from cache (the final usage chunk's "
        f"prompt_tokens_details.cached_tokens){unreported}.",
    ]
    return "\n".join(lines)


def plot_turns(rows: list[dict], path: Path) -> None:
    """Per conversation level: TTFT p90 and cached prompt % by turn, one line per column."""
    from kvrelay.bench.plots import finish, plot_by_turn, pyplot

    conv = conversation_rows(rows)
    levels = list(dict.fromkeys((r["workload"], r["streams"]) for r in conv))
    plt = pyplot()
    fig, axes = plt.subplots(len(levels), 2, figsize=(12, 4.5 * len(levels)), squeeze=False)
    for (ax_ttft, ax_cached), (workload, streams) in zip(axes, levels, strict=True):
        for r in conv:
            if (r["workload"], r["streams"]) == (workload, streams):
                plot_by_turn(ax_ttft, ax_cached, r["server"], turn_summaries(r), ("p90",))
        for ax, what in ((ax_ttft, "TTFT p90"), (ax_cached, "cached prompt %")):
            ax.set_title(f"{workload}, {streams} users: {what}")
            ax.set_xlabel("turn" if workload == "multi-turn" else "ask of a document")
    path.parent.mkdir(parents=True, exist_ok=True)
    finish(plt, fig, axes.ravel(), "peers: conversations by turn", path)
