"""A call in a forked child: its result, its failures and its memory come back to the parent."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from lightning_fullgraph.partition.forked import ForkedCall, can_fork

pytestmark = pytest.mark.skipif(not can_fork(), reason="needs the fork start method")


def _pid_and(values: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.tensor([os.getpid()]), values * 2])


def test_result_is_the_call_run_in_another_process() -> None:
    """The child reads the argument through the fork (no pickling) and its result comes
    back whole; the first element is the pid it ran in, which is not this process's.
    Negative control: running the call in ``__init__`` here (no fork) fails the pid check;
    reading the buffer one word off fails the value check."""
    values = torch.arange(100_000, dtype=torch.int64)
    out = ForkedCall(_pid_and, (values,), 100_001).result()
    assert int(out[0]) != os.getpid()
    assert torch.equal(out[1:], values * 2)


def _raise(message: str) -> torch.Tensor:
    raise ValueError(message)


def _exit(code: int) -> torch.Tensor:
    os._exit(code)


def _wrong(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32)


def test_a_failing_child_raises_with_its_traceback() -> None:
    """An exception in the child, a child that dies without a result, and a result of the
    wrong type each raise ``RuntimeError`` here (never a garbage result).  Negative
    control: without the status word's check the dead child's zeros are returned."""
    with pytest.raises(RuntimeError, match="ValueError: boom in the child"):
        ForkedCall(_raise, ("boom in the child",), 4).result()
    with pytest.raises(RuntimeError, match="exit code 7"):
        ForkedCall(_exit, (7,), 4).result()
    with pytest.raises(RuntimeError, match="expected int64"):
        ForkedCall(_wrong, (4,), 4).result()


def _allocate(mib: int) -> torch.Tensor:
    block = torch.ones(mib * 2**20 // 8, dtype=torch.int64)  # every page written
    return block[:1].clone()


def test_private_peak_is_what_the_child_allocated() -> None:
    """A child that writes 192 MiB reports a private peak of at least that and not the
    parent's resident memory on top (which the child shares through the fork).  Negative
    controls: without subtracting the resident set at the fork the report includes this
    process's hundreds of MiB and fails the upper bound; without the report it is 0."""
    call = ForkedCall(_allocate, (192,), 1)
    assert int(call.result()[0]) == 1
    mib = call.private_peak_bytes / 2**20
    assert 192 <= mib < 192 + 96, mib


def _allocate_after_a_collection(mib: int) -> torch.Tensor:
    gc.collect()  # what any allocation in the child may trigger
    return _allocate(mib)


class _Cycle:
    """128 MiB held by a reference cycle: garbage only a collection frees."""

    def __init__(self) -> None:
        self.me = self
        self.block = torch.ones(128 * 2**20 // 8, dtype=torch.int64)


def test_private_peak_survives_a_collection_of_the_parents_garbage() -> None:
    """This process holds 128 MiB of garbage (a reference cycle not yet collected) when it
    forks; the child's call runs a collection, then writes 192 MiB.  The report is still at
    least 192 MiB: the child does not collect what it inherited, which would unmap memory the
    parent still holds and hide that much of the child's own allocation (the suite's CI
    failed this way, reporting 40 MiB for 192, once a test file left garbage in its worker).
    Negative control (run): without ``gc.freeze()`` in the child this reports ~64 MiB."""
    enabled = gc.isenabled()
    gc.disable()  # keep the cycle uncollected until the fork
    try:
        _Cycle()
        call = ForkedCall(_allocate_after_a_collection, (192,), 1)
        assert int(call.result()[0]) == 1
    finally:
        if enabled:
            gc.enable()
        gc.collect()
    mib = call.private_peak_bytes / 2**20
    assert 192 <= mib < 192 + 96, mib


def test_calls_are_forked_on_linux_only(monkeypatch) -> None:
    """macOS offers ``fork`` but forking a threaded process is unsafe there and ``/proc`` is
    missing, so the planner numbers parts in its own process.  Negative control: without the
    platform check ``can_fork`` is true on "darwin" and the planner would fork."""
    from lightning_fullgraph.partition.planner import _order_workers

    assert can_fork() and _order_workers(4, 4, "locality") == 4
    monkeypatch.setattr("sys.platform", "darwin")
    assert not can_fork()
    assert _order_workers(4, 4, "locality") == 1
