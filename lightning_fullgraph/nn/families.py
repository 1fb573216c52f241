r"""The other conv families' adapters: ``bipartite`` (with SAGE's fused path) and ``full_then_slice``.

* ``bipartite`` (``SAGEConv``, ``GINConv``, ``GINEConv``, ``GraphConv``): called with the tuple
  ``(x_full, x)`` and ``size=(N_r + H_r, N_r)``.
* ``full_then_slice`` (``GATConv``, ``GATv2Conv``): called on ``x_full`` as a homogeneous graph;
  their self-loops for halo rows only reach halo outputs, which are dropped, so the owned
  rows are exact and no projection runs twice.

(``GCNConv`` has its own adapter, :mod:`.gcn`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.nn import MessagePassing
from torch_geometric.nn.conv import GINConv, GraphConv, SAGEConv

from lightning_fullgraph.nn.context import HaloContext, csr_dtype

__all__ = ["SPARSE_VALUES", "bipartite_adapter", "full_then_slice_adapter"]


# Convs whose fused path is exact on a CSR adjacency, and what its values hold: "ones"
# (the conv ignores edge weights: SAGE, GIN) or "edge_weight" (GraphConv's optional weights).
# Exact types only: a subclass may override `message`, which the fused path would bypass.
SPARSE_VALUES: dict[type, str] = {SAGEConv: "ones", GINConv: "ones", GraphConv: "edge_weight"}


def bipartite_adapter(conv, forward, ctx: HaloContext, x: Tensor, edge_index, args: tuple, kwargs: dict):
    """The ``"bipartite"`` adapter: ``forward((x_full, x), ..., size=(N_r + H_r, N_r))``, or the
    conv's fused path on the cached CSR blocks (see :mod:`.context`; ``SAGEConv``: :func:`_sage`)."""
    if kwargs.get("size") is not None:
        raise ValueError(f"{type(conv).__name__}: do not pass `size=` under FullGraphStrategy; it is set for you")
    kwargs.pop("size", None)
    values = SPARSE_VALUES.get(type(conv))
    weight = None
    if values == "edge_weight":
        weight = args[0] if args else kwargs.get("edge_weight")
        rest_args, rest_kwargs = args[1:], {k: v for k, v in kwargs.items() if k != "edge_weight"}
    else:
        rest_args, rest_kwargs = args, kwargs
    # Only GraphConv multiplies its messages by a scalar edge weight.
    score = ctx.score(conv, edge_index, weight if values == "edge_weight" else None)
    if values is not None and not rest_args and not rest_kwargs and ctx.use_sparse(conv, x, weight):
        if _sage_fusable(conv):
            return _sage(conv, ctx, x, edge_index, score)
        # The conv's own fused path (message_and_aggregate -> torch.sparse.mm) on cached CSR blocks.
        if not ctx.overlap or (split := ctx.split(edge_index, weight, sparse=True, dtype=csr_dtype(x))) is None:
            return forward((ctx.exchange(x, score), x), ctx.adjacency(edge_index, weight, csr_dtype(x)))
        pending = ctx.exchange_async(x, score)
        if not getattr(conv, "project", False) and getattr(conv, "decomposed_layers", 1) == 1:
            # Aggregate the central rows while the exchange is in flight and the marginal rows
            # after it, then run the conv's own forward once over all owned rows with that
            # aggregation: its root term (lin_r, lin_root, (1 + eps) x) reads `x` itself.  A
            # forward per block would keep gathered copies x[central], x[marginal] of the layer
            # input alive for the backward, one more [N_r, F] per layer.
            # (GraphConv's message_and_aggregate also takes the edge weights: in the CSR values)
            extra = {"edge_weight": None} if values == "edge_weight" else {}
            agg_c = conv.message_and_aggregate(split.central_block, (x, None), **extra)
            x_full = torch.cat([x, pending.wait()], dim=0)
            agg = split.merge(agg_c, conv.message_and_aggregate(split.marginal_block, (x_full, None), **extra))
            del agg_c
            stand_in = ctx.hand_over(agg, x_full.size(0))
            try:
                return forward((x_full, x), stand_in)
            finally:
                ctx.take_aggregation(stand_in)  # never left for a later call, even after an error
        out_c = forward((x, x[split.central]), split.central_block)
        x_full = torch.cat([x, pending.wait()], dim=0)
        out_m = forward((x_full, x[split.marginal]), split.marginal_block)
        return split.merge(out_c, out_m)
    split = ctx.split(edge_index) if ctx.overlap and not args and not kwargs else None
    if split is None:
        return forward((ctx.exchange(x, score), x), edge_index, *args, size=(ctx.num_full, ctx.num_owned), **kwargs)
    # Central rows need no halo: aggregate them while the exchange is in flight.
    pending = ctx.exchange_async(x, score)
    out_c = forward((x, x[split.central]), split.central_block, size=(ctx.num_owned, split.central.numel()))
    x_full = torch.cat([x, pending.wait()], dim=0)
    out_m = forward((x_full, x[split.marginal]), split.marginal_block, size=(ctx.num_full, split.marginal.numel()))
    return split.merge(out_c, out_m)


def _unhooked(module: nn.Module) -> bool:
    # forward (pre-)hooks may rewrite the weights (torch.nn.utils.prune) or read the output
    return not (module._forward_hooks or module._forward_pre_hooks)


def _sage_fusable(conv: MessagePassing) -> bool:
    """Whether :func:`_sage` computes this conv: an exact ``SAGEConv`` with a linear
    aggregation, no ``project`` step, one decomposed layer, initialised weights and no hooks
    on it that the fused arithmetic would bypass."""
    if type(conv) is not SAGEConv or conv.project or conv.decomposed_layers != 1:
        return False
    if conv.aggr not in ("mean", "sum", "add") or getattr(conv, "explain", False):
        return False
    if conv._propagate_forward_pre_hooks or conv._propagate_forward_hooks:
        return False
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return False
    lins = [conv.lin_l] + ([conv.lin_r] if conv.root_weight else [])
    return all(
        _unhooked(lin) and not isinstance(lin.weight, nn.parameter.UninitializedParameter) for lin in lins
    )


def _sage(conv: SAGEConv, ctx: HaloContext, x: Tensor, edge_index: Tensor, score: Callable[[], Tensor]) -> Tensor:
    r"""``SAGEConv`` with a linear aggregation :math:`\mathcal{A}` (mean or sum), on the cached
    CSR blocks:

    .. math::
        \mathbf{X}'_r = \mathcal{A}(\mathbf{X}^{full}_r)\, W_l^\top + b_l
        + \mathbf{X}_r W_r^\top
        \quad\text{or, when } F_{out} < F_{in}, \quad
        \mathcal{A}(\mathbf{X}^{full}_r W_l^\top) + b_l + \mathbf{X}_r W_r^\top

    (then PyG's optional L2 ``normalize``).  The same maths as ``SAGEConv.forward``, summed in
    another order, with fewer ``[N_r, F_out]`` temporaries: the root term is added into the
    output in place (``addmm_``) rather than as ``lin_r``'s own output plus a sum, and a layer
    whose ``lin_l`` narrows the rows (the output layer) aggregates the narrower rows
    ``X W_l^T``.  Its message is then, by :meth:`~.context.HaloContext.sends_projection`, the
    projected rows ``X_r W_l^T`` (``F_out`` values per halo row each way instead of ``F_in``)
    unless ``X_r`` is the batch's static features; those travel as themselves, and the owned
    and the received rows are projected separately so autograd keeps the received
    ``[H_r, F_in]`` rows, not an ``[N_r + H_r, F_in]`` copy (``X_r`` is kept for the root term
    anyway).  Every other layer's message is ``X_r``'s halo rows, as for every conv.

    Shapes:
        x: ``[N_r, F_in]`` -> ``[N_r, F_out]``.
    """
    narrow = x.size(-1) > conv.out_channels
    w_l, b_l = conv.lin_l.weight, conv.lin_l.bias

    def rows(t: Tensor) -> Tensor:  # what the adjacency multiplies
        return torch.nn.functional.linear(t, w_l) if narrow else t

    dtype = csr_dtype(x)
    # the projected rows travel where they are the narrower message (HaloContext.sends_projection)
    project = narrow and ctx.sends_projection(x, conv.out_channels, w_l)
    split = ctx.split(edge_index, None, sparse=True, dtype=dtype) if ctx.overlap else None
    if split is None:
        if project:
            src = ctx.exchange(rows(x), score, source=x)
        elif narrow:
            halo = ctx.halo(x, score)
            src = torch.cat([rows(x), rows(halo)], dim=0)
            del halo
        else:
            src = ctx.exchange(x, score)
        agg = conv.message_and_aggregate(ctx.adjacency(edge_index, None, dtype), (src, None))
    else:
        # central rows (owned sources) while the halo is in flight, marginal rows after it
        if project:
            own = rows(x)
            pending = ctx.exchange_async(own, score, source=x)
        else:
            pending = ctx.exchange_async(x, score)
            own = rows(x)
        agg_c = conv.message_and_aggregate(split.central_block, (own, None))
        src = torch.cat([own, pending.wait() if project else rows(pending.wait())], dim=0)
        del own
        agg = split.merge(agg_c, conv.message_and_aggregate(split.marginal_block, (src, None)))
        del agg_c
    del src
    # `out` is a new tensor of this function's own (not the aggregation) where `owned`
    owned = not narrow or b_l is not None
    if narrow:
        # (the bias in the aggregation's dtype, as lin_l's addmm has it under autocast)
        out = agg if b_l is None else agg + b_l.to(agg.dtype)
    else:
        out = torch.nn.functional.linear(agg, w_l, b_l)
    del agg
    if conv.root_weight:
        w_r = conv.lin_r.weight.t()
        if owned and not torch.is_autocast_enabled(x.device.type):
            out = out.addmm_(x, w_r)
        else:
            out = torch.addmm(out, x, w_r)  # autocast covers addmm, not the in-place form
    if conv.normalize:
        out = torch.nn.functional.normalize(out, p=2.0, dim=-1)
    return out


def _slice_output(out: Any, n: int) -> Any:
    if isinstance(out, Tensor):
        return out[:n]
    if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
        return (out[0][:n],) + tuple(out[1:])
    return out


def full_then_slice_adapter(conv, forward, ctx: HaloContext, x: Tensor, edge_index, args: tuple, kwargs: dict):
    """The ``"full_then_slice"`` adapter: ``forward(x_full, edge_index)``, owned rows kept."""
    if kwargs.get("size") is not None:
        raise ValueError(f"{type(conv).__name__}: do not pass `size=` under FullGraphStrategy; it is set for you")
    x_full = ctx.exchange(x, ctx.score(conv, edge_index))
    return _slice_output(forward(x_full, edge_index, *args, **kwargs), ctx.num_owned)

