"""The tests' script runner: a hung script and its forked children say where they were."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from lightning_fullgraph._os import proc_start
from tests.processes import descendants, run_process

_HANGS = textwrap.dedent(
    """
    import os, sys, time

    def child_waits_forever():
        time.sleep(3600)

    def parent_waits_forever():
        os.waitpid(pid, 0)

    pid = os.fork()
    if pid == 0:
        child_waits_forever()
    print("forked", pid, flush=True)
    parent_waits_forever()
    """
)


def test_a_script_past_its_timeout_fails_with_every_process_stack(tmp_path) -> None:
    """A script that forks a child and both block: the test fails with the script's output
    and both processes' Python stacks, and neither process is left running.

    Negative controls (run): without ``PYTHONFAULTHANDLER=1`` the message has no stack;
    signalling the script only (not its descendants), the child lives on holding the pipe and
    the message has neither the output nor the child's stack."""
    script = tmp_path / "hang.py"
    script.write_text(_HANGS)
    with pytest.raises(pytest.fail.Exception) as failed:
        run_process([sys.executable, str(script)], timeout=3)
    message = str(failed.value)
    assert "ran past 3 s" in message and "2 processes" in message
    assert "forked" in message
    assert "in parent_waits_forever" in message
    assert "in child_waits_forever" in message
    child = int(message.split("forked", 1)[1].split()[0])
    assert proc_start(child) == ""  # gone, or a zombie its new parent has not reaped


_MANY_STACKS = textwrap.dedent(
    """
    import threading, time

    def deep(n):
        if n:
            return deep(n - 1)
        time.sleep(3600)

    for _ in range(60):
        threading.Thread(target=deep, args=(90,), daemon=True).start()
    print("started", flush=True)

    def main_thread_waits_forever():
        time.sleep(3600)

    main_thread_waits_forever()
    """
)


def test_stacks_larger_than_the_pipe_come_back_whole(tmp_path) -> None:
    """61 threads, 60 of them 90 frames deep: the dump (~300 kB) is several times what a pipe
    holds, so the runner must read while the process writes it.  The main thread, dumped
    last, is in the message (which keeps the dump's last 40 kB).

    Negative control (run): sleeping instead of reading while the process dies blocks its
    dump on the full pipe; it is SIGKILLed and the main thread's frame is missing."""
    script = tmp_path / "many.py"
    script.write_text(_MANY_STACKS)
    with pytest.raises(pytest.fail.Exception) as failed:
        run_process([sys.executable, str(script)], timeout=5)
    message = str(failed.value)
    assert "in main_thread_waits_forever" in message  # the end of the dump
    assert message.count("in deep") > 300  # (the message keeps the last 40 kB)


def test_a_script_that_finishes_returns_its_output_and_status(tmp_path) -> None:
    """The ordinary case is ``subprocess.run``'s: output, separate stderr when asked, status.
    Negative control: returning before ``communicate`` loses the output."""
    script = tmp_path / "ok.py"
    script.write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)\n")
    proc = run_process([sys.executable, str(script)], timeout=60, merge_stderr=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")
    merged = run_process([sys.executable, str(script)], timeout=60)
    assert sorted(merged.stdout.split()) == ["err", "out"] and merged.stderr is None


def test_descendants_lists_children_and_grandchildren() -> None:
    """Negative control: stopping after the first generation misses the grandchild."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: forks a grandchild, both wait on the pipe
        os.close(write)
        if os.fork() == 0:
            os.read(read, 1)
            os._exit(0)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        import time

        deadline = time.monotonic() + 10
        while len(descendants(os.getpid())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = descendants(pid)
        assert len(tree) == 1 and tree[0] != pid
        assert set(descendants(os.getpid())) >= {pid, tree[0]}
    finally:
        os.write(write, b"xx")
        os.close(write)
        os.waitpid(pid, 0)
