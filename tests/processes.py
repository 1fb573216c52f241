"""Running a test's script in a child process, with a timeout that says where it hung.

A script that runs past its timeout is stopped with ``SIGABRT``, then each of its descendants
(forked ranks, a forked METIS call), one process at a time, after ``PYTHONFAULTHANDLER=1`` made
each of them print every thread's Python stack on that signal; the test then fails with those
stacks.
``subprocess.run(timeout=...)`` would SIGKILL the script only, say nothing of where it was,
and leave its ranks to notice their launcher is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from lightning_fullgraph._os import proc_start

__all__ = ["descendants", "run_process"]

#: Seconds the processes get to print their stacks after SIGABRT.
DUMP_GRACE = 10.0


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid``, deepest first (read from ``/proc``; ``[]`` without it)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        found.extend(frontier)
    return found[::-1]


def _without_module_lists(text: str) -> str:
    """``text`` without faulthandler's "Extension modules: ..." lines (a few kB each)."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("Extension modules:"))


def _signal_all(pids: Sequence[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def run_process(
    args: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    merge_stderr: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, text=True)`` capturing the output (stderr into stdout unless
    ``merge_stderr=False``); past ``timeout`` seconds, fails the test with the Python stack
    of every thread of the script and of its descendants (see the module's docstring)."""
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    with subprocess.Popen(
        list(args), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, errors="replace"
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # One at a time, so that the stacks do not interleave, the script first: a child
            # stopped first could let its parent move on from where it hung.
            tree = [proc.pid, *descendants(proc.pid)[::-1]]
            done: tuple[str | None, str | None] | None = None
            for pid in tree:
                _signal_all([pid], signal.SIGABRT)
                deadline = time.monotonic() + DUMP_GRACE
                while proc_start(pid) and time.monotonic() < deadline:  # ("": gone or a zombie)
                    if done is not None:
                        time.sleep(0.05)
                        continue
                    try:  # keeps reading meanwhile: a full pipe would block the stacks' writes
                        done = proc.communicate(timeout=0.05)
                    except subprocess.TimeoutExpired:
                        pass
            _signal_all(tree, signal.SIGKILL)  # any that survived (stuck in the kernel, say)
            if done is None:
                try:
                    done = proc.communicate(timeout=DUMP_GRACE)
                except subprocess.TimeoutExpired:  # a process outside the tree holds the pipe
                    done = ("(the output could not be read)", None)
            out, err = done
            shown = _without_module_lists(out or "")[-40000:]
            if err:
                shown += "\n--- stderr ---\n" + _without_module_lists(err)[-40000:]
            pytest.fail(
                f"{' '.join(map(str, args))} ran past {timeout:.0f} s; the Python stacks of its "
                f"{len(tree)} processes (SIGABRT), after its output:\n{shown}",
                pytrace=False,
            )
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err)
