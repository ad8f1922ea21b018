"""Every command that takes a Redis URL checks it before using it: a malformed one is bad usage,
one line `kvrelay <cmd>: error: ...` and exit 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.core import config
from tests.cli.in_process import run

NOT_A_URL = "not a Redis URL (redis://[:PASSWORD@]HOST[:PORT][/DB], rediss://... or unix:///PATH)"
BAD_URLS = [
    ("notaurl", NOT_A_URL),
    ("http://x", NOT_A_URL),
    ("redis://127.0.0.1:99999/0", "the port must be 1-65535, got '99999'"),
    ("redis://:secret@h:0/0", "the port must be 1-65535, got '0'"),
    ("redis://h:port/0", "the port must be 1-65535, got 'port'"),
    ("redis://127.0.0.1:6379/zero", "the database must be a number, got 'zero'"),
    ("redis://127.0.0.1:6379?db=x", "the database must be a number, got 'x'"),
    ("unix://", "a unix:// URL needs a socket path (unix:///run/valkey.sock)"),
]
# Every command with --redis-url, as a user types it (serve, worker, store and up before
# they start anything; the admin commands before they connect).
COMMANDS = [
    ("status",),
    ("requests", "show", "q1"),
    ("dlq", "ls"),
    ("drain", "w1"),
    ("usage",),
    ("serve",),
    ("worker", "decode"),
    ("store", "--page-bytes", "64"),
    ("up", "--detach"),
]


@pytest.mark.parametrize(("url", "problem"), BAD_URLS, ids=[u for u, _ in BAD_URLS])
def test_a_malformed_url_is_named_with_what_is_wrong(url, problem):
    assert config.redis_url_problem(url) == problem


def test_urls_redis_py_takes_pass():
    for url in ("redis://127.0.0.1:6379/0", "rediss://:pw@h:6380/2", "redis://u:p@h/15",
                "redis://localhost", "redis://[::1]:6379/1", "unix:///tmp/v.sock?db=1",
                "redis://h:1/0?db=3"):  # fmt: skip
        assert config.redis_url_problem(url) is None, url


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_command_refuses_a_malformed_url_in_one_line(capsys, tmp_path: Path, argv):
    # before: a ValueError traceback (exit 1) from redis-py, or a crash later on
    extra = ["--run-dir", str(tmp_path / "run")] if argv[0] == "up" else []
    for url, problem in BAD_URLS[:3]:
        code, out, err = run(capsys, *argv, *extra, "--redis-url", url)
        assert (code, out) == (2, ""), err
        assert err == f"kvrelay {argv[0]}: error: invalid Redis URL {url!r} for --redis-url: " \
                      f"{problem}\n"  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_the_url_is_named_by_where_it_came_from(capsys, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("KVRELAY_REDIS_URL", "redis://:hunter2@h:70000/0")
    shown = "'redis://:***@h:70000/0'"  # the password never shows
    for argv in (("status",), ("serve",), ("config", "show")):
        code, out, err = run(capsys, *argv)
        assert (code, out, err) == (
            2,
            "",
            f"kvrelay {argv[0]}: error: invalid Redis URL {shown} for KVRELAY_REDIS_URL: the port "
            "must be 1-65535, got '70000'\n",
        )
    monkeypatch.delenv("KVRELAY_REDIS_URL")
    config = tmp_path / "k.toml"
    config.write_text('[ingress]\nredis_url = "http://h"\n')
    code, out, err = run(capsys, "serve", "--config", str(config))
    assert (code, out, err) == (
        2, "", f"kvrelay serve: error: invalid Redis URL 'http://h' for redis_url in {config}: "
               f"{NOT_A_URL}\n")  # fmt: skip
