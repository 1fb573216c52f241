"""``join_process_group`` on one rank: the group it creates, and what it leaves for exit."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_fullgraph.launch import rendezvous as rz


def _environment() -> LightningEnvironment:
    env = LightningEnvironment()
    env.set_world_size(1)
    env.set_global_rank(0)
    return env


def test_one_rank_joins_through_the_env_store(monkeypatch, caplog) -> None:
    """A gloo group of one rank on ``MASTER_PORT``, announced with Lightning's lines (what
    ``tests/integration/test_preflight.py`` looks for to tell that no group was made);
    nothing registered for exit.

    Negative controls: logging on the module's own logger (no handler: users never see the
    lines) fails the first assert; registering the exit handler for every backend the last."""
    registered: list = []
    monkeypatch.setattr(rz.atexit, "register", registered.append)
    with caplog.at_level(logging.INFO, logger="lightning.fabric.utilities.distributed"):
        rz.join_process_group(_environment(), "gloo", timedelta(seconds=5), timedelta(seconds=30))
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/1" in caplog.text
    assert "All distributed processes registered. Starting with 1 processes" in caplog.text
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    assert os.environ["MASTER_PORT"] == str(_environment().main_port)
    assert registered == []


def test_an_nccl_group_is_destroyed_at_exit(monkeypatch) -> None:
    """As Lightning's ``_init_dist_connection`` does for NCCL (torch warns at exit about a group
    left alive). CPU only, so the group is a gloo one created in place of NCCL's.

    Negative control: without the ``atexit`` registration nothing is registered and the group
    outlives the handler."""
    registered: list = []
    monkeypatch.setattr(rz.atexit, "register", registered.append)
    real_init = dist.init_process_group
    monkeypatch.setattr(rz.dist, "init_process_group", lambda backend, **kw: real_init("gloo", **kw))
    rz.join_process_group(_environment(), "nccl", timedelta(seconds=5), timedelta(seconds=30))
    assert registered == [rz.destroy_at_exit]
    registered[0]()
    assert not dist.is_initialized()
