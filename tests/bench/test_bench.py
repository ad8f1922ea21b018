"""`kvrelay bench` against a real stack (`kvrelay up`, SmolLM2): closed and Poisson loops,
results.json and plots, --compare, cache reporting, multi-turn, JSONL sets, failures and bad
usage; plus exact checks of the statistics and the prompt sets."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.bench.datasets import (
    DOC_QA_QUESTIONS,
    DatasetError,
    Shape,
    builtin,
    parse_think_time,
    shared_system_prompt,
)
from kvrelay.bench.request import (
    RequestOptions,
    RequestRecord,
    Target,
    request_body,
    request_seed,
)
from kvrelay.bench.runner import Load, poisson_arrivals, run_load
from kvrelay.bench.stats import Slo, by_turn, percentile, summarize
from kvrelay.bench.sweep import derived_seed
from tests.conftest import free_port
from tests.e2e.stack import Stack

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("run"), prefill=0, decode=1)
    s.up()
    yield s
    s.down()


def bench(
    args: str, *extra: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`kvrelay bench ARGS EXTRA...` (ARGS split on spaces) as a finished process."""
    cmd = [sys.executable, "-m", "kvrelay.cli.main", "bench", *args.split(), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def test_closed_loop_sweep_writes_results_and_plots(stack, tmp_path):
    out = tmp_path / "out"
    done = bench(
        f"--url {stack.url} --concurrency 1,2 --num-requests 2 --max-tokens 4 --ignore-eos "
        f"--out {out}"
    )
    assert done.returncode == 0, done.stderr
    # not a tty: no progress bar, and no per-request log lines
    assert done.stderr == f"kvrelay bench: wrote {out}/results.json, latency_cdf.png, sweep.png\n"
    assert "kvrelay bench: short, concurrency sweep, throughput" in done.stdout
    res = results(out)
    assert res["config"]["points"] == [1.0, 2.0] and res["config"]["mode"] == "concurrency"
    assert res["config"]["servers"]["A"]["model"] == "smollm2-135m-instruct"
    rows = [
        (s["server"], s["point"], s["num_requests"], s["num_ok"], s["output_tokens"])
        for s in res["summaries"]
    ]
    assert rows == [("A", 1.0, 2, 2, 8), ("A", 2.0, 2, 2, 8)]
    reqs = res["requests"]
    assert sorted((r["point"], r["session"]) for r in reqs) == [
        (1.0, 0),
        (1.0, 1),
        (2.0, 0),
        (2.0, 1),
    ]
    for r in reqs:
        assert r["error"] is None and r["output_tokens"] == 4  # ignore_eos: exactly max_tokens
        assert 0 < r["ttft_s"] < r["e2e_s"] and 1 <= len(r["itl_s"]) <= 3
    for s in res["summaries"]:
        assert s["ttft_ms"]["count"] == 2 and s["ttft_ms"]["p50"] > 0 and s["duration_s"] > 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg

    for name, shape in (("latency_cdf.png", (450, 1500, 4)), ("sweep.png", (450, 1200, 4))):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        assert mpimg.imread(out / name).shape == shape


def test_a_first_matplotlib_run_logs_nothing(stack, tmp_path):
    # Where matplotlib never ran, its first import builds a font cache and logs `INFO
    # matplotlib.font_manager: generated new fontManager`; kvrelay let other libraries' INFO
    # lines through to its users' terminals (the test above failed on a fresh machine).
    out, mpl = tmp_path / "out", tmp_path / "mplconfig"
    mpl.mkdir()
    done = bench(
        f"--url {stack.url} --concurrency 1 --num-requests 1 --max-tokens 2 --out {out}",
        env={**os.environ, "MPLCONFIGDIR": str(mpl)},
    )
    assert (done.returncode, done.stderr) == (
        0, f"kvrelay bench: wrote {out}/results.json, latency_cdf.png\n")  # fmt: skip
    assert any(p.name.startswith("fontlist") for p in mpl.iterdir())  # it did build the cache


def test_poisson_run_follows_seeded_arrivals(stack, tmp_path):
    out = tmp_path / "out"
    done = bench(
        f"--url {stack.url} --request-rate 5 --num-requests 3 --seed 7 --max-tokens 4 --json "
        f"--out {out}"
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert "requests" not in printed  # stdout has the summaries; results.json every request
    (s,) = printed["summaries"]
    assert (s["mode"], s["point"], s["num_requests"], s["num_errors"]) == ("rate", 5.0, 3, 0)
    arrivals = poisson_arrivals(5.0, derived_seed(7, 0, 0))
    expected = [round(next(arrivals), 6) for _ in range(3)]
    reqs = sorted(results(out)["requests"], key=lambda r: r["session"])
    assert [r["scheduled_s"] for r in reqs] == expected
    assert all(r["start_s"] >= r["scheduled_s"] - 1e-3 for r in reqs)


def test_compare_same_server_reports_ratios(stack, tmp_path):
    out = tmp_path / "out"
    done = bench(
        f"--url {stack.url} --compare {stack.url}/v1 --concurrency 2 --num-requests 2 "
        f"--rounds 2 --max-tokens 3 --ignore-eos --json --out {out}"
    )
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    a, b = res["summaries"]
    assert [(x["server"], x["num_requests"], x["num_ok"], x["rounds"]) for x in (a, b)] == [
        ("A", 4, 4, 2),
        ("B", 4, 4, 2),
    ]
    (cmp,) = res["comparisons"]
    assert cmp["point"] == 2.0
    assert cmp["output_throughput_ratio"] == round(
        b["output_throughput"] / a["output_throughput"], 3
    )
    assert cmp["ttft_p50_ratio"] == round(b["ttft_ms"]["p50"] / a["ttft_ms"]["p50"], 3)
    assert cmp["itl_p50_ratio"] == round(b["itl_ms"]["p50"] / a["itl_ms"]["p50"], 3)
    # A and B got identical requests, so identical prompts: same prompt tokens per request
    prompts: dict[str, dict] = {"A": {}, "B": {}}
    for r in results(out)["requests"]:
        prompts[r["server"]][(r["round"], r["session"])] = r["prompt_tokens"]
    assert prompts["A"] == prompts["B"] and len(prompts["A"]) == 4


def test_shared_prefix_reports_cached_tokens(stack, tmp_path):
    out = tmp_path / "out"
    done = bench(
        f"--url {stack.url} --dataset shared-prefix --concurrency 1 --num-requests 2 "
        f"--max-tokens 2 --out {out}"
    )
    assert done.returncode == 0, done.stderr
    first, second = sorted(results(out)["requests"], key=lambda r: r["session"])
    assert first["prompt_tokens"] > 1500 and second["prompt_tokens"] > 1500
    # the ~1,510-token system prompt fills 94 pages of 16 tokens, stored by the first request
    assert second["cached_tokens"] >= 94 * 16
    assert "cached prompt %" in done.stdout


def test_multi_turn_follow_ups_carry_the_answer(stack, tmp_path):
    out = tmp_path / "out"
    done = bench(
        f"--url {stack.url} --dataset multi-turn --concurrency 1 --num-requests 3 --max-tokens 2 "
        f"--ignore-eos --out {out}"
    )
    assert done.returncode == 0, done.stderr
    reqs = sorted(results(out)["requests"], key=lambda r: r["turn"])
    assert [(r["session"], r["turn"]) for r in reqs] == [(0, 0), (0, 1), (0, 2)]
    # each turn = the previous prompt + a 2-token answer + a new user message
    assert reqs[0]["prompt_tokens"] + 2 < reqs[1]["prompt_tokens"]
    assert reqs[1]["prompt_tokens"] + 2 < reqs[2]["prompt_tokens"]
    assert reqs[1]["cached_tokens"] >= 16 and reqs[2]["cached_tokens"] >= 16


def test_a_cold_conversation_is_served_from_no_cache(stack):
    # the same 2-turn conversation (seed 11), warm then cold (a cache_salt per request); both
    # name it in prompt_cache_key, which kvrelay accepts
    target = Target("A", stack.url, "smollm2-135m-instruct")
    dataset = builtin("multi-turn", 11, Shape(turns=2))

    def conversation(cold: bool) -> list[RequestRecord]:
        opts = RequestOptions(max_tokens=2, ignore_eos=True, cache_key=True, cold=cold)
        load = Load(concurrency=1, num_requests=2, seed=11)
        done = asyncio.run(run_load(target, dataset, load, opts, 0, lambda _rec: None))
        return sorted(done.records, key=lambda r: r.turn)

    warm, cold = conversation(False), conversation(True)
    outcomes = [(r.error, r.turn, r.output_tokens) for r in warm + cold]
    assert outcomes == [(None, 0, 2), (None, 1, 2), (None, 0, 2), (None, 1, 2)]
    assert [r.prompt_tokens for r in cold] == [r.prompt_tokens for r in warm]
    assert [r.cached_tokens for r in cold] == [0, 0]
    # the second turn finds every full 16-token page of the first turn's prompt
    assert warm[1].cached_tokens >= warm[0].prompt_tokens // 16 * 16


def test_doc_qa_reports_each_documents_re_ask_as_a_cached_turn(stack, tmp_path):
    out = tmp_path / "out"
    # one 3,000-token document (the stack's pool and arena hold one, not two), asked 3 times
    done = bench(
        f"--url {stack.url} --dataset doc-qa --documents 1 --concurrency 1 --num-requests 3 "
        f"--max-tokens 2 --ignore-eos --out {out}"
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.endswith("latency_cdf.png, turns.png\n")
    assert "by turn (doc-qa: by ask of a document)" in done.stdout
    reqs = sorted(results(out)["requests"], key=lambda r: r["turn"])
    assert [(r["session"], r["turn"]) for r in reqs] == [(0, 0), (1, 1), (2, 2)]
    # the document is prefilled once; its pages serve the later asks (all but the tail past
    # the last full 16-token page)
    assert reqs[0]["prompt_tokens"] > 3000
    assert all(r["cached_tokens"] >= r["prompt_tokens"] - 32 for r in reqs[1:])
    summary = results(out)["summaries"][0]
    assert [t["turn"] for t in summary["by_turn"]] == [0, 1, 2]
    assert summary["by_turn"][2]["cached_ratio"] > 0.98


def test_jsonl_file_on_completions_endpoint(stack, tmp_path):
    data = tmp_path / "reqs.jsonl"
    data.write_text(
        json.dumps({"prompt": "The capital of France is", "max_tokens": 3})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
        + "\n"
    )
    out = tmp_path / "out"
    done = bench(
        f"--url {stack.url} --dataset {data} --endpoint completions --concurrency 2 "
        f"--num-requests 2 --max-tokens 5 --ignore-eos --out {out}"
    )
    assert done.returncode == 0, done.stderr
    reqs = sorted(results(out)["requests"], key=lambda r: r["session"])
    assert [r["output_tokens"] for r in reqs] == [3, 5]
    assert results(out)["config"]["endpoint"] == "completions"


def test_duration_run_starts_no_request_after_its_end(stack, tmp_path):
    out = tmp_path / "out"
    done = bench(f"--url {stack.url} --duration 1 --concurrency 1 --max-tokens 2 --out {out}")
    assert done.returncode == 0, done.stderr
    res = results(out)
    assert res["config"]["num_requests"] is None and res["config"]["duration_s"] == 1.0
    reqs = res["requests"]
    assert len(reqs) == res["summaries"][0]["num_requests"] >= 1
    assert sorted(r["session"] for r in reqs) == list(range(len(reqs)))
    assert all(r["error"] is None for r in reqs)
    # one user: a request starts after the one before ended, and only if the run had not
    # ended then, so every request followed by another ended within the run's second (the
    # times are rounded to microseconds: their sum is at most 1e-6 past the clock's)
    ordered = sorted(reqs, key=lambda r: r["start_s"])
    assert all(round(r["start_s"] + r["e2e_s"], 5) <= 1.0 for r in ordered[:-1])


def test_failed_requests_exit_1_with_summary(stack, tmp_path):
    out = tmp_path / "out"
    done = bench(
        f"--url {stack.url} --model nonexistent --concurrency 2 --num-requests 2 --max-tokens 4 "
        f"--out {out}"
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == "kvrelay bench: error: 2 of 2 requests failed"
    lines = done.stdout.splitlines()
    at = lines.index("A concurrency 2: 2 of 2 failed; first errors:")
    assert lines[at + 1].startswith("  HTTP 404: The model `nonexistent` does not exist")
    res = results(out)
    assert res["num_errors"] == 2 and res["summaries"][0]["num_ok"] == 0
    assert (out / "latency_cdf.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "0"], "--concurrency must be > 0, got 0"),
        (
            ["--concurrency", "1", "--request-rate", "2"],
            "give --concurrency (closed loop) or --request-rate (open loop), not both",
        ),
        (["--request-rate", "fast"], "--request-rate: 'fast' is not a number"),
        (["--num-requests", "0"], "--num-requests must be >= 1, got 0"),
        (
            ["--dataset", "nope"],
            "--dataset: unknown dataset 'nope' (one of short, shared-prefix,"
            " long, long-context, multi-turn, doc-qa, grounded or a .jsonl)",
        ),
        (["--turns", "3"], "--turns shapes --dataset multi-turn only"),
        (
            ["--dataset", "doc-qa", "--think-time", "1"],
            "--think-time shapes --dataset multi-turn only",
        ),
        (
            ["--dataset", "multi-turn", "--documents", "2"],
            "--documents shapes --dataset doc-qa only",
        ),
        (
            ["--dataset", "multi-turn", "--think-time", "5,x"],
            "--think-time: '5,x' is not S or LOW,HIGH",
        ),
        (
            ["--dataset", "multi-turn", "--think-time", "9,2"],
            "--dataset multi-turn: turns and documents must be >= 1 and think time 0 <= low <= "
            "high, got 4 turns, 8 documents, think 9-2 s",
        ),
    ],
)
def test_bad_usage_exits_2_with_one_line(args, message):
    done = bench(f"--url http://127.0.0.1:{free_port()}", *args)
    assert (done.returncode, done.stdout, done.stderr) == (
        2,
        "",
        f"kvrelay bench: error: {message}\n",
    )


def test_bad_jsonl_and_unreachable_server(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"messages": "hi"}\n')
    done = bench(f"--dataset {bad}")
    assert done.returncode == 2 and done.stderr == (
        f"kvrelay bench: error: --dataset: {bad}:2: needs either 'prompt' (a string) or 'messages' "
        "(a non-empty list of {role, content} strings)\n"
    )
    port = free_port()
    done = bench(f"--url http://127.0.0.1:{port} --num-requests 1")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(
        f"kvrelay bench: error: cannot reach the server at http://127.0.0.1:{port} (ConnectError: "
    )
    assert len(done.stderr.splitlines()) == 1


def _rec(ttft: float, e2e: float, tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        "A",
        1.0,
        0,
        0,
        0,
        ttft_s=ttft,
        e2e_s=e2e,
        output_tokens=tokens,
        itl_s=[(e2e - ttft) / max(tokens - 1, 1)] * (tokens - 1),
        error=error,
    )


def test_summary_percentiles_goodput_and_errors():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([], 50) is None
    recs = [_rec(0.1, 1.0, 10), _rec(0.3, 1.2, 10), _rec(0.1, 3.7, 10), _rec(0, 0, 0, "HTTP 500")]
    s = summarize(
        recs,
        2.0,
        Slo(ttft_ms=200, itl_ms=150),
        server="A",
        url="u",
        mode="rate",
        point=1.0,
        rounds=1,
    )
    # good: the first only (the second misses TTFT, the third TPOT 400 ms, the fourth failed)
    assert (s.num_requests, s.num_ok, s.num_errors, s.num_good) == (4, 3, 1, 1)
    assert (s.goodput, s.request_throughput, s.output_throughput) == (0.5, 1.5, 15.0)
    assert (s.ttft_ms.p50, s.tpot_ms.p50, s.e2e_ms.p99) == (100.0, 100.0, 3650.0)
    assert s.itl_ms.count == 27 and s.errors == ["HTTP 500"] and s.cached_ratio is None


def test_by_turn_groups_successful_requests_by_their_turn():
    def rec(turn: int, ttft: float, prompt: int, cached: int | None, error=None) -> RequestRecord:
        r = RequestRecord("A", 1.0, 0, 0, turn, ttft_s=ttft, prompt_tokens=prompt, error=error)
        r.cached_tokens = cached
        return r

    recs = [
        rec(0, 0.5, 100, 0),
        rec(1, 0.1, 200, 180),
        rec(1, 0.3, 200, 190),
        rec(2, 0.2, 50, None),
    ]
    turns = by_turn([r for r in recs + [rec(2, 9.0, 10, 0, "HTTP 500")] if r.ok])
    rows = [(t.turn, t.num_ok, t.prompt_tokens, t.cached_tokens, t.cached_ratio) for t in turns]
    assert rows == [(0, 1, 100, 0, 0.0), (1, 2, 400, 370, 0.925), (2, 1, 50, None, None)]
    assert (turns[1].ttft_ms.p50, turns[1].ttft_ms.p90) == (200.0, 280.0)
    assert by_turn([rec(0, 0.5, 100, 0)]) == []


def test_prompt_sets_are_deterministic():
    assert builtin("short", 3).session(5) == builtin("short", 3).session(5)
    assert builtin("short", 3).session(5) != builtin("short", 4).session(5)
    sessions = builtin("multi-turn", 0).sessions(6)  # 4 turns, then one cut to 2
    assert [s.num_requests for s in sessions] == [4, 2]
    assert sessions[0].messages[0] == {"role": "system", "content": shared_system_prompt()}
    assert sessions[0].think_s == [0.0, 0.0, 0.0] and sessions[1].think_s == [0.0]
    shaped = builtin("multi-turn", 5, Shape(turns=6, think_s=(30.0, 120.0))).session(1)
    assert shaped.num_requests == 6 and len(shaped.think_s) == 5
    assert all(30.0 <= t <= 120.0 for t in shaped.think_s) and len(set(shaped.think_s)) == 5
    assert shaped == builtin("multi-turn", 5, Shape(turns=6, think_s=(30.0, 120.0))).session(1)
    docs = builtin("doc-qa", 2, Shape(documents=3))
    asks = [docs.session(i) for i in range(7)]
    assert [a.first_turn for a in asks] == [0, 0, 0, 1, 1, 1, 2]
    text = [a.messages[0]["content"] for a in asks]
    assert text[0].split("\n\n(0) ")[0] == text[3].split("\n\n(1) ")[0] != text[1].split("\n\n")[0]
    assert text[3].endswith(f"(1) {DOC_QA_QUESTIONS[1]}")
    head = builtin("shared-prefix", 9).session(2).messages[0]
    assert head == {"role": "system", "content": shared_system_prompt()}
    assert len(shared_system_prompt().split()) == 1095
    a, b = poisson_arrivals(2.0, 1), poisson_arrivals(2.0, 1)
    firsts = [next(a) for _ in range(4)]
    assert firsts == [next(b) for _ in range(4)] and firsts[0] == 0.0
    assert firsts == sorted(firsts) and len(set(firsts)) == 4


def test_request_body_names_the_conversation_in_cache_key_salt_and_seed():
    target, messages = Target("A", "http://x", "m"), [{"role": "user", "content": "hi"}]
    opts = RequestOptions(max_tokens=4, ignore_eos=True, temperature=0.8, seeded=True,
                          cache_key=True, cold=True)  # fmt: skip
    assert request_body(target, opts, messages, None, None, "7-3", 2) == {
        "model": "m", "max_tokens": 4, "temperature": 0.8, "stream": True,
        "stream_options": {"include_usage": True}, "messages": messages, "ignore_eos": True,
        "min_tokens": 4, "seed": 2073941580, "prompt_cache_key": "7-3", "cache_salt": "cold/7-3/2",
    }  # fmt: skip
    assert request_seed("7-3", 2) == 2073941580 != request_seed("7-3", 1)
    plain = request_body(target, RequestOptions(), messages, None, None, "7-3", 2)
    assert not {"seed", "prompt_cache_key", "cache_salt"} & set(plain)
    assert Target("A", "u", "m", "k", keep_alive=False).headers() == {
        "Authorization": "Bearer k",
        "Connection": "close",
    }
    # doc-qa's asks of one document are one conversation; a multi-turn session is its own
    docs = builtin("doc-qa", 2, Shape(documents=3))
    assert [docs.session(i).conversation for i in (1, 4, 5)] == ["doc-1", "doc-1", "doc-2"]
    assert builtin("multi-turn", 2).session(0).conversation is None


def test_think_time_is_one_value_or_low_and_high():
    assert parse_think_time("5") == (5.0, 5.0)
    assert parse_think_time("30,120") == (30.0, 120.0)
    for bad in ("1,2,3", "x", "inf", ""):
        with pytest.raises(DatasetError, match=f"^{bad!r} is not S or LOW,HIGH$"):
            parse_think_time(bad)


def test_bench_imports_no_torch_nor_workers():
    code = (
        "import sys, kvrelay.cli.bench, kvrelay.bench.sweep, kvrelay.bench.report, "
        "kvrelay.bench.plots; print(sorted(m for m in sys.modules if m == 'torch' "
        "or m.startswith('kvrelay.workers')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr
