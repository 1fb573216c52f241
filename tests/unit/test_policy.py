"""Compression policies: settings validated once, decisions, state round trip, pickling."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_fullgraph import FullGraphStrategy
from lightning_fullgraph.comm.policy import (
    AdaQPPolicy,
    ExactPolicy,
    PolicyEnv,
    SylviePolicy,
    make_policy,
)
from lightning_fullgraph.partition.plan import HaloPlan


def _plan(num_send: int = 5, num_halo: int = 3) -> HaloPlan:
    # a one-rank view of a two-rank plan: rank 0 sends num_send rows to rank 1 and borrows
    # num_halo rows from it
    return HaloPlan(
        rank=0, world_size=2, num_owned=10, num_halo=num_halo, send_index=torch.arange(num_send),
        send_counts=[0, num_send], recv_counts=[0, num_halo],
    )


def _env(plan: HaloPlan, final_epoch: int | None = None) -> PolicyEnv:
    def control(rows, send_counts, recv_counts):  # pragma: no cover - not reached here
        raise AssertionError("no control traffic expected")

    return PolicyEnv(plan=plan, group=None, device=torch.device("cpu"), control=control, final_epoch=final_epoch)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (AdaQPPolicy, {"bits": 3}, "bits=3"),
        (AdaQPPolicy, {"bits": 32}, "bits=32"),
        (AdaQPPolicy, {"lambda_": 1.5}, "lambda_"),
        (AdaQPPolicy, {"first_assign": 0}, "first_assign"),
        (SylviePolicy, {"staleness": 0}, "staleness"),
        (SylviePolicy, {"smoothing": 1.0}, "smoothing"),
        (SylviePolicy, {"smooth": "weights"}, "smooth="),
        (SylviePolicy, {"bits": "adaptive", "epoch_adaptive": True}, "epoch_adaptive"),
    ],
)
def test_settings_are_validated_at_construction(cls, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_make_policy_refuses_settings_of_another_mode() -> None:
    """A setting the mode does not use is an error that names what the mode takes.

    Negative control: silently dropping unknown settings (``staleness`` for adaqp) passes
    ``make_policy`` and fails the ``raises``."""
    assert isinstance(make_policy("sylvie", staleness=3, bits="adaptive"), SylviePolicy)
    with pytest.raises(ValueError, match="does not take \\['staleness'\\]"):
        make_policy("adaqp", staleness=3)
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("fp16")


def test_strategy_takes_a_ready_policy_or_mode_settings_not_both() -> None:
    policy = SylviePolicy(bits="adaptive", staleness=2)
    strategy = FullGraphStrategy(policy=policy)
    assert strategy.mode == "sylvie" and strategy.policy is policy and strategy.bits == "adaptive"
    with pytest.raises(ValueError, match="carries its own settings"):
        FullGraphStrategy(policy=policy, staleness=3)
    with pytest.raises(ValueError, match="carries its own settings"):
        FullGraphStrategy(mode="adaqp", policy=policy)


def test_uniform_bits_per_direction_and_fp32() -> None:
    """Forward tables are [S] sent / [H] received, backward the reverse; 32 bits is fp32."""
    plan = _plan()
    policy = SylviePolicy(bits=2)
    policy.setup(_env(plan))
    fwd_send, fwd_recv = policy.message_bits(0, "forward")
    bwd_send, bwd_recv = policy.message_bits(0, "backward")
    assert (fwd_send.numel(), fwd_recv.numel(), bwd_send.numel(), bwd_recv.numel()) == (5, 3, 3, 5)
    assert set(fwd_send.tolist()) == {2}
    fp32 = SylviePolicy(bits=32)
    fp32.setup(_env(plan))
    assert fp32.message_bits(0, "forward") is None and fp32.pipeline is not None
    assert ExactPolicy().message_bits(0, "forward") is None


def test_sylvie_schedule_sends_only_what_is_consumed() -> None:
    """eps=3 over 7 epochs: synchronous at 0, 3, 6; an asynchronous epoch sends unless the next
    is synchronous or there is none.

    Negative control: ``launch = not synchronous`` (sending in every asynchronous epoch) gives
    ``launch`` True at epochs 2 and 5 and fails the comparison."""
    policy = SylviePolicy(staleness=3)
    policy.setup(_env(_plan(), final_epoch=6))
    schedule = []
    for epoch in range(7):
        policy.on_train_epoch_start(epoch)
        schedule.append((policy.synchronous, policy.launch))
        policy.on_train_epoch_end(epoch, None)
    S, A = True, False
    assert schedule == [(S, False), (A, True), (A, False), (S, False), (A, True), (A, False), (S, False)]


def test_epoch_adaptive_decides_bits_for_next_epoch_and_schedule_two_ahead() -> None:
    """A stalled loss at the end of epoch t doubles the bits from t+1 and makes t+2
    synchronous; epoch t+1 therefore knows not to send.

    Negative control: forcing epoch t+1 synchronous instead would throw away what epoch t
    sent; the assertions on ``launch`` and ``synchronous`` fail."""
    policy = SylviePolicy(staleness=100, epoch_adaptive=True, adaptive_tolerance=0.1)
    policy.setup(_env(_plan()))
    policy.on_train_epoch_start(0)
    policy.on_train_epoch_end(0, 1.0)
    policy.on_train_epoch_start(1)
    assert not policy.synchronous and policy.launch
    policy.on_train_epoch_end(1, 0.99)  # < 10 % better: stalled
    assert policy.uniform_bits == 2
    policy.on_train_epoch_start(2)
    assert not policy.synchronous and not policy.launch  # epoch 3 will be synchronous
    policy.on_train_epoch_end(2, 0.5)  # improved: halve, stay asynchronous
    assert policy.uniform_bits == 1
    policy.on_train_epoch_start(3)
    assert policy.synchronous
    policy.on_train_epoch_end(3, 0.4)
    policy.on_train_epoch_start(4)
    assert not policy.synchronous


def test_state_round_trips_and_pickles_without_the_process_group() -> None:
    """``state_dict`` holds tensors and numbers only; a restored policy draws the same rounding
    numbers and keeps the schedule decisions; pickling drops the environment (like
    ``PowerSGDState.__getstate__`` drops the process group)."""
    plan = _plan()
    policy = SylviePolicy(staleness=100, epoch_adaptive=True)
    policy.setup(_env(plan))
    policy.on_train_epoch_start(0)
    policy.on_train_epoch_end(0, 1.0)
    policy.on_train_epoch_end(1, 1.0)  # stalled: epoch 3 forced synchronous
    torch.rand(3, generator=policy.generator)
    state = policy.state_dict()
    again = SylviePolicy(staleness=100, epoch_adaptive=True)
    again.setup(_env(plan))
    again.load_state_dict(state)
    assert torch.equal(torch.rand(4, generator=again.generator), torch.rand(4, generator=policy.generator))
    assert again.is_sync(3) and again.uniform_bits == policy.uniform_bits == 2
    with pytest.raises(ValueError, match="'sylvie' policy but this run uses 'adaqp'"):
        AdaQPPolicy().load_state_dict(state)
    clone = pickle.loads(pickle.dumps(policy))
    assert clone.env is None and clone.staleness == 100
