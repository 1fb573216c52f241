"""A call in a forked child: its result, its failures and its memory come back to the parent."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

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


# Run in a fresh interpreter, whose heap is in a known state (a pytest worker's depends on
# the tests before): 300 MiB of tensors in the main heap (the mmap threshold raised past
# their size by freeing a larger one, as any run of torch does), a live tensor above them,
# then the 300 MiB freed: a free chunk still resident, which the child's 192 MiB can reuse.
_FREED_HEAP_SCRIPT = textwrap.dedent(
    """
    import torch
    from lightning_fullgraph._os import status_kib
    from lightning_fullgraph.partition.forked import ForkedCall

    def allocate(mib):
        block = torch.ones(mib * 2**20 // 8, dtype=torch.int64)
        return block[:1].clone()

    del_me = torch.ones(30 * 2**20 // 8, dtype=torch.int64)
    del del_me
    blocks = [torch.ones(15 * 2**20 // 8, dtype=torch.int64) for _ in range(20)]
    keeper = torch.ones(2**20, dtype=torch.int64)
    before = status_kib("VmRSS")
    del blocks
    freed_mib = (before - status_kib("VmRSS")) / 1024
    call = ForkedCall(allocate, (192,), 1)
    call.result()
    print(freed_mib, call.private_peak_bytes / 2**20)
    """
)


def test_private_peak_counts_an_allocation_served_from_the_parents_freed_heap() -> None:
    """The parent holds 300 MiB of freed heap memory, still resident (``malloc`` keeps a
    free chunk below a live block), when it forks; the child's 192 MiB come from that chunk.
    The report is still at least 192 MiB: the child hands the inherited free heap back to
    the kernel and resets its peak before taking the baseline.  (The suite's CI reported
    ~41 MiB for 192 in ``test_private_peak_is_what_the_child_allocated`` about one run in
    five this way: what a worker's earlier tests freed decides the heap the child reuses.)
    Negative controls (run): without ``release_free_heap()`` this reports 9 MiB; releasing
    without ``reset_peak_rss()`` reports 300 MiB (the peak before the release)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _FREED_HEAP_SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    freed_mib, peak_mib = map(float, run.stdout.split())
    assert freed_mib < 16, f"the setup lost its premise: {freed_mib} MiB of the freed heap left memory"
    assert 192 <= peak_mib < 192 + 96, peak_mib


def test_calls_are_forked_on_linux_only(monkeypatch) -> None:
    """macOS offers ``fork`` but forking a threaded process is unsafe there and ``/proc`` is
    missing, so the planner numbers parts in its own process.  Negative control: without the
    platform check ``can_fork`` is true on "darwin" and the planner would fork."""
    from lightning_fullgraph.partition.planner import _order_workers

    assert can_fork() and _order_workers(4, 4, "locality") == 4
    monkeypatch.setattr("sys.platform", "darwin")
    assert not can_fork()
    assert _order_workers(4, 4, "locality") == 1
