"""The suite's own configuration: pyproject's ``addopts`` run with and without pytest-xdist."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_plain_pytest_runs_without_xdist() -> None:
    """``addopts`` carries ``--dist=loadfile`` for pytest-xdist; with the plugin disabled
    (as where it is not installed) pytest still collects and runs instead of stopping at
    "unrecognized arguments".

    Negative control: removing ``pytest_addoption`` from ``tests/conftest.py`` makes the run
    exit 4 with that error (run)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
                           "tests/unit/test_ports.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout
