"""`kvrelay config show --run-dir`: the settings a `kvrelay up` stack's programs were given
(issue 46: it printed the defaults), from supervisord.conf and from a running process."""

from __future__ import annotations

import json
import sys

from kvrelay.cli.main import build_parser, main
from kvrelay.cli.up.command import build_programs
from kvrelay.cli.up.launch import Program, Supervisor


def show(capsys, *argv: str) -> tuple[int, dict | str]:
    capsys.readouterr()
    code = main(["config", "show", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else err


def test_a_written_stack_shows_each_programs_settings(tmp_path, capsys, monkeypatch):
    args = build_parser().parse_args(
        ["up", "--redis-url", "redis://db:6379/2", "--prefill", "1", "--decode", "1",
         "--threads", "2", "--max-waiting", "77", "--body-timeout", "5",
         "--env", "KVRELAY_WORKER_LEASE_MS=500"]
    )  # fmt: skip
    programs, state = build_programs(args, tmp_path)
    Supervisor(tmp_path).write(programs, nodaemon=True, state=state)
    # not running: supervisord.conf's items over the defaults (not this shell's environment)
    monkeypatch.setenv("KVRELAY_INGRESS_MAX_INFLIGHT", "33")
    code, out = show(capsys, "--run-dir", str(tmp_path))
    assert code == 0 and list(out) == ["store", "ingress", "prefill-0", "decode-0"]
    assert {p["source"] for p in out.values()} == {"supervisord.conf"}
    assert [p["component"] for p in out.values()] == ["store", "ingress", "worker", "worker"]
    ingress = out["ingress"]["settings"]
    assert (ingress["max_waiting"], ingress["body_timeout_s"], ingress["max_inflight"]) == (
        77, 5.0, 4096)  # fmt: skip
    assert (ingress["redis_url"], ingress["mode"], ingress["port"]) == (
        "redis://db:6379/2", state["mode"], 8000)  # fmt: skip
    prefill = out["prefill-0"]["settings"]
    assert (prefill["name"], prefill["lease_ms"], prefill["threads"]) == (
        "prefill-0", 500, state["threads_per_worker"])  # fmt: skip
    assert out["decode-0"]["settings"]["name"] == "decode-0"
    store = out["store"]["settings"]
    assert (store["run_dir"], store["model"]) == (str(tmp_path / "store"), state["model"])
    code, out = show(capsys, "--run-dir", str(tmp_path), "--component", "worker")
    assert (code, list(out)) == (0, ["prefill-0", "decode-0"])
    # the defaults, as before, without --run-dir
    code, out = show(capsys, "--component", "ingress")
    assert (code, out["ingress"]["max_waiting"], out["ingress"]["max_inflight"]) == (0, 512, 33)
    code, err = show(capsys, "--run-dir", str(tmp_path / "none"))
    assert code == 2 and err.startswith("kvrelay config: error: no kvrelay stack in ")
    code, err = show(capsys, "--run-dir", str(tmp_path), "--config", "x.toml")
    assert (code, err) == (2, "kvrelay config: error: --config and --run-dir do not go together\n")


def test_a_running_program_shows_what_its_process_was_given(tmp_path, capsys, monkeypatch):
    # a stand-in ingress whose command line and environment are an ingress's
    stand_in = [sys.executable, "-c", "import time; time.sleep(120)",
                "kvrelay.cli.main", "serve", "--max-waiting", "9"]  # fmt: skip
    program = Program("ingress", stand_in, env={"KVRELAY_INGRESS_RETRY_AFTER_S": "7"})
    supervisor = Supervisor(tmp_path)
    supervisor.write([program], nodaemon=False, state={"run_dir": str(tmp_path)})
    monkeypatch.setenv("KVRELAY_INGRESS_MAX_INFLIGHT", "33")  # inherited through supervisord
    supervisor.start(detach=True)
    try:
        pid = supervisor.wait_running(["ingress"], timeout=60)["ingress"]
        monkeypatch.delenv("KVRELAY_INGRESS_MAX_INFLIGHT")  # not this shell's: the process's
        code, out = show(capsys, "--run-dir", str(tmp_path))
    finally:
        assert supervisor.stop(timeout=30)
    assert code == 0 and out["ingress"]["source"] == f"pid {pid}"
    settings = out["ingress"]["settings"]
    assert (settings["max_waiting"], settings["retry_after_s"], settings["max_inflight"]) == (
        9, 7, 33)  # fmt: skip
