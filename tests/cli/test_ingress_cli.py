"""`kvrelay serve` flags and environment -> IngressConfig."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvrelay.cli.main import build_parser
from kvrelay.cli.serve import config_from_args
from kvrelay.core.config import ConfigError


def test_flags_override_environment(monkeypatch):
    monkeypatch.setenv("KVRELAY_REDIS_URL", "redis://env:1/0")
    monkeypatch.setenv("KVRELAY_INGRESS_PORT", "9001")
    monkeypatch.setenv("KVRELAY_INGRESS_ROUTE_THRESHOLD", "32")
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9100",
            "--mode",
            "colocated",
            "--model",
            "a",
            "--model",
            "b",
            "--api-key",
            "k",
            "--max-waiting",
            "7",
            "--request-timeout",
            "2.5",
        ]
    )
    cfg = config_from_args(args)
    assert (
        cfg.redis_url,
        cfg.port,
        cfg.route_threshold,
        cfg.mode,
        cfg.models,
        cfg.api_keys,
        cfg.max_waiting,
        cfg.request_timeout_s,
    ) == ("redis://env:1/0", 9100, 32, "colocated", ("a", "b"), ("k",), 7, 2.5)


def test_bad_values_are_config_errors(monkeypatch):
    monkeypatch.setenv("KVRELAY_INGRESS_MODE", "sideways")
    with pytest.raises(ConfigError, match="mode must be one of"):
        config_from_args(build_parser().parse_args(["serve"]))
    monkeypatch.setenv("KVRELAY_INGRESS_MODE", "auto")
    monkeypatch.setenv("KVRELAY_INGRESS_PORT", "eighty")
    with pytest.raises(ConfigError, match="KVRELAY_INGRESS_PORT"):
        config_from_args(build_parser().parse_args(["serve"]))


def test_serve_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--route-threshold" in out.stdout and "--disconnect-grace" in out.stdout
