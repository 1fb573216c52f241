r"""AdaQP's adaptive bit-widths, distributed: measure links, score rows, gather variances, solve.

The pure parts live in :mod:`~lightning_fullgraph.comm.policies.adaqp.links` (the link cost
fit) and :mod:`~lightning_fullgraph.comm.policies.adaqp.milp` (grouping, the MILP); this module runs them across the ``W`` ranks of a process group.  Nothing here knows the halo
exchanger: small picklable tables travel by ``torch.distributed`` object collectives on
``group``, rows (scores, bit-widths) by a caller-provided
:data:`~lightning_fullgraph.comm.policies.base.ControlFn`, an uncompressed
all-to-all of the caller's transport.

Notation (one rank, its halo plan): ``send_counts[p]`` = rows this rank owns that rank ``p``
holds as halo (``S = sum``), ``recv_counts[p]`` = halo rows owned by ``p`` (``H = sum``), both
in peer-rank order.  A layer ``l`` has two message directions, keyed ``(l, "forward")`` and
``(l, "backward")``:

* forward: this rank sends ``M = S`` feature rows (send counts ``plan.send_counts``) and
  receives its ``H`` halo rows (``plan.recv_counts``);
* backward: this rank sends the gradients of its ``M = H`` halo rows back to their owners
  (send counts ``plan.recv_counts``) and receives ``S`` rows (``plan.send_counts``), which it
  scatter-adds with coefficient 1.

1. :func:`profile_links` (once, at the first assignment, when every layer's width is known):
   each link ``s -> p`` is timed over its real message range (the rows ``s`` sends ``p`` in
   any key, at the fewest to the most bits; :func:`~.links.message_range`): in round
   :math:`r = 1..W-1` every rank ``s`` sends to :math:`(s + r) \bmod W` and receives from
   :math:`(s - r) \bmod W` at once, many sizes, several repeats each; the receiver times
   each message; rank 0 fits :math:`t = \alpha \cdot bytes + \beta` (seconds, bytes) per
   link with the checks of :mod:`~lightning_fullgraph.comm.policies.adaqp.links` (rejected
   fits, links indistinguishable from the pooled fit) and broadcasts the costs.
2. :func:`sender_weights` (once per layer, or once if all layers share a score): the receiver's aggregation score :math:`a_j` of every halo
   row ``j`` (computed by the caller for its conv type, e.g. GCN
   :math:`\sum_{i: j \to i} d_{out}(j)^{-1/2} d_{in}(i)^{-1/2}` (global degrees), mean aggregation
   :math:`\sum_{i: j \to i} 1/d_{in}(i)`) is sent home, so every sender knows
   :math:`w = a^2` of each row it sends forward, ``[S]`` in send order.  Backward rows use
   :math:`w = 1`.
3. :func:`assign_message_bits` (every ``assign_every`` epochs), per key (layer, direction), from
   :class:`MessageStats` (the ``[M]`` row ranges of the last compressed step of that direction,
   its weights and counts):

   * every rank computes :math:`c_i = w_i \, F \, (\max_i - \min_i)^2 / 6` of each row it sends
     (quantisation variance at ``b`` bits: :math:`c_i / (2^b - 1)^2`), sorts each peer's rows
     by ``c`` and chops them into groups of ``group_size`` (:func:`~.milp.group_nodes`);
   * rank 0 gathers every rank's groups and builds ONE
     :class:`~.milp.AssignmentProblem` per key over ALL senders: the pair :math:`s \to p`
     belongs to round :math:`r = (p - s) \bmod W`, the round time is
     :math:`Z_r = \max_{(s,p) \in r} \alpha_{sp} \cdot bytes_{sp} + \beta_{sp}` with
     :math:`bytes = \sum_g n_g (\lceil F b_g / 8 \rceil + m)`, ``m`` =
     :data:`~.quantize.META_NBYTES`, and the objective is
     :math:`\lambda \, \hat V + (1 - \lambda) \, \hat T`, :math:`T = \sum_r Z_r` (normalised
     between all-min-bits and all-max-bits); :func:`~.milp.assign_bits` solves it as
     independent per-round MILPs, one per round that has a group (the separation is exact;
     each round is solved to a relative gap of ``1e-2``, :data:`~.milp.MIP_REL_GAP`, within a
     shared 10 s budget, with a greedy fallback, see :mod:`~.milp`);
   * rank 0 broadcasts the group bit-widths; each rank expands them to per-row send bits
     ``[M]`` and obtains, through the control all-to-all, the bit-width of every row it
     receives in that direction, ``[sum(recv_counts)]``.

   Backward messages are assigned from their own statistics (their own rows, ranges and
   links), as in the paper; they do not reuse the forward bit-widths.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fullgraph.comm.plan import DIRECTIONS
from lightning_fullgraph.comm.policies.adaqp.links import LinkCost, ResolvedLinks, probe_sizes, resolve_links
from lightning_fullgraph.comm.policies.adaqp.milp import (
    ADAPTIVE_BITS,
    AssignmentProblem,
    assign_bits,
    group_aggregates,
    group_nodes,
    range_coefficients,
)
from lightning_fullgraph.comm.policies.base import ControlFn
from lightning_fullgraph.comm.quantize import META_NBYTES

__all__ = [
    "MessageStats",
    "assign_message_bits",
    "measure_link_costs",
    "profile_links",
    "sender_weights",
]

Key = tuple[int, str]
_Entry = tuple[int, int, float]  # (peer, rows, variance coefficient) of one group


@dataclass
class MessageStats:
    """Statistics of one message direction of one layer on this rank (rows in send order).

    Attributes:
        row_range: ``[M]`` float32, ``max - min`` of every row this rank SENDS in this
            direction (at the last compressed step).
        weight: ``[M]`` float32, squared aggregation score of each sent row (forward: from the
            receiver, :func:`sender_weights`; backward: ones).
        feature_dim: features per row ``F``.
        send_counts: rows to each peer, ``[W]`` (forward: ``plan.send_counts``; backward:
            ``plan.recv_counts``); sums to ``M``.
        recv_counts: rows from each peer, ``[W]`` (forward: ``plan.recv_counts``; backward:
            ``plan.send_counts``).
    """

    row_range: Tensor
    weight: Tensor
    feature_dim: int
    send_counts: list[int]
    recv_counts: list[int]


def _global_rank(group: Any, group_rank: int) -> int:
    """Global rank of ``group_rank`` in ``group`` (identity for the default group)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# --------------------------------------------------------------------------- link costs


def _timed_exchange(send: Tensor, recv: Tensor, to: int, frm: int, group: Any, device: torch.device) -> float:
    """One probe message each way after a barrier: seconds until ``recv`` has arrived (the
    link ``frm -> this rank``); the send is waited for too, untimed.  Ranks are global."""
    ops = [dist.P2POp(dist.irecv, recv, frm, group=group), dist.P2POp(dist.isend, send, to, group=group)]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    reqs = dist.batch_isend_irecv(ops)
    reqs[0].wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    took = time.perf_counter() - start
    for req in reqs[1:]:
        req.wait()
    return took


def profile_links(
    group: Any,
    rank: int,
    world_size: int,
    device: torch.device | str,
    message_bytes: Sequence[tuple[float, float]],
    num_sizes: int = 8,
    repeats: int = 3,
    max_probe_bytes: int = 1 << 24,
    min_r2: float = 0.8,
    tolerance: float = 0.25,
) -> tuple[ResolvedLinks, dict[str, float]]:
    """Times messages over each link's real size range and resolves the link costs.

    Collective over ``group`` (module docstring, step 1; the rule is
    :mod:`~lightning_fullgraph.comm.policies.adaqp.links`):

    1. one ``all_gather_object`` of every rank's ``message_bytes``; the link ``s -> p`` is
       probed at :func:`~.links.probe_sizes` ``(lo, hi)`` of its range (a link that carries
       nothing at the union range of all links, so every link gets a cost);
    2. rounds ``r = 1..W-1``: every rank sends to ``(rank + r) % W`` and receives from
       ``(rank - r) % W`` at once (as the halo exchange does); one untimed warm-up message
       per round at the largest size, then ``repeats`` passes, each over every round and,
       within a round, over every size in a shuffled order (the same on every rank: a drift
       of the host's load spreads over all rounds and sizes instead of making one round's
       links look slower or biasing a slope); every message starts after a barrier and the
       RECEIVER times it (barrier exit to the message's arrival), for the link
       ``sender -> receiver``;
    3. one ``all_gather_object`` of the samples; rank 0 runs :func:`~.links.resolve_links`
       and broadcasts the result (so every rank holds the same costs), and warns once per
       note (a rejected fit, naming the link).

    Cost: at most ``(W - 1) * (num_sizes * repeats + 1)`` exchanges of at most
    ``max_probe_bytes`` each, plus a barrier each; defaults: 75 exchanges at 4 ranks (about
    1.4 s behind one shared 1 Gbit/s link for a GCN 3 x 256 on a 20k-node graph, 4.4 s with
    16 sizes x 5 repeats, which gave the same costs and the same mean bits;
    ``benchmarks/link_profile.py --profiles 16x5,8x3`` prints both).
    Probe tensors (``uint8``) live on ``device`` (NCCL needs CUDA, gloo CPU); on CUDA the
    device is synchronised around every timed message.

    Args:
        group: the process group (``None``: default group).
        rank: this rank in ``group``.
        world_size: ranks in ``group`` (``W``).
        device: where the probe tensors live.
        message_bytes: per peer (``[W]``, this rank's entry ignored) ``(lo, hi)``, the
            smallest and largest message this rank sends it, bytes
            (:func:`~.links.message_range`); ``(0, 0)``: none.
        num_sizes: sizes per link (``>= 2``).
        repeats: timed messages per size (``>= 1``); the fit takes their median.
        max_probe_bytes: cap on one probe message, bytes (larger messages are extrapolated).
        min_r2, tolerance: :func:`~.links.resolve_links`'s thresholds.

    Returns:
        ``(links, figures)``: ``links.costs`` holds a :class:`~.links.LinkCost` (s/byte, s)
        for all ``W (W - 1)`` ordered pairs (group ranks), identical on every rank;
        ``figures``: ``profile_time`` (seconds, this rank, whole call) and
        ``profile_messages`` (timed messages this rank received).
    """
    start = time.perf_counter()
    device = torch.device(device)
    if len(message_bytes) != world_size:
        raise ValueError(f"message_bytes needs one (lo, hi) per rank: {len(message_bytes)} != {world_size}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    ranges: list[Any] = [None] * world_size
    dist.all_gather_object(ranges, [(float(lo), float(hi)) for lo, hi in message_bytes], group=group)
    used = [(lo, hi) for s, row in enumerate(ranges) for p, (lo, hi) in enumerate(row) if p != s and hi > 0]
    union = (min(lo for lo, _ in used), max(hi for _, hi in used)) if used else (float(1 << 10), float(1 << 20))

    def sizes_of(s: int, p: int) -> list[int]:
        lo, hi = ranges[s][p]
        lo, hi = (lo, hi) if hi > 0 else union
        return probe_sizes(lo, hi, num_sizes, max_probe_bytes)

    rounds = []
    for r in range(1, world_size):
        to, frm = (rank + r) % world_size, (rank - r) % world_size
        out_sizes, in_sizes = sizes_of(rank, to), sizes_of(frm, rank)
        rounds.append((
            frm, out_sizes, in_sizes,
            torch.zeros(max(out_sizes), dtype=torch.uint8, device=device),
            torch.empty(max(in_sizes), dtype=torch.uint8, device=device),
            (_global_rank(group, to), _global_rank(group, frm)),
        ))
    samples: dict[tuple[int, int], tuple[list[float], list[float]]] = {
        (frm, rank): ([], []) for frm, *_ in rounds
    }

    def step(i: int, k: int, timed: bool) -> None:
        frm, out_sizes, in_sizes, send, recv, peers = rounds[i]
        n_out, n_in = out_sizes[k % len(out_sizes)], in_sizes[k % len(in_sizes)]
        took = _timed_exchange(send[:n_out], recv[:n_in], *peers, group, device)
        if timed:
            samples[(frm, rank)][0].append(float(n_in))
            samples[(frm, rank)][1].append(took)

    num_steps = [max(len(out), len(inc)) for _, out, inc, *_ in rounds]  # a shorter list cycles
    for i, n in enumerate(num_steps):  # untimed warm-up at the largest sizes: connection, buffers
        step(i, n - 1, False)
    # repeats outermost, rounds inside: a drift of the host's load spreads over every round
    # and size instead of making one round's links look slower (the same order on every rank)
    for rep in range(repeats):
        for i, n in enumerate(num_steps):
            for k in np.random.default_rng([rep, i]).permutation(n).tolist():
                step(i, k, True)

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, samples, group=group)
    decision: list[Any] = [None]
    if rank == 0:
        try:
            everything = {pair: data for table in gathered for pair, data in table.items()}
            decision = [{"links": resolve_links(everything, min_r2=min_r2, tolerance=tolerance), "error": None}]
        except Exception as exc:  # shared with every rank below
            decision = [{"links": None, "error": f"{type(exc).__name__}: {exc}"}]
    dist.broadcast_object_list(decision, src=_global_rank(group, 0), group=group)
    if decision[0]["error"] is not None:
        raise RuntimeError(f"profile_links: rank 0 could not fit the link costs: {decision[0]['error']}")
    links: ResolvedLinks = decision[0]["links"]
    if rank == 0:
        for note in links.notes:
            warnings.warn(note, UserWarning, stacklevel=2)
    received = sum(len(xs) for xs, _ in samples.values())
    figures = {"profile_time": time.perf_counter() - start, "profile_messages": float(received)}
    return links, figures


def measure_link_costs(
    group: Any,
    rank: int,
    world_size: int,
    device: torch.device | str,
    message_bytes: Sequence[tuple[float, float]] | None = None,
    **kwargs: Any,
) -> dict[tuple[int, int], LinkCost]:
    """The costs of :func:`profile_links` alone (``message_bytes`` ``None``: every link
    probed over 1 KiB .. 1 MiB); keyword arguments go to :func:`profile_links`."""
    if message_bytes is None:
        message_bytes = [(float(1 << 10), float(1 << 20))] * world_size
    return profile_links(group, rank, world_size, device, message_bytes, **kwargs)[0].costs


# --------------------------------------------------------------------------- row weights


def sender_weights(
    halo_score: Tensor, send_counts: list[int], recv_counts: list[int], control: ControlFn
) -> Tensor:
    """Squared receiver-side aggregation score of every row this rank sends forward.

    Collective (one ``control`` call).  The counts are this rank's FORWARD plan counts:
    ``send_counts = plan.send_counts`` (rows this rank sends to each peer, ``S = sum``) and
    ``recv_counts = plan.recv_counts`` (halo rows this rank receives from each peer,
    ``H = sum``).  The halo scores travel the reverse way, back to the rows' owners:
    ``control(halo_score[:, None], recv_counts, send_counts)``; since the halo block of the
    receiver is exactly the concatenation, in owner order, of what each owner sends it (in
    the same row order), the result lines up with this rank's send order.

    Args:
        halo_score: ``[H]`` aggregation score ``a_j`` of each of this rank's halo rows, in halo
            order (computed by the caller for its conv type).
        send_counts: ``plan.send_counts``, ``[W]``.
        recv_counts: ``plan.recv_counts``, ``[W]``.
        control: the caller's uncompressed all-to-all (:data:`ControlFn`).

    Returns:
        ``[S]`` float32 ``a^2`` of every row this rank sends, in send order, on the device
        ``control`` returns.

    Raises:
        ValueError: if ``halo_score`` is not ``[sum(recv_counts)]`` or the counts' lengths
            differ (raised before the collective: every rank's inputs are its own).
    """
    score = halo_score.detach().reshape(-1)
    if len(send_counts) != len(recv_counts):
        raise ValueError(
            f"send_counts and recv_counts differ in length: {len(send_counts)} vs {len(recv_counts)}"
        )
    if score.numel() != sum(recv_counts):
        raise ValueError(
            f"halo_score has {score.numel()} rows but recv_counts (the halo rows per owner) sum to "
            f"{sum(recv_counts)}"
        )
    home = control(score.to(torch.float32).unsqueeze(1).contiguous(), list(recv_counts), list(send_counts))
    if home.numel() != sum(send_counts):
        raise ValueError(
            f"control returned {home.numel()} rows, expected sum(send_counts) = {sum(send_counts)}"
        )
    return home.reshape(-1).to(torch.float32).pow(2)


# --------------------------------------------------------------------------- assignment


def _check_stats(key: Any, stat: Any, world_size: int) -> str | None:
    """Why ``stat`` is unusable, or ``None``."""
    if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], int) and key[1] in DIRECTIONS):
        return f"key {key!r} is not (layer, 'forward' | 'backward')"
    if len(stat.send_counts) != world_size or len(stat.recv_counts) != world_size:
        return f"{key}: send_counts / recv_counts must have world_size = {world_size} entries"
    if any(int(c) < 0 for c in list(stat.send_counts) + list(stat.recv_counts)):
        return f"{key}: counts must be non-negative"
    m = sum(int(c) for c in stat.send_counts)
    if stat.row_range.numel() != m or stat.weight.numel() != m:
        return (
            f"{key}: row_range ({stat.row_range.numel()}) and weight ({stat.weight.numel()}) must have "
            f"sum(send_counts) = {m} rows"
        )
    if int(stat.feature_dim) < 0:
        return f"{key}: feature_dim must be non-negative"
    return None


def _local_groups(stat: MessageStats, group_size: int) -> tuple[list[_Entry], Tensor]:
    """Groups of one key's sent rows: ``(entries, ids)``.

    ``entries`` lists ``(peer, rows, C_g)`` per group, peers ascending; ``ids`` ``[M]`` int64
    maps every sent row (send order) to its index in ``entries``.
    """
    c = range_coefficients(stat.row_range.detach().cpu(), stat.feature_dim) * stat.weight.detach().to(
        "cpu", torch.float64
    ).reshape(-1)
    if not bool(torch.isfinite(c).all()):
        raise ValueError("non-finite row range or weight")
    entries: list[_Entry] = []
    ids = torch.empty(c.numel(), dtype=torch.long)
    offset = 0
    for peer, count in enumerate(int(n) for n in stat.send_counts):
        if count == 0:
            continue
        part = c[offset : offset + count]
        gid = group_nodes(part, group_size)
        rows, var = group_aggregates(part, gid)
        ids[offset : offset + count] = gid + len(entries)
        entries += [(peer, int(n), float(v)) for n, v in zip(rows.tolist(), var.tolist())]
        offset += count
    return entries, ids


def _solve_keys(
    tables: list[dict[Key, list[_Entry]]],
    feature_dims: dict[Key, int],
    costs: dict[tuple[int, int], LinkCost],
    world_size: int,
    lambda_: float,
    bit_choices: tuple[int, ...],
) -> tuple[dict[Key, list[list[int]]], dict[str, float]]:
    """Rank 0's part: one joint problem per key over all senders (pure; no collectives).

    Args:
        tables: per sender rank, ``{key: [(peer, rows, C_g), ...]}`` (every rank the same keys).
        feature_dims: ``F`` per key.
        costs: :class:`LinkCost` per ``(sender, peer)``.

    Returns:
        ``(bits, figures)``: ``bits[key][s]`` the bit-width of each of sender ``s``'s groups
        (its entries' order); figures ``solve_time`` and the row-weighted mean bits
        ``assigned_bits`` / ``assigned_bits_forward`` / ``assigned_bits_backward`` (0.0 where
        no row is sent).
    """
    out: dict[Key, list[list[int]]] = {}
    solve = 0.0
    bit_rows = {d: 0.0 for d in DIRECTIONS}
    rows_of = {d: 0 for d in DIRECTIONS}
    for key in sorted(feature_dims):
        sender, peer, rows, var = [], [], [], []
        for s, table in enumerate(tables):
            for p, n, v in table[key]:
                sender.append(s)
                peer.append(p)
                rows.append(n)
                var.append(v)
        problem = AssignmentProblem(
            sender=sender,
            peer=peer,
            rows=rows,
            var_coef=var,
            costs=costs,
            world_size=world_size,
            feature_dim=int(feature_dims[key]),
            meta_bytes_per_row=float(META_NBYTES),
        )
        result = assign_bits(problem, lambda_=lambda_, bit_choices=bit_choices)
        solve += result.solve_seconds
        bits = [int(b) for b in result.bits_per_group.tolist()]
        per_sender: list[list[int]] = []
        offset = 0
        for table in tables:
            per_sender.append(bits[offset : offset + len(table[key])])
            offset += len(table[key])
        out[key] = per_sender
        bit_rows[key[1]] += float(sum(n * b for n, b in zip(rows, bits)))
        rows_of[key[1]] += int(sum(rows))

    def mean(total: float, n: int) -> float:
        return total / n if n else 0.0

    figures = {
        "solve_time": solve,
        "assigned_bits": mean(sum(bit_rows.values()), sum(rows_of.values())),
        "assigned_bits_forward": mean(bit_rows["forward"], rows_of["forward"]),
        "assigned_bits_backward": mean(bit_rows["backward"], rows_of["backward"]),
    }
    return out, figures


def assign_message_bits(
    stats: dict[Key, MessageStats],
    rank: int,
    world_size: int,
    group: Any,
    costs: dict[tuple[int, int], LinkCost],
    control: ControlFn,
    lambda_: float = 0.5,
    group_size: int = 100,
    bit_choices: tuple[int, ...] = ADAPTIVE_BITS,
) -> tuple[dict[Key, tuple[Tensor, Tensor]], dict[str, float]]:
    """Assigns the bit-width of every row of every message direction of every layer.

    Collective over ``group`` (all ranks, the same point, the same keys): one
    ``all_gather_object``, one ``broadcast_object_list`` from rank 0, then one ``control``
    call per key in sorted key order.  Each key's problem is joint over all senders (the
    round time is the max over the round's links) and is solved from that key's own
    statistics (module docstring, step 3).  Invalid inputs on any rank (counts, lengths,
    non-finite ranges, differing keys or feature dims) and solver errors on rank 0 raise the
    same error on every rank, after the collectives, so no rank is left waiting.

    Args:
        stats: ``{(layer, "forward" | "backward"): MessageStats}`` of this rank.
        rank: this rank in ``group`` (the index into the counts).
        world_size: ranks in ``group`` (``W``).
        group: the process group of the object collectives (``None``: default group).
        costs: :class:`LinkCost` per ``(sender, peer)`` (e.g. :func:`measure_link_costs`);
            every pair that sends rows needs one.
        control: the caller's uncompressed all-to-all (:data:`ControlFn`).
        lambda_: weight of the normalised variance term (``1 - lambda_``: time term).
        group_size: rows per group.
        bit_choices: allowed bit-widths.

    Returns:
        ``(bits, figures)``: ``bits[key] = (send_bits, recv_bits)``, uint8, ``send_bits``
        ``[M]`` (one per sent row, send order, on ``row_range``'s device) and ``recv_bits``
        ``[sum(recv_counts)]`` (one per received row, as returned by ``control``); figures
        (floats, seconds for times): ``assign_time`` (this rank, whole call), ``solve_time``
        (rank 0's MILP time), ``assigned_bits`` (mean bits per assigned row over all keys and
        ranks), ``assigned_bits_forward``, ``assigned_bits_backward`` (the same per direction;
        0.0 where no row is sent).
    """
    start = time.perf_counter()
    keys = sorted(stats)
    tables: dict[Key, list[_Entry]] = {}
    group_ids: dict[Key, Tensor] = {}
    errors: list[str] = []
    dims: dict[Key, int] = {}
    for key in keys:
        # every local problem is reported through the gather, so no rank is left waiting
        try:
            problem = _check_stats(key, stats[key], world_size)
            if problem is None:
                dims[key] = int(stats[key].feature_dim)
                tables[key], group_ids[key] = _local_groups(stats[key], group_size)
        except Exception as exc:
            problem = f"{key}: {type(exc).__name__}: {exc}"
        if problem is not None:
            errors.append(problem)
    local = {"keys": keys, "dims": dims, "tables": tables, "errors": errors}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local, group=group)
    problems = [f"rank {r}: {e}" for r, g in enumerate(gathered) for e in g["errors"]]
    for r, g in enumerate(gathered):
        if g["keys"] != keys:
            problems.append(f"rank {r} has keys {g['keys']}, rank {rank} has {keys}")
        elif g["dims"] != local["dims"]:
            problems.append(f"rank {r} has feature dims {g['dims']}, rank {rank} has {local['dims']}")
    if problems:
        raise ValueError("assign_message_bits: " + "; ".join(problems))

    decision: list[Any] = [None]
    if rank == 0:
        try:
            solved, figures = _solve_keys(
                [g["tables"] for g in gathered], local["dims"], costs, world_size, lambda_, tuple(bit_choices)
            )
            decision = [{"bits": solved, "figures": figures, "error": None}]
        except Exception as exc:  # shared with every rank below
            decision = [{"bits": None, "figures": None, "error": f"{type(exc).__name__}: {exc}"}]
    dist.broadcast_object_list(decision, src=_global_rank(group, 0), group=group)
    outcome = decision[0]
    if outcome["error"] is not None:
        raise RuntimeError(f"assign_message_bits: rank 0 could not solve: {outcome['error']}")

    result: dict[Key, tuple[Tensor, Tensor]] = {}
    for key in keys:
        stat = stats[key]
        per_group = torch.tensor(outcome["bits"][key][rank], dtype=torch.uint8)
        send_bits = per_group[group_ids[key]].to(stat.row_range.device)
        recv = control(send_bits.unsqueeze(1), list(stat.send_counts), list(stat.recv_counts))
        recv_bits = recv.reshape(-1).to(torch.uint8)
        if recv_bits.numel() != sum(stat.recv_counts):
            raise ValueError(
                f"control returned {recv_bits.numel()} rows for {key}, expected {sum(stat.recv_counts)}"
            )
        result[key] = (send_bits, recv_bits)
    figures = {"assign_time": time.perf_counter() - start, **outcome["figures"]}
    return result, figures
