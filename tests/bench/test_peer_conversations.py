"""benchmarks/peers.py's conversation workloads (benchmarks/conversations.py): their sizes, the
by-turn report of a column, kvrelay over the best peer, warm over cold, the tables, and a whole
run through peers.main with stand-in servers (no server started)."""

from __future__ import annotations

import json

import pytest

from benchmarks import conversations, peers
from benchmarks.common import SERVERS, cpu_flags
from kvrelay.bench.datasets import Shape
from kvrelay.bench.request import RequestRecord
from kvrelay.bench.runner import RunResult
from tests.bench.test_benchmark_scripts import ZEN_CPUINFO, print_config


def record(
    session: int,
    turn: int,
    ttft: float,
    prompt: int,
    cached: int | None,
    error: str | None = None,
    server: str = "kvrelay",
) -> RequestRecord:
    return RequestRecord(
        server,
        2.0,
        0,
        session,
        turn,
        ttft_s=ttft,
        e2e_s=ttft + 1.5,
        itl_s=[0.1] * 15,
        prompt_tokens=prompt,
        output_tokens=16,
        cached_tokens=cached,
        error=error,
    )


def test_sizes_follow_users_turns_and_documents():
    conv = Shape(turns=6, think_s=(30.0, 120.0), documents=8)
    assert conversations.shape(6, "30,120", 8) == conv
    assert [conversations.concurrency(w, 16, conv) for w in ("multi-turn", "doc-qa")] == [16, 8]
    assert conversations.concurrency("doc-qa", 4, conv) == 4
    assert [conversations.num_requests(w, 16, conv) for w in ("multi-turn", "doc-qa")] == [96, 48]
    # 1,700 + 5 follow-ups of a 128-token answer and 40 tokens of message; doc-qa: 3,000 + 64
    assert conversations.prompt_tokens("multi-turn", 6, 128) == 2540
    assert conversations.prompt_tokens("doc-qa", 6, 128) == 3064
    assert conversations.working_set_tokens("multi-turn", 16, conv, 128) == 16 * 2540
    assert conversations.working_set_tokens("doc-qa", 16, conv, 128) == 8 * 3064
    with pytest.raises(SystemExit, match=r"--turns/--think-time/--documents: '9,x' is not S"):
        conversations.shape(6, "9,x", 8)
    with pytest.raises(SystemExit, match="think 120-30 s"):
        conversations.shape(6, "120,30", 8)


def test_turn_fields_count_turns_from_one_and_pool_the_follow_ups():
    recs = [
        record(0, 0, 1.0, 1500, 0),
        record(1, 0, 2.0, 1500, 1488),
        record(0, 1, 0.2, 1600, 1584),
        record(1, 1, 0.4, 1600, 1584),
        record(1, 2, 9.0, 1700, 0, error="HTTP 500"),
    ]
    got = conversations.turn_fields(recs)
    rows = [
        (
            t["turn"],
            t["num_ok"],
            t["prompt_tokens"],
            t["cached_tokens"],
            t["cached_ratio"],
            t["ttft_ms"]["p50"],
            t["ttft_ms"]["p90"],
        )
        for t in got["by_turn"]
    ]
    assert rows == [
        (1, 2, 3000, 1488, 0.496, 1500.0, 1900.0),
        (2, 2, 3200, 3168, 0.99, 300.0, 380.0),
    ]
    assert (got["followup_ttft_ms_p90"], got["cached_reported"]) == (380.0, True)
    silent = conversations.turn_fields(
        [record(0, 0, 1.0, 1500, None), record(0, 1, 0.5, 1600, None)]
    )
    assert silent["cached_reported"] is False
    assert [t["cached_ratio"] for t in silent["by_turn"]] == [None, None]
    # back as TurnSummary for the plots
    back = conversations.turn_summaries(got)
    assert [(t.turn, t.ttft_ms.p90) for t in back] == [(1, 1900.0), (2, 380.0)]
    # one turn only: no follow-ups, no by-turn report
    assert conversations.turn_fields([record(0, 0, 1.0, 1500, 0)]) == {
        "by_turn": [],
        "followup_ttft_ms_p90": None,
        "cached_reported": True,
    }


def row(
    server: str,
    followup_p90: float | None,
    tok_s: float,
    workload: str = "multi-turn",
    by_turn: list[dict] | None = None,
) -> dict:
    return {
        "server": server,
        "workload": workload,
        "streams": 16,
        "output_tok_s": tok_s,
        "followup_ttft_ms_p90": followup_p90,
        "by_turn": by_turn or [],
        "cached_reported": True,
    }


KINDS = {"kvrelay": "kvrelay", "kvrelay-cold": "kvrelay", "llama": "llama", "vllm": "vllm"}


def test_each_kvrelay_column_is_compared_with_the_best_peer_on_each_metric():
    rows = [
        row("kvrelay", 100.0, 50.0),
        row("kvrelay-cold", 400.0, 40.0),
        row("llama", 250.0, 20.0),
        row("vllm", 500.0, 45.0),
        {"server": "llama", "workload": "short", "streams": 16, "output_tok_s": 99.0},
    ]
    got = [
        (q["server"], q["ttft_p90"], q["ttft_peer"], q["throughput"], q["throughput_peer"])
        for q in conversations.best_peer_ratios(rows, KINDS)
    ]
    # TTFT: llama is the best peer (250 ms); throughput: vLLM (45 tok/s)
    assert got == [
        ("kvrelay", 0.4, "llama", 1.11, "vllm"),
        ("kvrelay-cold", 1.6, "llama", 0.89, "vllm"),
    ]
    # a peer without follow-ups measured still counts for throughput; no peer: no row
    rows = [row("kvrelay", 100.0, 50.0), row("llama", None, 25.0)]
    assert [
        (q["ttft_p90"], q["ttft_peer"], q["throughput"])
        for q in conversations.best_peer_ratios(rows, KINDS)
    ] == [(None, None, 2.0)]
    assert conversations.best_peer_ratios([row("kvrelay", 100.0, 50.0)], KINDS) == []


def turns(*p90s: float) -> list[dict]:
    return [
        {
            "turn": i + 1,
            "num_ok": 16,
            "prompt_tokens": 1000 * (i + 1),
            "cached_tokens": None,
            "cached_ratio": None,
            "ttft_ms": {"count": 16, "mean": p, "p50": p, "p90": p, "p99": p},
        }
        for i, p in enumerate(p90s)
    ]


def test_cold_twins_are_compared_turn_by_turn_with_their_warm_column():
    rows = [
        row("kvrelay", 100.0, 50.0, by_turn=turns(1000.0, 100.0, 80.0)),
        row("kvrelay-cold", 900.0, 40.0, by_turn=turns(1100.0, 900.0)),
        row("llama", 250.0, 20.0, by_turn=turns(1200.0, 250.0)),
    ]
    got = conversations.cold_by_turn(rows, {"kvrelay-cold": "kvrelay"})
    assert [
        (
            q["server"],
            q["cold"],
            q["turn"],
            q["warm_ttft_ms_p90"],
            q["cold_ttft_ms_p90"],
            q["warm_cold"],
        )
        for q in got
    ] == [
        ("kvrelay", "kvrelay-cold", 1, 1000.0, 1100.0, 0.91),
        ("kvrelay", "kvrelay-cold", 2, 100.0, 900.0, 0.11),
    ]
    table = conversations.turn_tables(
        {
            "rows": rows,
            "turn_ratios": conversations.best_peer_ratios(rows, KINDS),
            "cold_turns": got,
        }
    ).splitlines()
    assert table[2] == "| multi-turn | 16 | kvrelay | 1 | 16 | 1000 | - | 1000.0 | 1000.0 |"
    assert "| multi-turn | 16 | kvrelay-cold | 40.0 | 900.0 |" in table
    assert "| multi-turn | 16 | kvrelay / best peer | 0.4x (llama) | 2.5x (llama) |" in table
    assert "| multi-turn | 16 | 2 | kvrelay | kvrelay-cold | 100.0 | 900.0 | 0.11x |" in table
    assert table[-1] == (
        "Cached %: prompt tokens served from cache (the final usage chunk's "
        "prompt_tokens_details.cached_tokens)."
    )
    rows[2]["cached_reported"] = False
    last = conversations.turn_tables({"rows": rows, "turn_ratios": [], "cold_turns": []})
    assert last.endswith("prompt_tokens_details.cached_tokens); reported none (-): llama.")


def test_conversation_levels_are_sized_and_get_a_cold_column(monkeypatch, capsys):
    out = print_config(
        monkeypatch,
        capsys,
        ZEN_CPUINFO,
        "--workloads=multi-turn,doc-qa",
        "--cold",
        "--users=16",
        "--turns=6",
        "--tokens=128",
    )
    assert out["levels"] == [["multi-turn", 16], ["doc-qa", 8]]
    # the longest prompt is a doc-qa one (3,064 tokens); the most KV in flight multi-turn's
    assert (out["slots"], out["tokens_per_slot"]) == (16, 3064 + 128)
    assert out["kv_tokens"] == 16 * (2540 + 128)
    assert out["working_set_tokens"] == {"multi-turn": 16 * 2540, "doc-qa": 8 * 3064}
    assert list(out["servers"]) == ["kvrelay", "kvrelay-cold", "llama", "vllm"]
    assert out["servers"]["kvrelay-cold"] == out["servers"]["kvrelay"]
    assert out["servers"]["vllm"].endswith(" --enable-prompt-tokens-details")
    # an explicit pool and arena (a working set ~3x the pool) go to kvrelay as given
    out = print_config(
        monkeypatch,
        capsys,
        ZEN_CPUINFO,
        "--workloads=multi-turn",
        "--kvrelay-extra=--kv-cache-bytes 312000000 --arena-bytes 1000000000",
    )
    assert out["servers"]["kvrelay"] == (
        "--threads 2 --quantization auto --kv-cache-bytes 312000000 --arena-bytes 1000000000"
    )
    assert out["servers"]["vllm"].count("--enable-prompt-tokens-details") == 1


def test_a_conversation_run_reports_by_turn_against_the_best_peer(monkeypatch, capsys):
    # stand-in servers and conversations: each column's TTFT by turn set by who it is
    started: list[str] = []
    sent: list[tuple[str, str, int, bool, bool, int]] = []

    def fake(kind: str) -> type:
        class Fake(SERVERS[kind]):
            def start(self) -> None:
                started.append(kind)

        return Fake

    async def closed_loop(url, convs, tokens, streams, sampled=False):
        return [], 1.0

    async def run_conversations(target, workload, users, conv, opts, seed, round_):
        sent.append((target.label, workload, users, opts.cache_key, opts.cold, opts.max_tokens))
        warm = target.label == "kvrelay"
        ttft = {"kvrelay": (2.0, 0.1), "kvrelay-cold": (2.0, 1.0), "llama": (3.0, 0.5)}
        recs = [
            record(
                s,
                t,
                ttft[target.label][t],
                1600 * (t + 1),
                1500 * t if warm else 0,
                server=target.label,
            )
            for s in range(users)
            for t in range(conv.turns)
        ]
        return RunResult(recs, 8.0)

    monkeypatch.setattr(peers, "SERVERS", {k: fake(k) for k in SERVERS})
    monkeypatch.setattr(peers, "closed_loop", closed_loop)
    monkeypatch.setattr(peers, "run_conversations", run_conversations)
    monkeypatch.setattr(peers, "machine_line", lambda: "test machine")
    monkeypatch.setattr(peers, "cpu_flags", lambda: cpu_flags(ZEN_CPUINFO))
    argv = [
        "--servers=kvrelay,llama",
        "--workloads=multi-turn",
        "--users=2",
        "--turns=2",
        "--think-time=0,1",
        "--tokens=16",
        "--repeats=1",
        "--cold",
    ]
    assert peers.main(argv) == 0
    assert started == ["kvrelay", "kvrelay", "llama"]
    assert sent == [
        ("kvrelay", "multi-turn", 2, True, False, 16),
        ("kvrelay-cold", "multi-turn", 2, True, True, 16),
        ("llama", "multi-turn", 2, True, False, 16),
    ]
    lines = capsys.readouterr().out.splitlines()
    res = json.loads(lines[0])
    # 2 users x 2 turns x 16 tokens in 8 s
    assert [
        (r["server"], r["requests"], r["output_tok_s"], r["followup_ttft_ms_p90"])
        for r in res["rows"]
    ] == [("kvrelay", 4, 8.0, 100.0), ("kvrelay-cold", 4, 8.0, 1000.0), ("llama", 4, 8.0, 500.0)]
    assert [(q["server"], q["ttft_p90"], q["throughput"]) for q in res["turn_ratios"]] == [
        ("kvrelay", 0.2, 1.0),
        ("kvrelay-cold", 2.0, 1.0),
    ]
    assert [(q["turn"], q["warm_cold"]) for q in res["cold_turns"]] == [(1, 1.0), (2, 0.1)]
    assert res["working_set_tokens"] == {"multi-turn": 2 * (1700 + 56)}
    assert "| multi-turn | 2 | kvrelay | 2 | 2 | 6400 | 46.9 | 100.0 | 100.0 |" in lines
    assert "| multi-turn | 2 | kvrelay / best peer | 0.2x (llama) | 1.0x (llama) |" in lines
