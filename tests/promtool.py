"""Prometheus's promtool for the tests of the shipped rules and queries: skip without it, FAIL under CI=true."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.services import in_ci


def promtool() -> str:
    """The path of promtool; a skip on a laptop without it, a failure in CI (.ci/run installs it)."""
    found = shutil.which("promtool")
    if found is not None:
        return found
    message = "promtool is missing: apt-get install prometheus"
    if in_ci():
        pytest.fail(f"{message} (under CI=true a missing promtool is a failure; .ci/run installs it)")
    pytest.skip(message)


def run(*args: str, cwd: Path) -> str:
    """``promtool ARGS`` in ``cwd``; fails the test with promtool's whole output unless it succeeded."""
    done = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        pytest.fail(f"promtool {' '.join(args)} exited {done.returncode}:\n{output}")
    return output
