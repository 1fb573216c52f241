"""Shared fixtures: a free MASTER_PORT per test, the offline datasets folder, cleanup."""

from __future__ import annotations

import os
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _isolated_distributed(monkeypatch, tmp_path):
    """Every test gets its own free MASTER_PORT and partition cache, and leaves no process
    group behind."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("LIGHTNING_FULLGRAPH_CACHE", str(tmp_path / "partitions"))
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
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
