"""Installation handles: patching a module's convs, and restoring them exactly.

Single process: a fake exchanger stands in for the other ranks (:mod:`tests.unit.halo_fakes`).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch_geometric.nn import GATConv, GATv2Conv, GCNConv, GINConv, GraphConv, SAGEConv

from lightning_fullgraph.nn.context import HaloContext
from lightning_fullgraph.nn.patch import AdapterHandle, install_adapters, uninstall_adapters
from tests.unit.halo_fakes import F_IN, NUM_HALO, NUM_OWNED, FakeExchanger, mlp, run_conv

# -- install / remove ------------------------------------------------------------------------

CONVS = {
    "gcn": lambda: GCNConv(F_IN, 2),
    "gcn_cached": lambda: GCNConv(F_IN, 2, cached=True),
    "sage": lambda: SAGEConv(F_IN, 2),
    "sage_max": lambda: SAGEConv(F_IN, 2, aggr="max"),
    "gin": lambda: GINConv(mlp()),
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
    _, _, handle, out = run_conv(conv, overlap=overlap)
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
    _, _, handle, out = run_conv(conv)
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
    conv = GINConv(mlp())
    uninstall_adapters([])
    uninstall_adapters(None)
    _, _, handle, _ = run_conv(conv)
    uninstall_adapters(handle.convs)  # a plain list of convs, as before
    assert "forward" not in conv.__dict__
    _, _, handle, _ = run_conv(conv)
    uninstall_adapters(handle)
    assert "forward" not in conv.__dict__ and len(handle) == 0
