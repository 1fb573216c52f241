"""Halo exchange over real gloo ranks: forward fills the halo, backward is its adjoint."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fullgraph.comm.exchange import HaloExchanger
from lightning_fullgraph.comm.policies import AdaQPPolicy, PolicyEnv
from lightning_fullgraph.partition.partitioner import partition_graph
from lightning_fullgraph.partition.planner import build_local_partitions
from tests.helpers import directed_graph, run_ranks


def _setup(rank: int, world_size: int):
    data = directed_graph(num_nodes=70, num_edges=300, seed=7)
    parts = partition_graph(data.edge_index, data.num_nodes, world_size, method="random")
    local = build_local_partitions(data, parts, world_size)
    group = dist.new_group(backend="gloo")
    return data, local, HaloExchanger(local[rank].plan, group=group)


def _forward_backward(rank: int, world_size: int) -> None:
    data, local, ex = _setup(rank, world_size)
    mine = local[rank]
    x = data.x[mine.data.n_id].clone().requires_grad_(True)
    full = ex.exchange(x)
    assert full.shape == (mine.plan.num_owned + mine.plan.num_halo, data.x.size(1))
    torch.testing.assert_close(full, data.x[torch.cat([mine.data.n_id, mine.data.halo_n_id])], rtol=0, atol=0)

    # Every rank weighs every row it holds with a global coefficient field c_r[v]; the gradient
    # at an owner must be its own coefficient plus the coefficients of all borrowers.
    coeff = lambda r: torch.arange(data.num_nodes, dtype=torch.float) * (r + 1) + 0.5  # noqa: E731
    ids = torch.cat([mine.data.n_id, mine.data.halo_n_id])
    (full * coeff(rank)[ids].unsqueeze(1)).sum().backward()
    expected = coeff(rank)[mine.data.n_id].clone()
    for r, other in enumerate(local):
        if r == rank:
            continue
        borrowed = torch.isin(mine.data.n_id, other.data.halo_n_id)
        expected[borrowed] += coeff(r)[mine.data.n_id[borrowed]]
    torch.testing.assert_close(x.grad, expected.unsqueeze(1).expand_as(x.grad), rtol=0, atol=0)
    # bytes: fp32 rows sent = sum of send counts * row bytes, forward + backward
    row = 4 * data.x.size(1)
    assert ex.stats.bytes_sent["message"] == row * (mine.plan.num_send + mine.plan.num_halo)
    assert ex.stats.bytes_recv["message"] == row * (mine.plan.num_halo + mine.plan.num_send)


def _static_cache(rank: int, world_size: int) -> None:
    data, local, ex = _setup(rank, world_size)
    x = data.x[local[rank].data.n_id].clone()
    other = x.clone()
    ex.exchange(other)
    ex.exchange(other)  # not registered: fetched every time
    assert ex.stats.cache_hits == 0 and ex.stats.forward_exchanges == 2
    ex.stats.reset()
    ex.register_static(x)
    first = ex.exchange(x)
    sent = ex.stats.bytes_sent["onetime"]
    assert sent > 0 and ex.stats.bytes_sent["message"] == 0
    again = ex.exchange(x)
    assert ex.stats.cache_hits == 1 and ex.stats.bytes_sent["onetime"] == sent
    assert torch.equal(first, again)
    x.mul_(2.0)  # in-place change bumps the version: must be fetched again
    third = ex.exchange(x)
    assert ex.stats.cache_hits == 1 and ex.stats.bytes_sent["onetime"] == 2 * sent
    assert torch.equal(third[x.size(0):], 2 * first[x.size(0):])
    with pytest.raises(ValueError, match="rows this rank owns"):
        ex.exchange(x[:-1].clone().requires_grad_(True))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_forward_fills_halo_and_backward_sums_at_owners(world_size: int) -> None:
    run_ranks(_forward_backward, world_size)


@pytest.mark.timeout(60)
def test_static_inputs_cross_the_wire_once() -> None:
    run_ranks(_static_cache, 2)


def _backward_allocations(rank: int, world_size: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    _, local, ex = _setup(rank, world_size)
    n, feats = local[rank].plan.num_owned, 24
    x = torch.randn(n, feats, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    ex.begin_step(True)
    full = ex.exchange(x)
    weights = torch.rand(full.shape, generator=torch.Generator().manual_seed(9))
    loss = (full * weights).sum()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    ex.begin_step(False)
    sized = [e for e in prof.events() if e.cpu_memory_usage == n * feats * 4]
    # one allocation is reported by every op on its call path (new_zeros > new_empty > empty)
    owned_sized = [e for e in sized if not any(e.cpu_parent is other for other in sized)]
    assert len(owned_sized) == 1, [e.name for e in sized]
    # the gradient itself: own weights plus what the borrowers sent home (checked exactly in
    # test_forward_fills_halo_and_backward_sums_at_owners); here against a plain recomputation
    home = ex.push_back(weights[n:].contiguous())
    torch.testing.assert_close(x.grad, weights[:n] + home, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_backward_allocates_one_owned_gradient() -> None:
    """The exchange's backward writes the owned rows' gradient once: the concatenation's
    gradient for the owned rows plus the rows that came home, one ``[N_r, F]`` tensor (here
    the leaf's ``.grad`` itself), not a zero-filled ``[N_r, F]`` that autograd then adds to the
    concatenation's slice (a second one).  Negative control (run): ``add_home`` ignoring
    ``owned`` (the previous backward) allocates two and fails."""
    run_ranks(_backward_allocations, 2)


def _compressed_allocations(rank: int, world_size: int, bits: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    data, local, plain = _setup(rank, world_size)
    plan = local[rank].plan
    ex = _quantized(plan, plain.transport.group, bits)
    feats = 24
    sizes = {plan.num_send * feats * 4}  # the [S, F] float32 rows of a rank's sent rows
    other = {n * feats * 4 for n in (plan.num_owned, plan.num_halo, plan.num_owned + plan.num_halo)}
    assert not sizes & other, "pick a graph whose row counts differ"
    x = torch.randn(plan.num_owned, feats, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        full = ex.exchange(x)
        (full * torch.rand(full.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
    ex.begin_step(False)
    sent_sized = [e.name for e in prof.events() if e.cpu_memory_usage in sizes]
    assert not sent_sized, sent_sized
    # ... and the gradient is the plain exchange's: own weights plus what came home, decoded
    assert x.grad is not None and x.grad.shape == x.shape and bool(torch.isfinite(x.grad).all())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bits", [1, 8])
def test_compressed_messages_never_hold_the_sent_rows_in_float(bits: int) -> None:
    """A compressed exchange reads the sender's rows where they lie (the codec takes the send
    index) and decodes the gradients coming home straight into the owned rows' sum: neither
    side allocates the ``[S, F]`` float rows of the message (exact's all-to-all needs them).

    Negative control (run): gathering the rows before encoding (``launch`` without ``index``,
    the previous forward) allocates them on the sender; decoding the gradient message before
    adding it up (``add_home(message.wait(), owned)``, the previous backward) allocates them on
    the receiver; either fails."""
    run_ranks(_compressed_allocations, 2, bits)


def _fails_on_rank_one(rank: int, world_size: int) -> None:
    data, local, ex = _setup(rank, world_size)
    if rank == 1:
        raise RuntimeError("rank 1 broke on purpose")
    ex.exchange(data.x[local[rank].data.n_id].clone())


@pytest.mark.timeout(60)
def test_a_failing_rank_fails_the_run_quickly() -> None:
    import time

    import torch.multiprocessing as mp

    start = time.monotonic()
    # whichever rank the launcher reports first: the one that raised, or its peer that lost it
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 broke on purpose|Connection closed by peer"):
        run_ranks(_fails_on_rank_one, 2)
    assert time.monotonic() - start < 40


def _quantized(plan, group, bits: int, skip: bool = False) -> HaloExchanger:
    """An exchanger inside a training step whose policy sends ``bits``-bit messages."""
    policy = AdaQPPolicy(bits=bits)
    ex = HaloExchanger(plan, group=group, policy=policy)
    policy.setup(PolicyEnv(plan=plan, group=group, device=torch.device("cpu"), control=ex.transport.control))
    ex.skip_transfers = skip
    ex.begin_step(training=True)
    return ex


def _bound_runs_the_codec(rank: int, world_size: int) -> None:
    # Two exchangers over the same plan, same seed: one transfers, one is the benchmark bound.
    data, local, plain = _setup(rank, world_size)
    plan = local[rank].plan
    real, bound = _quantized(plan, plain.transport.group, 4), _quantized(plan, plain.transport.group, 4, skip=True)
    x = data.x[local[rank].data.n_id].clone()
    for ex in (real, bound):
        halo = ex.fetch(x, layer=0)
    # the bound received nothing: zeros, in the shape the transfer would have filled
    assert halo.shape == (plan.num_halo, x.size(1)) and not halo.any()
    # ... but drew exactly the stochastic-rounding numbers the real exchange drew, i.e. it
    # encoded the same rows (and decoded a buffer of the same size)
    assert torch.equal(real.policy.generator.get_state(), bound.policy.generator.get_state())
    assert bound.stats.bytes_sent["message"] == real.stats.bytes_sent["message"] > 0


@pytest.mark.timeout(60)
def test_compute_only_bound_runs_the_modes_codec() -> None:
    """``skip_transfers`` (``FullGraphStrategy(compute_only=True)``) skips only the collective:
    the quantizer runs as in the real exchange, so the adaqp/sylvie bounds pay its cost.

    Negative control: returning zeros before encoding (the earlier bound) leaves the
    generator untouched and fails the state comparison."""
    run_ranks(_bound_runs_the_codec, 2)


def _backward_is_quantized(rank: int, world_size: int, bits: int | None) -> None:
    data, local, plain = _setup(rank, world_size)
    plan = local[rank].plan
    ex = _quantized(plan, plain.transport.group, bits) if bits else plain
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(plan.num_owned, 64, generator=g, requires_grad=True)
    full = ex.exchange(x)
    # the loss only reads halo rows: each owned row's gradient is what came back over the wire
    weight = torch.randn(plan.num_halo, 64, generator=g)
    (full[plan.num_owned :] * weight).sum().backward()
    # rows sent to exactly one peer: their gradient is one received row
    once = torch.bincount(plan.send_index, minlength=plan.num_owned) == 1
    distinct = [torch.unique(row).numel() for row in x.grad[once]]
    assert distinct, "no row is sent to exactly one peer"
    if bits == 1:
        # a one-bit row dequantizes to one of its grid's two ends: at most two values per row
        assert max(distinct) <= 2, distinct
    else:
        assert min(distinct) > 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bits", [1, None])
def test_backward_gradients_travel_at_the_policys_bits(bits: int | None) -> None:
    """Backward messages are encoded too: with 1-bit messages every gradient row an owner
    gets back holds at most two distinct values (the ends of its quantization grid).

    Negative control: sending backward gradients in fp32 (as in the ``bits=None`` case, and
    as a transport that ignored the policy for backward would) gives rows of 64 distinct
    values, failing the ``<= 2`` assertion."""
    run_ranks(_backward_is_quantized, 2, bits)
