"""Compression policies: settings validated once, decisions, state round trip, pickling."""

from __future__ import annotations

import ast
import inspect
import pickle
import re
import warnings

import pytest
import torch

from lightning_fullgraph import FullGraphStrategy
from lightning_fullgraph.comm.plan import HaloPlan
from lightning_fullgraph.comm.policies import (
    AdaQPPolicy,
    ExactPolicy,
    PolicyEnv,
    SylviePolicy,
    make_policy,
)
from lightning_fullgraph.comm.policies.modes import MODE_TABLE, policy_settings
from tests.conftest import REPO


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


def _policy_default(mode: str, name: str) -> object:
    return inspect.signature(MODE_TABLE[mode].policy.__init__).parameters[name].default


def _documented_defaults(doc: str) -> dict[str, list[tuple[str | None, object]]]:
    """``{argument: [(mode or None, value), ...]}`` of every ``default V`` / ``<mode> default V``
    in the ``Args:`` section of ``doc``, for literal ``V`` (a number or a double-quoted string)."""
    args = doc.split("Args:", 1)[1]
    found: dict[str, list[tuple[str | None, object]]] = {}
    for entry in re.split(r"\n {8}(?=\w+: )", args):
        name = entry.split(":", 1)[0].strip()
        text = " ".join(entry.split())
        for m in re.finditer(r"(?:\b(exact|adaqp|sylvie) )?default:? (?:``)?(-?\d+(?:\.\d+)?|\"\w+\")", text):
            found.setdefault(name, []).append((m.group(1), ast.literal_eval(m.group(2))))
    return found


def test_the_strategys_docstring_states_the_policies_defaults() -> None:
    """Every default that ``FullGraphStrategy``'s docstring states for a policy setting (the
    strategy passes ``None`` on, so the policy constructor decides) is the policy's own: the
    default of the named mode's policy, or of every mode's policy that takes the setting.  The
    docstring is what ``--help`` of the CLI prints.

    Negative control: the docstring's former ``max_halo_share ... (default 0.5)`` (the policy's
    is 0.2) fails it (run)."""
    documented = _documented_defaults(FullGraphStrategy.__doc__ or "")
    checked = []
    for name, values in documented.items():
        takers = [row for row in MODE_TABLE.values() if name in policy_settings(row.name)]
        if not takers:
            continue  # a strategy argument of its own (its default is in its signature)
        for mode, value in values:
            for row in takers:
                if mode is not None and row.name != mode:
                    continue
                default = _policy_default(row.name, name)
                assert default == value, (
                    f"FullGraphStrategy's docstring says {name} defaults to {value!r}"
                    f"{f' in {mode} mode' if mode else ''}; {row.policy.__name__} says {default!r}"
                )
                checked.append((name, row.name))
    # the check reads real statements, not none: these settings must state their default
    assert {name for name, _ in checked} >= {
        "bits", "staleness", "guard", "guard_cooldown", "max_halo_share", "assign_every", "first_assign",
        "lambda_", "group_size", "adaptive_window", "seed", "smooth", "link_costs",
    }


def test_the_usage_guides_option_table_states_the_policies_defaults() -> None:
    """``docs/usage.md``'s ``FullGraphStrategy`` option table gives, for every policy setting,
    the default of each mode's policy that takes it (``adaqp `"adaptive"`, sylvie `1```
    names the mode; a row of several options lists their defaults in order).

    Negative control: ``max_halo_share``'s default cell set to ``0.5`` fails it (run)."""
    text = (REPO / "docs" / "usage.md").read_text()
    table = text.split("`FullGraphStrategy(...)`", 1)[1].split("`FullGraphDataModule(...)`", 1)[0]
    settings = set().union(*(policy_settings(mode) for mode in MODE_TABLE))
    checked: set[str] = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3:
            continue
        names = re.findall(r"`(\w+)`", cells[0])
        if not names or not set(names) <= settings:
            continue
        stated = re.findall(r"(?:\b(adaqp|sylvie) )?`([^`]+)`", cells[1])
        if any(mode for mode, _ in stated):  # one option, a default per mode
            assert len(names) == 1, line
            for mode, value in stated:
                assert _policy_default(mode, names[0]) == ast.literal_eval(value), line
        else:
            assert len(stated) == len(names), f"one default per option expected: {line}"
            for name, (_, value) in zip(names, stated):
                for mode in MODE_TABLE:
                    if name in policy_settings(mode):
                        assert _policy_default(mode, name) == ast.literal_eval(value), (
                            f"docs/usage.md says {name} defaults to {value}; {mode}'s policy says "
                            f"{_policy_default(mode, name)!r}"
                        )
        checked.update(names)
    assert checked == settings, f"settings without a row: {sorted(settings - checked)}"


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
        (SylviePolicy, {"guard": -0.1}, "guard"),
        (SylviePolicy, {"guard_cooldown": 0}, "guard_cooldown"),
        (SylviePolicy, {"max_halo_share": 0.0}, "max_halo_share"),
        (SylviePolicy, {"epoch_adaptive": True, "adaptive_window": 1}, "adaptive_window"),
        (SylviePolicy, {"epoch_adaptive": "sometimes"}, "epoch_adaptive"),
        (SylviePolicy, {"bits": 32, "epoch_adaptive": "epoch"}, "epoch_adaptive"),
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
        _one_layer_exchanges(policy, epoch)
        schedule.append((policy.synchronous, policy.launch))
        policy.on_train_epoch_end(epoch, None)
    S, A = True, False
    assert schedule == [(S, False), (A, True), (A, False), (S, False), (A, True), (A, False), (S, False)]


def _one_layer_exchanges(policy: SylviePolicy, epoch: int) -> None:
    """What the exchanger does to the pipeline of one layer in ``epoch`` (no transfer): a
    synchronous epoch keeps the blocks it exchanged, an asynchronous one launches its own
    when the policy says so.  (An asynchronous epoch needs the blocks of the epoch before.)"""
    pipe = policy.pipeline.layer(0)
    block = torch.zeros(1, 1)
    if policy.synchronous:
        pipe.halo, pipe.halo_epoch, pipe.grad, pipe.grad_epoch = block, epoch, block, epoch
    elif policy.launch:
        pipe.fwd_pending, pipe.fwd_epoch = (lambda: block), epoch
        pipe.grad_pending, pipe.grad_pending_epoch = (lambda: block), epoch


def _run_epoch(policy: SylviePolicy, epoch: int, loss: float | None, seconds: float = 1.0) -> tuple[bool, bool]:
    policy.on_train_epoch_start(epoch)
    _one_layer_exchanges(policy, epoch)
    decided = (policy.synchronous, policy.launch)
    policy.on_train_epoch_end(epoch, loss, seconds)
    return decided


def test_adaptor_raises_bits_and_stops_the_pipeline_from_the_next_epoch() -> None:
    """Sylvie's Bounded Staleness Adaptor: a monotone slowdown of the loss's decrease per
    second over the window doubles the bits and makes the very next epoch synchronous, so the
    raised bits reach the wire at once; a monotone speed-up halves them and turns the pipeline
    back on; a noisy rate changes nothing.

    Negative control: deciding for epoch t+2 (the superseded rule) leaves epoch t+1
    asynchronous and the assertion on its schedule fails."""
    # momentum 0: the rates are those of the raw losses; decreases 0.5, 0.4, 0.3 per epoch
    # (1 s each) give three falling rates at epoch 3
    fresh = SylviePolicy(staleness=100, epoch_adaptive=True, adaptive_window=3, guard=False)
    fresh.setup(_env(_plan()))
    fresh.adaptor.start, fresh.adaptor.momentum = 1, 0.0
    schedule = [_run_epoch(fresh, e, loss) for e, loss in enumerate([10.0, 9.5, 9.1, 8.8])]
    assert [s for s, _ in schedule] == [True, False, False, False]
    assert not fresh.pipelined and fresh.uniform_bits == 2
    assert _run_epoch(fresh, 4, 8.7) == (True, False)  # the next epoch: synchronous at 2 bits
    assert fresh.message_bits(0, "forward")[0].unique().tolist() == [2]
    # a noisy rate: nothing changes
    _run_epoch(fresh, 5, 8.5)
    _run_epoch(fresh, 6, 8.45)
    assert not fresh.pipelined and fresh.uniform_bits == 2
    # speeding up (rates 0.05 -> 0.1 -> 0.2 -> 0.4): bits halve, pipeline back on next epoch
    for e, loss in zip(range(7, 10), [8.35, 8.15, 7.75]):
        _run_epoch(fresh, e, loss)
    assert fresh.pipelined and fresh.uniform_bits == 1
    assert _run_epoch(fresh, 10, 7.0)[0] is False


def test_adaptor_cannot_restart_the_pipeline_above_the_halo_share_limit() -> None:
    """Above ``max_halo_share`` a speed-up halves the bits but leaves every epoch synchronous.

    Negative control: letting the adaptor set ``pipelined = True`` makes epoch 5 asynchronous."""
    policy = SylviePolicy(bits=4, staleness=100, epoch_adaptive=True, adaptive_window=3, guard=False)
    env = _env(_plan())
    env.halo_share = 0.5
    policy.setup(env)
    policy.adaptor.start, policy.adaptor.momentum = 1, 0.0
    for e, loss in enumerate([10.0, 9.9, 9.7, 9.3, 8.5]):  # rates 0.1, 0.2, 0.4, 0.8: faster
        _run_epoch(policy, e, loss)
    assert policy.uniform_bits == 2 and not policy.pipelined
    assert _run_epoch(policy, 5, 8.0)[0] is True


@pytest.mark.parametrize(("share", "adapts"), [(0.5, True), (0.2, True), (0.1, False)])
def test_default_adaptor_reads_the_decrease_per_epoch_above_the_halo_share_limit(share, adapts) -> None:
    """``epoch_adaptive="auto"`` (the default) runs the adaptor on the loss's decrease per
    epoch where the halo share is at or above ``max_halo_share`` and leaves it off below.  The
    losses fall by 0.5, 0.4, 0.3 in epochs of 1, 0.5 and 0.25 s: per epoch a slowdown (bits
    2 from the next epoch), per second a speed-up (0.5, 0.8, 1.2 per second).

    Negative controls: resolving ``"auto"`` to the seed's rate per second halves nothing and
    raises nothing here (the bits stay 1 above the share); resolving it to on below the share
    raises the bits at a 10 % share; dropping the clause on the adaptor from the setup line
    fails the message assertion."""
    policy = SylviePolicy(staleness=100, adaptive_window=3, guard=False)
    env = _env(_plan())
    env.halo_share = share
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy.setup(env)
    # the fit-start line says that the bits will follow the loss
    said = " ".join(str(w.message) for w in caught)
    assert ("the bits double when the loss's decrease per epoch slows" in said) is (share >= 0.2), said
    assert policy.epoch_adaptive is adapts
    if adapts:
        assert policy.adaptor.per == "epoch"
        policy.adaptor.start, policy.adaptor.momentum = 1, 0.0
    for e, (loss, seconds) in enumerate([(10.0, 1.0), (9.5, 1.0), (9.1, 0.5), (8.8, 0.25)]):
        assert _run_epoch(policy, e, loss, seconds)[0] is (e == 0 or share >= 0.2)
    assert policy.uniform_bits == (2 if adapts else 1)
    assert policy.settings()["epoch_adaptive"] == ("epoch" if adapts else "auto")


def test_guard_runs_the_next_epochs_synchronous_after_a_rise_under_stale_values() -> None:
    """A loss more than ``guard`` above its best after an asynchronous epoch makes the next
    ``guard_cooldown`` epochs synchronous, then pipelines again; the second reaction's cooldown
    is twice as long; a rise in a synchronous stretch is not the pipeline's doing.

    Negative control: without the guard (``guard=False``) epoch 4 is asynchronous and the
    schedule assertion fails."""
    policy = SylviePolicy(staleness=100, guard=0.1, guard_cooldown=2)
    policy.setup(_env(_plan()))
    losses = [2.0, 1.8, 1.7, 2.0, 1.6, 1.5, 1.4, 1.2, 1.5, 1.9, 1.3, 1.2, 1.1, 1.0]
    schedule = [_run_epoch(policy, e, loss)[0] for e, loss in enumerate(losses)]
    S, A = True, False
    #            0  1  2  3  4  5  6  7  8  9  10 11 12 13
    assert schedule == [S, A, A, A, S, S, A, A, A, S, S, S, S, A]
    assert [(r.epoch, r.until) for r in policy.guard.reactions] == [(3, 5), (8, 12)]
    assert "rose 25% above its best (1.2 -> 1.5)" in policy.guard.reactions[1].message(None)
    assert "2 time(s)" in policy.summary(len(losses))


def test_guard_off_and_rise_under_synchronous_training_do_not_react() -> None:
    """``guard=False`` never forces an epoch; with the guard, a loss rise while every epoch is
    synchronous (``staleness=1``) is no reaction.

    Negative control: ignoring whether stale values were used reacts at epoch 1."""
    off = SylviePolicy(staleness=100, guard=False)
    off.setup(_env(_plan()))
    assert [_run_epoch(off, e, loss)[0] for e, loss in enumerate([1.0, 5.0, 9.0])] == [True, False, False]
    sync = SylviePolicy(staleness=1, guard=0.1)
    sync.setup(_env(_plan()))
    for e, loss in enumerate([1.0, 5.0, 9.0]):
        _run_epoch(sync, e, loss)
    assert sync.guard.reactions == [] and sync.summary(3) is None


def test_the_compute_only_bound_keeps_the_schedule_whatever_its_loss() -> None:
    """Under ``compute_only`` (halo rows are zeros, the loss means nothing) the guard never
    reacts, so the bound runs the schedule the mode runs on a converging loss.

    Negative control: observing the loss under ``compute_only`` too makes epoch 4 synchronous
    (the rise at epoch 3 is a reaction), and the schedule assertion fails."""
    import dataclasses

    policy = SylviePolicy(staleness=100, guard=0.1, guard_cooldown=2)
    policy.setup(dataclasses.replace(_env(_plan()), compute_only=True))
    losses = [2.0, 1.8, 1.7, 2.0, 1.6, 1.5]
    assert [_run_epoch(policy, e, loss)[0] for e, loss in enumerate(losses)] == [True, False, False, False,
                                                                                 False, False]
    assert policy.guard.reactions == []


def test_guard_ignores_the_relative_noise_of_a_loss_near_zero() -> None:
    """Late in training a loss of 0.05 that reads 0.08 next epoch (+60 %; seen on Cora) is
    noise, not divergence: the rise must exceed ``guard`` times half the first loss (2.0 here).

    Negative control: the purely relative test (``loss > 1.1 * best``) reacts at epoch 3."""
    policy = SylviePolicy(staleness=100, guard=0.1)
    policy.setup(_env(_plan()))
    for e, loss in enumerate([2.0, 0.5, 0.05, 0.08, 0.06]):
        _run_epoch(policy, e, loss)
    assert policy.guard.reactions == []
    _run_epoch(policy, 5, 0.16)  # +0.11 > 0.1 * 1.0: divergence
    assert [r.epoch for r in policy.guard.reactions] == [5]


@pytest.mark.parametrize(("share", "pipelined"), [(0.19, True), (0.2, False), (0.55, False)])
def test_a_large_halo_share_runs_every_epoch_synchronous(share: float, pipelined: bool) -> None:
    """At or above ``max_halo_share`` the pipeline is off from epoch 0 (still at ``bits``);
    ``max_halo_share=1.0`` pipelines anyway.

    Negative control: ignoring the share makes epoch 1 asynchronous at 0.55 and fails."""
    policy = SylviePolicy(staleness=5)
    env = _env(_plan())
    env.halo_share = share
    policy.setup(env)
    assert [_run_epoch(policy, e, None)[0] for e in range(3)] == [True, not pipelined, not pipelined]
    assert policy.message_bits(1, "forward")[0].unique().tolist() == [1]
    anyway = SylviePolicy(staleness=5, max_halo_share=1.0)
    anyway.setup(env)
    assert [_run_epoch(anyway, e, None)[0] for e in range(2)] == [True, False]


def test_state_round_trips_and_pickles_without_the_process_group() -> None:
    """``state_dict`` holds tensors and numbers only; a restored policy draws the same rounding
    numbers and keeps the schedule decisions; pickling drops the environment (like
    ``PowerSGDState.__getstate__`` drops the process group)."""
    plan = _plan()
    policy = SylviePolicy(staleness=100, epoch_adaptive=True, guard_cooldown=3)
    policy.setup(_env(plan))
    for epoch, loss in enumerate([1.0, 0.9, 1.2]):  # the guard reacts at epoch 2
        _run_epoch(policy, epoch, loss)
    policy.pipelined, policy.uniform_bits = False, 2  # as the adaptor leaves them
    torch.rand(3, generator=policy.generator)
    state = policy.state_dict()
    again = SylviePolicy(staleness=100, epoch_adaptive=True, guard_cooldown=3)
    again.setup(_env(plan))
    again.load_state_dict(state)
    assert torch.equal(torch.rand(4, generator=again.generator), torch.rand(4, generator=policy.generator))
    assert again.uniform_bits == policy.uniform_bits == 2 and not again.pipelined
    assert again.guard.state_dict() == policy.guard.state_dict() and again.guard.forces_sync(5)
    assert again.adaptor.state_dict() == policy.adaptor.state_dict()
    with pytest.raises(ValueError, match="'sylvie' policy but this run uses 'adaqp'"):
        AdaQPPolicy().load_state_dict(state)
    clone = pickle.loads(pickle.dumps(policy))
    assert clone.env is None and clone.staleness == 100


def test_an_asynchronous_epoch_without_the_previous_epochs_blocks_runs_synchronous() -> None:
    """The staleness bound is one epoch: epoch 8 (asynchronous by ``staleness=5``) may only
    consume blocks sent in epoch 7.  Holding epoch 6's (a checkpoint whose last epoch sent
    nothing) or none (a reset pipeline) makes it synchronous.

    Negative control: without the ``holds_blocks_of`` check in ``on_train_epoch_start`` the
    first and last cases are asynchronous and this test fails."""
    block = torch.zeros(1, 1)

    def start(sent: int | None) -> bool:
        policy = SylviePolicy(staleness=5)
        policy.setup(_env(_plan(), final_epoch=11))
        if sent is not None:
            pipe = policy.pipeline.layer(0)
            pipe.halo, pipe.halo_epoch, pipe.grad, pipe.grad_epoch = block, sent, block, sent
        policy.on_train_epoch_start(8)
        return policy.synchronous

    assert start(6) is True
    assert start(7) is False
    assert start(None) is True
