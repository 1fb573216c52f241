"""Shared fixtures: a free MASTER_PORT per test, the offline datasets folder, cleanup."""

from __future__ import annotations

import itertools
import os
import random
import socket
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATASETS = Path(os.environ.get("LIGHTNING_FULLGRAPH_SHARED", REPO.parent / "shared")) / "datasets"


def pytest_collection_modifyitems(config, items) -> None:
    """Every test under ``tests/distributed`` carries the ``distributed`` marker."""
    distributed = REPO / "tests" / "distributed"
    for item in items:
        if distributed in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.distributed)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def port_slice(worker: str) -> range:
    """The ports :func:`free_port` hands out in pytest-xdist worker ``worker`` (``"gw0"``,
    ``"gw1"``, ...; README's test command runs 2): disjoint slices of 10000 up to the
    ephemeral range, one per worker (modulo 8)."""
    index = worker.removeprefix("gw")
    size = max(64, (_ephemeral_start() - 10000) // 8)
    start = 10000 + (int(index) % 8 if index.isdigit() else 0) * size
    return range(start, start + size)


_PORTS = port_slice(os.environ.get("PYTEST_XDIST_WORKER", "gw0"))
_next_port = itertools.count(random.Random(os.urandom(8)).randrange(len(_PORTS)))


def free_port() -> int:
    """A free TCP port for a test's ``MASTER_PORT``.

    Not ``bind(0)``: that hands out a port of the kernel's ephemeral range, where the
    outgoing connections of every process (the gloo meshes of a test running beside this one
    in the other xdist worker, say) take theirs, so the port could be gone again before the
    test's store binds it. The ports come from below that range instead, from this worker's
    slice, in turn (so no port comes back while a former run's socket may linger), each
    checked free by binding it.
    """
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_next_port) % len(_PORTS)]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


@pytest.fixture(autouse=True)
def _isolated_distributed(monkeypatch, tmp_path):
    """Every test gets its own free MASTER_PORT and partition cache, and leaves no process
    group behind.  ``OMP_NUM_THREADS`` and Lightning's seed variables are unset for each test:
    Lightning's launchers set the first in the process they run in (to the ranks' share of the
    cores), ``seed_everything`` the others, and neither unsets them, so they would otherwise
    pass from one test of a worker to the next (and to its scripts), depending on the order."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("LIGHTNING_FULLGRAPH_CACHE", str(tmp_path / "partitions"))
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "OMP_NUM_THREADS", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(var, raising=False)
    torch.set_num_threads(1)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def shared_datasets() -> Path:
    if not SHARED_DATASETS.is_dir():
        pytest.skip(f"offline datasets not found at {SHARED_DATASETS} (expected ../shared/datasets beside the repo)")
    return SHARED_DATASETS


def pytest_addoption(parser, pluginmanager) -> None:
    """pyproject's ``addopts`` carry ``--dist=loadfile`` for pytest-xdist (the ``test`` extra);
    where the plugin is absent or disabled (``-p no:xdist``) the option is accepted and means
    nothing, so a plain ``pytest`` still runs, serially."""
    if not pluginmanager.has_plugin("xdist"):
        parser.addoption("--dist", default="no", help="ignored: pytest-xdist is not active")
