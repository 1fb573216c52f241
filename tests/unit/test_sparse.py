"""CSR adjacency blocks and their cache (``lightning_fullgraph.nn.sparse``)."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.utils import scatter

from lightning_fullgraph.nn.sparse import (
    DerivedCache,
    csr_adjacency,
    csr_mm,
    csr_transpose,
    mean_operator,
    split_blocks,
    spmm,
)


def _bipartite(num_dst: int = 30, num_src: int = 50, num_edges: int = 200, seed: int = 0, max_src: int | None = None):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, max_src or num_src, (num_edges,), generator=g)
    dst = torch.randint(0, num_dst - 3, (num_edges,), generator=g)  # the last 3 rows: no in-edge
    edge_index = torch.stack([src, dst])
    edge_index = torch.cat([edge_index, edge_index[:, :5]], dim=1)  # duplicates
    weight = torch.rand(edge_index.size(1), generator=g)
    x = torch.randn(num_src, 6, generator=g, dtype=torch.float64)
    return edge_index, weight, x


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("weighted", [False, True])
def test_csr_matches_scatter_over_edges(reduce: str, weighted: bool) -> None:
    """``A^T X`` with reduction equals gathering messages per edge and scattering them,
    duplicates and empty rows included.  Negative control: building the CSR without the
    stable (destination, source) sort scrambles rows and fails; dropping duplicates changes
    sum and mean."""
    edge_index, weight, x = _bipartite()
    w = weight if weighted else None
    adj = csr_adjacency(edge_index, w, 30, 50, torch.float64)
    assert adj.layout == torch.sparse_csr and adj.shape == (30, 50) and adj.dtype == torch.float64
    assert adj.values().numel() == edge_index.size(1)
    msg = x[edge_index[0]] * (w.to(x.dtype).view(-1, 1) if weighted else 1.0)
    expected = scatter(msg, edge_index[1], dim=0, dim_size=30, reduce=reduce)
    actual = torch.sparse.mm(adj, x, reduce)
    torch.testing.assert_close(actual, expected)


def test_csr_gradient_matches_edge_path() -> None:
    """The gradient through ``torch.sparse.mm`` equals the edge path's (index_add of messages)."""
    edge_index, weight, x = _bipartite()
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    g = torch.randn(30, 6, dtype=torch.float64)
    torch.sparse.mm(csr_adjacency(edge_index, weight, 30, 50, torch.float64), x1).backward(g)
    scatter(x2[edge_index[0]] * weight.double().view(-1, 1), edge_index[1], 0, dim_size=30).backward(g)
    torch.testing.assert_close(x1.grad, x2.grad)


@pytest.mark.parametrize("sparse", [False, True])
def test_split_blocks_recombine_to_full_aggregation(sparse: bool) -> None:
    """Central rows use owned sources only; merging central and marginal outputs gives the
    full aggregation.  Negative control: swapping the two index sets in ``merge`` fails."""
    num_owned, num_full = 30, 50
    # sources mostly owned, so that many destinations are central
    edge_index, weight, x = _bipartite(num_edges=60, max_src=33)
    blocks = split_blocks(edge_index, weight, num_owned, num_full, sparse, torch.float64)
    assert blocks is not None
    assert torch.equal(torch.sort(torch.cat([blocks.central, blocks.marginal])).values, torch.arange(num_owned))
    full = scatter(x[edge_index[0]] * weight.double().view(-1, 1), edge_index[1], 0, dim_size=num_owned)
    if sparse:
        assert blocks.central_block.shape == (blocks.central.numel(), num_owned)
        out_c = torch.sparse.mm(blocks.central_block, x[:num_owned])  # no halo row needed
        out_m = torch.sparse.mm(blocks.marginal_block, x)
    else:
        assert int(blocks.central_block[0].max()) < num_owned
        ei_c, ei_m = blocks.central_block, blocks.marginal_block
        out_c = scatter(x[ei_c[0]] * blocks.central_weight.double().view(-1, 1), ei_c[1], 0,
                        dim_size=blocks.central.numel())
        out_m = scatter(x[ei_m[0]] * blocks.marginal_weight.double().view(-1, 1), ei_m[1], 0,
                        dim_size=blocks.marginal.numel())
    torch.testing.assert_close(blocks.merge(out_c, out_m), full)


def test_split_is_none_without_central_or_marginal_rows() -> None:
    edge_index = torch.tensor([[5, 6], [0, 1]])  # both destinations have a halo source
    assert split_blocks(edge_index, None, 2, 7, sparse=True) is None
    edge_index = torch.tensor([[1, 0], [0, 1]])  # no halo source at all
    assert split_blocks(edge_index, None, 2, 7, sparse=True) is None


def test_derived_cache_rebuilds_on_new_or_modified_tensors() -> None:
    """Negative control: a cache keyed on ``id`` alone returns a stale value after the
    in-place change and after a new tensor reuses the id."""
    cache = DerivedCache()
    calls = []

    def build(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t.sum()

    def lookup(t: torch.Tensor, tag: str = "s") -> torch.Tensor:
        return cache.get((t, None), tag, lambda: build(t))

    a = torch.ones(4)
    assert lookup(a) == 4
    assert lookup(a) == 4
    assert len(calls) == 1
    a.add_(1)  # in place: version changes
    assert lookup(a) == 8
    assert len(calls) == 2
    assert lookup(a, "other") == 8  # another tag is another value
    assert len(calls) == 3
    del a
    b = torch.zeros(4)
    assert lookup(b) == 0
    # dead sources are purged when a new entry goes in
    assert len(cache) == 1


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_spmm_with_cached_transpose_matches_torch_autograd(reduce: str) -> None:
    """Forward and gradient of :func:`spmm` (transpose built once) equal torch's own
    ``torch.sparse.mm`` autograd.  Negative control: a backward that multiplies by ``A``
    instead of ``A^T`` (non-square here) fails with a shape error, one with stale values fails
    the comparison."""
    edge_index, weight, x = _bipartite()
    adj = csr_adjacency(edge_index, weight, 30, 50, torch.float64)
    op = adj if reduce == "sum" else mean_operator(adj)
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    g = torch.randn(30, 6, dtype=torch.float64)
    out1 = spmm(op, csr_transpose(op), x1)
    out2 = torch.sparse.mm(adj, x2, reduce)
    torch.testing.assert_close(out1, out2)
    out1.backward(g)
    out2.backward(g)
    torch.testing.assert_close(x1.grad, x2.grad)


def test_empty_adjacency() -> None:
    """A rank with no local edge: every product is zeros of the right shape."""
    adj = csr_adjacency(torch.empty(2, 0, dtype=torch.long), None, 3, 5, torch.float32)
    x = torch.randn(5, 4, requires_grad=True)
    out = spmm(mean_operator(adj), csr_transpose(mean_operator(adj)), x)
    out.sum().backward()
    assert out.shape == (3, 4) and not out.any() and not x.grad.any()


def _reference_transpose(adj: torch.Tensor) -> torch.Tensor:
    """The previous ``csr_transpose``: COO rows and columns stacked, re-sorted by the combined key."""
    d, n = adj.shape
    crow, col, val = adj.crow_indices().long(), adj.col_indices().long(), adj.values()
    row = torch._convert_indices_from_csr_to_coo(crow, col)[0]
    return csr_adjacency(torch.stack([row, col]), val, n, d, val.dtype)


@pytest.mark.parametrize("num_edges", [0, 1, 200, 2000])
def test_transpose_is_entry_for_entry_the_sorted_edge_list_build(num_edges: int) -> None:
    """The counting-free transpose (stable sort by column only) gives exactly the matrix the
    combined-key build of the transposed edge list gives, duplicates in the same order.
    Negative control: an unstable sort by column (``stable=False``) reorders duplicate and
    same-column entries and fails the value comparison."""
    edge_index, _, _ = _bipartite(num_edges=num_edges)  # duplicates included
    weight = torch.arange(edge_index.size(1), dtype=torch.float64)  # distinct values: the order shows
    adj = csr_adjacency(edge_index, weight, 30, 50, torch.float64)
    for op in (adj, mean_operator(adj)):
        got, expected = csr_transpose(op), _reference_transpose(op)
        assert got.shape == expected.shape == (50, 30)
        assert torch.equal(got.crow_indices().long(), expected.crow_indices().long())
        assert torch.equal(got.col_indices().long(), expected.col_indices().long())
        assert torch.equal(got.values(), expected.values())


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_int32_indices_give_the_same_products_as_int64(reduce: str) -> None:
    """CSR blocks use int32 indices (half the index bytes); ``torch.sparse.mm`` forward (sum,
    mean, max) and :func:`spmm`'s gradient are bitwise those of int64 indices.  Negative
    control: a kernel that rejected int32 indices raises; one that summed in another order
    fails ``torch.equal``."""
    edge_index, weight, x = _bipartite(num_edges=2000)
    adj = csr_adjacency(edge_index, weight, 30, 50, torch.float64)
    assert adj.crow_indices().dtype == adj.col_indices().dtype == torch.int32
    wide = torch.sparse_csr_tensor(
        adj.crow_indices().long(), adj.col_indices().long(), adj.values(), adj.shape, check_invariants=False
    )
    g = torch.randn(30, 6, dtype=torch.float64)
    results = []
    for a in (adj, wide):  # torch's own product and autograd (PyG's path for max / min)
        xi = x.clone().requires_grad_()
        out = torch.sparse.mm(a, xi, reduce)
        out.backward(g)
        results.append((out, xi.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    if reduce == "max":
        return
    op, op_wide = (adj, wide) if reduce == "sum" else (mean_operator(adj), mean_operator(wide))
    assert op.col_indices().dtype == torch.int32 and op_wide.col_indices().dtype == torch.int64
    grads = []
    for a in (op, op_wide):
        xi = x.clone().requires_grad_()
        out = spmm(a, csr_transpose(a), xi)
        out.backward(g)
        grads.append((out, xi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def _allocated_bytes(fn) -> tuple[torch.Tensor, int]:
    """``fn()`` and the bytes of the CPU allocations it made, as torch's profiler records
    them: every op's own (``self``) allocations net of its own frees, summed where positive
    (an op's total would count its children's allocations again)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_csr_mm_is_torch_sparse_mm_bitwise(dtype: torch.dtype) -> None:
    """:func:`csr_mm` gives exactly ``torch.sparse.mm``'s product for ``A``, ``A^T`` and the
    mean operator, contiguous or not, rows without entries exactly 0.  The output it writes
    into is never initialised: torch's ``addmm`` with ``beta = 0`` must ignore what is there,
    which is checked on an output full of NaN.  Negative control: ``beta=1`` on that output
    fails (NaN rows), a product in another summation order fails ``torch.equal``."""
    edge_index, weight, _ = _bipartite(num_edges=2000)
    adj = csr_adjacency(edge_index, weight.to(dtype), 30, 50, dtype)
    g = torch.Generator().manual_seed(3)
    for op in (adj, csr_transpose(adj), mean_operator(adj)):
        for x in (
            torch.randn(op.size(1), 9, generator=g, dtype=dtype),
            torch.randn(9, op.size(1), generator=g, dtype=dtype).t(),
        ):
            expected = torch.sparse.mm(op, x)
            assert torch.equal(csr_mm(op, x), expected)
            poisoned = torch.full_like(expected, float("nan"))
            assert torch.equal(torch.addmm(poisoned, op, x, beta=0, out=poisoned), expected)
    assert not csr_mm(adj, torch.ones(50, 4, dtype=dtype))[-3:].any()  # no in-edge: exact zeros


def test_csr_mm_allocates_its_output_once() -> None:
    """Forward and backward of :func:`spmm` allocate one ``[D, F]`` output and one ``[S, F]``
    input gradient, nothing else of that size (each is a fresh ``mmap`` of page faults on a
    large rank).  ``torch.sparse.mm`` is measured alongside: it allocates a zero matrix and a
    second result.  Negative control: ``csr_mm`` returning ``torch.sparse.mm(adj, x)`` fails
    the first bound (twice the bytes)."""
    edge_index, weight, _ = _bipartite(num_dst=3000, num_src=5000, num_edges=20000)
    adj = csr_adjacency(edge_index, weight.float(), 3000, 5000, torch.float32)
    adj_t = csr_transpose(adj)
    x = torch.randn(5000, 64)
    out_bytes = 3000 * 64 * 4
    small = 64 * 1024  # bookkeeping allocations are far below one output
    _, torch_bytes = _allocated_bytes(lambda: torch.sparse.mm(adj, x))
    assert torch_bytes >= 2 * out_bytes  # what the helper avoids (a fact about torch 2.x)
    out, ours = _allocated_bytes(lambda: csr_mm(adj, x))
    assert out_bytes <= ours <= out_bytes + small
    xg = x.clone().requires_grad_()
    grad = torch.randn(3000, 64)
    _, both = _allocated_bytes(lambda: spmm(adj, adj_t, xg).backward(grad))
    assert both <= out_bytes + 5000 * 64 * 4 + small
    torch.testing.assert_close(xg.grad, torch.sparse.mm(adj_t, grad))
