r"""When the central/marginal overlap runs: the central share of the aggregation, decided once.

The overlap (AdaQP's schedule, :func:`~lightning_fullgraph.nn.sparse.split_blocks`) aggregates
the *central* rows -- owned rows without a halo in-neighbour -- while the halo transfer is in
flight, and the *marginal* rows after it.  It hides at most the central rows' share of the
aggregation, and it always costs: two products instead of one, the merge of the two halves
(an ``[N_r, F]`` index copy forward, two gathers backward), a second cached adjacency.  Where
almost every edge ends at a marginal row (tolokers at 4 ranks: 99 %), it hides nothing and
pays that cost every layer and epoch.

:func:`decide_overlap` decides at setup, from the partition, the same way on every rank:

* ``overlap=True`` forces the split, ``overlap=False`` turns it off;
* ``overlap=None`` (the default) turns it on only for a mode whose row of the mode table says
  so (:func:`~lightning_fullgraph.comm.policies.modes.overlap_by_default`), and there only
  when the smallest central share over the ranks is at least :data:`MIN_CENTRAL_SHARE`.

The smallest share decides because every layer's exchange waits for every rank: the rank that
can hide least sets the layer's time.  One all-gather of two numbers per rank gives every rank
the same figures, hence the same decision -- the split changes what each layer computes, and
the ranks run one model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fullgraph.comm.policies.modes import overlap_by_default

if TYPE_CHECKING:
    from lightning_fullgraph.comm.plan import LocalPartition
    from lightning_fullgraph.comm.policies.base import CompressionPolicy

__all__ = ["MIN_CENTRAL_SHARE", "OverlapDecision", "central_inputs", "decide_overlap"]

#: The smallest central share (over ranks) at which ``overlap=None`` turns the split on; chosen
#: by measurement (the table in :func:`decide_overlap`).
MIN_CENTRAL_SHARE = 0.5


@dataclass(frozen=True)
class OverlapDecision:
    """Whether this run splits its aggregation into central and marginal rows, and why.

    Attributes:
        used: The split runs (the same on every rank).
        share_min: The smallest central share over the ranks (:func:`central_inputs`), in
            ``[0, 1]``.
        share_mean: The mean of the ranks' central shares.
        reason: Why, in a few words (the fit-start line shows it).
    """

    used: bool
    share_min: float
    share_mean: float
    reason: str

    def describe(self) -> str:
        """The fit-start line's clause: ``overlap on|off (<reason>; central share ...)``."""
        return (
            f"overlap {'on' if self.used else 'off'} ({self.reason}; central share of the aggregation "
            f"{self.share_min:.1%} min, {self.share_mean:.1%} mean over ranks, the same for every layer)"
        )


def central_inputs(edge_index: Tensor, num_owned: int, marginal_mask: Tensor | None = None) -> tuple[int, int]:
    """``(central, total)`` aggregation inputs of one rank's owned rows.

    What is counted: every local edge (``edge_index``, ``[2, E_r]``, destinations owned, sources
    in ``[0, N_r + H_r)``) plus one self term per owned row (GCN's self-loop, SAGE's / GIN's /
    GraphConv's root term), so ``total = E_r + N_r``; ``central`` counts the edges whose
    destination is central (no halo in-neighbour) plus the central rows.  These are the inputs
    the split's central block aggregates before the halo arrives.

    Args:
        edge_index: ``[2, E_r]`` the rank's local edges.
        num_owned: ``N_r``.
        marginal_mask: ``[N_r]`` bool, owned rows with a halo in-neighbour (the plan's
            ``marginal_mask``); derived from ``edge_index`` when ``None`` or of another length.
    """
    src, dst = edge_index[0], edge_index[1]
    if marginal_mask is None or marginal_mask.numel() != num_owned:
        marginal_mask = torch.zeros(num_owned, dtype=torch.bool, device=edge_index.device)
        marginal_mask[dst[src >= num_owned]] = True
    marginal_mask = marginal_mask.to(dst.device)
    central_rows = num_owned - int(marginal_mask.sum())
    central_edges = int((~marginal_mask[dst]).sum()) if dst.numel() else 0
    return central_edges + central_rows, int(dst.numel()) + num_owned


def decide_overlap(
    setting: bool | None,
    policy: CompressionPolicy,
    partition: LocalPartition,
    world_size: int,
    device: torch.device | None = None,
) -> OverlapDecision:
    """The run's overlap decision (the same on every rank; collective when ``world_size > 1``:
    every rank must call it, once, whatever ``setting`` is).

    Rule: ``setting`` True/False forces; ``None`` follows the policy's row of the mode table
    and, where that says overlap, uses the split only when the smallest central share over the
    ranks is at least :data:`MIN_CENTRAL_SHARE`.  One rank has no halo: nothing to hide.

    The threshold is measured.  Per rank, single thread, CPU time (``time.thread_time``, robust
    to the other processes sharing the cores), median of 9 alternating steps: forward+backward
    of GCN 3 x 256 through the adapters, split on against off, with a stand-in exchanger whose
    halo arrives at once (the compute-only view); *hideable* is the work the split runs between
    launching a transfer and waiting for it (forward and backward), the most it can hide.  The
    split pays only where hideable exceeds its cost, and then by at most the difference:

    =======================  ==========  =========  ===========  ==========  =============
    graph, METIS parts       central     rows/rank  step off ms  split cost  hideable ms
                             share                                ms
    =======================  ==========  =========  ===========  ==========  =============
    tolokers, 4              0.005-0.09  2.4-3.6k   22-29        +1.8-3.7    1.8-2.7
    community 20k d8, 4      0.09-0.17   4.9-5.1k   32-34        +3.8-5.3    3.3-3.9
    products-like 100k, 4    0.05-0.08   24-25k     330-415      -13..+6     32
    products-like 100k, 2    0.19-0.22   49-51k     770-790      +65-81      120-122
    community 20k d8, 2      0.29-0.37   9.8-10k    62-68        +10.8-10.9  9.2
    Cora, 4                  0.73-0.76   0.6-0.7k   11-13        +1.2-1.7    3.9-4.3
    grid 200 x 200, 4        0.98        10k        51-53        +9.9-12.4   8.8-9.6
    community 60k d40, 4     0.000-0.001 15k        --           no split: no central row
    =======================  ==========  =========  ===========  ==========  =============

    The split's cost is mostly per row (the merge's ``[N_r, F]`` copies forward and backward),
    what it hides mostly per central input, so the share alone is a rough predictor: on sparse
    graphs (degree 4-8) the split lost at every share up to 0.37 and on the grid even at 0.98;
    on the dense products-like graph it could gain up to 6 % of the step at shares of 0.05-0.2
    (where the transfer is long enough); on Cora (0.73) up to 20 %.  The threshold 0.5 keeps it
    off wherever a measured loss or a gain under 6 % was at stake below 0.4, and on from the
    shares where the largest measured gain was.  ``overlap=True`` forces it where a run knows
    better.  (``benchmarks/overlap_cost.py`` prints these figures.)
    """
    plan = partition.plan
    central, total = central_inputs(partition.data.edge_index, plan.num_owned, plan.marginal_mask)
    mine = torch.tensor([float(central), float(total)], dtype=torch.float64)
    if world_size > 1:
        mine = mine.to(device) if device is not None else mine
        rows = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu()
    else:
        table = mine.reshape(1, 2)
    shares = torch.where(table[:, 1] > 0, table[:, 0] / table[:, 1].clamp_min(1.0), torch.ones(()))
    low, mean = float(shares.min()), float(shares.mean())
    if setting is not None:
        return OverlapDecision(bool(setting), low, mean, f"overlap={bool(setting)}")
    if not overlap_by_default(policy):
        return OverlapDecision(False, low, mean, f"{policy.name} does not overlap by default")
    if world_size <= 1:
        return OverlapDecision(False, low, mean, "one rank: no transfer to hide")
    if low < MIN_CENTRAL_SHARE:
        return OverlapDecision(False, low, mean, f"central share below {MIN_CENTRAL_SHARE:.0%}: nothing to hide")
    return OverlapDecision(True, low, mean, f"central share at least {MIN_CENTRAL_SHARE:.0%}")
