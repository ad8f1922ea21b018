"""A pytest plugin for runs that may be cut short (the GPU checks, scripts/gpu_check.sh): each
failed test's report is appended to $PYTEST_FAILURES as it comes in, not in the end summary a
killed run never prints. Load with `-p scripts.pytest_failures` from the repository root."""

from __future__ import annotations

import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("PYTEST_FAILURES")
    # under xdist the controller gets every worker's reports: only it writes
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
