"""`kvrelay generate` as a user runs it (subprocess, real model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris." <eos>


def kvrelay(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVRELAY_WORKER_KV_CACHE_BYTES": str(24 << 20)}
    return subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "--log-level", "WARNING", "generate",
         *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def test_streams_chat_answer():
    r = kvrelay("What is the capital of France?", "--chat", "--temperature", "0",
                "--max-tokens", "16")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is Paris.\n"


def test_batch_file_json(tmp_path):
    batch = tmp_path / "batch.jsonl"
    france = [{"role": "user", "content": "What is the capital of France?"}]
    lines = [
        {"id": "france", "messages": france, "temperature": 0},
        {"id": "short", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0},
        {"id": "stopped", "messages": france, "temperature": 0, "stop": [" is"]},
    ]
    batch.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    r = kvrelay("--batch-file", str(batch), "--json", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    results = {o["id"]: o for o in map(json.loads, r.stdout.splitlines())}
    assert set(results) == {"france", "short", "stopped"}
    france = results["france"]
    assert france["token_ids"] == ANSWER and france["text"] == "The capital of France is Paris."
    assert france["finish_reason"] == "stop" and france["completion_tokens"] == 8
    assert france["prompt_tokens"] == results["stopped"]["prompt_tokens"] > 20
    assert set(france["timings"]) == {"ttft_s", "total_s", "decode_tok_s"}
    assert results["short"]["finish_reason"] == "length"
    assert len(results["short"]["token_ids"]) == 3
    assert results["stopped"]["text"] == "The capital of France"
    assert results["stopped"]["finish_reason"] == "stop"


def test_speculation_changes_nothing_but_the_step_count():
    """`--speculation off` and `ngram` answer the same tokens; --json reports the drafts."""
    prompt = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
    results = {}
    for mode in ("off", "ngram"):
        r = kvrelay(prompt, "--chat", "--temperature", "0", "--max-tokens", "32", "--json",
                    "--speculation", mode)  # fmt: skip
        assert r.returncode == 0, r.stderr
        results[mode] = json.loads(r.stdout)
    off, ngram = results["off"], results["ngram"]
    assert off["text"] == ngram["text"] == "The quick brown fox jumps over lazy dog."
    assert off["token_ids"] == ngram["token_ids"] and off["completion_tokens"] == 10
    assert off["speculation"] == {
        "draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None, "tokens_per_step": 1.0,
    }  # fmt: skip
    spec = ngram["speculation"]
    drafted, accepted = spec["draft_tokens"], spec["accepted_tokens"]
    assert 0 < accepted <= drafted
    assert spec["acceptance_rate"] == round(accepted / drafted, 4)
    assert spec["tokens_per_step"] == round(10 / (10 - accepted), 4)


@pytest.mark.parametrize(
    ("args", "lines", "message"),
    [
        ((), None, "give a PROMPT or --batch-file"),
        (("hi", "--max-tokens", "0"), None, "max_tokens must be at least 1"),
        (("hi", "--model", "no-such-model"), None, "unknown model 'no-such-model'"),
        ((), ['{"id": "a", "prompt": "x"}', "{oops"], "batch.jsonl:2: invalid JSON"),
        ((), ['{"id": "a", "prompt": "x", "temprature": 1}'], "unknown field(s) temprature"),
        ((), ['{"id": "a"}'], "give exactly one of 'prompt' or 'messages'"),
        ((), ['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], "duplicate id 'a'"),
        ((), ['{"id": "a", "prompt": [1, 99999999]}'],
         "request 'a': token id 99999999 is outside the vocabulary (size 49152)"),
        ((), ['{"id": "a", "prompt": "x", "top_p": 2}'], "request 'a': top_p must be in"),
        (("hi", "--num-speculative-tokens", "0"), None,
         "num_speculative_tokens must be at least 1, got 0"),
        (("hi", "--speculation", "draft"), None,
         "speculation 'draft' needs a draft model (--draft-model)"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(tmp_path, args, lines, message):
    if lines is not None:
        path = tmp_path / "batch.jsonl"
        path.write_text("\n".join(lines) + "\n")
        args = ("--batch-file", str(path))
    r = kvrelay(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("kvrelay generate:")]
    assert len(errors) == 1 and message in errors[0], r.stderr


def test_bad_sampling_is_rejected_before_torch_loads():
    code = (
        "import sys\n"
        "from kvrelay.cli.main import main\n"
        "code = main(['generate', 'x', '--temperature', '-1'])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout == "2 False\n"
    assert r.stderr == (
        "kvrelay generate: error: request 'generate-0': temperature must be in [0, 100], got -1.0\n"
    )
