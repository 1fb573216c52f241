"""The distributed side of AdaQP's bit-width assignment, simulated in one process.

``W`` ranks run as threads; ``torch.distributed``'s object collectives are replaced by a
barrier-based exchange between the threads, and the ``control`` all-to-all is emulated from
every thread's input (each receiver gets, in peer order, the slice each peer addressed to
it).  The real gloo run is in ``tests/distributed/test_adaptive.py``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_fullgraph.comm.policies.adaqp.distributed import (
    MessageStats,
    assign_message_bits,
    profile_links,
    sender_weights,
)
from lightning_fullgraph.comm.policies.adaqp.links import LinkCost
from lightning_fullgraph.comm.policies.adaqp.milp import (
    AssignmentProblem,
    assign_bits,
    group_aggregates,
    group_nodes,
)

# --------------------------------------------------------------------------- simulated ranks


class SimWorld:
    """``W`` threads that meet at a barrier to swap objects (all-gather) and rows (all-to-all)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.slots: list[Any] = [None] * world_size

    def gather(self, rank: int, obj: Any) -> list[Any]:
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def control(self, rank: int) -> Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]:
        def all_to_all(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
            assert rows.size(0) == sum(send_counts) and len(send_counts) == self.world_size
            everyone = self.gather(rank, (rows.clone(), list(send_counts)))
            chunks = []
            for peer, (their_rows, their_counts) in enumerate(everyone):
                offset, n = sum(their_counts[:rank]), their_counts[rank]
                assert n == recv_counts[peer], f"rank {rank}: {peer} sends {n}, expected {recv_counts[peer]}"
                chunks.append(their_rows[offset : offset + n])
            return torch.cat(chunks)

        return all_to_all

    def group(self, rank: int) -> SimpleNamespace:
        return SimpleNamespace(world=self, rank=rank)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # first error first; the others see a broken barrier
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a simulated rank hung"
        if errors:
            raise errors[0]
        return results


@pytest.fixture
def sim_dist(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routes the object collectives through the ``SimWorld`` of the group argument."""

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
        out[:] = group.world.gather(group.rank, obj)

    def broadcast_object_list(objs: list[Any], src: int = 0, group: Any = None, **kw: Any) -> None:
        objs[0] = group.world.gather(group.rank, objs[0] if group.rank == src else None)[src]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: r)


# --------------------------------------------------------------------------- hand-made plans


def make_plans(
    world_size: int, num_nodes: int, seed: int, empty: tuple[int, int] | None = None
) -> list[dict]:
    """Per-rank halo plans built by hand: node ``g`` is owned by rank ``g % W``; rank ``r``
    borrows a random subset of every other rank's nodes (``empty = (owner, borrower)``: none).

    Each plan: ``send_gids`` (global ids this rank sends, peer order, in each receiver's halo
    order), ``send_counts``, ``halo_gids`` (halo order: by owner, ascending id) and
    ``recv_counts``.
    """
    gen = torch.Generator().manual_seed(seed)
    owned = [list(range(q, num_nodes, world_size)) for q in range(world_size)]
    halo = [[[] for _ in range(world_size)] for _ in range(world_size)]  # halo[r][q]: from q
    for r in range(world_size):
        for q in range(world_size):
            if q == r or (q, r) == empty:
                continue
            keep = torch.rand(len(owned[q]), generator=gen) < 0.6
            halo[r][q] = [g for g, k in zip(owned[q], keep.tolist()) if k]
    plans = []
    for r in range(world_size):
        plans.append(
            {
                "send_gids": [g for p in range(world_size) for g in halo[p][r]],
                "send_counts": [len(halo[p][r]) for p in range(world_size)],
                "halo_gids": [g for q in range(world_size) for g in halo[r][q]],
                "recv_counts": [len(halo[r][q]) for q in range(world_size)],
            }
        )
    return plans


def chunks(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, counts))


# --------------------------------------------------------------------------- sender_weights


def test_sender_weights_round_trip() -> None:
    """Every receiver scores its halo rows ``a = 1 + r + g / 100`` (``r`` receiver, ``g``
    global id); each sender must get ``a^2`` of exactly the rows it sends, in send order.
    Negative control: sending with the forward counts (``control(score, send_counts,
    recv_counts)``) fails the emulated all-to-all's count check or misplaces the scores."""
    world = SimWorld(3)
    plans = make_plans(3, 40, seed=0, empty=(1, 2))
    assert plans[1]["send_counts"][2] == 0 and min(sum(p["send_counts"]) for p in plans) > 0

    def rank_fn(r: int) -> torch.Tensor:
        plan = plans[r]
        score = torch.tensor([1.0 + r + g / 100 for g in plan["halo_gids"]])
        return sender_weights(score, plan["send_counts"], plan["recv_counts"], world.control(r))

    out = world.run(rank_fn)
    for q, plan in enumerate(plans):
        receivers = [p for p, n in enumerate(plan["send_counts"]) for _ in range(n)]
        expected = torch.tensor([(1.0 + p + g / 100) ** 2 for p, g in zip(receivers, plan["send_gids"])])
        assert out[q].dtype == torch.float32 and out[q].shape == (sum(plan["send_counts"]),)
        torch.testing.assert_close(out[q], expected)


def test_sender_weights_rejects_wrong_counts() -> None:
    """The halo scores must match the halo counts (``recv_counts``); swapped counts raise
    before any collective."""
    never = lambda *a: pytest.fail("control must not be called")  # noqa: E731
    with pytest.raises(ValueError, match="halo_score has 3 rows"):
        sender_weights(torch.ones(3), send_counts=[0, 3], recv_counts=[0, 5], control=never)
    with pytest.raises(ValueError, match="differ in length"):
        sender_weights(torch.ones(3), send_counts=[0, 3, 0], recv_counts=[0, 3], control=never)


# --------------------------------------------------------------------------- measure_link_costs


def test_profile_links_probes_each_link_over_its_message_range_on_the_given_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every probe tensor is created on the requested device ("meta" stands in for CUDA: no
    data, so only the device is checked), and each link is probed over ITS message range:
    the sizes sent to peer ``p`` span ``[lo / 2, hi + lo / 2]`` of this rank's range to
    ``p``, the sizes received from ``q`` that of ``q``'s range to this rank (the AdaQP
    ``profile.py`` rule), each ``repeats`` times after one warm-up.

    Negative controls (run): CPU-hardcoded probes record ``cpu`` and fail; one fixed size
    list for every link (the former 1 KiB .. 1 MiB) fails the span checks."""
    world_size, rank, num_sizes, repeats = 3, 0, 5, 2
    ranges = {0: [(0, 0), (1000, 4000), (20000, 90000)], 1: [(500, 800), (0, 0), (7, 7)],
              2: [(3000, 3000), (100, 200), (0, 0)]}
    seen: list[tuple[str, str, int, int]] = []

    def batch_isend_irecv(ops: list[Any]) -> list[Any]:
        seen.extend((op.kind, op.tensor.device.type, op.peer, op.tensor.numel()) for op in ops)
        return [SimpleNamespace(wait=lambda: None) for _ in ops]

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
        for r in range(world_size):
            if isinstance(obj, list):  # the message ranges
                out[r] = obj if r == rank else ranges[r]
            else:  # the samples: the other receivers' links, one clean line each
                out[r] = obj if r == rank else {
                    (q, r): ([1e3, 2e3, 4e3], [1e-6 * (1 + q), 2e-6 * (1 + q), 4e-6 * (1 + q)])
                    for q in range(world_size) if q != r
                }

    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(
        dist, "P2POp",
        lambda op, tensor, peer, group=None: SimpleNamespace(kind=op.__name__, tensor=tensor, peer=peer),
    )
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda obj, src=0, group=None: None)
    with warnings.catch_warnings():  # meta "messages" take no time: this rank's own fits are noise
        warnings.simplefilter("ignore", UserWarning)
        links, figures = profile_links(
            None, rank, world_size, torch.device("meta"), ranges[0], num_sizes=num_sizes, repeats=repeats
        )
    # 2 rounds x (1 warm-up + 5 sizes x 2 repeats) exchanges of one send + one receive
    assert len(seen) == 2 * (1 + num_sizes * repeats) * 2
    assert {device for _, device, _, _ in seen} == {"meta"}
    sent = {p: sorted({n for kind, _, q, n in seen if kind == "isend" and q == p}) for p in (1, 2)}
    got = {q: sorted({n for kind, _, p, n in seen if kind == "irecv" and p == q}) for q in (1, 2)}
    for peer, (lo, hi) in ((1, ranges[0][1]), (2, ranges[0][2])):
        assert sent[peer][0] == lo // 2 and sent[peer][-1] == hi + lo // 2 and len(sent[peer]) == num_sizes
    for sender, (lo, hi) in ((1, ranges[1][0]), (2, ranges[2][0])):
        assert got[sender][0] == lo // 2 and got[sender][-1] == hi + lo // 2
    assert figures["profile_messages"] == 2 * num_sizes * repeats
    assert set(links.costs) == {(s, p) for s in range(3) for p in range(3) if s != p}


# --------------------------------------------------------------------------- assign_message_bits


def _stats_for(plans: list[dict], feature_dim: int, forward_range, backward_range) -> list[dict]:
    """Per rank ``{(0, "forward"), (0, "backward")}`` stats; ranges are functions of
    (rank, global id)."""
    out = []
    for r, plan in enumerate(plans):
        fwd = torch.tensor([forward_range(r, g) for g in plan["send_gids"]], dtype=torch.float32)
        bwd = torch.tensor([backward_range(r, g) for g in plan["halo_gids"]], dtype=torch.float32)
        out.append(
            {
                (0, "forward"): MessageStats(
                    fwd, torch.ones_like(fwd), feature_dim, plan["send_counts"], plan["recv_counts"]
                ),
                (0, "backward"): MessageStats(
                    bwd, torch.ones_like(bwd), feature_dim, plan["recv_counts"], plan["send_counts"]
                ),
            }
        )
    return out


def _run_assign(world: SimWorld, stats: list[dict], costs: dict, **kw: Any) -> list[Any]:
    return world.run(
        lambda r: assign_message_bits(
            stats[r], r, world.world_size, world.group(r), costs, world.control(r), **kw
        )
    )


def _uniform_costs(world_size: int, alpha: float = 1e-7, beta: float = 1e-5) -> dict:
    return {(s, p): LinkCost(alpha, beta) for s in range(world_size) for p in range(world_size) if s != p}


def _noise(r: int, g: int) -> float:
    return float(torch.rand(1, generator=torch.Generator().manual_seed(1000 * r + g)))


@pytest.mark.usefixtures("sim_dist")
def test_recv_bits_match_the_senders_send_bits() -> None:
    """For both directions every receiver's bit-width of a row equals its sender's.
    Negative control: a recv/send count mix-up or a per-row order mismatch (e.g. group ids
    not mapped back to send order) breaks the equality (bits vary by row, asserted)."""
    world = SimWorld(3)
    plans = make_plans(3, 240, seed=1, empty=(2, 0))
    stats = _stats_for(plans, 32, lambda r, g: 10 * _noise(r, g) ** 3, lambda r, g: _noise(r + 7, g))
    out = _run_assign(world, stats, _uniform_costs(3), group_size=4)
    for direction, sent_ids, recv_ids, sc, rc in (
        ("forward", "send_gids", "halo_gids", "send_counts", "recv_counts"),
        ("backward", "halo_gids", "send_gids", "recv_counts", "send_counts"),
    ):
        key = (0, direction)
        values = set()
        for r, plan in enumerate(plans):
            send_bits, recv_bits = out[r][0][key]
            assert send_bits.dtype == recv_bits.dtype == torch.uint8
            assert send_bits.shape == (sum(plan[sc]),) and recv_bits.shape == (sum(plan[rc]),)
            values |= set(send_bits.tolist())
            for p, got in enumerate(chunks(recv_bits, plan[rc])):
                sender_chunk = chunks(out[p][0][key][0], plans[p][sc])[r]
                assert torch.equal(got, sender_chunk)
                # the same rows (global ids), too
                assert (
                    chunks(torch.tensor(plan[recv_ids]), plan[rc])[p].tolist()
                    == chunks(torch.tensor(plans[p][sent_ids]), plans[p][sc])[r].tolist()
                )
        assert values <= {2, 4, 8} and len(values) > 1, (direction, values)
    figures = [o[1] for o in out]
    assert set(figures[0]) == {
        "assign_time",
        "solve_time",
        "assigned_bits",
        "assigned_bits_forward",
        "assigned_bits_backward",
    }
    for name in ("solve_time", "assigned_bits", "assigned_bits_forward", "assigned_bits_backward"):
        assert len({f[name] for f in figures}) == 1  # rank 0's, shared
    all_bits = torch.cat([o[0][k][0].double() for o in out for k in o[0]])
    assert figures[0]["assigned_bits"] == pytest.approx(float(all_bits.mean()))
    fwd = torch.cat([o[0][(0, "forward")][0].double() for o in out])
    assert figures[0]["assigned_bits_forward"] == pytest.approx(float(fwd.mean()))


def _two_rank_plans(n: int) -> list[dict]:
    """W = 2, rank 0 owns even ids, rank 1 odd ids; each borrows ``n`` rows of the other."""
    halo = [list(range(1, 2 * n, 2)), list(range(0, 2 * n, 2))]  # halo[r]: rows r borrows
    return [
        {
            "send_gids": halo[1 - r],
            "send_counts": [0, n] if r == 0 else [n, 0],
            "halo_gids": halo[r],
            "recv_counts": [0, n] if r == 0 else [n, 0],
        }
        for r in range(2)
    ]


@pytest.mark.usefixtures("sim_dist")
def test_joint_round_time_is_max_over_links() -> None:
    """W = 2: the pairs 0 -> 1 and 1 -> 0 share round 1; link 0 -> 1 is 100x slower and is
    the round's bottleneck at any bit-width, so in the joint problem (the paper's
    ``Z_r = max``) rank 1's rows are free to send at max bits -- more than rank 1 gets when
    its problem is solved alone.  Negative control: per-sender solving gives rank 1 exactly
    ``alone`` below."""
    n, f, gs = 40, 64, 4
    plans = _two_rank_plans(n)
    ranges = torch.logspace(1, -2, n)
    stats = _stats_for(
        plans, f, lambda r, g: float(ranges[(g // 2) % n]), lambda r, g: float(ranges[(g // 2) % n])
    )
    costs = {(0, 1): LinkCost(1e-6, 1e-5), (1, 0): LinkCost(1e-8, 1e-5)}
    out = _run_assign(SimWorld(2), stats, costs, group_size=gs)
    fast = out[1][0][(0, "forward")][0]
    # rank 1's forward problem solved alone, from the same groups
    s1 = stats[1][(0, "forward")]
    c = f * s1.row_range.double().square() / 6
    rows, var = group_aggregates(c, group_nodes(c, gs))
    alone = AssignmentProblem.for_sender(1, [0] * rows.numel(), rows, var, {0: costs[(1, 0)]}, 2, f)
    alone_bits = assign_bits(alone, 0.5).bits_per_group
    assert fast.tolist() == [8] * n
    assert float(fast.double().mean()) > float((rows * alone_bits).sum() / rows.sum())
    # the scenario discriminates: alone, the low-variance groups drop bits
    assert 8 not in alone_bits.tolist()[-2:]
    # the received side agrees
    assert torch.equal(out[0][0][(0, "forward")][1], fast)


@pytest.mark.usefixtures("sim_dist")
def test_backward_bits_come_from_backward_stats() -> None:
    """Forward feature rows: the variance sits in a few rows (the rest have range 0);
    backward gradient rows: large ranges everywhere.  Each direction is solved from its own
    statistics, so the halo rows' backward bits differ from their forward bits.  Negative
    control: reusing the forward bit-widths for the backward messages (the old behaviour)
    makes the two equal.

    Only the SHAPE of the variance matters: the objective is normalised between all-min and
    all-max bits, so multiplying a direction's ranges by a constant leaves its bits unchanged
    (checked below); "huge gradients vs tiny features" alone would not differ."""
    n, f = 40, 64
    plans = _two_rank_plans(n)
    fwd_range = lambda r, g: 1e-3 if (g // 2) % 10 == 0 else 0.0  # noqa: E731
    bwd_range = lambda r, g: 1e3 * (1.0 + 0.1 * _noise(r, g))  # noqa: E731
    costs = _uniform_costs(2, alpha=1e-7)
    out = _run_assign(SimWorld(2), _stats_for(plans, f, fwd_range, bwd_range), costs, group_size=4)
    for r in range(2):
        bits, _ = out[r]
        fwd_recv = bits[(0, "forward")][1]  # forward bits of this rank's halo rows
        bwd_send = bits[(0, "backward")][0]  # backward bits of the same rows
        assert not torch.equal(fwd_recv, bwd_send)
        fwd_send = bits[(0, "forward")][0]
        zero = torch.tensor([fwd_range(r, g) == 0.0 for g in plans[r]["send_gids"]])
        assert set(fwd_send[zero].tolist()) == {2} and int(fwd_send[~zero].min()) > 2
        assert 2 not in bwd_send.tolist() and float(bwd_send.double().mean()) > float(
            fwd_recv.double().mean()
        )
    assert out[0][1]["assigned_bits_backward"] > out[0][1]["assigned_bits_forward"]
    scaled = _run_assign(
        SimWorld(2),
        _stats_for(plans, f, lambda r, g: 1e4 * fwd_range(r, g), lambda r, g: 1e-6 * bwd_range(r, g)),
        costs,
        group_size=4,
    )
    for r in range(2):
        for key in out[r][0]:
            assert torch.equal(scaled[r][0][key][0], out[r][0][key][0])


@pytest.mark.usefixtures("sim_dist")
def test_inconsistent_inputs_raise_on_every_rank() -> None:
    """A rank with other keys (or bad counts) makes EVERY rank raise after the gather, so no
    rank waits in a collective.  Negative control: raising only locally would hang the other
    simulated rank (SimWorld's barrier timeout / the join check)."""
    plans = _two_rank_plans(8)
    stats = _stats_for(plans, 8, lambda r, g: 1.0, lambda r, g: 1.0)
    del stats[1][(0, "backward")]
    errors: list[str] = []
    world = SimWorld(2)

    def rank_fn(r: int) -> None:
        try:
            assign_message_bits(stats[r], r, 2, world.group(r), _uniform_costs(2), world.control(r))
        except ValueError as exc:
            errors.append(str(exc))

    world.run(rank_fn)
    assert len(errors) == 2 and all("has keys" in e for e in errors)
    bad = _stats_for(plans, 8, lambda r, g: 1.0, lambda r, g: 1.0)
    bad[0][(0, "forward")].row_range = torch.ones(3)
    errors.clear()
    world = SimWorld(2)

    def rank_fn2(r: int) -> None:
        try:
            assign_message_bits(bad[r], r, 2, world.group(r), _uniform_costs(2), world.control(r))
        except ValueError as exc:
            errors.append(str(exc))

    world.run(rank_fn2)
    assert len(errors) == 2 and all("rank 0: (0, 'forward'): row_range (3)" in e for e in errors)
