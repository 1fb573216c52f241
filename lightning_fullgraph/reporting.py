"""What a run says about itself: the fit-start line, its figures, and the warnings about settings that cannot pay.

Everything here reads the run (partitions, policy, trainer settings, traffic counters) and
returns or prints text; none of it changes training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

if TYPE_CHECKING:
    from lightning_fullgraph.comm.exchange import HaloExchanger
    from lightning_fullgraph.comm.plan import LocalPartition
    from lightning_fullgraph.comm.policies.base import CompressionPolicy
    from lightning_fullgraph.nn.overlap import OverlapDecision

__all__ = [
    "DDP_ONLY_KWARGS",
    "SMALL_HALO_SHARE",
    "accumulate_grad_batches_warning",
    "describe_run",
    "drop_ddp_only_kwargs",
    "graph_figures",
    "small_halo_warning",
    "transformed_input_warning",
    "warn_non_exact_layers",
]

#: Below this share of the aggregation inputs, compressing halo messages cannot matter.
SMALL_HALO_SHARE = 0.02
#: ``DDPStrategy`` arguments that only configure DDP's wrapper (not used here).
DDP_ONLY_KWARGS = frozenset({"find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb"})


# -- the run's figures ------------------------------------------------------------------------
def graph_figures(partition: LocalPartition, world_size: int, device: torch.device) -> tuple[float, Tensor]:
    """``(halo share, table)``: the share of halo rows among the aggregation inputs of the
    whole graph -- edges whose source is a halo row, over all edges plus one self term per
    node (GCN's self-loop, SAGE's root term) -- and every rank's ``[owned rows, halo rows,
    edges from halo rows, edges]`` (``[world_size, 4]``, float64).  One all-gather: every rank
    gets the same figures."""
    edge_index, plan = partition.data.edge_index, partition.plan
    halo_edges = float((edge_index[0] >= plan.num_owned).sum()) if edge_index.numel() else 0.0
    mine = torch.tensor(
        [float(plan.num_owned), float(plan.num_halo), halo_edges, float(edge_index.size(1))], dtype=torch.float64
    )
    if world_size > 1:
        mine = mine.to(device)
        rows = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu()
    else:
        table = mine.reshape(1, -1)
    inputs = float(table[:, 3].sum() + table[:, 0].sum())
    return (float(table[:, 2].sum()) / inputs if inputs > 0 else 0.0), table


def describe_run(
    policy: CompressionPolicy, table: Tensor, halo_share: float, overlap: OverlapDecision | None = None
) -> str:
    """The fit-start line: mode and settings, graph, parts, halo rows per rank and their
    share of the aggregation inputs (``table`` from :func:`graph_figures`), and the overlap
    decision with the central share (:meth:`~lightning_fullgraph.nn.overlap.OverlapDecision.describe`)."""
    settings = ", ".join(f"{k}={v}" for k, v in policy.settings().items() if v is not None)
    nodes, edges = int(table[:, 0].sum()), int(table[:, 3].sum())
    halo = [int(h) for h in table[:, 1].tolist()]
    shown = ", ".join(map(str, halo[:8])) + (", ..." if len(halo) > 8 else "")
    return (
        f"FullGraphStrategy: mode {policy.name}{f' ({settings})' if settings else ''}; graph "
        f"{nodes:,} nodes, {edges:,} edges in {len(halo)} part(s); halo rows per rank [{shown}] "
        f"({sum(halo) / max(nodes, 1):.1%} of the nodes), {halo_share:.1%} of the aggregation inputs"
        + (f"; {overlap.describe()}" if overlap is not None else "")
    )


_NON_EXACT_NORMS = ("BatchNorm", "GraphNorm", "InstanceNorm", "PairNorm", "DiffGroupNorm", "GraphSizeNorm")


def warn_non_exact_layers(module: torch.nn.Module) -> None:
    """Warns about layers whose statistics span nodes of several ranks (not exact here)."""
    from torch_geometric.nn.norm import LayerNorm as PygLayerNorm

    names = set()
    for m in module.modules():
        name = type(m).__name__
        if any(name.startswith(n) or name == n for n in _NON_EXACT_NORMS):
            names.add(name)
        if isinstance(m, PygLayerNorm) and getattr(m, "mode", "graph") == "graph":
            names.add("torch_geometric.nn.LayerNorm(mode='graph')")
    if names:
        rank_zero_warn(
            f"{sorted(names)} normalise over the nodes of a batch; under FullGraphStrategy each rank "
            "only sees its own partition, so their statistics differ from a single-process run. "
            "Use per-node normalisation (torch.nn.LayerNorm, or PyG LayerNorm(mode='node')) for "
            "exact results."
        )


# -- settings that cannot pay -----------------------------------------------------------------
def drop_ddp_only_kwargs(kwargs: dict[str, Any]) -> None:
    """Removes :data:`DDP_ONLY_KWARGS` from ``kwargs`` (in place) and warns when one of them
    carries a value someone chose (config systems pass DDP's defaults along)."""
    ignored = {key: kwargs.pop(key) for key in sorted(DDP_ONLY_KWARGS & kwargs.keys())}
    chosen = [key for key, value in ignored.items() if value not in (None, False, 25)]
    if chosen:
        rank_zero_warn(f"FullGraphStrategy does not wrap the model in DDP; ignoring {chosen}")


def accumulate_grad_batches_warning(k: int) -> str | None:
    """Why ``Trainer(accumulate_grad_batches=k)`` gains nothing here (``None`` for ``k <= 1``)."""
    if k <= 1:
        return None
    return (
        f"accumulate_grad_batches={k}: every epoch is one batch (the "
        "whole graph), so Lightning steps once every "
        f"{k} epochs with the mean of their gradients -- the same "
        "gradient as one epoch, with "
        f"{k} times fewer updates (training at 1/"
        f"{k} of the learning rate per epoch). Nothing is gained "
        "in memory; set accumulate_grad_batches=1"
    )


def small_halo_warning(mode: str, halo_share: float, world_size: int) -> str | None:
    """The warning for a compressed mode whose halo rows are under :data:`SMALL_HALO_SHARE` of
    the aggregation inputs, or ``None``."""
    if world_size <= 1 or mode == "exact" or halo_share >= SMALL_HALO_SHARE:
        return None
    return (
        f"halo rows are {halo_share:.1%} of the aggregation inputs: compressing them cannot "
        f"change much, in accuracy or in time ({mode} and exact train alike). "
        "Compression pays where partitions share many boundary rows (more parts, a graph "
        "with less locality)"
    )


def transformed_input_warning(exchanger: HaloExchanger) -> str | None:
    """When the first layer's message is a transform of the batch's features (dropout on
    ``batch.x`` before the first conv), rows that would travel once, cached, travel every
    epoch: the warning names the factor of extra per-epoch traffic (``None`` otherwise)."""
    if exchanger.transformed_input is None:
        return None
    layer, width = exchanger.transformed_input
    values = exchanger.stats.layer_values
    total, first = float(sum(values.values())), float(values.get(layer, 0))
    if first == 0:
        return None
    factor = f"{total / (total - first):.1f}x" if total > first else "from none to"
    return (
        f"the first message-passing layer's input is not the batch's features but a tensor of the same "
        f"shape (dropout or another transform of `batch.x` before the first conv?): its halo rows "
        f"({width} values each) travel every epoch instead of once, cached; that makes this model's "
        f"per-epoch halo traffic {factor} what it would be. Apply the transform inside or after the "
        "first conv, or accept the traffic"
    )
