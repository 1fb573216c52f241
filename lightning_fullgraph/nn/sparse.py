r"""Sparse adjacency blocks of a rank's local graph, built once and cached.

A rank's local graph is bipartite: sources are ``[owned | halo]`` (``N_r + H_r`` ids),
destinations are owned (``N_r`` ids).  Aggregating through its edges
(``x_j`` gathered per edge into an ``[E_r, F]`` message tensor, then scattered) costs
``O(E_r F)`` memory traffic *twice* and allocates a fresh ``[E_r, F]`` tensor per layer and
direction.  PyG's fused path instead multiplies by the transposed adjacency

.. math::
    \mathbf{A}^{\top}_r \in \mathbb{R}^{N_r \times (N_r + H_r)}, \qquad
    (\mathbf{A}^{\top}_r)_{ij} = \sum_{e:\, j \to i} w_e, \qquad
    \mathbf{X}'_r = \mathbf{A}^{\top}_r \mathbf{X}^{full}_r

(``torch.sparse.mm`` on a CSR matrix, with ``reduce="mean" | "max" | ...`` where the conv
aggregates that way), which reads each source row once per entry and writes each output row
once.  Duplicate edges stay separate entries, so ``sum`` adds them, ``mean`` counts them and
``max`` compares them exactly as a scatter over the edge list would.

Building a CSR matrix sorts the edges, so it is done once per ``(edge_index, weights)`` pair
and cached (:class:`DerivedCache`); the same holds for the central/marginal blocks of the
overlap schedule (:func:`split_blocks`).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = [
    "DerivedCache",
    "SplitBlocks",
    "csr_adjacency",
    "csr_mm",
    "csr_tensor",
    "csr_transpose",
    "mean_operator",
    "spmm",
    "split_blocks",
]

T = TypeVar("T")


def _index_dtype(num_dst: int, num_src: int, nnz: int) -> torch.dtype:
    """Index dtype of a CSR block: int32 while every index and the entry count fit (half the
    bytes per entry; ``torch.sparse.mm`` takes either), else int64."""
    return torch.int32 if max(num_dst, num_src, nnz) < 2**31 - 1 else torch.int64


def csr_tensor(crow: Tensor, col: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    """A ``[D, S]`` (``shape``) ``torch.sparse_csr`` tensor of these parts, unchecked, without
    torch's once-per-process "beta" warning."""
    with warnings.catch_warnings():
        # torch says once per process that CSR support is "beta"; it is what PyG uses.
        warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def csr_adjacency(edge_index: Tensor, values: Tensor | None, num_dst: int, num_src: int, dtype: torch.dtype) -> Tensor:
    r"""The transposed adjacency ``A^T`` of a (bipartite) edge list as a sorted CSR matrix.

    Args:
        edge_index: ``[2, E]`` edges ``source -> destination`` (sources in ``[0, num_src)``,
            destinations in ``[0, num_dst)``).
        values: ``[E]`` edge weights, or ``None`` for ones.
        num_dst: Rows of the result (destinations).
        num_src: Columns of the result (sources).
        dtype: Value dtype (the features' dtype: ``torch.sparse.mm`` does not promote).

    Returns:
        ``torch.sparse_csr`` tensor of shape ``[num_dst, num_src]``; entries of one row are
        sorted by source id; duplicate edges are kept as separate entries.  Its indices are
        int32 where they fit (:func:`_index_dtype`): 4 + 4 bytes per entry with float32
        values instead of 8 + 4.
    """
    src, dst = edge_index[0], edge_index[1]
    nnz = src.numel()
    index_dtype = _index_dtype(num_dst, num_src, nnz)
    # A stable sort by (destination, source) keeps duplicate edges in input order.  The key
    # is built in place and dropped before the gathers: one [E] int64 temporary, not two.
    key = dst.to(torch.int64) * max(num_src, 1)
    key += src
    perm = torch.argsort(key, stable=True)
    del key
    crow = torch._convert_indices_from_coo_to_csr(dst[perm], num_dst, out_int32=index_dtype == torch.int32)
    col = src[perm].to(index_dtype)
    if values is None:
        vals = torch.ones(nnz, dtype=dtype, device=src.device)
    else:
        vals = values.detach()[perm].to(dtype)
    return csr_tensor(crow, col, vals, (num_dst, num_src))


def csr_transpose(adj: Tensor) -> Tensor:
    """``A`` as a CSR matrix of its transpose, ``[S, D] `` from ``[D, S]`` (sorted).

    Entry for entry the matrix :func:`csr_adjacency` builds from ``A``'s entries as edges
    ``column -> row``: ``A``'s entries are in (row, column) order, so a stable sort by
    column alone puts them in (column, row) order with duplicates in ``A``'s order, the same
    permutation as the stable sort by the combined key.  It needs no ``[2, E]`` COO copy and
    no combined key: a row index and the permutation are the only ``[E]`` temporaries.
    """
    d, n = adj.shape
    crow, col, val = adj.crow_indices(), adj.col_indices(), adj.values()
    nnz = val.numel()
    index_dtype = _index_dtype(n, d, nnz)
    perm = torch.argsort(col, stable=True)
    new_crow = torch._convert_indices_from_coo_to_csr(col[perm], n, out_int32=index_dtype == torch.int32)
    rows = torch.arange(d, dtype=index_dtype, device=crow.device)
    row = torch.repeat_interleave(rows, (crow[1:] - crow[:-1]).to(torch.int64), output_size=nnz)
    new_col = row[perm]
    del row
    return csr_tensor(new_crow, new_col, val[perm], (n, d))


def mean_operator(adj: Tensor) -> Tensor:
    """``D^{-1} A``: the CSR matrix whose product is the row mean of ``A``'s entries
    (``reduce="mean"``: each row's values divided by its entry count; empty rows stay 0).
    Shares ``A``'s index tensors: only the values are new."""
    crow = adj.crow_indices()
    counts = (crow[1:] - crow[:-1]).to(torch.int64)
    count = counts.clamp(min=1).to(adj.dtype)
    per_entry = torch.repeat_interleave(count, counts, output_size=adj.values().numel())
    return csr_tensor(crow, adj.col_indices(), adj.values() / per_entry, adj.shape)


class _SpMM(torch.autograd.Function):
    """``A X`` with ``dX = A^T dOut`` from a transpose built once, not per backward
    (torch's own backward of ``torch.sparse.mm`` re-sorts ``A^T`` on every call)."""

    @staticmethod
    def forward(ctx: Any, adj: Tensor, adj_t: Tensor, x: Tensor) -> Tensor:
        ctx.adj_t = adj_t
        return csr_mm(adj, x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, Tensor]:
        return None, None, csr_mm(ctx.adj_t, grad.contiguous())


def csr_mm(adj: Tensor, x: Tensor) -> Tensor:
    r"""``[D, S] x [S, F] -> [D, F]``: the product ``torch.sparse.mm(adj, x)`` computes, in
    one fresh output (not differentiable; :func:`spmm` is).

    On CPU ``torch.sparse.mm`` of a CSR matrix allocates a ``[D, F]`` zero matrix, a second
    ``[D, F]`` result, copies the first into the second and only then runs the product; every
    ``[D, F]`` matrix of a large rank is a fresh ``mmap`` whose pages the kernel faults in and
    zeroes.  Here the product writes straight into one uninitialised output
    (``addmm(out, adj, x, beta=0, out=out)``: with ``beta = 0`` the output's old contents
    are ignored, NaN included, and rows without entries come out 0), the same kernel with the
    same summation order, so the result is bitwise the same with half the fresh pages and
    neither the fill nor the copy.  Other devices keep ``torch.sparse.mm``.
    """
    if adj.device.type != "cpu":
        return torch.sparse.mm(adj, x)
    out = x.new_empty((adj.size(0), x.size(1)))
    return torch.addmm(out, adj, x, beta=0, out=out)


def spmm(adj: Tensor, adj_t: Tensor, x: Tensor) -> Tensor:
    """``[D, S] x [S, F] -> [D, F]``, differentiable in ``x`` (not in ``adj``'s values).

    Args:
        adj: CSR ``A`` (its values are constants).
        adj_t: CSR ``A^T`` (:func:`csr_transpose`), used by the backward.
        x: Dense ``[S, F]``.
    """
    if not (x.requires_grad and torch.is_grad_enabled()):
        return csr_mm(adj, x)
    return _SpMM.apply(adj, adj_t, x)


class SplitBlocks:
    """The central/marginal split of a rank's destinations (see :func:`split_blocks`).

    Attributes:
        central: ``[C]`` owned ids with no halo in-neighbour (ascending).
        marginal: ``[M]`` owned ids with at least one halo in-neighbour (ascending).
        central_block: ``[C, N_r]`` CSR (sparse path) or ``[2, E_c]`` edges with destinations
            renumbered to ``[0, C)`` (edge path).
        marginal_block: ``[M, N_r + H_r]`` CSR, or ``[2, E_m]`` edges renumbered to ``[0, M)``.
        central_weight / marginal_weight: the edges' weights on the edge path, else ``None``.
    """

    __slots__ = ("central", "marginal", "central_block", "marginal_block", "central_weight", "marginal_weight")

    def __init__(
        self,
        central: Tensor,
        marginal: Tensor,
        central_block: Tensor,
        marginal_block: Tensor,
        central_weight: Tensor | None = None,
        marginal_weight: Tensor | None = None,
    ) -> None:
        self.central, self.marginal = central, marginal
        self.central_block, self.marginal_block = central_block, marginal_block
        self.central_weight, self.marginal_weight = central_weight, marginal_weight

    def merge(self, out_central: Tensor, out_marginal: Tensor) -> Tensor:
        """``[C, *], [M, *] -> [N_r, *]``: the two halves back in owned-node order.

        Differentiable in both halves; autograd keeps the two index vectors only (torch's
        ``index_copy`` would also keep both halves alive until the backward)."""
        if torch.is_grad_enabled() and (out_central.requires_grad or out_marginal.requires_grad):
            return _MergeRows.apply(self.central, self.marginal, out_central, out_marginal)
        return _merge_rows(self.central, self.marginal, out_central, out_marginal)


def _merge_rows(central: Tensor, marginal: Tensor, out_central: Tensor, out_marginal: Tensor) -> Tensor:
    n = central.numel() + marginal.numel()
    out = out_central.new_empty((n,) + tuple(out_central.shape[1:]))
    # central and marginal partition [0, N_r): every row is written exactly once.
    return out.index_copy_(0, central, out_central).index_copy_(0, marginal, out_marginal)


class _MergeRows(torch.autograd.Function):
    """Rows ``central`` from the first half, ``marginal`` from the second; the backward gathers
    the same rows of the gradient and needs neither half."""

    @staticmethod
    def forward(ctx: Any, central: Tensor, marginal: Tensor, out_central: Tensor, out_marginal: Tensor) -> Tensor:
        ctx.save_for_backward(central, marginal)
        return _merge_rows(central, marginal, out_central, out_marginal)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, Tensor, Tensor]:
        central, marginal = ctx.saved_tensors
        return None, None, grad.index_select(0, central), grad.index_select(0, marginal)


def split_blocks(
    edge_index: Tensor,
    weight: Tensor | None,
    num_owned: int,
    num_full: int,
    sparse: bool,
    dtype: torch.dtype = torch.float32,
) -> SplitBlocks | None:
    """Splits the local edges by destination into central and marginal blocks.

    Central destinations have no halo in-neighbour: all their sources are owned, so they can
    be aggregated while the halo exchange is in flight.  Marginal destinations are the rest.

    Args:
        edge_index: ``[2, E_r]`` local edges (sources ``[0, N_r + H_r)``, destinations owned).
        weight: ``[E_r]`` edge weights or ``None``.
        num_owned: ``N_r``.
        num_full: ``N_r + H_r``.
        sparse: Build CSR blocks (weights folded into the values) instead of edge lists.
        dtype: Value dtype of the CSR blocks.

    Returns:
        The blocks, or ``None`` when either set is empty (overlap cannot help).
    """
    src, dst = edge_index[0], edge_index[1]
    device = edge_index.device
    marginal = torch.zeros(num_owned, dtype=torch.bool, device=device)
    marginal[dst[src >= num_owned]] = True
    central_idx = (~marginal).nonzero().flatten()
    marginal_idx = marginal.nonzero().flatten()
    if central_idx.numel() == 0 or marginal_idx.numel() == 0:
        return None
    pos = torch.empty(num_owned, dtype=torch.long, device=device)
    pos[central_idx] = torch.arange(central_idx.numel(), device=device)
    pos[marginal_idx] = torch.arange(marginal_idx.numel(), device=device)
    to_m = marginal[dst]
    ei_c = torch.stack([src[~to_m], pos[dst[~to_m]]])
    ei_m = torch.stack([src[to_m], pos[dst[to_m]]])
    w_c = weight[~to_m] if weight is not None else None
    w_m = weight[to_m] if weight is not None else None
    if not sparse:
        return SplitBlocks(central_idx, marginal_idx, ei_c, ei_m, w_c, w_m)
    return SplitBlocks(
        central_idx,
        marginal_idx,
        csr_adjacency(ei_c, w_c, central_idx.numel(), num_owned, dtype),
        csr_adjacency(ei_m, w_m, marginal_idx.numel(), num_full, dtype),
    )


class DerivedCache:
    """Values derived from tensors (CSR matrices, normalised weights, splits), rebuilt when a
    source tensor is replaced or modified in place.

    Keys are object identity plus the version counter of every source tensor, checked
    against weak references: a later tensor that reuses a dead one's ``id`` never hits, and
    entries die with their sources.
    """

    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple[tuple[Any, ...], Any]] = {}

    def get(self, sources: tuple[Tensor | None, ...], tag: Hashable, build: Callable[[], T]) -> T:
        """``build()``'s value for ``(sources, tag)``, computed on the first call only."""
        key = (tag, tuple(None if t is None else (id(t), t._version) for t in sources))
        hit = self._entries.get(key)
        if hit is not None and all(
            (ref is None and t is None) or (ref is not None and ref() is t) for ref, t in zip(hit[0], sources)
        ):
            return hit[1]
        value = build()
        self._entries = {
            k: v for k, v in self._entries.items() if all(ref is None or ref() is not None for ref in v[0])
        }
        self._entries[key] = (tuple(None if t is None else weakref.ref(t) for t in sources), value)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
