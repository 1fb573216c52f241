"""Tests for :mod:`lightning_fullgraph.data.datasets.community` (the generated default dataset)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv
from torch_geometric.utils import contains_self_loops, degree, homophily, is_undirected

from lightning_fullgraph.data.datasets import community_graph
from tests.unit.dataset_checks import assert_equal_data as _assert_equal_data
from tests.unit.dataset_checks import check_normalised as _check_normalised


# --------------------------------------------------------------------------- #
# community_graph
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def default_graph() -> Data:
    return community_graph()


def test_community_deterministic(default_graph: Data) -> None:
    _assert_equal_data(default_graph, community_graph(seed=0))
    other = community_graph(seed=1)
    assert not torch.equal(default_graph.y, other.y)
    assert not torch.equal(default_graph.x, other.x)
    assert default_graph.edge_index.shape != other.edge_index.shape or not torch.equal(
        default_graph.edge_index, other.edge_index
    )


def test_community_does_not_touch_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    community_graph(num_nodes=200)
    assert torch.equal(torch.rand(3), expected)


def test_community_shapes_and_dtypes(default_graph: Data) -> None:
    d = default_graph
    assert d.num_nodes == 3000
    assert d.x.shape == (3000, 64) and d.x.dtype == torch.float32
    assert d.y.shape == (3000,) and d.y.dtype == torch.int64
    assert set(d.y.unique().tolist()) == set(range(5))
    assert d.edge_index.dtype == torch.int64 and d.edge_index.size(0) == 2
    _check_normalised(d)
    # Mean degree close to the requested one.
    assert d.edge_index.size(1) / d.num_nodes == pytest.approx(8.0, rel=0.05)


def test_community_masks(default_graph: Data) -> None:
    d = default_graph
    assert int(d.train_mask.sum()) == 5 * 20
    assert torch.equal(torch.bincount(d.y[d.train_mask], minlength=5), torch.full((5,), 20))
    assert int(d.val_mask.sum()) == 500
    assert int(d.test_mask.sum()) == 1000
    assert not (d.train_mask & d.val_mask).any()
    assert not (d.train_mask & d.test_mask).any()
    assert not (d.val_mask & d.test_mask).any()


def test_community_small_graph_clips_masks() -> None:
    d = community_graph(num_nodes=60, num_classes=3, train_per_class=5, num_val=30, num_test=100)
    assert int(d.train_mask.sum()) == 15
    assert int(d.val_mask.sum()) == 30
    assert int(d.test_mask.sum()) == 15
    assert int((d.train_mask.long() + d.val_mask.long() + d.test_mask.long()).max()) == 1


def test_community_no_self_loops_and_undirected(default_graph: Data) -> None:
    assert not contains_self_loops(default_graph.edge_index)
    assert is_undirected(default_graph.edge_index, num_nodes=default_graph.num_nodes)
    # Coalesced: no duplicates.
    keys = default_graph.edge_index[0] * default_graph.num_nodes + default_graph.edge_index[1]
    assert keys.unique().numel() == keys.numel()


def test_community_directed() -> None:
    d = community_graph(directed=True)
    assert not contains_self_loops(d.edge_index)
    assert not is_undirected(d.edge_index, num_nodes=d.num_nodes)
    assert d.edge_index.size(1) / d.num_nodes == pytest.approx(8.0, rel=0.05)
    assert homophily(d.edge_index, d.y) == pytest.approx(0.8, abs=0.03)


def test_community_isolated_nodes() -> None:
    n = 2000
    d = community_graph(num_nodes=n, isolated_fraction=0.1)
    deg = degree(d.edge_index.flatten(), num_nodes=n)
    num_isolated = int((deg == 0).sum())
    assert 200 <= num_isolated <= 210  # a couple may be isolated by chance
    assert is_undirected(d.edge_index, num_nodes=n)
    assert int((degree(community_graph(num_nodes=n).edge_index.flatten(), num_nodes=n) == 0).sum()) < 10
    everything = community_graph(num_nodes=100, isolated_fraction=1.0)
    assert everything.edge_index.shape == (2, 0)


@pytest.mark.parametrize("h", [0.0, 0.3, 0.8, 1.0])
def test_community_homophily(h: float) -> None:
    d = community_graph(homophily=h)
    assert homophily(d.edge_index, d.y, method="edge") == pytest.approx(h, abs=0.03)


def test_community_single_class_and_no_edges() -> None:
    d = community_graph(num_nodes=50, num_classes=1, homophily=0.0)
    assert (d.y == 0).all() and d.edge_index.size(1) > 0
    assert not contains_self_loops(d.edge_index)
    d = community_graph(num_nodes=50, avg_degree=0.0)
    assert d.edge_index.shape == (2, 0) and d.edge_index.dtype == torch.int64
    d = community_graph(num_nodes=5, num_classes=5)
    assert d.num_nodes == 5


def test_community_feature_noise() -> None:
    d = community_graph(num_nodes=500, feature_noise=0.0)
    # Without noise every node carries exactly its class centroid.
    for c in range(5):
        rows = d.x[d.y == c]
        assert torch.equal(rows, rows[:1].expand_as(rows))


def test_community_large_graph() -> None:
    start = time.perf_counter()
    d = community_graph(num_nodes=100_000)
    elapsed = time.perf_counter() - start
    assert d.num_nodes == 100_000 and d.x.shape == (100_000, 64)
    assert d.edge_index.size(1) == pytest.approx(800_000, rel=0.02)
    print(f"community_graph(num_nodes=100_000) took {elapsed:.2f}s")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_nodes": 0},
        {"num_nodes": 3, "num_classes": 5},
        {"num_classes": 0},
        {"num_features": 0},
        {"avg_degree": -1.0},
        {"avg_degree": float("inf")},
        {"homophily": -0.1},
        {"homophily": 1.5},
        {"homophily": float("nan")},
        {"feature_noise": -1.0},
        {"isolated_fraction": 1.1},
        {"train_per_class": -1},
        {"num_val": -1},
        {"num_test": -5},
        {"num_nodes": 10.5},
        {"directed": "yes"},
    ],
)
def test_community_argument_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        community_graph(**kwargs)


# --------------------------------------------------------------------------- #
# Learnability of the default graph
# --------------------------------------------------------------------------- #
class _GCN(torch.nn.Module):
    def __init__(self, dim_in: int, hidden: int, dim_out: int) -> None:
        super().__init__()
        self.conv1 = GCNConv(dim_in, hidden)
        self.conv2 = GCNConv(hidden, dim_out)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, 0.5, self.training)
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, 0.5, self.training)
        return self.conv2(x, edge_index)


class _MLP(torch.nn.Module):
    def __init__(self, dim_in: int, hidden: int, dim_out: int) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(dim_in, hidden)
        self.lin2 = torch.nn.Linear(hidden, dim_out)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, 0.5, self.training)
        x = F.relu(self.lin1(x))
        x = F.dropout(x, 0.5, self.training)
        return self.lin2(x)


def _train_and_test(model: torch.nn.Module, data: Data, epochs: int = 100) -> float:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    for _ in range(epochs):
        model.train()
        optimizer.zero_grad()
        out = model(data.x, data.edge_index)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        pred = model(data.x, data.edge_index).argmax(-1)
    return float((pred[data.test_mask] == data.y[data.test_mask]).float().mean())


def test_default_graph_is_learnable(default_graph: Data) -> None:
    d = default_graph
    num_classes = int(d.y.max()) + 1
    with torch.random.fork_rng():
        torch.manual_seed(0)
        gcn_acc = _train_and_test(_GCN(d.num_features, 64, num_classes), d)
        torch.manual_seed(0)
        mlp_acc = _train_and_test(_MLP(d.num_features, 64, num_classes), d)
    print(f"default community graph: GCN test acc {gcn_acc:.3f}, MLP test acc {mlp_acc:.3f}")
    assert 0.7 <= gcn_acc <= 0.97
    assert mlp_acc < gcn_acc - 0.3
    assert mlp_acc > 1.0 / num_classes - 0.05  # features are not pure noise either

