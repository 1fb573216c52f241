r"""What makes distributed training equal one process's: loss weights, gradient all-reduce, output gather, logged means.

Outside the halo exchange: the loss weights, the gradient all-reduce, the node-output gather,
the global loss handed to the policy, and what a rank logs.  :class:`~lightning_fullgraph.FullGraphStrategy`
calls these from its Lightning hooks.

The global gradient is the gradient of the mean loss over all training nodes:

.. math::
    \nabla_\theta \mathcal{L} = \sum_r \frac{n_r}{n}\, \nabla_\theta \mathcal{L}_r,
    \qquad \mathcal{L}_r = \frac{1}{n_r}\sum_{i \in \mathcal{T}_r} \ell_i

Each rank back-propagates :math:`(n_r/n)\,\mathcal{L}_r` (:func:`loss_scale`) and the weight
gradients are summed over ranks after every backward call (:func:`all_reduce_gradients`),
only what that call added.

Every function that takes a ``world_size > 1`` issues collectives on the default process
group: all ranks call it, in the same order.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fullgraph.data.validation import all_finite

if TYPE_CHECKING:
    from lightning_fullgraph.comm.plan import LocalPartition

__all__ = [
    "LOSS_WEIGHTINGS",
    "STAGE_MASKS",
    "StageLogging",
    "all_reduce_gradients",
    "forget_empty_means",
    "gather_node_outputs",
    "global_loss_and_seconds",
    "gradient_snapshot",
    "loss_scale",
    "mean_over_ranks_with_nodes",
    "stage_nodes",
]

LOSS_WEIGHTINGS = ("train_mask", "mean", "sum")
#: The masks of the training, validation and test stages (``self.log``'s batch size).
STAGE_MASKS = ("train_mask", "val_mask", "test_mask")


# -- loss weights and gradients ---------------------------------------------------------------
def loss_scale(
    partition: LocalPartition, loss_weighting: str, mask_key: str, world_size: int, device: torch.device
) -> float:
    """The factor this rank's loss is multiplied by before backward (module docstring):
    ``n_r / n`` for ``"train_mask"``, ``1 / world_size`` for ``"mean"``, 1 for ``"sum"``.
    A collective for ``"train_mask"``."""
    if loss_weighting == "sum":
        return 1.0
    if loss_weighting == "mean":
        return 1.0 / world_size
    data = partition.data
    if mask_key not in data:
        raise KeyError(
            f"loss_weighting='train_mask' needs a node mask `{mask_key}` in the batch; set "
            f"FullGraphStrategy(mask_key=...) or loss_weighting='mean'"
        )
    mask = data[mask_key]
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (partition.plan.num_owned,):
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            raise ValueError(
                f"`{mask_key}` must be a bool tensor with one entry per owned node "
                f"({partition.plan.num_owned}), got {getattr(mask, 'dtype', type(mask))} of shape "
                f"{list(getattr(mask, 'shape', []))}; a partition folder written by hand may hold another mask"
            )
        # Summing an [N, S] mask counts every split: the rank weights would be silently wrong.
        raise ValueError(
            f"`{mask_key}` has shape {list(mask.shape)}: one column per split. Choose the split "
            "with FullGraphDataModule(split=k) (default 0), which selects it before partitioning"
        )
    local = torch.tensor([float(mask.sum())], dtype=torch.float64, device=device)
    total = local.clone()
    if world_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    if float(total) == 0:
        raise ValueError(f"no node anywhere is set in `{mask_key}`: there is nothing to train on")
    return float(local) / float(total)


def gradient_snapshot(module: torch.nn.Module) -> dict[Tensor, Tensor | None]:
    """Every trainable parameter's gradient before a backward call (copies; ``None`` where
    there is none): what that call adds is ``p.grad - before``."""
    return {
        p: (p.grad.detach().clone() if p.grad is not None else None) for p in module.parameters() if p.requires_grad
    }


def all_reduce_gradients(
    module: torch.nn.Module,
    before: dict[Tensor, Tensor | None] | None,
    device: torch.device,
    check_finite: bool = True,
    rank: int = 0,
) -> None:
    """Sums over ranks what the backward call that just ran added to every gradient.

    Only that call's contribution crosses the wire, and it is added to the gradient held
    before the call: a gradient accumulated over several backward calls (manual
    optimization, a regulariser's own backward, stepping every k-th epoch) is summed once,
    never again, and ``p.grad`` is the single-process gradient whenever user code sees it
    (clipping, inspection, ``optimizer.step``), as under DDP.

    Args:
        module: The model whose trainable parameters' gradients are summed.
        before: :func:`gradient_snapshot` taken before the call (``None``: no gradient
            existed, the whole of ``p.grad`` is the call's).
        device: Where the collectives' tensors live.
        check_finite: Raise naming ``rank`` when the summed gradient holds NaN/inf.
        rank: This rank (for the message).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return
    before = before or {}
    # A parameter may have a gradient on some ranks only (e.g. a branch unused here):
    # agree first, so that all ranks all-reduce the same buffers.
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    live = [p for p, h in zip(params, has.tolist()) if h]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in live:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        olds = [before.get(p) for p in group]
        added = [p.grad if old is None else p.grad - old for p, old in zip(group, olds)]
        flat = torch.cat([a.reshape(-1) for a in added])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if check_finite and not all_finite(flat):
            raise FloatingPointError(
                f"rank {rank}: the summed weight gradient holds NaN/inf although every "
                "layer output and loss was finite on this rank; another rank's log names the cause"
            )
        offset = 0
        for p, old in zip(group, olds):
            total = flat[offset : offset + p.numel()].view_as(p.grad)
            p.grad.copy_(total if old is None else old + total)
            offset += p.numel()


# -- outputs ----------------------------------------------------------------------------------
def gather_node_outputs(out: Any, partition: LocalPartition, world_size: int, device: torch.device) -> Any:
    """Assembles per-rank node outputs into the global node order.

    Every tensor in ``out`` (nested tuples/lists/dicts too) whose first dimension equals
    the rank's owned node count is gathered from all ranks and returned with one row per
    global node, row ``v`` for global node ``v``.  Other values pass through.
    """
    from lightning_utilities.core.apply_func import apply_to_collection

    n_id = partition.data.n_id.to(device)
    n_owned = n_id.numel()
    num_global = partition.num_global_nodes

    def gather(t: Tensor) -> Tensor:
        if t.dim() == 0 or t.size(0) != n_owned:
            return t
        if world_size == 1:
            result = t.new_empty((num_global,) + tuple(t.shape[1:]))
            result[n_id] = t
            return result
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size)]
        dist.all_gather(counts, torch.tensor([n_owned], device=device))
        sizes = [int(c) for c in counts]
        width = max(sizes)
        padded = t.new_zeros((width,) + tuple(t.shape[1:]))
        padded[:n_owned] = t
        ids = n_id.new_full((width,), -1)
        ids[:n_owned] = n_id
        rows = [torch.empty_like(padded) for _ in sizes]
        all_ids = [torch.empty_like(ids) for _ in sizes]
        dist.all_gather(rows, padded.contiguous())
        dist.all_gather(all_ids, ids)
        result = t.new_empty((num_global,) + tuple(t.shape[1:]))
        for size, r, i in zip(sizes, rows, all_ids):
            result[i[:size]] = r[:size]
        return result

    return apply_to_collection(out, Tensor, gather)


# -- what a rank logs ---------------------------------------------------------------------------
def stage_nodes(
    partition: LocalPartition, world_size: int, device: torch.device
) -> tuple[dict[str, int], frozenset[str]]:
    """This rank's node count in each stage mask (bool masks only), and the stages where some
    rank has none (one all-reduce; the same answer on every rank)."""
    counts = {}
    for key in STAGE_MASKS:
        mask = getattr(partition.data, key, None)
        if isinstance(mask, Tensor) and mask.dtype == torch.bool:
            counts[key] = int(mask.sum())
    empty = torch.tensor([float(counts.get(k, 1) == 0) for k in STAGE_MASKS], dtype=torch.float64)
    if world_size > 1:
        empty = empty.to(device)
        dist.all_reduce(empty, op=dist.ReduceOp.MAX)
    return counts, frozenset(k for k, e in zip(STAGE_MASKS, empty.tolist()) if e)


def forget_empty_means(results: Any) -> None:
    """A rank with no node in the stage's mask logs a mean over no node (NaN for a loss)
    with weight 0, and ``NaN * 0`` is NaN: the epoch's weighted mean over ranks would be
    NaN on every rank.  Such an accumulated value carries no information; make it 0.

    Args:
        results: Lightning's ``trainer._results`` (a ``_ResultCollection``), or ``None``.
    """
    if results is None:
        return
    for metric in results.values():
        value = getattr(metric, "value", None)
        if (
            getattr(metric, "is_tensor", False)
            and metric.meta.is_mean_reduction
            and isinstance(value, Tensor)
            and float(metric.cumulated_batch_size) == 0
            and not bool(torch.isfinite(value).all())
        ):
            metric.value = torch.zeros_like(value)


def mean_over_ranks_with_nodes(tensor: Tensor, has_nodes: bool, group: Any | None = None) -> Tensor:
    """``sum_r has_r x_r / sum_r has_r`` over the ranks of ``group`` (NaN when no rank has
    nodes), in float (an integer tensor's mean is a float).  A collective."""
    value = tensor.detach().to(torch.float64).reshape(-1)
    packed = torch.cat([value if has_nodes else torch.zeros_like(value), value.new_tensor([float(has_nodes)])])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    count = float(packed[-1])
    out = packed[:-1] / count if count else torch.full_like(packed[:-1], math.nan)
    dtype = tensor.dtype if tensor.is_floating_point() else torch.get_default_dtype()
    return out.reshape(tensor.shape).to(dtype)


def global_loss_and_seconds(
    step_loss: Tensor, seconds: float, world_size: int, device: torch.device
) -> tuple[float, float]:
    """The step's global loss (the sum of the ranks' weighted losses) and its mean time over
    ranks in seconds, in one all-reduce (every rank calls it and then decides alike)."""
    total = torch.stack([
        step_loss.reshape(()).to(device, torch.float64),
        torch.tensor(seconds / world_size, dtype=torch.float64, device=device),
    ])
    if world_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    loss, mean_seconds = (float(v) for v in total.tolist())
    return loss, mean_seconds


class StageLogging:
    """What a rank's ``self.log`` calls need in each stage (training, validation, test).

    * The batch size: this rank's nodes in the stage's mask.  Lightning cannot infer it from a
      graph (it warns and uses 1); with it an epoch mean logged with ``sync_dist=True`` is the
      mean over all nodes of the stage, weighted by each rank's share, instead of a plain
      average of ranks of different size.  An explicit ``batch_size=`` in ``self.log`` still
      wins.
    * In a stage where some rank owns no node (:func:`stage_nodes`, the same on every rank), a
      mean over ranks leaves those ranks out (:func:`mean_over_ranks_with_nodes`), and the
      rank's accumulated means of weight 0 are made 0 (:func:`forget_empty_means`).
    """

    def __init__(self) -> None:
        #: this rank's node count per stage mask
        self.nodes: dict[str, int] = {}
        #: the stages where some rank has no node
        self.empty: frozenset[str] = frozenset()
        #: the mask of the stage whose step is running (``None`` between steps)
        self.stage: str | None = None

    def setup(self, partition: LocalPartition, world_size: int, device: torch.device) -> None:
        """Counts every rank's nodes per stage (one all-reduce)."""
        self.nodes, self.empty = stage_nodes(partition, world_size, device)

    def begin(self, results: Any, partition: LocalPartition | None, mask_key: str) -> None:
        """A step of the stage named by ``mask_key`` starts: sets Lightning's batch size
        (``results``: ``trainer._results``)."""
        if results is None or partition is None:
            return
        mask = getattr(partition.data, mask_key, None)
        count = int(mask.sum()) if isinstance(mask, Tensor) and mask.dtype == torch.bool else 1
        results.batch_size = count
        self.stage = mask_key

    def end(self) -> None:
        """The step's own ``self.log`` calls are over."""
        self.stage = None

    def forget_empty(self, results: Any, mask_key: str) -> None:
        """After a step: on a rank without nodes in the stage, means of weight 0 become 0."""
        if self.nodes.get(mask_key, 1) > 0:
            return
        forget_empty_means(results)

    def mean(self, tensor: Any, group: Any | None, world_size: int, mean: bool) -> Tensor | None:
        """The corrected mean over ranks of a logged value, or ``None`` where Lightning's own
        reduction is right (not a mean, one rank, not a tensor, or a float tensor in a stage
        where every rank has nodes).  A collective when it returns a tensor."""
        stage = self.stage
        excluding = stage is not None and stage in self.empty
        if not mean or world_size == 1 or not isinstance(tensor, Tensor) or (tensor.is_floating_point() and not excluding):
            return None
        has = not excluding or self.nodes.get(stage, 1) > 0  # type: ignore[arg-type]
        return mean_over_ranks_with_nodes(tensor, has, group)
