r"""GCN's adapter: ``GCNConv`` on the rank's partition, normalised with global degrees.

``GCNConv`` is normalised with *global* degrees,
:math:`\hat{A}_{ij} = w_{ji} / \sqrt{\hat d_i \hat d_j}` with
:math:`\hat d_i = \sum_{j \to i} w_{ji}` after PyG's self-loop rule.  The local graph
knows the in-degree of every owned node (all its in-edges are local) but not of a halo
node, so each rank computes its owned degrees and receives the halo degrees through the
same exchange (once, then cached: :meth:`~lightning_fullgraph.nn.context.HaloContext.gcn_norm`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch_geometric.nn.conv import GCNConv

from lightning_fullgraph.nn.context import HaloContext, csr_dtype
from lightning_fullgraph.nn.errors import UnsupportedConvError

__all__ = ["gcn_adapter"]


def _aggregate_first(conv: GCNConv, x: Tensor) -> bool:
    r"""Whether a GCN layer computes :math:`(\hat{A} X) W` rather than PyG's
    :math:`\hat{A} (X W)` (the same matrix, summed in another order; DGL's ``GraphConv`` rule).

    When ``lin`` does not narrow the rows (``F_in <= F_out``), aggregating first keeps only the
    ``[N_r, F_in]`` aggregation for ``lin``'s backward instead of the ``[N_r + H_r, F_in]``
    layer input with its halo rows, and ``lin`` multiplies ``N_r`` rows instead of
    ``N_r + H_r``.  When it narrows (the output layer), transforming first aggregates the
    narrower rows, and the message is then the projected rows where
    :meth:`~lightning_fullgraph.nn.context.HaloContext.sends_projection` says so (see
    :func:`_projects_message`); otherwise the message is the layer input.
    """
    return x.size(-1) <= conv.out_channels


def _projects_message(conv: GCNConv, ctx: HaloContext, x: Tensor) -> bool:
    r"""Whether this (transform-first) layer exchanges :math:`X W` rather than :math:`X`:
    the context's one rule (:meth:`~lightning_fullgraph.nn.context.HaloContext.sends_projection`).
    Then the owners project their rows once and every rank aggregates what it receives,
    :math:`\hat{A}\,[X_r W \,\|\, (X W)_{halo}] + b`, the maths of ``GCNConv.forward``
    (``lin``, ``propagate``, bias) with the exchange between ``lin`` and ``propagate``."""
    return ctx.sends_projection(x, conv.out_channels, conv.lin.weight)


def _propagate_projected(
    conv: GCNConv,
    ctx: HaloContext,
    x: Tensor,
    score: Callable[[], Tensor],
    adjacency: Tensor,
    edge_weight: Tensor | None = None,
) -> Tensor:
    """``GCNConv.forward`` with normalisation done, the projected rows exchanged:
    ``[N_r, F_in] -> [N_r, F_out]`` on a CSR, or ``[N_r + H_r, F_out]`` on an edge list (the
    caller keeps the owned rows)."""
    out = conv.propagate(adjacency, x=ctx.exchange(conv.lin(x), score, source=x), edge_weight=edge_weight)
    return out + conv.bias if conv.bias is not None else out


def _gcn_transform(conv: GCNConv, aggregation: Tensor) -> Tensor:
    """``lin`` and bias on an aggregation ``[N_r, F_in] -> [N_r, F_out]``."""
    out = conv.lin(aggregation)
    return out + conv.bias if conv.bias is not None else out


def gcn_adapter(conv: GCNConv, forward, ctx: HaloContext, x: Tensor, edge_index, args: tuple, kwargs: dict):
    """``GCNConv`` with the global-degree normalisation of the module docstring (the conv's own
    ``lin``/``propagate``/bias, or the fused CSR path; overlap: central rows first)."""
    edge_weight = args[0] if args else kwargs.pop("edge_weight", None)
    if conv.flow != "source_to_target":
        raise UnsupportedConvError("GCNConv with flow='target_to_source' is not supported by FullGraphStrategy")
    sources = (edge_index, edge_weight)
    rule = ("sum", "gcn", bool(conv.normalize), bool(conv.improved), bool(conv.add_self_loops))
    constant = conv.normalize and (edge_weight is None or not edge_weight.requires_grad)
    split = None
    if constant and ctx.overlap:
        # Overlap keeps only the central/marginal blocks, built from the normalised edges,
        # which are then dropped (as gcn_adjacency does); the score is rebuilt on demand.
        sparse = ctx.use_sparse(conv, x, edge_weight)
        split = ctx.gcn_split(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype, sparse, csr_dtype(x))
        score = ctx.gcn_score(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype, rule)
    if constant and split is None and ctx.use_sparse(conv, x, edge_weight):
        # The fused path only reads the CSR: build it from the normalised edges and keep no
        # edge list (same matrix, same score, as the general path below).  The degree exchange
        # runs (once) before the feature exchange, as below.  Also taken with overlap on where
        # this rank has no central or no marginal row: no split, and the general path would
        # keep the normalised edge list and run PyG's transform-first order for nothing.
        adj = ctx.gcn_adjacency(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype)
        score = ctx.gcn_score(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype, rule)
        if _aggregate_first(conv, x):
            return _gcn_transform(conv, conv.propagate(adj, x=ctx.exchange(x, score), edge_weight=None))
        if _projects_message(conv, ctx, x):
            return _propagate_projected(conv, ctx, x, score, adj)
        normalize, conv.normalize = conv.normalize, False
        try:
            return forward(ctx.exchange(x, score), adj)
        finally:
            conv.normalize = normalize
    if split is None:
        if conv.normalize:
            edge_index, weight = ctx.gcn_norm(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype)
        else:
            weight = edge_weight
        # The coefficients are the values aggregated below (global-degree normalisation or the
        # raw weights), cached on the user's tensors and this conv's normalisation options.
        score = ctx.score(conv, edge_index, weight, rule=rule, sources=sources)
        sparse = ctx.use_sparse(conv, x, weight)
        split = ctx.split(edge_index, weight, sparse=sparse, dtype=csr_dtype(x)) if ctx.overlap else None
    if split is not None:
        # out = A_hat (X W) + b, computed as central rows (owned sources only) while the halo
        # is in flight, then marginal rows; lin is applied once per row, before the
        # aggregation when it narrows the rows and after it otherwise (see _aggregate_first).
        first = _aggregate_first(conv, x)
        projected = not first and _projects_message(conv, ctx, x)
        if projected:
            h = conv.lin(x)
            pending = ctx.exchange_async(h, score, source=x)
        else:
            pending = ctx.exchange_async(x, score)
            h = x if first else conv.lin(x)
        if sparse:
            out_c = conv.propagate(split.central_block, x=h, edge_weight=None)
        else:
            size_c = (ctx.num_owned, split.central.numel())
            out_c = conv.propagate(split.central_block, x=h, edge_weight=split.central_weight, size=size_c)
        halo = pending.wait()
        h_full = torch.cat([h, halo if first or projected else conv.lin(halo)], dim=0)
        del halo
        if sparse:
            out_m = conv.propagate(split.marginal_block, x=h_full, edge_weight=None)
        else:
            size_m = (ctx.num_full, split.marginal.numel())
            out_m = conv.propagate(split.marginal_block, x=h_full, edge_weight=split.marginal_weight, size=size_m)
        del h_full
        out = split.merge(out_c, out_m)
        if first:
            return _gcn_transform(conv, out)
        return out + conv.bias if conv.bias is not None else out
    if not _aggregate_first(conv, x) and _projects_message(conv, ctx, x):
        if sparse:
            return _propagate_projected(conv, ctx, x, score, ctx.adjacency(edge_index, weight, csr_dtype(x)))
        return _propagate_projected(conv, ctx, x, score, edge_index, weight)[: ctx.num_owned]
    # The conv's own code does lin/propagate/bias; only its normalisation is replaced.
    normalize, conv.normalize = conv.normalize, False
    try:
        if sparse:
            return forward(ctx.exchange(x, score), ctx.adjacency(edge_index, weight, csr_dtype(x)))
        out = forward(ctx.exchange(x, score), edge_index, weight)
    finally:
        conv.normalize = normalize
    return out[: ctx.num_owned]
