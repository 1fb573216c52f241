"""The halo rows' aggregation scores every message-passing exchange carries, and their cache.

Single process: a fake exchanger stands in for the other ranks (:mod:`tests.unit.halo_fakes`).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch_geometric.nn import GATConv, GATv2Conv, GCNConv, GINConv, GINEConv, GraphConv, SAGEConv

from lightning_fullgraph.nn import context
from lightning_fullgraph.nn.context import HaloContext
from lightning_fullgraph.nn.patch import install_adapters
from lightning_fullgraph.nn.scores import halo_scores
from tests.unit.halo_fakes import EDGES, F_IN, NUM_HALO, NUM_OWNED, WEIGHTS, FakeExchanger, mlp, run_conv

# -- aggregation scores ----------------------------------------------------------------------

S6, S8, S20 = math.sqrt(6), math.sqrt(8), math.sqrt(20)
# GCN, unweighted: hat-degrees (in-degree + self-loop) of owned 0, 1, 2 are 3, 4, 2; halo 2, 5.
GCN = [1 / math.sqrt(3 * 2) + 1 / math.sqrt(4 * 2) + 1 / math.sqrt(2 * 2), 1 / math.sqrt(4 * 5)]
# GCN, weighted: owned hat-degrees 0.5 + 3 + 1 = 4.5, 2 + 1 + 1.5 + 1 = 5.5, 0.25 + 1 = 1.25.
GCN_W = [0.5 / math.sqrt(4.5 * 2) + 2.0 / math.sqrt(5.5 * 2) + 0.25 / math.sqrt(1.25 * 2), 1.0 / math.sqrt(5.5 * 5)]
# improved=True, weighted: self-loops weigh 2: 5.5, 6.5, 2.25.
GCN_IW = [0.5 / math.sqrt(5.5 * 2) + 2.0 / math.sqrt(6.5 * 2) + 0.25 / math.sqrt(2.25 * 2), 1.0 / math.sqrt(6.5 * 5)]
# no self-loops: owned degrees 2, 3, 1.
GCN_NL = [1 / math.sqrt(2 * 2) + 1 / math.sqrt(3 * 2) + 1 / math.sqrt(1 * 2), 1 / math.sqrt(3 * 5)]
MEAN = [1 / 2 + 1 / 3 + 1 / 1, 1 / 3]
SUM = [3.0, 1.0]
# GAT: softmax over in-edges + one self-loop: group sizes 3, 4, 2.
SOFTMAX = [1 / 3 + 1 / 4 + 1 / 2, 1 / 4]

SCORE_CASES = {
    "gcn": (lambda: GCNConv(F_IN, 2), False, GCN),
    "gcn_weighted": (lambda: GCNConv(F_IN, 2), True, GCN_W),
    "gcn_improved_weighted": (lambda: GCNConv(F_IN, 2, improved=True), True, GCN_IW),
    "gcn_no_self_loops": (lambda: GCNConv(F_IN, 2, add_self_loops=False), False, GCN_NL),
    "gcn_no_normalize_weighted": (lambda: GCNConv(F_IN, 2, normalize=False), True, [0.5 + 2.0 + 0.25, 1.0]),
    "sage_mean": (lambda: SAGEConv(F_IN, 2), False, MEAN),
    "sage_sum": (lambda: SAGEConv(F_IN, 2, aggr="sum"), False, SUM),
    "sage_max": (lambda: SAGEConv(F_IN, 2, aggr="max"), False, SUM),
    "gin": (lambda: GINConv(mlp()), False, SUM),
    "graph_weighted": (lambda: GraphConv(F_IN, 2), True, [0.5 + 2.0 + 0.25, 1.0]),
    "graph_mean_weighted": (lambda: GraphConv(F_IN, 2, aggr="mean"), True, [0.5 / 2 + 2.0 / 3 + 0.25 / 1, 1.0 / 3]),
    "gat": (lambda: GATConv(F_IN, 2, heads=2), False, SOFTMAX),
    "gatv2": (lambda: GATv2Conv(F_IN, 2), False, SOFTMAX),
    "gat_no_self_loops": (lambda: GATConv(F_IN, 2, add_self_loops=False), False, MEAN),
}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("case", list(SCORE_CASES))
def test_halo_scores_match_hand_computed_coefficients(case: str, overlap: bool) -> None:
    """Each message-passing exchange carries a score equal to the hand-computed
    ``a_j = sum_{j->i} |c_ij|``; the degree exchange (``exact=True``) carries none.

    Negative control: scoring GCN with 1/in-degree (the SAGE-mean rule) gives
    ``[1.8333, 0.3333]`` instead of ``[1.2618, 0.2236]`` and fails the GCN cases (checked
    below)."""
    factory, weighted, expected = SCORE_CASES[case]
    torch.manual_seed(0)
    exchanger, _, handle, _ = run_conv(factory(), weighted=weighted, overlap=overlap)
    handle.remove()
    scores = exchanger.scores()
    assert len(scores) == 1 and callable(scores[0])
    assert all(score is None for exact, score in exchanger.calls if exact)
    got = scores[0]()
    assert got.dtype == torch.float32 and got.shape == (NUM_HALO,)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32))
    if case == "gcn":
        wrong = halo_scores(EDGES, None, ("mean",), NUM_OWNED, NUM_HALO)
        assert not torch.allclose(wrong, got)


def test_negative_weights_count_by_magnitude() -> None:
    weights = -WEIGHTS
    exchanger = FakeExchanger()
    conv = GraphConv(F_IN, 2)
    install_adapters(nn.ModuleList([conv]), HaloContext(exchanger))
    conv(torch.randn(NUM_OWNED, F_IN), EDGES, weights)
    torch.testing.assert_close(exchanger.scores()[0](), torch.tensor([2.75, 1.0]))


def test_gat_self_loops_are_replaced_not_counted_twice() -> None:
    """PyG's GAT drops an existing self-loop and adds one: node 1's group stays 4."""
    edges = torch.cat([EDGES, torch.tensor([[1], [1]])], dim=1)
    exchanger, _, _, _ = run_conv(GATConv(F_IN, 2), edges=edges)
    torch.testing.assert_close(exchanger.scores()[0](), torch.tensor(SOFTMAX))


def test_gine_with_edge_features_scores_as_a_sum() -> None:
    """GINE sums ``relu(x_j + lin(e_ji))``: each x_j enters with slope at most 1."""
    attr = torch.randn(EDGES.size(1), 2)
    exchanger, _, _, _ = run_conv(GINEConv(mlp(), edge_dim=2), edge_attr=attr)
    torch.testing.assert_close(exchanger.scores()[0](), torch.tensor(SUM))


def test_scores_are_lazy_and_cached_per_conv_configuration(monkeypatch) -> None:
    """Never calling the score computes nothing; calling it again (same graph, same conv
    options) reuses the tensor; another normalisation on the same graph is a new entry."""
    built = []
    real = halo_scores

    def counting(*args: Any) -> Tensor:
        built.append(args[2])
        return real(*args)

    monkeypatch.setattr(context, "halo_scores", counting)
    exchanger = FakeExchanger()
    ctx = HaloContext(exchanger)
    plain, improved = GCNConv(F_IN, 2), GCNConv(F_IN, 2, improved=True)
    install_adapters(nn.ModuleList([plain, improved]), ctx)
    x = torch.randn(NUM_OWNED, F_IN)
    for _ in range(3):
        plain(x, EDGES, WEIGHTS)
    assert built == []
    first, second = exchanger.scores()[0](), exchanger.scores()[1]()
    assert first is second and len(built) == 1
    improved(x, EDGES, WEIGHTS)
    other = exchanger.scores()[-1]()
    assert len(built) == 2
    torch.testing.assert_close(first, torch.tensor(GCN_W, dtype=torch.float32))
    torch.testing.assert_close(other, torch.tensor(GCN_IW, dtype=torch.float32))
    # a new weight tensor (or an in-place change) is a new graph
    WEIGHTS_2 = WEIGHTS.clone()
    plain(x, EDGES, WEIGHTS_2)
    exchanger.scores()[-1]()
    assert len(built) == 3
