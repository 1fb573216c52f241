r"""AdaQP's adaptive bit-widths, distributed: measure links, gather variances, solve, share.

The pure parts (cost fit, grouping, the MILP) live in :mod:`~lightning_fullgraph.comm.assign`;
this module runs them across ranks:

1. :func:`measure_link_costs` (once, at setup): in round :math:`r = 1..W-1` every rank sends
   to :math:`(s + r) \bmod W` and receives from :math:`(s - r) \bmod W` at once, for a range
   of message sizes; each sender fits :math:`t = \alpha \cdot bytes + \beta` for its link and
   the table is all-gathered.
2. :func:`receiver_weights` (once): the receiver's aggregation score of every halo row,
   :math:`a_j = \sum_{i: j \to i} 1/d_i` (mean-aggregation weight of the in-edge into owned
   node :math:`i`), sent back so the sender knows :math:`a^2` of every row it sends.
3. :func:`assign_layer_bits` (every ``assign_every`` epochs): every rank groups the rows it
   sends to each peer by weighted variance
   :math:`c_i = a_i^2 \, F \, (\max_i - \min_i)^2 / 6` (from the last compressed forward),
   rank 0 gathers all groups, solves one MILP per layer and sender (the sender's rounds are
   its peers) and broadcasts the bits; a final
   all-to-all tells every receiver the bit-width of each of its halo rows.

Backward messages of a layer reuse the bit-widths of its forward rows (the same rows in the
opposite direction) — a simplification of the paper, which solves for them separately.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fullgraph.comm.assign import (
    AssignmentProblem,
    LinkCost,
    assign_bits,
    fit_alpha_beta,
    group_aggregates,
    group_nodes,
)
from lightning_fullgraph.comm.exchange import HaloExchanger
from lightning_fullgraph.comm.quantize import META_NBYTES

__all__ = ["assign_layer_bits", "measure_link_costs", "receiver_weights"]


def measure_link_costs(
    group: Any, rank: int, world_size: int, sizes: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 17, 1 << 20), repeats: int = 3
) -> dict[tuple[int, int], LinkCost]:
    """Times concurrent sends on every directed link and fits alpha-beta (module docstring).

    Returns:
        ``{(sender, peer): LinkCost}`` for all ordered pairs, identical on every rank.
    """
    mine: dict[tuple[int, int], tuple[float, float]] = {}
    for r in range(1, world_size):
        to, frm = (rank + r) % world_size, (rank - r) % world_size
        xs, ts = [], []
        for size in sizes:
            send = torch.zeros(size, dtype=torch.uint8)
            recv = torch.empty(size, dtype=torch.uint8)
            for _ in range(repeats):
                dist.barrier(group=group)
                start = time.perf_counter()
                ops = [dist.P2POp(dist.isend, send, to, group=group), dist.P2POp(dist.irecv, recv, frm, group=group)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
                xs.append(float(size))
                ts.append(time.perf_counter() - start)
        cost = fit_alpha_beta(xs, ts)
        mine[(rank, to)] = (cost.alpha, cost.beta)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    return {pair: LinkCost(*ab) for table in gathered for pair, ab in table.items()}


def receiver_weights(exchanger: HaloExchanger, edge_index: Tensor) -> Tensor:
    """Squared aggregation score of every row this rank SENDS, ``[S]`` (send order).

    Computed by the receivers from their local graphs and returned through one all-to-all.
    """
    plan = exchanger.plan
    src, dst = edge_index[0], edge_index[1]
    deg = torch.bincount(dst, minlength=plan.num_owned).clamp(min=1).to(torch.float32)
    score = torch.zeros(plan.num_owned + plan.num_halo, dtype=torch.float32, device=edge_index.device)
    score.index_add_(0, src, 1.0 / deg[dst])
    halo_score = score[plan.num_owned :].unsqueeze(1).contiguous()
    sent = exchanger._all_to_all(halo_score, plan.recv_counts, plan.send_counts)
    return sent.squeeze(1).pow(2)


def assign_layer_bits(
    exchanger: HaloExchanger,
    group: Any,
    costs: dict[tuple[int, int], LinkCost],
    weights: Tensor,
    feature_dims: dict[int, int],
    lambda_: float = 0.5,
    group_size: int = 100,
    bit_choices: tuple[int, ...] = (2, 4, 8),
) -> dict[str, float]:
    """Re-assigns the bit-width of every sent row, for every layer seen in the last step.

    Collective: every rank must call it at the same point.  Updates
    ``exchanger.layer_bits`` and returns timing figures (seconds) and the average assigned
    bits, for logging.
    """
    plan = exchanger.plan
    rank, world = plan.rank, plan.world_size
    start = time.perf_counter()
    layers = sorted(exchanger.row_range)
    local: dict[int, list[tuple[int, int, float]]] = {}
    group_ids: dict[int, Tensor] = {}
    for layer in layers:
        c = feature_dims[layer] * exchanger.row_range[layer].double().pow(2) / 6.0 * weights.double()
        entries: list[tuple[int, int, float]] = []
        ids = torch.empty(plan.num_send, dtype=torch.long)
        offset = 0
        for peer, count in enumerate(plan.send_counts):
            if count == 0:
                continue
            part = c[offset : offset + count].cpu()
            gid = group_nodes(part, group_size)
            rows, var = group_aggregates(part, gid)
            ids[offset : offset + count] = gid + len(entries)
            entries += [(peer, int(n), float(v)) for n, v in zip(rows.tolist(), var.tolist())]
            offset += count
        local[layer] = entries
        group_ids[layer] = ids
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    solve_seconds = 0.0
    decisions: list[Any] = [None]
    if rank == 0:
        solved: dict[int, dict[int, list[int]]] = {}
        for layer in layers:
            per_sender: dict[int, list[int]] = {}
            # One MILP per (layer, sender): the sender's rounds are its peers, so every link's
            # time counts (a joint problem lets links that are not their round's bottleneck
            # keep 8 bits for free, which on near-uniform links sends almost all rows at 8).
            for s, table in enumerate(gathered):
                entries = table[layer]
                if not entries:
                    per_sender[s] = []
                    continue
                problem = AssignmentProblem(
                    sender=[s] * len(entries),
                    peer=[p for p, _, _ in entries],
                    rows=[n for _, n, _ in entries],
                    var_coef=[v for _, _, v in entries],
                    costs={pair: c for pair, c in costs.items() if pair[0] == s},
                    world_size=world,
                    feature_dim=feature_dims[layer],
                    meta_bytes_per_row=float(META_NBYTES),
                )
                result = assign_bits(problem, lambda_=lambda_, bit_choices=bit_choices)
                solve_seconds += result.solve_seconds
                per_sender[s] = [int(b) for b in result.bits_per_group.tolist()]
            solved[layer] = per_sender
        decisions = [solved]
    dist.broadcast_object_list(decisions, src=0, group=group)
    solved = decisions[0]
    device = plan.send_index.device
    assigned_bits = 0.0
    assigned_rows = 0
    for layer in layers:
        per_group = torch.tensor(solved[layer][rank] or [8], dtype=torch.uint8)
        send_bits = per_group[group_ids[layer]].to(device) if plan.num_send else torch.zeros(0, dtype=torch.uint8, device=device)
        recv_bits = exchanger._all_to_all(send_bits.unsqueeze(1), plan.send_counts, plan.recv_counts).squeeze(1)
        exchanger.layer_bits[layer] = (send_bits, recv_bits)
        assigned_bits += float(send_bits.sum())
        assigned_rows += send_bits.numel()
    return {
        "assign_time": time.perf_counter() - start,
        "solve_time": solve_seconds,
        "assigned_bits": assigned_bits / assigned_rows if assigned_rows else 0.0,
    }
