"""`kvrelay store` and `kvrelay kv` as operators run them: env config, metrics, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvrelay.cli.errors import CommandError
from kvrelay.cli.store import add_store_arguments, build_config
from kvrelay.core.config import ConfigError
from kvrelay.kvstore.client import StoreClient
from kvrelay.kvstore.config import StoreConfig
from kvrelay.kvstore.server import arena_path
from tests.conftest import free_port
from tests.kvstore.conftest import SMALL, keys_for, payload

CLI = [sys.executable, "-m", "kvrelay.cli.main"]


def kv(capsys, run_dir: str, *args: str) -> tuple[int, dict | str]:
    """Run `kvrelay kv ... --json` in this process (the command only talks to the node)."""
    from kvrelay.cli.main import main

    capsys.readouterr()
    code = main(["kv", *args, "--run-dir", run_dir, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out) if code == 0 else out.err


def test_config_from_flags_and_env():
    import argparse

    p = argparse.ArgumentParser()
    add_store_arguments(p)
    args = p.parse_args(["--node-id", "x1", "--arena-bytes", "123456", "--page-bytes", "1024"])
    env = {
        "KVRELAY_STORE_NODE_ID": "ignored",
        "KVRELAY_STORE_TCP_PORT": "-1",
        "KVRELAY_STORE_SECRET": "s",
    }
    old = dict(os.environ)
    os.environ.update(env)
    try:
        cfg = build_config(args)
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert (cfg.node_id, cfg.arena_bytes, cfg.page_bytes, cfg.tcp_port, cfg.secret) == (
        "x1",
        123456,
        1024,
        -1,
        "s",
    )
    with pytest.raises(ConfigError, match="transport must be auto, ucx or tcp"):
        StoreConfig(transport="carrier-pigeon")
    with pytest.raises(ConfigError, match="invalid node id"):
        StoreConfig(node_id="a:b")
    with pytest.raises(CommandError, match="give --page-bytes or --model"):
        build_config(p.parse_args([]))


def test_store_node_and_kv_commands(tmp_path: Path, capsys):
    run_dir = str(tmp_path / "run")
    port = free_port()
    env = dict(
        os.environ,
        KVRELAY_STORE_RUN_DIR=run_dir,
        KVRELAY_STORE_PAGE_BYTES="1024",
        KVRELAY_STORE_ARENA_BYTES=str(4096 + 2 * 4096),
    )
    proc = subprocess.Popen(
        [
            *CLI,
            "store",
            "--node-id",
            "cli",
            "--metrics-port",
            str(port),
            "--disk-dir",
            str(tmp_path / "disk"),
            "--keep-arena",
            "false",
        ],
        env=env,
    )
    cfg = StoreConfig(node_id="cli", run_dir=run_dir)
    try:
        client = StoreClient(run_dir, SMALL, timeout_s=0.5)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.connect()
                break
            except Exception:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        keys = keys_for(3)
        assert client.put(keys, [payload(SMALL, i) for i in range(3)][:2]) == 2
        assert client.put(keys[2:], [payload(SMALL, 2)]) == 1  # page 0 goes to disk
        client.close()

        code, stats = kv(capsys, run_dir, "stats")
        assert code == 0 and stats["node_id"] == "cli"
        assert stats["pages"] == {
            "host": 2,
            "disk": 1,
            "host_slots": 2,
            "pinned": 0,
            "disk_capacity": 13421772,
            "sessions": 0,
            "retained_host": 0,
            "retained_disk": 0,
        }
        code, listing = kv(capsys, run_dir, "ls")
        assert listing == {"host": [keys[1].hex(), keys[2].hex()], "disk": [keys[0].hex()]}
        code, page = kv(capsys, run_dir, "get", keys[2].hex())
        assert page["found"] and page["verified"] and page["shape"] == [2, 2, 4, 2, 8]
        assert page["fingerprint"] == SMALL.fingerprint and page["payload_bytes"] == 1024
        code, err = kv(capsys, run_dir, "get", "00" * 16)
        assert (code, err) == (
            3,
            f"kvrelay kv: error: no page {'00' * 16} in the store at {run_dir}\n",
        )
        code, err = kv(capsys, run_dir, "get", "xyz")
        assert (code, err) == (
            2,
            "kvrelay kv: error: not a page key: 'xyz' (32 hex digits, as `kvrelay kv ls` prints "
            "them)\n",
        )
        stack = tmp_path / "stack"  # a `kvrelay up` run dir: stack.json names the store's dir
        stack.mkdir()
        (stack / "stack.json").write_text(json.dumps({"store_run_dir": run_dir}))
        code, listing = kv(capsys, str(stack), "ls", "--timeout-s", "2")
        assert listing == {"host": [keys[1].hex(), keys[2].hex()], "disk": [keys[0].hex()]}
        code, out = kv(capsys, str(stack), "evict")
        assert out == {"evicted": 2, "tier": "host"}

        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        text = text.decode()
        assert 'kvrelay:store_puts_total{tier="host"} 3.0' in text
        assert 'kvrelay:store_evictions_total{reason="capacity",tier="host"} 1.0' in text
        assert 'kvrelay:store_evictions_total{reason="operator",tier="host"} 2.0' in text
        assert 'kvrelay:store_pages{tier="disk"} 3.0' in text

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not cfg.socket_path.exists()
        assert not arena_path(cfg).exists()  # --keep-arena false
        code, err = kv(capsys, run_dir, "stats", "--timeout-s", "0.2")
        # this process watched the node go (its socket closed): refused at once; a process
        # that never saw it up waits out its timeout
        assert code == 1 and (
            f"store node at ipc://{cfg.socket_path} is down; 'stats' not sent" in err
            or "did not answer 'stats' within 0.2s" in err
        ), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        arena_path(cfg).unlink(missing_ok=True)


def test_model_sets_page_bytes_and_fingerprint():
    import argparse

    from kvrelay.core.modelref import converted_dir, is_prepared, read_model_info, resolve_model

    ref = resolve_model("smollm2-135m-instruct")
    if not is_prepared(ref):
        pytest.skip("SmolLM2 not converted yet (run `kvrelay generate` once)")
    p = argparse.ArgumentParser()
    add_store_arguments(p)
    cfg = build_config(p.parse_args(["--model", "smollm2-135m-instruct", "--dtype", "fp32"]))
    assert cfg.page_bytes == 737_280  # 16 tokens x 46,080 bytes
    assert cfg.fingerprint == read_model_info(converted_dir(ref), "float32").fingerprint
    # default --dtype auto: the pages fp32 workers' --kv-cache-dtype auto gives on this CPU
    from kvrelay.kernels import cpu_build

    auto = build_config(p.parse_args(["--model", "smollm2-135m-instruct"]))
    kv = "bfloat16" if cpu_build.load() is not None else "float32"
    assert auto.page_bytes == (368_640 if kv == "bfloat16" else 737_280)
    # and the attention fp32 workers' --attention-precision auto gives here (bf16 on AMX-BF16)
    from kvrelay.kernels import bf16_attention_available

    attention = "bf16" if kv == "bfloat16" and bf16_attention_available() else "fp32"
    info = read_model_info(converted_dir(ref), "float32", kv_dtype=kv, attention=attention)
    assert auto.fingerprint == info.fingerprint
    fp32 = build_config(
        p.parse_args(["--model", "smollm2-135m-instruct", "--attention-precision", "fp32"])
    )
    plain = read_model_info(converted_dir(ref), "float32", kv_dtype=kv).fingerprint
    assert fp32.fingerprint == plain
    with pytest.raises(CommandError, match="--page-bytes 1024 contradicts --model"):
        build_config(p.parse_args(["--model", "smollm2-135m-instruct", "--page-bytes", "1024"]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("get",), "kvrelay kv: error: give a page key (hex), as `kvrelay kv ls` prints it"),
        (("evict", "zzz"), "kvrelay kv: error: kv evict takes no page key, got 'zzz' (it works "
                           "on a whole tier: --tier host|all)"),
        (("stats", "ab"), "kvrelay kv: error: kv stats takes no page key, got 'ab'"),
    ],
)  # fmt: skip
def test_kv_usage_errors_exit_2(tmp_path: Path, capsys, args, message):
    assert kv(capsys, str(tmp_path), *args) == (2, message + "\n")


def test_kv_names_an_unreadable_stack_state(tmp_path: Path, capsys):
    (tmp_path / "stack.json").write_text("{oops")
    code, err = kv(capsys, str(tmp_path), "stats")
    assert (code, err) == (
        2,
        f"kvrelay kv: error: cannot read {tmp_path / 'stack.json'}: Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1)\n",
    )


def test_bad_store_setting_is_one_line_and_exit_2(tmp_path: Path):
    env = dict(os.environ, KVRELAY_STORE_ARENA_BYTES="abc")
    cmd = [sys.executable, "-m", "kvrelay.cli.main", "store", "--run-dir", str(tmp_path),
           "--page-bytes", "4096"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert (
        done.stderr == "kvrelay store: error: invalid value 'abc' for KVRELAY_STORE_ARENA_BYTES\n"
    )
