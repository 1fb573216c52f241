"""Lightning's two launchers with this package's rules, and every private Lightning name the package uses.

The launchers (``popen``: each rank re-runs the script; ``fork``/``spawn``) add the
launcher's checks before any rank starts
(:mod:`lightning_fullgraph.launch.preflight`), the shutdown guard in every rank
(:mod:`~lightning_fullgraph.launch.guard`), each error reported once
(:mod:`~lightning_fullgraph.launch.report`), and no rank outliving its launcher.

Forked ranks also get the thread rule of :func:`one_thread_after_fork` (GNU OpenMP's thread
pool does not survive ``fork``).

Lightning's private names (the launcher classes subclassed here, its share of the cores per
rank, and :func:`sync_module_states` for the strategy) are imported here and nowhere else, so
that a Lightning upgrade that moves one breaks one module.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.distributed import _suggested_max_num_threads
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_fullgraph.launch.guard import (
    GRACE,
    KILL_AFTER,
    LAUNCHER_PID_ENV,
    POLL,
    ShutdownGuard,
    child_alive,
    child_exitcode,
    flush_streams,
    stop_children,
    write_stderr,
)
from lightning_fullgraph.launch.report import RUN_DIR_ENV, make_run_dir, reported_elsewhere, reporter_pid

__all__ = [
    "FullGraphMultiprocessingLauncher",
    "FullGraphSubprocessLauncher",
    "fork_threads_message",
    "one_thread_after_fork",
    "rank_threads",
    "sync_module_states",
]

def sync_module_states(module: Any) -> None:
    """Broadcasts ``module``'s parameters and buffers from rank 0 (Lightning's
    ``_sync_module_states``): every rank starts from rank 0's weights, as under DDP."""
    _sync_module_states(module)


#: The launcher pid this rank already watches (one watcher thread per rank).
_watched_launcher: int | None = None


def _watch_launcher(launcher_pid: int, rank: Callable[[], int | None]) -> None:
    """In a rank started by a launcher: when the launcher exits, the rank's collectives fail
    (closed connections) and it stops with its own error; one that has not stopped
    :data:`GRACE` seconds later (stalled, or blocked where it cannot notice) exits (status 1)."""
    global _watched_launcher
    if _watched_launcher == launcher_pid:
        return
    _watched_launcher = launcher_pid
    if os.getppid() != launcher_pid:
        write_stderr("FullGraphStrategy: the launcher has exited; stopping this rank\n")
        flush_streams()
        os._exit(1)

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(POLL)
        time.sleep(GRACE)
        who = rank()
        prefix = f"[rank {who}] " if who is not None else ""
        write_stderr(f"{prefix}FullGraphStrategy: the launcher exited {GRACE:.0f} s ago; stopping this rank\n")
        flush_streams()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="fullgraph-launcher-watch").start()


class _RankObserver(threading.Thread):
    """In the ``popen`` launcher: when a rank it started fails, the launcher's own collectives
    fail (the peer is gone) and it stops with its error; if it has not within :data:`GRACE`
    seconds, it exits (status 1) and so stops the other ranks.  Lightning's observer SIGKILLs
    the launcher at once instead."""

    def __init__(self, children: Sequence[Any], guard: ShutdownGuard, period: float = POLL) -> None:
        super().__init__(daemon=True, name="fullgraph-rank-observer")
        self._children = children
        self._guard = guard
        self._period = period
        self.exiting = False

    def _standing_down(self) -> bool:
        return self.exiting or self._guard.signum is not None

    @override
    def run(self) -> None:
        failed_at: float | None = None
        while not self._standing_down():
            time.sleep(self._period)
            codes = [(child_alive(p), child_exitcode(p)) for p in self._children]
            if all(not alive and code == 0 for alive, code in codes):
                return
            failed = [(i + 1, code) for i, (alive, code) in enumerate(codes) if not alive and code]
            if not failed or self._standing_down():
                continue
            if failed_at is None:
                failed_at = time.monotonic()
            if time.monotonic() - failed_at < GRACE:
                continue
            rank, code = failed[0]
            if not reported_elsewhere():  # (else its error, printed, says why)
                write_stderr(
                    f"[rank 0] FullGraphStrategy: local rank {rank} exited with status {code}; stopping the launcher\n"
                )
            flush_streams()
            os._exit(1)


class _LauncherExit:
    """The ``popen`` launcher's process exits (``atexit``): after a successful run its ranks
    get up to the process-group timeout to finish (they are normally right behind it), then
    SIGTERM and, :data:`KILL_AFTER` s later, SIGKILL.  After a signal they get what is left of
    :data:`KILL_AFTER`; after a failed run none: they are waiting for this process, and its
    exit is what lets them fail (see :func:`_watch_launcher`).  The run's report folder
    (:func:`claim_report`) is removed once its ranks are gone; a failed run leaves it to the
    next run's :func:`make_run_dir` (its ranks may still read it)."""

    def __init__(
        self,
        children: Sequence[Any],
        guard: ShutdownGuard,
        observer: _RankObserver,
        wait: float,
        run_dir: str | None = None,
    ) -> None:
        self.children = children
        self.guard = guard
        self.observer = observer
        self.wait = wait
        self.run_dir = run_dir
        self.run_failed = False

    def __call__(self) -> None:
        self.observer.exiting = True
        if self._stop_children() and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _stop_children(self) -> bool:
        """Stops the ranks as the class says; returns whether they are gone."""
        children = self.children
        if not any(child_alive(p) for p in children):
            return True
        guard = self.guard
        if guard.signum is not None and guard.received_at is not None:
            stop_children(children, None, guard.received_at + KILL_AFTER)
            return True
        if self.run_failed:
            # A rank that reported the run's error is printing it: the launcher's exit (the
            # shell's prompt) comes after it.  The others wait for this exit to fail.
            reporter = reporter_pid()
            deadline = time.monotonic() + GRACE
            while (
                any(p.pid == reporter and child_alive(p) for p in children) and time.monotonic() < deadline
            ):
                time.sleep(0.05)
            return False
        deadline = time.monotonic() + self.wait
        while any(child_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        if any(child_alive(p) for p in children):
            write_stderr("[rank 0] FullGraphStrategy: stopping the ranks still running as the launcher exits\n")
            stop_children(children, signal.SIGTERM, time.monotonic() + KILL_AFTER)
        return True


def rank_threads(num_processes: int) -> int:
    """The torch threads a rank of ``num_processes`` on this machine asks for:
    ``$OMP_NUM_THREADS``, else Lightning's share of the cores (at least one)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() else _suggested_max_num_threads(num_processes)


def one_thread_after_fork(num_processes: int) -> int | None:
    """In a rank just forked: runs this rank's torch ops on one thread, and returns the
    threads the rank would have run (``$OMP_NUM_THREADS``, else Lightning's share of the
    cores) when that was more than one, else ``None``.

    torch's CPU wheels use GNU OpenMP, whose thread pool does not survive ``fork``: once the
    parent has run one multi-threaded op (loading or generating the graph, say), the pool's
    threads exist only in the parent, and a forked rank's first multi-threaded op waits for
    them forever (a hang with no error, in any op large enough to split).  That holds even
    when the parent has set one thread since (the idle pool stays), and whether a pool was
    ever started cannot be read, so every forked rank runs one thread: one thread cannot
    wait on the pool.  ``popen`` and ``spawn`` ranks start a new interpreter and keep every
    thread they are given."""
    wanted = rank_threads(num_processes)
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # (this rank only; Lightning's own rule then keeps it)
    return wanted if wanted > 1 else None


def fork_threads_message(wanted: int, parent_threads: int) -> str:
    """What rank 0 says when forked ranks are held to one thread (:func:`one_thread_after_fork`):
    a warning where the launching process runs torch on several threads (its pool is then
    almost surely started), an info line where it runs one (a pool from earlier is possible)."""
    why = (
        f"this process ran torch on {parent_threads} threads before forking the ranks"
        if parent_threads > 1
        else "this process may have run torch on several threads before (it runs one now)"
    )
    return (
        f"FullGraphStrategy(start_method='fork'): each rank runs torch on 1 thread, not {wanted}: "
        f"{why}, and GNU OpenMP's thread pool does not survive fork (a forked rank's first "
        "multi-threaded op would hang). For more threads per rank use start_method='popen' "
        "(scripts, the default) or 'spawn'"
    )


def _timeout_seconds(strategy: Any) -> float:
    timeout = getattr(strategy, "_timeout", None)
    return timeout.total_seconds() if isinstance(timeout, timedelta) else 1800.0


def _preflight(
    trainer: Any, function: Callable, args: tuple, kwargs: dict, load_graph: bool, environment: Any
) -> None:
    """:func:`lightning_fullgraph.launch.preflight.check_before_launch`; an error it finds is raised
    without the checks' own frames (its message says what to fix)."""
    from lightning_fullgraph.launch.preflight import check_before_launch

    node_rank = environment.node_rank() if environment is not None else 0
    found: Exception | None = None
    try:
        check_before_launch(trainer, function, args, kwargs, load_graph=load_graph, node_rank=node_rank)
    except Exception as err:
        found = err
    if found is not None:
        raise found.with_traceback(None)


# ----------------------------------------------------------------------------- launchers
class FullGraphSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher (each rank re-runs the script) with the shutdown rules of
    this module: signals forwarded, ranks tied to the launcher, none left behind."""

    def __init__(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._strategy = strategy
        self._at_exit: _LauncherExit | None = None

    def _rank(self) -> int | None:
        return self._strategy.global_rank

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
        from lightning.pytorch.utilities.exceptions import _TunerExitException

        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        spawns = not self.cluster_environment.creates_processes_externally
        launcher_pid = os.environ.get(LAUNCHER_PID_ENV, "")
        if spawns or not launcher_pid.isdigit():
            # Before any rank starts (under an external launcher: in every rank alike), so
            # that a configuration error is raised here, once, and no rank waits for a peer.
            _preflight(trainer, function, args, kwargs, spawns, self.cluster_environment)
        if not spawns and launcher_pid.isdigit() and os.environ.get("LOCAL_RANK", "0") != "0":
            _watch_launcher(int(launcher_pid), self._rank)
        multi_rank = self.num_processes * self.num_nodes > 1
        guard = ShutdownGuard(rank=self._rank, children=lambda: self.procs)
        with guard.active() if multi_rank else contextlib.nullcontext(guard):
            if spawns:
                os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
                run_dir = None
                if self.num_processes > 1:
                    # where the ranks note which error is reported (claim_report)
                    run_dir = os.environ[RUN_DIR_ENV] = make_run_dir()
                self._call_children_scripts()
                if self.procs:
                    observer = _RankObserver(self.procs, guard)
                    observer.start()
                    self._at_exit = _LauncherExit(
                        self.procs, guard, observer, _timeout_seconds(self._strategy), run_dir
                    )
                    atexit.register(self._at_exit)
            _set_num_threads_if_needed(num_processes=self.num_processes)
            try:
                return function(*args, **kwargs)
            except _TunerExitException:
                raise
            except BaseException:
                if self._at_exit is not None:
                    self._at_exit.run_failed = True
                raise


class FullGraphMultiprocessingLauncher(_MultiProcessingLauncher):
    """Lightning's ``spawn``/``fork`` launcher with the shutdown rules of this module: the
    parent forwards SIGTERM/SIGINT to the ranks and stops them; every rank ends within
    :data:`GRACE` seconds of a signal and of its parent's exit."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # In the parent, before any rank starts; forked ranks inherit the graph it loaded
        # (spawned ones would receive a pickled copy each: the ranks check it then).
        fork = self._start_method == "fork"
        _preflight(trainer, function, args, kwargs, fork, self._strategy.cluster_environment)
        self._parent_threads = torch.get_num_threads()  # read by the forked ranks
        if self._strategy.num_processes <= 1:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        guard = ShutdownGuard(children=lambda: list(getattr(self, "procs", [])), hard_exit=False)
        with guard.active():
            try:
                return super().launch(function, *args, trainer=trainer, **kwargs)
            except BaseException:
                if guard.signum is not None and guard.received_at is not None:
                    stop_children(list(getattr(self, "procs", [])), None, guard.received_at + KILL_AFTER)
                raise

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        if self._start_method == "fork":
            wanted = one_thread_after_fork(self._strategy.num_processes)
            if wanted is not None and process_idx == 0:
                parent_threads = getattr(self, "_parent_threads", 1)
                if parent_threads > 1:
                    warnings.warn(fork_threads_message(wanted, parent_threads), UserWarning, stacklevel=1)
                else:
                    rank_zero_info(fork_threads_message(wanted, parent_threads))
        if self._strategy.num_processes <= 1:
            return super()._wrapping_function(process_idx, *args, **kwargs)
        if self._start_method != "forkserver":
            _watch_launcher(os.getppid(), lambda: self._strategy.global_rank)
        guard = ShutdownGuard(rank=lambda: self._strategy.global_rank)
        with guard.active():
            return super()._wrapping_function(process_idx, *args, **kwargs)
