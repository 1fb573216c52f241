"""Adapter registry and installation handles; the halo rows' aggregation scores.

Single process: a fake exchanger stands in for the other ranks (fixed halo rows, fixed halo
degrees for GCN's global normalisation) and records what every exchange was given.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torch_geometric.nn import (
    APPNP,
    AGNNConv,
    ChebConv,
    GATConv,
    GATv2Conv,
    GCNConv,
    GENConv,
    GeneralConv,
    GINConv,
    GINEConv,
    GraphConv,
    LEConv,
    MessagePassing,
    MFConv,
    MixHopConv,
    NNConv,
    ResGatedGraphConv,
    RGATConv,
    SAGEConv,
    SGConv,
    SimpleConv,
    SSGConv,
    TAGConv,
    TransformerConv,
    WLConvContinuous,
)

from lightning_fullgraph.nn import adapters
from lightning_fullgraph.nn.adapters import (
    AdapterHandle,
    HaloContext,
    UnsupportedConvError,
    install_adapters,
    register_conv_adapter,
    supported_convs,
    uninstall_adapters,
)

F_IN = 3

# A rank's local graph: owned nodes 0..3, halo rows 0, 1 = local ids 4, 5.
#   4 -> 0, 4 -> 1, 5 -> 1, 1 -> 0, 2 -> 1, 4 -> 2, 0 -> 3
# in-degrees (no self-loops): node 0: 2, node 1: 3, node 2: 1, node 3: 1 (node 3 is central).
EDGES = torch.tensor([[4, 4, 5, 1, 2, 4, 0], [0, 1, 1, 0, 1, 2, 3]])
WEIGHTS = torch.tensor([0.5, 2.0, 1.0, 3.0, 1.5, 0.25, 0.7])
NUM_OWNED, NUM_HALO = 4, 2
# Global GCN degrees of the halo nodes (self-loop included), known only to their owners.
HALO_DEGREE = torch.tensor([2.0, 5.0])


class _Pending:
    def __init__(self, halo: Tensor) -> None:
        self.halo = halo

    def wait(self) -> Tensor:
        return self.halo


class FakeExchanger:
    """The other ranks: halo feature rows are fixed random rows, degree rows ``HALO_DEGREE``."""

    def __init__(self) -> None:
        self.plan = SimpleNamespace(num_owned=NUM_OWNED, num_halo=NUM_HALO, rank=0, world_size=2)
        self.calls: list[tuple[bool, Any]] = []
        self.halo_x = torch.randn(NUM_HALO, 64, generator=torch.Generator().manual_seed(1))

    def _halo(self, x: Tensor, exact: bool) -> Tensor:
        if exact:
            return HALO_DEGREE.to(x.dtype).view(-1, 1)
        return self.halo_x[:, : x.size(1)].to(x.dtype)

    def exchange(self, x: Tensor, exact: bool = False, score: Any = None) -> Tensor:
        self.calls.append((exact, score))
        return torch.cat([x, self._halo(x, exact)], dim=0)

    def halo(self, x: Tensor, exact: bool = False, score: Any = None) -> Tensor:
        self.calls.append((exact, score))
        return self._halo(x, exact)

    def exchange_async(self, x: Tensor, exact: bool = False, score: Any = None) -> _Pending:
        self.calls.append((exact, score))
        return _Pending(self._halo(x, exact))

    def scores(self) -> list[Any]:
        return [score for exact, score in self.calls if not exact]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(F_IN, 4), nn.ReLU(), nn.Linear(4, 4))


def _run(conv: MessagePassing, weighted: bool = False, edges: Tensor = EDGES, overlap: bool = False,
         edge_attr: Tensor | None = None):
    exchanger = FakeExchanger()
    ctx = HaloContext(exchanger, overlap=overlap)
    handle = install_adapters(nn.ModuleList([conv]), ctx)
    x = torch.randn(NUM_OWNED, F_IN, generator=torch.Generator().manual_seed(0))
    if weighted:
        out = conv(x, edges, WEIGHTS)
    elif edge_attr is not None:
        out = conv(x, edges, edge_attr)
    else:
        out = conv(x, edges)
    return exchanger, ctx, handle, out


# -- registry ------------------------------------------------------------------------------


class _Custom(MessagePassing):
    def forward(self, x: Any, edge_index: Tensor, size: Any = None) -> Tensor:
        return self.propagate(edge_index, x=x if isinstance(x, tuple) else (x, x), size=size)


def test_register_returns_a_removable_handle_that_restores_what_it_replaced() -> None:
    """Negative control: a ``remove()`` that deleted the type's entry (instead of its own
    registration) loses the first registration and the ``is adapters._bipartite`` check fails."""
    conv = _Custom()
    assert adapters._find_adapter(conv) is None
    first = register_conv_adapter(_Custom, "bipartite")
    second = register_conv_adapter(_Custom, "full_then_slice")
    try:
        assert isinstance(first, RemovableHandle) and isinstance(second, RemovableHandle)
        assert adapters._find_adapter(conv) is adapters._full_then_slice
        second.remove()
        assert adapters._find_adapter(conv) is adapters._bipartite
        second.remove()  # idempotent
        assert adapters._find_adapter(conv) is adapters._bipartite
        assert "_Custom" in supported_convs()
    finally:
        first.remove()
        second.remove()
    assert adapters._find_adapter(conv) is None
    assert "_Custom" not in supported_convs()
    with pytest.raises(UnsupportedConvError, match="_Custom"):
        install_adapters(nn.ModuleList([conv]), HaloContext(FakeExchanger()))


def test_removing_an_older_registration_keeps_the_newer_one() -> None:
    conv = _Custom()
    with register_conv_adapter(_Custom, "bipartite") as first:
        with register_conv_adapter(_Custom, "full_then_slice"):
            first.remove()
            assert adapters._find_adapter(conv) is adapters._full_then_slice
        assert adapters._find_adapter(conv) is None


def test_overriding_a_builtin_adapter_is_undone_by_remove() -> None:
    """Negative control: if ``register_conv_adapter`` overwrote ``_ADAPTERS`` in place,
    SAGEConv would have no adapter after ``remove()``."""
    calls = []

    def recording(conv, forward, ctx, x, edge_index, args, kwargs):
        calls.append(type(conv).__name__)
        return adapters._bipartite(conv, forward, ctx, x, edge_index, args, kwargs)

    handle = register_conv_adapter(SAGEConv, recording)
    try:
        _, _, patched, _ = _run(SAGEConv(F_IN, 2))
        patched.remove()
        assert calls == ["SAGEConv"]
    finally:
        handle.remove()
    assert adapters._find_adapter(SAGEConv(F_IN, 2)) is adapters._bipartite


def test_register_refuses_non_callables() -> None:
    with pytest.raises(TypeError, match="callable"):
        register_conv_adapter(_Custom, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown adapter kind"):
        register_conv_adapter(_Custom, "nope")


# -- what registration accepts, and the hint that goes with it ------------------------------

# (factory, accepted as "bipartite", what the refusal says)
REGISTRATION_CASES = {
    "gen": (lambda: GENConv(F_IN, 2), True, None),
    "mf": (lambda: MFConv(F_IN, 2), True, None),
    "simple": (lambda: SimpleConv(), True, None),
    "general": (lambda: GeneralConv(F_IN, 2), True, None),
    "nn": (lambda: NNConv(F_IN, 2, nn.Linear(1, F_IN * 2)), True, None),
    "wl": (lambda: WLConvContinuous(), True, None),
    "transformer": (lambda: TransformerConv(F_IN, 2), False, "TransformerConv.forward takes no `size` argument"),
    "res_gated": (lambda: ResGatedGraphConv(F_IN, 2), False, "ResGatedGraphConv.forward takes no `size`"),
    "le": (lambda: LEConv(F_IN, 2), False, "LEConv.forward takes no `size` argument"),
    "rgat": (lambda: RGATConv(F_IN, 2, num_relations=2), False, "RGATConv.forward's `x` is annotated `Tensor`"),
    "agnn": (lambda: AGNNConv(), False, "AGNNConv.forward's `x` is annotated `Tensor`"),
    "cheb": (lambda: ChebConv(F_IN, 2, K=3), False, "multi-hop: needs K halo exchanges per layer, not supported"),
    "tag": (lambda: TAGConv(F_IN, 2, K=2), False, "multi-hop: needs K halo exchanges per layer, not supported"),
    "sg": (lambda: SGConv(F_IN, 2, K=2), False, "multi-hop: needs K halo exchanges per layer, not supported"),
    "ssg": (lambda: SSGConv(F_IN, 2, alpha=0.1, K=2), False, "multi-hop: needs K halo exchanges"),
    "appnp": (lambda: APPNP(K=2, alpha=0.1), False, "multi-hop: needs K halo exchanges per layer, not supported"),
    "mixhop": (lambda: MixHopConv(F_IN, 2), False, "multi-hop: needs K halo exchanges per layer, not supported"),
}


@pytest.mark.parametrize("case", list(REGISTRATION_CASES))
def test_the_register_hint_appears_exactly_where_registration_is_accepted(case: str) -> None:
    """Installing an unsupported PyG conv raises ``UnsupportedConvError``; its
    ``register_conv_adapter(..., 'bipartite')`` hint appears iff that registration is accepted,
    refusals carry the reason, and a multi-hop conv's error does not mention registration.

    Negative control: the old unconditional hint puts ``register_conv_adapter(TransformerConv,
    'bipartite')`` (and the ChebConv one) in the message while the old registration accepted
    every class, so ``hinted == accepted`` held but ``accepted`` was ``True`` for the refused
    cases and the ``expected`` comparison fails."""
    factory, expected, reason = REGISTRATION_CASES[case]
    conv = factory()
    name = type(conv).__name__
    with pytest.raises(UnsupportedConvError, match=f"{name} cannot be made exact") as err:
        install_adapters(nn.ModuleList([conv]), HaloContext(FakeExchanger()))
    message = str(err.value)
    hinted = f"register_conv_adapter({name}, 'bipartite')" in message
    try:
        handle = register_conv_adapter(type(conv), "bipartite")
    except UnsupportedConvError as refused:
        accepted = False
        assert reason is not None and reason in str(refused), str(refused)
        assert reason in message
    else:
        accepted = True
        handle.remove()
    assert hinted == accepted == expected, message
    if reason is not None and "multi-hop" in reason:
        assert "register_conv_adapter" not in message and "ConvAdapter" not in message
    assert name not in supported_convs()


def test_transformer_and_cheb_are_refused_at_registration_with_the_reason() -> None:
    """The issue's two cases fail at ``register_conv_adapter``, not 30 s later inside forward,
    and leave nothing registered; a callable adapter (the user's own) is not checked.

    Negative control: without the check, ``register_conv_adapter(TransformerConv, 'bipartite')``
    returns a handle and the first forward raises ``unexpected keyword argument 'size'``
    (reproduced below with the adapter called directly)."""
    with pytest.raises(UnsupportedConvError, match=r"TransformerConv\.forward takes no `size` argument.*full_then_slice"):
        register_conv_adapter(TransformerConv, "bipartite")
    with pytest.raises(UnsupportedConvError, match="ChebConv is multi-hop: needs K halo exchanges per layer"):
        register_conv_adapter(ChebConv, "bipartite")
    with pytest.raises(UnsupportedConvError, match="ChebConv is multi-hop"):
        register_conv_adapter(ChebConv, "full_then_slice")
    # full_then_slice passes one feature matrix and no size: TransformerConv takes it, exactly.
    conv = TransformerConv(F_IN, 2)
    with register_conv_adapter(TransformerConv, "full_then_slice"):
        exchanger, _, handle, out = _run(conv)
        handle.remove()
    x = torch.randn(NUM_OWNED, F_IN, generator=torch.Generator().manual_seed(0))
    full = conv(torch.cat([x, exchanger.halo_x[:, :F_IN]]), EDGES)
    torch.testing.assert_close(out, full[:NUM_OWNED])
    assert adapters._find_adapter(TransformerConv(F_IN, 2)) is None
    assert adapters._find_adapter(ChebConv(F_IN, 2, K=3)) is None
    with register_conv_adapter(ChebConv, lambda conv, forward, ctx, x, edge_index, args, kwargs: x):
        assert adapters._find_adapter(ChebConv(F_IN, 2, K=3)) is not None
    # the failure the check prevents
    conv = TransformerConv(F_IN, 2)
    ctx = HaloContext(FakeExchanger())
    with pytest.raises(TypeError, match="unexpected keyword argument 'size'"):
        adapters._bipartite(conv, conv.forward, ctx, torch.randn(NUM_OWNED, F_IN), EDGES, (), {})


ACCEPTED_CONVS = {
    # eval(): GENConv's default MLP holds a BatchNorm, whose batch statistics span the rows
    # (per-partition under the strategy, which warns about them).
    "gen": lambda: GENConv(F_IN, 2).eval(),
    "mf": lambda: MFConv(F_IN, 2),
    "general": lambda: GeneralConv(F_IN, 2),
}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind", list(ACCEPTED_CONVS))
def test_an_accepted_registration_runs_exactly(kind: str, overlap: bool) -> None:
    """A conv accepted as ``"bipartite"`` (not supported by default) runs through a
    ``HaloContext`` and its owned rows equal the unpatched conv's on the full graph
    (owned rows followed by the halo rows the fake exchanger hands out).

    Negative control: the same conv without the halo rows (zeros in their place) gives other
    owned rows (checked below), so the comparison sees whether the halo was used."""
    torch.manual_seed(0)
    conv = ACCEPTED_CONVS[kind]()
    twin = copy.deepcopy(conv)
    with pytest.raises(UnsupportedConvError):
        install_adapters(nn.ModuleList([conv]), HaloContext(FakeExchanger()))
    with register_conv_adapter(type(conv), "bipartite"):
        exchanger, _, handle, out = _run(conv, overlap=overlap)
        handle.remove()
    x = torch.randn(NUM_OWNED, F_IN, generator=torch.Generator().manual_seed(0))
    halo = exchanger.halo_x[:, :F_IN]
    expected = twin(torch.cat([x, halo]), EDGES)[:NUM_OWNED]
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected)
    without_halo = twin(torch.cat([x, torch.zeros_like(halo)]), EDGES)[:NUM_OWNED]
    assert not torch.allclose(without_halo, expected)


class _KConv(_Custom):
    def __init__(self, K: int) -> None:
        super().__init__()
        self.K = K


def test_a_registered_kind_refuses_a_multi_hop_instance_at_installation() -> None:
    """A class registered with a kind installs when its instance's ``K`` is 1 and is refused
    (multi-hop) at installation when it is above 1; a callable adapter is the user's and
    installs either way.

    Negative control: ``K=1`` installs and runs (a check that refused every conv with a ``K``
    attribute fails here)."""
    with register_conv_adapter(_KConv, "bipartite"):
        _, _, handle, out = _run(_KConv(1))
        handle.remove()
        assert out.shape == (NUM_OWNED, F_IN)
        with pytest.raises(UnsupportedConvError, match=r"_KConv is multi-hop: needs K halo exchanges.*\(K=3\)"):
            install_adapters(nn.ModuleList([_KConv(3)]), HaloContext(FakeExchanger()))
    def own(conv, forward, ctx, x, edge_index, args, kwargs):
        return adapters._bipartite(conv, forward, ctx, x, edge_index, args, kwargs)

    with register_conv_adapter(_KConv, own):
        _run(_KConv(3))[2].remove()


# -- install / remove ------------------------------------------------------------------------

CONVS = {
    "gcn": lambda: GCNConv(F_IN, 2),
    "gcn_cached": lambda: GCNConv(F_IN, 2, cached=True),
    "sage": lambda: SAGEConv(F_IN, 2),
    "sage_max": lambda: SAGEConv(F_IN, 2, aggr="max"),
    "gin": lambda: GINConv(_mlp()),
    "graph": lambda: GraphConv(F_IN, 2),
    "gat": lambda: GATConv(F_IN, 2, heads=2),
    "gatv2": lambda: GATv2Conv(F_IN, 2),
}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind", list(CONVS))
def test_handle_remove_restores_the_conv_exactly(kind: str, overlap: bool) -> None:
    """After ``remove()`` the instance dict holds exactly what it held before installation
    and the conv computes what its never-patched twin computes.

    Negative control: leaving ``message_and_aggregate`` or the patch record behind fails the
    dict comparison; leaving ``forward`` behind fails the twin comparison (the patched
    forward refuses a graph of more than ``N_r`` rows)."""
    torch.manual_seed(0)
    conv = CONVS[kind]()
    twin = copy.deepcopy(conv)
    before = dict(conv.__dict__)
    _, _, handle, out = _run(conv, overlap=overlap)
    assert out.size(0) == NUM_OWNED
    assert isinstance(handle, AdapterHandle) and list(handle) == [conv]
    assert "forward" in conv.__dict__
    handle.remove()
    assert conv.__dict__.keys() == before.keys()
    assert all(conv.__dict__[k] is before[k] for k in before), [k for k in before if conv.__dict__[k] is not before[k]]
    handle.remove()  # idempotent
    uninstall_adapters(handle)
    x = torch.randn(NUM_OWNED + NUM_HALO, F_IN)
    full = torch.tensor([[4, 4, 5, 1, 2, 4, 0, 3], [0, 1, 1, 0, 1, 2, 3, 5]])
    torch.testing.assert_close(conv(x, full), twin(x, full), rtol=0, atol=0)


def test_a_user_instance_forward_is_put_back() -> None:
    """Negative control: popping ``forward`` on removal (the old uninstall) loses it."""
    conv = SAGEConv(F_IN, 2)

    def user_forward(*args: Any, **kwargs: Any) -> Tensor:
        return SAGEConv.forward(conv, *args, **kwargs) * 2

    conv.forward = user_forward
    _, _, handle, out = _run(conv)
    assert conv.__dict__["forward"] is not user_forward
    handle.remove()
    assert conv.__dict__["forward"] is user_forward


def test_a_stale_handle_does_not_undo_a_newer_installation() -> None:
    conv = GCNConv(F_IN, 2)
    module = nn.ModuleList([conv])
    ctx = HaloContext(FakeExchanger())
    old = install_adapters(module, ctx)
    new = install_adapters(module, ctx)
    old.remove()
    assert "forward" in conv.__dict__
    new.remove()
    assert "forward" not in conv.__dict__ and "message_and_aggregate" not in conv.__dict__


def test_uninstall_accepts_handles_lists_and_nothing() -> None:
    conv = GINConv(_mlp())
    uninstall_adapters([])
    uninstall_adapters(None)
    _, _, handle, _ = _run(conv)
    uninstall_adapters(handle.convs)  # a plain list of convs, as before
    assert "forward" not in conv.__dict__
    _, _, handle, _ = _run(conv)
    uninstall_adapters(handle)
    assert "forward" not in conv.__dict__ and len(handle) == 0


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
    "gin": (lambda: GINConv(_mlp()), False, SUM),
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
    exchanger, _, handle, _ = _run(factory(), weighted=weighted, overlap=overlap)
    handle.remove()
    scores = exchanger.scores()
    assert len(scores) == 1 and callable(scores[0])
    assert all(score is None for exact, score in exchanger.calls if exact)
    got = scores[0]()
    assert got.dtype == torch.float32 and got.shape == (NUM_HALO,)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32))
    if case == "gcn":
        wrong = adapters.halo_scores(EDGES, None, ("mean",), NUM_OWNED, NUM_HALO)
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
    exchanger, _, _, _ = _run(GATConv(F_IN, 2), edges=edges)
    torch.testing.assert_close(exchanger.scores()[0](), torch.tensor(SOFTMAX))


def test_gine_with_edge_features_scores_as_a_sum() -> None:
    """GINE sums ``relu(x_j + lin(e_ji))``: each x_j enters with slope at most 1."""
    attr = torch.randn(EDGES.size(1), 2)
    exchanger, _, _, _ = _run(GINEConv(_mlp(), edge_dim=2), edge_attr=attr)
    torch.testing.assert_close(exchanger.scores()[0](), torch.tensor(SUM))


def test_scores_are_lazy_and_cached_per_conv_configuration(monkeypatch) -> None:
    """Never calling the score computes nothing; calling it again (same graph, same conv
    options) reuses the tensor; another normalisation on the same graph is a new entry."""
    built = []
    real = adapters.halo_scores

    def counting(*args: Any) -> Tensor:
        built.append(args[2])
        return real(*args)

    monkeypatch.setattr(adapters, "halo_scores", counting)
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
