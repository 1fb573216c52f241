"""The runtime contract (comm/plan.py): a LocalPartition survives its on-disk state."""

from __future__ import annotations

import torch

from lightning_fullgraph.comm.plan import LocalPartition
from lightning_fullgraph.partition.partitioner import partition_graph
from lightning_fullgraph.partition.planner import build_local_partitions
from tests.helpers import directed_graph


def _partitions(num_parts: int, method: str = "metis", seed: int = 0, node_order: str = "locality"):
    """Local partitions of a small directed graph (as in tests/unit/test_planner.py)."""
    data = directed_graph(num_nodes=80, num_edges=400, seed=seed)
    data.edge_weight = torch.rand(data.edge_index.size(1))
    parts = partition_graph(data.edge_index, data.num_nodes, num_parts, method=method)
    return data, parts, build_local_partitions(data, parts, num_parts, node_order=node_order)


def test_state_round_trip() -> None:
    _, _, locals_ = _partitions(3)
    p = locals_[1]
    q = LocalPartition.from_state(p.state())
    assert q.plan.send_counts == p.plan.send_counts and q.plan.recv_counts == p.plan.recv_counts
    assert torch.equal(q.plan.send_index, p.plan.send_index)
    for key in p.data.keys():
        if isinstance(p.data[key], torch.Tensor):
            assert torch.equal(q.data[key], p.data[key])
    assert q.data.num_nodes == p.data.num_nodes
