"""AdaQP's distributed bit-width assignment over real gloo ranks (forked, every exit code
checked by ``tests.helpers.run_ranks``).

Negative controls: a swapped count pair in ``sender_weights`` / ``assign_message_bits``, or
send bits not mapped back to send order, make a receiver's bits differ from its sender's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fullgraph.comm.policies.adaqp.distributed import (
    MessageStats,
    assign_message_bits,
    measure_link_costs,
    sender_weights,
)
from lightning_fullgraph.comm.policies.adaqp.links import LinkCost
from lightning_fullgraph.partition.partitioner import partition_graph
from lightning_fullgraph.partition.planner import build_local_partitions
from tests.helpers import directed_graph, run_ranks


def _noise(gid: torch.Tensor, salt: int) -> torch.Tensor:
    """A deterministic pseudo-random value in [0, 1) per global id (same on every rank)."""
    return torch.frac(torch.sin(gid.double() * 12.9898 + salt) * 43758.5453).float()


def _adaptive(rank: int, world_size: int) -> None:
    data = directed_graph(num_nodes=150, num_edges=900, seed=3)
    parts = partition_graph(data.edge_index, data.num_nodes, world_size, method="random")
    local = build_local_partitions(data, parts, world_size)
    mine, plan = local[rank], local[rank].plan
    group = dist.new_group(backend="gloo")

    def control(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv_counts),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
        return out

    # link costs: every ordered pair, identical everywhere
    costs = measure_link_costs(group, rank, world_size, torch.device("cpu"), num_sizes=3, repeats=1)
    pairs = {(s, p) for s in range(world_size) for p in range(world_size) if s != p}
    assert set(costs) == pairs
    tables: list = [None] * world_size
    dist.all_gather_object(tables, costs, group=group)
    assert all(t == costs for t in tables)

    # sender weights: receiver r scores its halo row g as 1 + r + g / 1000
    send_gid = mine.data.n_id[plan.send_index]
    halo_gid = mine.data.halo_n_id
    weight = sender_weights(1.0 + rank + halo_gid.float() / 1000, plan.send_counts, plan.recv_counts, control)
    receiver = torch.repeat_interleave(torch.arange(world_size), torch.tensor(plan.send_counts))
    torch.testing.assert_close(weight, (1.0 + receiver + send_gid.float() / 1000) ** 2)

    # assignment: two layers, both directions, each from its own statistics
    f = 16
    stats = {}
    for layer in (0, 1):
        fwd = 5 * _noise(send_gid, layer) ** 3
        bwd = _noise(halo_gid, 10 + layer)
        stats[(layer, "forward")] = MessageStats(fwd, weight, f, plan.send_counts, plan.recv_counts)
        stats[(layer, "backward")] = MessageStats(
            bwd, torch.ones_like(bwd), f, plan.recv_counts, plan.send_counts
        )
    fixed = {pair: LinkCost(1e-7 * (1 + pair[0]), 1e-5) for pair in pairs}
    bits, figures = assign_message_bits(stats, rank, world_size, group, fixed, control, group_size=4)
    assert sorted(bits) == sorted(stats)
    assert {
        "assign_time",
        "solve_time",
        "assigned_bits",
        "assigned_bits_forward",
        "assigned_bits_backward",
    } == set(figures)
    assert 2.0 <= figures["assigned_bits"] <= 8.0

    # every receiver's bits of a row equal its sender's bits of the same row (global ids)
    ids = {"forward": (send_gid, halo_gid), "backward": (halo_gid, send_gid)}
    sent = {}
    for key, (send_bits, recv_bits) in bits.items():
        stat = stats[key]
        assert send_bits.dtype == recv_bits.dtype == torch.uint8
        assert send_bits.shape == (sum(stat.send_counts),) and recv_bits.shape == (sum(stat.recv_counts),)
        out_ids = ids[key[1]][0]
        sent[key] = [
            (g.tolist(), b.tolist())
            for g, b in zip(torch.split(out_ids, stat.send_counts), torch.split(send_bits, stat.send_counts))
        ]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, sent, group=group)
    values = set()
    for key, (send_bits, recv_bits) in bits.items():
        stat = stats[key]
        in_ids = ids[key[1]][1]
        values |= set(send_bits.tolist())
        for p, (g, b) in enumerate(
            zip(torch.split(in_ids, stat.recv_counts), torch.split(recv_bits, stat.recv_counts))
        ):
            their_ids, their_bits = everyone[p][key][rank]
            assert g.tolist() == their_ids, (key, p)
            assert b.tolist() == their_bits, (key, p)
    all_values: list = [None] * world_size
    dist.all_gather_object(all_values, values, group=group)
    assert len(set().union(*all_values)) > 1  # the bits vary, so the equality above is not trivial


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_assign_message_bits_over_gloo(world_size: int) -> None:
    run_ranks(_adaptive, world_size)
