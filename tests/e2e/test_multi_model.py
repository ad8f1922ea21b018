"""Two models from one `kvrelay up --model A --model B`: each answers from its own workers,
concurrently; /v1/models lists both; stopping B's workers gives 503 for B while A still
answers; `kvrelay status` shows each model's fleet. Per model flags: A is also served as
`smol` (`--served-model-name A=A,smol`), B renders chats with its own `--chat-template B=FILE`.

A is the bundled SmolLM2-135M. B is a tiny random-weight Llama (2 layers, hidden 128) built
here from transformers' own classes with SmolLM2's tokenizer: it loads in well under a second
(a second SmolLM2 would double the slowest part of the start on 2 cores) and its greedy output
differs from A's for the same prompt, which proves the request reached B's workers. Its pages
differ in size from A's, so it also exercises the second store node `up` gives each model.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
import redis

from kvrelay.core import modelref
from kvrelay.core.keys import Keys
from kvrelay.core.tokenizer import Tokenizer
from tests.conftest import free_port
from tests.e2e.stack import MODEL, kvrelay_up

SHARDS = int(os.environ.get("KVRELAY_E2E_SHARDS") or 1)  # as every e2e stack (stack.py)
TINY = "tiny-llama"  # the directory's name: the model's served name
PIPELINE = TINY  # `up` names the second model's pipeline after it
TINY_WORKER = f"decode-{PIPELINE}-0"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ALIAS = "smol"  # A's second served name
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


def tiny_checkpoint(root):
    """A random-weight 2-layer Llama with SmolLM2's vocabulary and tokenizer (seeded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvrelay.core import modelref

    source = modelref.converted_dir(modelref.resolve_model(MODEL))
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = root / TINY
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def kvrelay(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvrelay.cli.main", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    tiny = tiny_checkpoint(root)
    template = root / "tiny.jinja"
    template.write_text(TEMPLATE)
    run_dir, port = root / "run", free_port()
    done = kvrelay_up(
        run_dir, port, "--model", MODEL, "--model", str(tiny),
        "--served-model-name", f"{MODEL}={MODEL},{ALIAS}", "--chat-template", f"{TINY}={template}",
        "--decode", "1", "--kv-cache-bytes", str(64 << 20), "--arena-bytes", str(128 << 20),
        "--env", "KVRELAY_WORKER_HEARTBEAT_S=0.5", "--timeout", "240",
        *(["--shards", str(SHARDS)] if SHARDS > 1 else []),
        timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        logs = "".join(
            f"\n== {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted((run_dir / "logs").glob("*.log"))
        )
        raise RuntimeError(f"kvrelay up failed: {done.stderr[-3000:]}{logs}")
    state = json.loads(done.stdout.strip().splitlines()[-1])
    yield state, f"http://127.0.0.1:{port}", str(tiny)
    kvrelay("down", "--run-dir", str(run_dir))


def entries_read(r, keys: Keys) -> int:
    """Entries the decode streams of `keys`' pipeline delivered on every shard, ever
    (trimming does not lower it)."""
    total = 0
    for shard in keys.all():
        groups = r.xinfo_groups(shard.decode_stream) if r.exists(shard.decode_stream) else []
        total += sum(int(g["entries-read"] or 0) for g in groups)
    return total


def chat(model: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 8,
        "temperature": 0,
    }


async def _both(url: str, tiny: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(
            client.post("/v1/chat/completions", json=chat(MODEL)),
            client.post("/v1/chat/completions", json=chat(TINY)),
            client.post("/v1/chat/completions", json=chat(tiny)),  # its path: the same model
        )


def test_two_models_answer_from_their_own_workers_and_fail_alone(stack):
    state, url, tiny = stack
    assert [(m["served"], m["pipeline"], m["decode"]) for m in state["models"]] == [
        (MODEL, "", ["decode-0"]),
        (TINY, PIPELINE, [TINY_WORKER]),
    ]
    valkeys = [f"valkey-{i}" for i in range(SHARDS)] if SHARDS > 1 else ["valkey"]
    assert state["programs"] == [
        *valkeys, "store", f"store-{PIPELINE}", "ingress", "decode-0", TINY_WORKER,
    ]  # fmt: skip
    listed = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert {MODEL, ALIAS, TINY, tiny} <= set(listed)

    a, b, b_path = asyncio.run(_both(url, tiny))
    for resp in (a, b, b_path):
        assert resp.status_code == 200, resp.text
    text_a, text_b = (r.json()["choices"][0]["message"]["content"] for r in (a, b))
    assert b.json()["model"] == TINY and a.json()["model"] == MODEL
    assert b_path.json()["choices"][0]["message"]["content"] == text_b  # greedy: the same
    assert text_a != text_b  # random weights: not SmolLM2's answer
    assert b.json()["usage"]["completion_tokens"] == 8  # random weights never say eos
    # B's chats are rendered with its --chat-template (the ingress has B's own files too)
    source = modelref.converted_dir(modelref.resolve_model(MODEL))  # B's tokenizer is A's
    rendered = Tokenizer.from_dir(source).with_chat_template(TEMPLATE)
    ids = rendered.apply_chat_template(chat(TINY)["messages"])
    assert b.json()["usage"]["prompt_tokens"] == len(ids)
    assert a.json()["usage"]["prompt_tokens"] != len(ids)  # A keeps its own template
    # A's alias is A, answered under its first name
    aliased = httpx.post(f"{url}/v1/chat/completions", json=chat(ALIAS), timeout=120).json()
    assert (aliased["model"], aliased["choices"][0]["message"]["content"]) == (MODEL, text_a)

    # each model's requests went through its own pipeline's stream only
    keys = Keys(state["key_prefix"], shards=SHARDS)
    client = redis.RedisCluster if SHARDS > 1 else redis.Redis
    r = client.from_url(state["redis_url"])
    assert entries_read(r, keys) == 2  # A's chat and its alias's (acked ones may be trimmed)
    assert entries_read(r, keys.for_pipeline(PIPELINE)) == 2
    assert r.hget(keys.worker(TINY_WORKER), "model") == TINY.encode()

    status = json.loads(kvrelay("status", "--json", "--run-dir", state["run_dir"]).stdout)
    fleets = {m["model"]: m for m in status["models"]}
    assert (fleets[MODEL]["decode_workers"], fleets[MODEL]["aliases"]) == (["decode-0"], [ALIAS])
    assert (fleets[TINY]["pipeline"], fleets[TINY]["decode_workers"]) == (PIPELINE, [TINY_WORKER])
    stream_names = {s["stream"] for s in status["streams"]}
    assert keys.for_pipeline(PIPELINE).decode_stream in stream_names
    # each model's store node, with its pages
    stores = {s["model"]: s for s in status["stores"]}
    assert [stores[m]["program"] for m in (MODEL, TINY)] == ["store", f"store-{PIPELINE}"]
    assert all(s["stats"]["pages"]["host"] > 0 for s in stores.values()), stores
    human = kvrelay("status", "--run-dir", state["run_dir"]).stdout
    assert f"{TINY:<32}{PIPELINE:<20}{0:>8}{1:>7}" in human
    assert f"{TINY}: store " in human and f"{MODEL}: store " in human

    # B's workers stopped: B answers 503 at once, A still answers
    ctl = [sys.executable, "-m", "supervisor.supervisorctl", "-c"]
    conf = f"{state['run_dir']}/supervisord.conf"
    subprocess.run([*ctl, conf, "stop", TINY_WORKER], check=True, timeout=60, capture_output=True)
    assert httpx.get(f"{url}/health").status_code == 200  # A's workers serve every stage
    resp = httpx.post(f"{url}/v1/chat/completions", json=chat(TINY), timeout=60)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "model_unavailable"
    again = httpx.post(f"{url}/v1/chat/completions", json=chat(MODEL), timeout=120)
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"]["content"] == text_a
    status = json.loads(kvrelay("status", "--json", "--run-dir", state["run_dir"]).stdout)
    assert {m["model"]: m["decode_workers"] for m in status["models"]}[TINY] == []
