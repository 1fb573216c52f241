"""Exact mode equals single-process PyG training, for every supported conv.

Random DIRECTED graph with isolated nodes; the last rank owns no training node; several
SGD steps; weights compared with ``torch.testing.assert_close`` at fp32 default tolerances.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_fullgraph import FullGraphDataModule
from tests.helpers import (
    CONV_TYPES,
    NodeClassifier,
    cpu_trainer,
    directed_graph,
    reference_training,
    without_training_nodes_on_last_rank,
)

STEPS = 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("conv", CONV_TYPES)
def test_weights_equal_single_process(conv: str, world_size: int, tmp_path) -> None:
    data = without_training_nodes_on_last_rank(directed_graph(seed=world_size), world_size)
    torch.manual_seed(0)
    model = NodeClassifier(conv=conv, layer_norm=True, num_layers=3)
    initial = copy.deepcopy(model.state_dict())
    expected = reference_training(copy.deepcopy(model), data, STEPS)
    # Training must actually move the weights, or the comparison proves nothing.
    assert any(not torch.equal(initial[k], expected[k]) for k in expected)

    dm = FullGraphDataModule(data, cache_dir=tmp_path)
    trainer = cpu_trainer(world_size, max_epochs=STEPS)
    trainer.fit(model, datamodule=dm)

    actual = model.state_dict()
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], msg=lambda m, k=key: f"{conv} W={world_size} {k}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("conv", ["gcn", "sage", "gin", "graph", "gat"])
def test_overlap_with_fp32_messages_equals_exact(conv: str, tmp_path) -> None:
    """Central/marginal overlap (fp32 messages) against the single-process ground truth."""
    data = without_training_nodes_on_last_rank(directed_graph(seed=11), 3)
    torch.manual_seed(0)
    model = NodeClassifier(conv=conv, layer_norm=True, num_layers=3)
    expected = reference_training(copy.deepcopy(model), data, STEPS)
    trainer = cpu_trainer(3, max_epochs=STEPS, strategy_kwargs={"overlap": True})
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
    for key in expected:
        torch.testing.assert_close(model.state_dict()[key], expected[key], msg=lambda m, k=key: f"{conv} {k}: {m}")
