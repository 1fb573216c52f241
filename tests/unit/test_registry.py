"""The adapter registry: registration handles, what registration accepts and refuses, and why.

Single process: a fake exchanger stands in for the other ranks (:mod:`tests.unit.halo_fakes`).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torch_geometric.nn import (
    APPNP,
    AGNNConv,
    ChebConv,
    GENConv,
    GeneralConv,
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

from lightning_fullgraph.nn import families, registry
from lightning_fullgraph.nn.context import HaloContext
from lightning_fullgraph.nn.errors import UnsupportedConvError
from lightning_fullgraph.nn.patch import install_adapters
from lightning_fullgraph.nn.registry import register_conv_adapter, supported_convs
from tests.unit.halo_fakes import EDGES, F_IN, NUM_OWNED, FakeExchanger, run_conv

# -- registry ------------------------------------------------------------------------------


class _Custom(MessagePassing):
    def forward(self, x: Any, edge_index: Tensor, size: Any = None) -> Tensor:
        return self.propagate(edge_index, x=x if isinstance(x, tuple) else (x, x), size=size)


def test_register_returns_a_removable_handle_that_restores_what_it_replaced() -> None:
    """Negative control: a ``remove()`` that deleted the type's entry (instead of its own
    registration) loses the first registration and the ``is families.bipartite_adapter`` check fails."""
    conv = _Custom()
    assert registry.find_adapter(conv) is None
    first = register_conv_adapter(_Custom, "bipartite")
    second = register_conv_adapter(_Custom, "full_then_slice")
    try:
        assert isinstance(first, RemovableHandle) and isinstance(second, RemovableHandle)
        assert registry.find_adapter(conv) is families.full_then_slice_adapter
        second.remove()
        assert registry.find_adapter(conv) is families.bipartite_adapter
        second.remove()  # idempotent
        assert registry.find_adapter(conv) is families.bipartite_adapter
        assert "_Custom" in supported_convs()
    finally:
        first.remove()
        second.remove()
    assert registry.find_adapter(conv) is None
    assert "_Custom" not in supported_convs()
    with pytest.raises(UnsupportedConvError, match="_Custom"):
        install_adapters(nn.ModuleList([conv]), HaloContext(FakeExchanger()))


def test_removing_an_older_registration_keeps_the_newer_one() -> None:
    conv = _Custom()
    with register_conv_adapter(_Custom, "bipartite") as first:
        with register_conv_adapter(_Custom, "full_then_slice"):
            first.remove()
            assert registry.find_adapter(conv) is families.full_then_slice_adapter
        assert registry.find_adapter(conv) is None


def test_overriding_a_builtin_adapter_is_undone_by_remove() -> None:
    """Negative control: if ``register_conv_adapter`` overwrote ``_ADAPTERS`` in place,
    SAGEConv would have no adapter after ``remove()``."""
    calls = []

    def recording(conv, forward, ctx, x, edge_index, args, kwargs):
        calls.append(type(conv).__name__)
        return families.bipartite_adapter(conv, forward, ctx, x, edge_index, args, kwargs)

    handle = register_conv_adapter(SAGEConv, recording)
    try:
        _, _, patched, _ = run_conv(SAGEConv(F_IN, 2))
        patched.remove()
        assert calls == ["SAGEConv"]
    finally:
        handle.remove()
    assert registry.find_adapter(SAGEConv(F_IN, 2)) is families.bipartite_adapter


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
        exchanger, _, handle, out = run_conv(conv)
        handle.remove()
    x = torch.randn(NUM_OWNED, F_IN, generator=torch.Generator().manual_seed(0))
    full = conv(torch.cat([x, exchanger.halo_x[:, :F_IN]]), EDGES)
    torch.testing.assert_close(out, full[:NUM_OWNED])
    assert registry.find_adapter(TransformerConv(F_IN, 2)) is None
    assert registry.find_adapter(ChebConv(F_IN, 2, K=3)) is None
    with register_conv_adapter(ChebConv, lambda conv, forward, ctx, x, edge_index, args, kwargs: x):
        assert registry.find_adapter(ChebConv(F_IN, 2, K=3)) is not None
    # the failure the check prevents
    conv = TransformerConv(F_IN, 2)
    ctx = HaloContext(FakeExchanger())
    with pytest.raises(TypeError, match="unexpected keyword argument 'size'"):
        families.bipartite_adapter(conv, conv.forward, ctx, torch.randn(NUM_OWNED, F_IN), EDGES, (), {})


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
        exchanger, _, handle, out = run_conv(conv, overlap=overlap)
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
        _, _, handle, out = run_conv(_KConv(1))
        handle.remove()
        assert out.shape == (NUM_OWNED, F_IN)
        with pytest.raises(UnsupportedConvError, match=r"_KConv is multi-hop: needs K halo exchanges.*\(K=3\)"):
            install_adapters(nn.ModuleList([_KConv(3)]), HaloContext(FakeExchanger()))
    def own(conv, forward, ctx, x, edge_index, args, kwargs):
        return families.bipartite_adapter(conv, forward, ctx, x, edge_index, args, kwargs)

    with register_conv_adapter(_KConv, own):
        run_conv(_KConv(3))[2].remove()
