"""The partition plan: local graphs cover every edge once; send/receive lists line up."""

from __future__ import annotations

import pytest
import torch

from lightning_fullgraph.partition.partitioner import partition_graph
from lightning_fullgraph.partition.plan import LocalPartition, build_local_partitions
from tests.helpers import directed_graph


def _partitions(num_parts: int, method: str = "metis", seed: int = 0):
    data = directed_graph(num_nodes=80, num_edges=400, seed=seed)
    data.edge_weight = torch.rand(data.edge_index.size(1))
    parts = partition_graph(data.edge_index, data.num_nodes, num_parts, method=method)
    return data, parts, build_local_partitions(data, parts, num_parts)


@pytest.mark.parametrize("num_parts", [1, 2, 3, 4])
@pytest.mark.parametrize("method", ["metis", "random"])
def test_local_graphs_cover_every_edge_once(num_parts: int, method: str) -> None:
    """Negative control: the destination check used to read ``assert int(dst.max()) if
    dst.numel() else -1 < num_owned`` (a conditional expression: it asserted the truthy int
    ``dst.max()``), which passes with a halo node as destination; the checks below fail then."""
    data, parts, locals_ = _partitions(num_parts, method)
    recovered = []
    for r, p in enumerate(locals_):
        ids = torch.cat([p.data.n_id, p.data.halo_n_id])  # local id -> global id
        src, dst = p.data.edge_index
        # destinations are owned: local ids in [0, N_r), exactly the owned nodes with an in-edge
        assert bool(((dst >= 0) & (dst < p.plan.num_owned)).all()), "destinations must be owned"
        owned_with_in_edges = sorted(set(data.edge_index[1][parts[data.edge_index[1]] == r].tolist()))
        assert sorted(set(ids[dst].tolist())) == owned_with_in_edges
        assert (int(src.max()) if src.numel() else -1) < p.plan.num_owned + p.plan.num_halo
        recovered.append(torch.stack([ids[src], ids[dst]]))
        # edge attributes follow their edges
        glob = torch.stack([ids[src], ids[dst]])
        key = glob[0] * data.num_nodes + glob[1]
        gkey = data.edge_index[0] * data.num_nodes + data.edge_index[1]
        for k, w in zip(key.tolist(), p.data.edge_weight.tolist()):
            assert w in data.edge_weight[gkey == k].tolist()
    all_edges = torch.cat(recovered, dim=1)
    assert all_edges.size(1) == data.edge_index.size(1)
    as_set = lambda e: sorted(map(tuple, e.t().tolist()))  # noqa: E731
    assert as_set(all_edges) == as_set(data.edge_index)


@pytest.mark.parametrize("num_parts", [2, 3, 4])
def test_owned_nodes_partition_the_graph_and_features_follow(num_parts: int) -> None:
    data, parts, locals_ = _partitions(num_parts)
    owned = torch.cat([p.data.n_id for p in locals_])
    assert sorted(owned.tolist()) == list(range(data.num_nodes))
    for r, p in enumerate(locals_):
        assert torch.equal(p.data.n_id, (parts == r).nonzero().flatten())
        assert torch.equal(p.data.x, data.x[p.data.n_id])
        assert torch.equal(p.data.y, data.y[p.data.n_id])
        assert torch.equal(p.data.train_mask, data.train_mask[p.data.n_id])
        assert p.data.num_nodes == p.plan.num_owned
        # halo: remote in-neighbours only, grouped by owner, ascending inside a group
        halo = p.data.halo_n_id
        assert bool((parts[halo] != r).all())
        owners = parts[halo]
        assert torch.equal(owners, owners.sort(stable=True).values)
        assert torch.equal(torch.bincount(owners, minlength=num_parts), torch.tensor(p.plan.recv_counts))


@pytest.mark.parametrize("num_parts", [2, 3, 4])
def test_simulated_all_to_all_fills_the_halo(num_parts: int) -> None:
    """What q sends to r (send_index, in rank order) is exactly r's halo block from q."""
    data, parts, locals_ = _partitions(num_parts)
    for r, p in enumerate(locals_):
        received = []
        for other in locals_:
            offsets = [0] + torch.cumsum(torch.tensor(other.plan.send_counts), 0).tolist()
            rows = other.plan.send_index[offsets[r] : offsets[r + 1]]
            received.append(other.data.n_id[rows])
        assert torch.equal(torch.cat(received), p.data.halo_n_id)
        assert p.plan.send_counts[r] == 0 and p.plan.recv_counts[r] == 0


def test_marginal_nodes_are_those_with_remote_in_neighbours() -> None:
    data, parts, locals_ = _partitions(3)
    for p in locals_:
        src, dst = p.data.edge_index
        expect = torch.zeros(p.plan.num_owned, dtype=torch.bool)
        expect[dst[src >= p.plan.num_owned]] = True
        assert torch.equal(p.plan.marginal_mask, expect)


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


def test_isolated_nodes_are_owned_without_edges() -> None:
    data, parts, locals_ = _partitions(2)
    isolated = set(range(data.num_nodes - 6, data.num_nodes))
    for p in locals_:
        ids = torch.cat([p.data.n_id, p.data.halo_n_id])
        used = set(ids[p.data.edge_index.flatten()].tolist())
        assert not (used & isolated)
    assert isolated <= set(torch.cat([p.data.n_id for p in locals_]).tolist())


def test_wrong_parts_shape_is_refused() -> None:
    data = directed_graph()
    with pytest.raises(ValueError, match="parts"):
        build_local_partitions(data, torch.zeros(3, dtype=torch.long), 1)
