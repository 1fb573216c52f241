r"""The halo rows' aggregation scores: each conv's coefficient rule and the per-row sums.

Every message-passing exchange passes ``score=``: a zero-argument callable
returning, for each halo row :math:`j`, :math:`a_j = \sum_{j \to i} |c_{ij}|` over the local
edges, where :math:`c_{ij}` is the factor with which :math:`x_j` enters node :math:`i`'s
aggregation in that conv (the weight of a halo row in AdaQP's variance model; see
:meth:`~lightning_fullgraph.nn.context.HaloContext.score`).  It costs nothing unless called and
is cached per conv configuration and graph when it is.  This module computes the scores (pure
functions of the local edges: no state, no exchange); the context caches them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch_geometric.nn import MessagePassing
from torch_geometric.nn.conv import GATConv, GATv2Conv, GCNConv, GINConv, GINEConv, GraphConv, SAGEConv

__all__ = ["halo_scores", "score_rule"]


def score_rule(conv: MessagePassing) -> tuple:
    """The coefficient rule of :meth:`HaloContext.score` for ``conv``."""
    if isinstance(conv, (GATConv, GATv2Conv)):
        return ("softmax", bool(conv.add_self_loops))
    if isinstance(conv, (GINConv, GINEConv)):
        return ("sum",)
    aggr = getattr(conv, "aggr", None)
    if aggr in ("add", "sum"):
        # Known sum convs only: an unknown conv with aggr="add" may weigh its messages
        # (attention convs aggregate softmax-weighted messages with "add").
        return ("sum",) if isinstance(conv, (SAGEConv, GraphConv, GCNConv)) else ("mean",)
    if aggr in ("max", "min"):
        return ("max",)
    return ("mean",)


def halo_scores(
    edge_index: Tensor, weight: Tensor | None, rule: tuple, num_owned: int, num_halo: int
) -> Tensor:
    """``[H]`` float32: per halo row, the sum of its out-edges' coefficients under ``rule``
    (see :meth:`HaloContext.score`); halo row ``j`` is local id ``num_owned + j``."""
    src, dst = edge_index[0], edge_index[1]
    device = edge_index.device
    if weight is None:
        coef = torch.ones(src.numel(), dtype=torch.float32, device=device)
    else:
        coef = weight.detach().abs().to(torch.float32)
    kind = rule[0]
    if kind == "mean":
        count = torch.bincount(dst, minlength=num_owned).to(torch.float32)
        coef = coef / count[dst]
    elif kind == "softmax":
        add_self_loops = rule[1]
        # With self-loops PyG drops the existing ones and adds one per node; a self-loop is
        # never a halo edge, so only the group size changes.
        keep = src != dst if add_self_loops else torch.ones_like(src, dtype=torch.bool)
        count = torch.bincount(dst[keep], minlength=num_owned).to(torch.float32) + float(add_self_loops)
        coef = coef / count[dst]
    elif kind not in ("sum", "max"):
        raise ValueError(f"unknown score rule {rule!r}")
    halo = src >= num_owned
    out = torch.zeros(num_halo, dtype=torch.float32, device=device)
    return out.index_add_(0, src[halo] - num_owned, coef[halo])
