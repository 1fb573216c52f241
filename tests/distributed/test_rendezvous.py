"""The ranks' start is bounded by ``rendezvous_timeout``, not by the collectives' ``timeout``
(:mod:`lightning_fullgraph.launch.rendezvous`)."""

from __future__ import annotations

import copy
import time
from datetime import timedelta

import pytest
import torch

from lightning_fullgraph import FullGraphDataModule, FullGraphStrategy
from lightning_fullgraph.launch.rendezvous import rendezvous_seconds
from tests.helpers import NodeClassifier, cpu_trainer, directed_graph, reference_training

pytestmark = pytest.mark.timeout(120)

TIMEOUT = timedelta(seconds=3)
LATE = 6.0


class _LateRank1(FullGraphStrategy):
    """Rank 1 reaches the process group ``LATE`` seconds after rank 0 (a slow import, a
    scheduler starting the job's processes apart)."""

    def setup_distributed(self) -> None:
        if self.local_rank == 1:
            time.sleep(LATE)
        super().setup_distributed()


def test_a_rank_that_starts_later_than_the_timeout_joins(tmp_path) -> None:
    """timeout 3 s, rank 1 arrives 6 s late: the run trains, as a single process does.

    Negative control (run): with Lightning's own connection (``setup_distributed`` without
    ``join_process_group``) rank 0 fails with "Timed out after 4 seconds waiting for clients.
    1/2 clients joined." -- what a loaded CI machine did to a 20 s run of
    ``test_sigint_to_the_cli_launcher_stops_every_rank``."""
    data = directed_graph(seed=7)
    torch.manual_seed(0)
    model = NodeClassifier(conv="gcn")
    expected = reference_training(copy.deepcopy(model), data, 2)
    strategy = _LateRank1(start_method="fork", timeout=TIMEOUT, rendezvous_timeout=timedelta(seconds=60))
    started = time.monotonic()
    cpu_trainer(2, max_epochs=2, strategy=strategy).fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
    assert time.monotonic() - started > LATE
    for key, value in expected.items():
        torch.testing.assert_close(model.state_dict()[key], value)


def test_the_rendezvous_waits_the_longer_of_the_two() -> None:
    """Negative control: taking ``rendezvous_timeout`` alone lets a long process-group timeout
    (a user's 2 h) be cut to 10 min at the start, and ``None`` fails."""
    assert rendezvous_seconds(timedelta(seconds=20), timedelta(minutes=10)) == timedelta(minutes=10)
    assert rendezvous_seconds(timedelta(hours=2), timedelta(minutes=10)) == timedelta(hours=2)
    assert rendezvous_seconds(None, timedelta(seconds=5)) == timedelta(minutes=30)
