"""Per-edge memory the sparse aggregation path keeps after the first forward and backward.

The budgets count the bytes of the tensors the :class:`HaloContext` cache actually references
(every storage reachable from its entries, CSR index and value arrays included, each storage
once), not anything the code reports about itself.  With ``E`` local edges and ``R = N_r + H_r``
rows, the path needs per cached CSR ``E`` int32 column indices and ``E`` float32 values, and
per-row arrays besides.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch_geometric.nn import GCNConv, GINConv, GraphConv, SAGEConv

from lightning_fullgraph.nn.context import HaloContext
from lightning_fullgraph.nn.patch import install_adapters
from lightning_fullgraph.nn.sparse import csr_adjacency

NUM_OWNED, NUM_HALO, NUM_EDGES = 600, 400, 12_000


class _Pending:
    def __init__(self, halo: Tensor) -> None:
        self.halo = halo

    def wait(self) -> Tensor:
        return self.halo


class _Exchanger:
    """The other ranks: fixed halo feature rows, halo degree rows 7."""

    def __init__(self) -> None:
        self.plan = SimpleNamespace(num_owned=NUM_OWNED, num_halo=NUM_HALO, rank=0, world_size=2)
        self.halo_x = torch.randn(NUM_HALO, 64, generator=torch.Generator().manual_seed(1))

    def _halo(self, x: Tensor, exact: bool) -> Tensor:
        if exact:
            return torch.full((NUM_HALO, x.size(1)), 7.0, dtype=x.dtype)
        return self.halo_x[:, : x.size(1)].to(x.dtype)

    def is_static(self, x: Tensor) -> bool:
        # The fixed halo rows stand for remote rows of a layer INPUT: a projection of them
        # (HaloContext.sends_projection) cannot be faked, so every input travels as itself.
        return True

    def exchange(self, x: Tensor, exact: bool = False, score: Any = None, source: Any = None) -> Tensor:
        return torch.cat([x, self._halo(x, exact)], dim=0)

    def halo(self, x: Tensor, exact: bool = False, score: Any = None) -> Tensor:
        return self._halo(x, exact)

    def exchange_async(self, x: Tensor, exact: bool = False, score: Any = None, source: Any = None) -> _Pending:
        return _Pending(self._halo(x, exact))


def _graph() -> Tensor:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, NUM_OWNED + NUM_HALO, (NUM_EDGES,), generator=g)
    dst = torch.randint(0, NUM_OWNED, (NUM_EDGES,), generator=g)
    return torch.stack([src, dst])


def _storage_key(t: Tensor) -> tuple[int, int]:
    """(address, bytes) of a dense tensor's storage: views of one storage share it."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _held_bytes(obj: Any, seen: set[tuple[int, int]], visited: set[int]) -> int:
    """Bytes of every tensor storage reachable from ``obj`` (each storage once)."""
    if isinstance(obj, Tensor):
        if obj.layout == torch.sparse_csr:
            parts = (obj.crow_indices(), obj.col_indices(), obj.values())
            return sum(_held_bytes(t, seen, visited) for t in parts)
        if obj.layout != torch.strided:
            raise AssertionError(f"unexpected layout {obj.layout} in the cache")
        key = _storage_key(obj)
        if key in seen:
            return 0
        seen.add(key)
        return key[1]
    if id(obj) in visited:
        return 0
    visited.add(id(obj))
    if isinstance(obj, dict):
        return sum(_held_bytes(v, seen, visited) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_held_bytes(v, seen, visited) for v in obj)
    slots = getattr(type(obj), "__slots__", ())
    total = sum(_held_bytes(getattr(obj, s, None), seen, visited) for s in slots)
    return total + sum(_held_bytes(v, seen, visited) for v in getattr(obj, "__dict__", {}).values())


def _train_step(kind: str, overlap: bool = False) -> tuple[HaloContext, Tensor]:
    torch.manual_seed(0)
    ctx = HaloContext(_Exchanger(), overlap=overlap)
    make = GCNConv if kind == "gcn" else SAGEConv
    convs = nn.ModuleList([make(16, 32), make(32, 8)])
    install_adapters(convs, ctx)
    edge_index = _graph()
    x = torch.randn(NUM_OWNED, 16)
    h = torch.relu(convs[0](x, edge_index))
    convs[1](h, edge_index).sum().backward()
    return ctx, edge_index


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize(
    ("kind", "per_edge"),
    [
        # CSR and its transpose: 4 + 4 bytes each per entry (self-loops add at most N_r entries).
        ("gcn", 16),
        # ones-valued CSR (4 + 4), the mean operator's values (4; indices shared), the transpose (4 + 4).
        ("sage", 20),
    ],
)
def test_cached_structures_stay_under_a_per_edge_budget(kind: str, per_edge: int, overlap: bool) -> None:
    """After one forward and backward the context's cache holds at most ``per_edge`` bytes per
    local edge plus 48 bytes per row, with or without overlap (whose central and marginal
    blocks together hold every edge once).  Negative controls: the previous layout (int64 CSR
    indices; for GCN also the cached normalised ``[2, E']`` edge list and ``[E']`` weights)
    holds 44 (GCN) / 28 (SAGE) bytes per edge and fails; so does GCN with overlap caching
    ``gcn_norm``'s edge list next to its blocks (36 bytes per edge)."""
    ctx, edge_index = _train_step(kind, overlap)
    held = _held_bytes(ctx.cache._entries, set(), set())
    rows = NUM_OWNED + NUM_HALO
    edges = edge_index.size(1) + NUM_OWNED  # self-loops (GCN) at most
    assert held > 0
    assert held <= per_edge * edges + 48 * rows, f"{held / edge_index.size(1):.1f} bytes per edge"


def test_gcn_sparse_path_keeps_no_edge_list_and_matches_the_edge_list_build() -> None:
    """The GCN CSR is entry for entry the CSR of the normalised edge list (``gcn_norm`` ->
    ``csr_adjacency``), and no ``[E]``-sized index or weight tensor besides the CSR blocks is
    cached.  Negative control: caching ``gcn_norm``'s output (the previous path) leaves its
    ``[2, E']`` edge list in the cache and fails the second check."""
    ctx, edge_index = _train_step("gcn")
    reference = HaloContext(_Exchanger())
    ei, w = reference.gcn_norm(edge_index, None, False, True, torch.float32)
    expected = csr_adjacency(ei, w, NUM_OWNED, NUM_OWNED + NUM_HALO, torch.float32)
    adj = ctx.gcn_adjacency(edge_index, None, False, True, torch.float32)
    assert torch.equal(adj.crow_indices(), expected.crow_indices())
    assert torch.equal(adj.col_indices(), expected.col_indices())
    assert torch.equal(adj.values(), expected.values())
    for _, value in ctx.cache._entries.values():
        for t in value if isinstance(value, tuple) else (value,):
            if isinstance(t, Tensor) and t.layout == torch.strided:
                assert t.numel() < edge_index.size(1), f"an edge-sized tensor {tuple(t.shape)} is cached"


@pytest.mark.parametrize("sparse", [True, False], ids=["csr", "edges"])
def test_gcn_overlap_blocks_match_the_split_of_the_normalised_edges(sparse: bool) -> None:
    """``gcn_split``'s central/marginal blocks are entry for entry ``split`` of ``gcn_norm``'s
    edge list (what the overlap path built before it stopped caching that list), and a GCN
    layer with overlap gives the same output as without.  Negative control: building the
    blocks from the raw (unnormalised) edges fails the value comparison."""
    edge_index = _graph()
    ctx = HaloContext(_Exchanger(), overlap=True)
    got = ctx.gcn_split(edge_index, None, False, True, torch.float32, sparse, torch.float32)
    reference = HaloContext(_Exchanger())
    ei, w = reference.gcn_norm(edge_index, None, False, True, torch.float32)
    want = reference.split(ei, w, sparse=sparse, dtype=torch.float32)
    assert got is not None and want is not None
    assert torch.equal(got.central, want.central) and torch.equal(got.marginal, want.marginal)
    for a, b in ((got.central_block, want.central_block), (got.marginal_block, want.marginal_block)):
        if sparse:
            for part in ("crow_indices", "col_indices", "values"):
                assert torch.equal(getattr(a, part)(), getattr(b, part)())
        else:
            assert torch.equal(a, b)
    if not sparse:
        assert torch.equal(got.central_weight, want.central_weight)
        assert torch.equal(got.marginal_weight, want.marginal_weight)
    torch.manual_seed(0)
    conv = GCNConv(16, 8)
    x = torch.randn(NUM_OWNED, 16)
    outs = []
    for overlap in (False, True):
        layer = HaloContext(_Exchanger(), overlap=overlap)
        with install_adapters(conv, layer):
            outs.append(conv(x, edge_index))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)


def _saved_bytes(conv: nn.Module, overlap: bool, x: Tensor, edge_index: Tensor) -> tuple[int, Tensor, Tensor]:
    """Bytes of the distinct storages autograd saves in one forward of ``conv`` (each once;
    the layer input, alive anyway, not counted), its output, and the input's gradient."""
    xi = x.clone().requires_grad_()
    seen: set[tuple[int, int]] = {_storage_key(xi)}
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        if t.layout == torch.strided:
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += key[1]
        return t

    ctx = HaloContext(_Exchanger(), overlap=overlap)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), install_adapters(conv, ctx):
        out = conv(xi, edge_index)
    out.backward(torch.ones_like(out))
    return total, out.detach(), xi.grad


@pytest.mark.parametrize(
    "make",
    [
        lambda: SAGEConv(32, 32),
        lambda: GINConv(nn.Linear(32, 32)),
        lambda: GraphConv(32, 32, aggr="mean"),
    ],
    ids=["sage", "gin", "graph"],
)
def test_overlap_saves_no_copy_of_the_layer_input(make: Any) -> None:
    """With overlap the conv runs once over all owned rows on the merged central/marginal
    aggregation, so autograd keeps what it keeps without overlap plus the two row-index
    vectors (8 bytes per row): no per-block copies ``x[central]``, ``x[marginal]`` of the
    input for the root term (128 bytes per row here), and the merge keeps neither half.
    Output and input gradient equal the plain path's.  Negative controls (run): one forward
    per block (the previous overlap path) fails the bound for SAGE and GraphConv (GIN's root
    term keeps no copy); a merge through torch's ``index_copy``, whose backward keeps both
    halves, fails it for all three."""
    torch.manual_seed(0)
    conv = make()
    g = torch.Generator().manual_seed(2)
    # half the owned rows read halo rows (marginal), the other half owned rows only (central)
    src = torch.cat(
        [
            torch.randint(0, NUM_OWNED + NUM_HALO, (6000,), generator=g),
            torch.randint(0, NUM_OWNED, (6000,), generator=g),
        ]
    )
    dst = torch.cat(
        [
            torch.randint(0, NUM_OWNED // 2, (6000,), generator=g),
            torch.randint(NUM_OWNED // 2, NUM_OWNED, (6000,), generator=g),
        ]
    )
    edge_index = torch.stack([src, dst])
    x = torch.randn(NUM_OWNED, 32)
    plain, out_plain, grad_plain = _saved_bytes(conv, False, x, edge_index)
    overlap, out_overlap, grad_overlap = _saved_bytes(conv, True, x, edge_index)
    assert overlap <= plain + 16 * NUM_OWNED, f"{(overlap - plain) / NUM_OWNED:.0f} more bytes per row"
    torch.testing.assert_close(out_overlap, out_plain)
    torch.testing.assert_close(grad_overlap, grad_plain)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_widening_gcn_keeps_only_the_owned_aggregation(overlap: bool) -> None:
    """A GCN layer that widens the rows (``F_in <= F_out``) aggregates first,
    ``(A_hat X) W``: autograd keeps the ``[N_r, F_in]`` aggregation (and the weight) for
    ``lin``'s backward, not the ``[N_r + H_r, F_in]`` layer input with its halo rows (nor, with
    overlap, ``x`` and the received rows separately).  Output and input gradient equal PyG's
    own order ``A_hat (X W)``, run on the edge path.  Negative control (run): transforming
    first (``_aggregate_first`` returning False) keeps ``(N_r + H_r) F_in`` floats and fails
    the bound, with and without overlap."""
    torch.manual_seed(0)
    conv = GCNConv(32, 48)
    edge_index = _graph()
    x = torch.randn(NUM_OWNED, 32)
    saved, out, grad = _saved_bytes(conv, overlap, x, edge_index)
    weight_bytes = conv.lin.weight.numel() * 4
    assert saved <= 4 * 32 * NUM_OWNED + weight_bytes + 16 * NUM_OWNED, f"{saved / NUM_OWNED:.0f} bytes per row"
    xi = x.clone().requires_grad_()
    with install_adapters(conv, HaloContext(_Exchanger(), sparse=False)):
        ref = conv(xi, edge_index)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out, ref.detach())
    torch.testing.assert_close(grad, xi.grad)


def _allocations(conv: nn.Module, overlap: bool, x: Tensor, edge_index: Tensor, nbytes: int) -> tuple[int, Tensor, Tensor]:
    """Allocations of exactly ``nbytes`` in one forward of ``conv`` (each counted once, not
    once per op on its call path), its output and the input's gradient."""
    from torch.profiler import ProfilerActivity, profile

    xi = x.clone().requires_grad_()
    with install_adapters(conv, HaloContext(_Exchanger(), overlap=overlap)):
        conv(xi, edge_index)  # builds and caches the CSR blocks
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = conv(xi, edge_index)
    out.backward(torch.ones_like(out))
    sized = [e for e in prof.events() if e.cpu_memory_usage == nbytes]
    return len([e for e in sized if not any(e.cpu_parent is o for o in sized)]), out.detach(), xi.grad


def _own_forward(conv: nn.Module, x: Tensor, edge_index: Tensor) -> tuple[Tensor, Tensor]:
    """``SAGEConv.forward`` itself (PyG's edge path), output and input gradient."""
    xi = x.clone().requires_grad_()
    with install_adapters(conv, HaloContext(_Exchanger(), sparse=False)):
        out = conv(xi, edge_index)
    out.backward(torch.ones_like(out))
    return out.detach(), xi.grad


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize(("out_channels", "expected"), [(32, 2), (8, 0)], ids=["root_in_place", "narrowing"])
def test_sage_fused_forward_allocations(out_channels: int, expected: int, overlap: bool) -> None:
    """Allocations of ``[N_r, 32]`` (the input width) in a SAGE layer's (mean) forward, with
    output and input gradient equal to ``SAGEConv.forward``'s:

    * 32 -> 32: two, the aggregation and ``lin_l``'s output, into which ``lin_r``'s term is
      added in place; ``SAGEConv.forward`` allocates four (``lin_r``'s output and the sum).
    * 32 -> 8 (``lin_l`` narrows): none, the layer aggregates ``X W_l^T`` (only ``[., 8]``
      rows are gathered and summed), not a ``[N_r, 32]`` aggregation.

    Negative controls (run): ``_sage_fusable`` returning False (the conv's own forward on the
    CSR) allocates four and one and fails both; ``narrow = False`` fails the second."""
    torch.manual_seed(0)
    conv = SAGEConv(32, out_channels)
    edge_index, x = _graph(), torch.randn(NUM_OWNED, 32)
    count, out, grad = _allocations(conv, overlap, x, edge_index, NUM_OWNED * 32 * 4)
    assert count == expected
    ref_out, ref_grad = _own_forward(conv, x, edge_index)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)


def test_sage_with_hooked_linears_runs_its_own_forward() -> None:
    """Pruning (a forward pre-hook that recomputes ``lin_r.weight`` from ``weight_orig`` and
    the mask on every call) is honoured: after ``weight_orig`` changes, as an optimizer step
    changes it, the layer's output is ``SAGEConv.forward``'s with the new pruned weight, since a
    conv with hooked linears is not fused.  Negative control (run): ``_sage_fusable`` ignoring
    the linears' hooks reads the stale ``weight`` attribute and fails."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    conv = SAGEConv(32, 32)
    prune.l1_unstructured(conv.lin_r, "weight", amount=0.5)
    edge_index, x = _graph(), torch.randn(NUM_OWNED, 32)
    with install_adapters(conv, HaloContext(_Exchanger())):
        conv(x, edge_index)
        with torch.no_grad():
            conv.lin_r.weight_orig.mul_(3.0)
        out = conv(x, edge_index)
    with install_adapters(conv, HaloContext(_Exchanger(), sparse=False)):
        ref = conv(x, edge_index)
    torch.testing.assert_close(out, ref)
