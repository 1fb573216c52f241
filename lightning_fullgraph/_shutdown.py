"""How a multi-rank run ends: signals, exit status, no process left behind.

Lightning's own SIGTERM handling does not suit halo exchange: its handler broadcasts on the
default process group from wherever the main thread happens to be (inside the gradient
all-reduce, say) while the peer waits in a halo transfer, so both ranks block until the
process-group timeout; its ``SIGTERMException`` then exits with status 0, and ranks started by
the ``popen`` launcher outlive a launcher that fails or is killed.

While :class:`~lightning_fullgraph.FullGraphStrategy` runs (one launcher ``launch`` call), every
rank of a multi-rank run has a :class:`ShutdownGuard`:

* SIGTERM / SIGINT raise ``SIGTERMException(128 + signum)`` / ``KeyboardInterrupt`` in the main
  thread (Lightning's exception path: ``on_exception`` hooks, loggers finalised), and the rank
  ends with ``os._exit(128 + signum)`` when the strategy tears down.  No broadcast, no
  barrier: a rank never waits for another one to agree to stop.
* A watcher thread sees the signal even while the main thread is blocked in a collective (the
  interpreter's wakeup fd): the launcher forwards it to its ranks at once; a rank whose main
  thread has not started to stop :data:`UNRESPONSIVE` seconds after the signal (it is blocked,
  typically waiting for a peer that is stopping too) exits then, and every rank exits at the
  latest :data:`GRACE` seconds after the signal; the launcher SIGKILLs ranks still alive
  :data:`KILL_AFTER` seconds after it, then exits itself.
* Under the ``fork``/``spawn`` launchers the parent (not a rank; maybe an interactive session)
  forwards the signal and stops the ranks, and the exception propagates to its caller.
* No rank outlives its launcher: a rank whose launcher has exited (its collectives then fail
  with the launcher's closed connections) exits :data:`GRACE` seconds later if it has not
  stopped by itself (stalled in user code, say).  A launcher that exits after a successful run
  waits for its ranks (at most the process-group timeout), then stops them; after a failed
  run it exits at once, which is what lets them fail.  When a rank fails, the launcher gets
  :data:`GRACE` seconds to fail on its own before it exits (Lightning SIGKILLs it at once).
* The signal handlers and the wakeup fd in place before the run are restored after it.

How a run that fails says why:

* Configuration errors every rank would hit (parts that do not match the ranks, a graph
  without training nodes, an unsupported conv, no FullGraphDataModule) are found by the
  launcher before it starts any rank (:mod:`lightning_fullgraph.preflight`): one ordinary
  exception, no rank started, no process-group timeout.
* In a ``popen`` run, the rank that finds an error reports it (prints it) and its peers,
  which then lose it (closed connection, timeout) or raise the same error, end quietly with
  status 1 (:func:`claim_report`): the output ends with that error, once, and without the
  halo-exchange paragraph, which is kept for a peer that stopped without a word (killed).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

__all__ = [
    "GRACE",
    "KILL_AFTER",
    "FullGraphMultiprocessingLauncher",
    "FullGraphSubprocessLauncher",
    "ShutdownGuard",
    "active_guard",
    "claim_report",
    "is_lost_peer",
]

#: Seconds a rank has to stop after SIGTERM/SIGINT before it exits regardless.
GRACE = 4.0
#: Seconds after the signal within which the main thread must have started to stop: if it has
#: not, it is blocked in a collective (where the Python-level handler cannot run), most likely
#: waiting for a peer that is stopping too, and the rank exits at once.
UNRESPONSIVE = 1.5
#: Seconds after a signal (or a failure) after which a launcher SIGKILLs its ranks still alive.
KILL_AFTER = GRACE + 1.5
#: Seconds between the launcher's checks of its ranks.
POLL = 1.0
#: Environment variable that tells a rank started by the ``popen`` launcher its launcher's pid.
LAUNCHER_PID_ENV = "LIGHTNING_FULLGRAPH_LAUNCHER_PID"
#: The signals that stop a run.
SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Environment variable naming the folder where the ranks of one ``popen`` run note which
#: error is reported (:func:`claim_report`).
RUN_DIR_ENV = "LIGHTNING_FULLGRAPH_RUN_DIR"
#: Prefix of those folders (in the temporary directory).
_RUN_DIR_PREFIX = "lightning_fullgraph-run-"
#: What the error of a rank whose peer stopped says (gloo's closed connection, a timeout).
LOST_PEER_TEXTS = ("Timed out", "timed out", "Connection closed", "Connection reset")
#: Attribute marking an exception another rank has reported (printed by no one here).
_REPORTED_ELSEWHERE = "_fullgraph_reported_elsewhere"

_active: ShutdownGuard | None = None
#: A guard that received a signal stays reachable after its ``launch`` returned: Lightning's
#: exception path (``on_exception``, ``teardown``) runs outside the launcher.
_signalled: ShutdownGuard | None = None
_watched_launcher: int | None = None


def active_guard() -> ShutdownGuard | None:
    """The guard of the run in progress in this process, or the one that received a signal
    and has not finished yet (``None`` otherwise)."""
    return _active if _active is not None else _signalled


def _write(message: str) -> None:
    # os.write: no lock a blocked main thread could hold (print/logging would need them)
    with contextlib.suppress(OSError):
        os.write(2, message.encode(errors="replace"))


def _flush_streams(timeout: float = 0.5) -> None:
    """Flushes stdout/stderr before ``os._exit`` without risking to block on their locks."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    t = threading.Thread(target=flush, daemon=True, name="fullgraph-flush")
    t.start()
    t.join(timeout)


def _child_alive(proc: Any) -> bool:
    try:
        if hasattr(proc, "poll"):  # subprocess.Popen
            return proc.poll() is None
        return bool(proc.is_alive())  # multiprocessing.Process
    except Exception:  # pragma: no cover - a process we cannot query is treated as gone
        return False


def _child_exitcode(proc: Any) -> int | None:
    return proc.returncode if hasattr(proc, "poll") else proc.exitcode


def _signal_child(proc: Any, signum: int) -> None:
    if _child_alive(proc):
        with contextlib.suppress(ProcessLookupError, OSError):
            os.kill(proc.pid, signum)


def stop_children(children: Sequence[Any], first_signal: int | None, kill_at: float) -> None:
    """Sends ``first_signal`` (unless ``None``) to the live ``children``, waits for them until
    ``kill_at`` (a ``time.monotonic()`` value), then SIGKILLs and reaps those still alive."""
    if first_signal is not None:
        for proc in children:
            _signal_child(proc, first_signal)
    while any(_child_alive(p) for p in children) and time.monotonic() < kill_at:
        time.sleep(0.05)
    for proc in children:
        _signal_child(proc, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while any(_child_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)


class ShutdownGuard:
    """SIGTERM/SIGINT handling of one process while a run is in progress.

    Args:
        rank: Gives this process's global rank for messages (``None``: not a rank, e.g. the
            parent of forked ranks).
        children: Gives the rank processes this process launched (``Popen`` or
            ``multiprocessing.Process`` objects).
        hard_exit: End the process with ``os._exit(128 + signum)`` after a signal (ranks).
            Without it (the parent of forked ranks, possibly an interactive session) the
            exception raised by the signal propagates to the caller.
        grace: Seconds after the signal at which a rank exits regardless (:data:`GRACE`).
    """

    def __init__(
        self,
        rank: Callable[[], int | None] = lambda: None,
        children: Callable[[], Sequence[Any]] = tuple,
        hard_exit: bool = True,
        grace: float = GRACE,
    ) -> None:
        self._rank = rank
        self._children = children
        self.hard_exit = hard_exit
        self.grace = grace
        self.signum: int | None = None
        self.received_at: float | None = None
        self._main_thread_stopping = False
        self._exiting = False
        self._lock = threading.RLock()
        self._installed = False
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}
        self._previous_wakeup_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self) -> Iterator[ShutdownGuard]:
        """Installs the guard for the duration of the block (a no-op off the main thread or
        while another guard is active)."""
        installed = self.install()
        try:
            yield self
        finally:
            if installed:
                self.uninstall()

    def install(self) -> bool:
        global _active
        _forget_inherited()
        if threading.current_thread() is not threading.main_thread() or _active is not None:
            return False
        self._pid = os.getpid()
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._previous = {s: signal.getsignal(s) for s in SIGNALS}
        try:
            for s in SIGNALS:
                signal.signal(s, self._handle)
            self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):  # pragma: no cover - e.g. an embedded interpreter
            self._restore_handlers()
            self._close_pipe()
            return False
        self._watcher = threading.Thread(
            target=self._watch, args=(read_fd,), daemon=True, name="fullgraph-signals"
        )
        self._watcher.start()
        self._installed = True
        _active = self
        return True

    def reassert(self) -> None:
        """Puts the guard's handlers back if something replaced them since :meth:`install`
        (Lightning installs its SIGTERM handler, which broadcasts, after the launcher ran)."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            if signal.getsignal(s) is not self._handle:
                signal.signal(s, self._handle)

    def uninstall(self) -> None:
        global _active
        if not self._installed:
            return
        self._installed = False
        if _active is self:
            _active = None
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(self._previous_wakeup_fd)
        self._restore_handlers()
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self._pipe[1], b"\0")  # wakes the watcher, which closes the pipe

    def _restore_handlers(self) -> None:
        for s, handler in self._previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._pipe = None

    # -- signals --------------------------------------------------------------------------
    def _handle(self, signum: int, frame: Any) -> None:
        """The Python-level handler (main thread, between two bytecodes)."""
        self._note(signum)  # (the watcher thread has usually noted it already)
        if self._main_thread_stopping:
            return  # a repeated signal: the main thread is stopping already
        self._main_thread_stopping = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SIGTERMException(128 + signum)

    def _watch(self, read_fd: int) -> None:
        """Reads the interpreter's wakeup fd: runs even while the main thread is blocked in a
        collective, where the Python-level handler cannot run."""
        try:
            while True:
                try:
                    data = os.read(read_fd, 64)
                except InterruptedError:  # pragma: no cover
                    continue
                if not data:
                    return
                for byte in data:
                    if byte == 0 and not self._installed:
                        return
                    if byte in SIGNALS:
                        self._note(byte)
                    elif self._previous_wakeup_fd >= 0:
                        with contextlib.suppress(OSError):
                            os.write(self._previous_wakeup_fd, bytes([byte]))
        finally:
            self._close_pipe()

    def _note(self, signum: int) -> bool:
        """Records the first stopping signal: forwards it to the launched ranks and arms the
        deadline.  Returns whether this call recorded it."""
        with self._lock:
            if self.signum is not None:
                return False
            self.signum = signum
            self.received_at = time.monotonic()
            global _signalled
            _signalled = self
        children = list(self._children())
        rank = self._rank()
        name = signal.Signals(signum).name
        who = f"[rank {rank}] " if rank is not None else ""
        also = " and the ranks it launched" if children else ""
        status = f" (exit status {128 + signum})" if self.hard_exit else ""
        _write(f"{who}FullGraphStrategy: received {name}; stopping this process{also}{status}\n")
        for proc in children:
            _signal_child(proc, signum)
        if self.hard_exit:
            threading.Thread(target=self._deadline, daemon=True, name="fullgraph-deadline").start()
        return True

    def _deadline(self) -> None:
        assert self.received_at is not None
        start = self.received_at
        time.sleep(max(0.0, start + min(UNRESPONSIVE, self.grace) - time.monotonic()))
        if not self._main_thread_stopping and not self._exiting:
            _write(
                f"{self._prefix()}FullGraphStrategy: the main thread is blocked (in a collective or native "
                f"code) {UNRESPONSIVE:.1f} s after the signal; exiting now\n"
            )
            self.exit_now()
        time.sleep(max(0.0, start + self.grace - time.monotonic()))
        if not self._exiting:
            _write(
                f"{self._prefix()}FullGraphStrategy: still running {self.grace:.0f} s after the signal; exiting now\n"
            )
            self.exit_now()
        # the main thread is in exit_now (waiting for the launched ranks): a last resort only
        time.sleep(max(0.0, start + KILL_AFTER + 3.0 - time.monotonic()))
        self.exit_now()

    def _prefix(self) -> str:
        rank = self._rank()
        return f"[rank {rank}] " if rank is not None else ""

    # -- ending ---------------------------------------------------------------------------
    def finish_if_signalled(self) -> None:
        """After a signal: stops the launched ranks and, for a rank, ends the process with
        status ``128 + signum``.  A no-op when no signal arrived."""
        global _signalled
        if self.signum is None:
            return
        if self.hard_exit:
            self.exit_now()
        assert self.received_at is not None
        stop_children(list(self._children()), None, self.received_at + KILL_AFTER)
        if _signalled is self:
            _signalled = None

    def exit_now(self) -> None:
        """Ends the process (status ``128 + signum``) once its launched ranks have stopped."""
        assert self.signum is not None and self.received_at is not None
        self._exiting = True
        with contextlib.suppress(Exception):
            stop_children(list(self._children()), None, self.received_at + KILL_AFTER)
        _flush_streams()
        os._exit(128 + self.signum)


def _forget_inherited() -> None:
    """In a process forked while its parent's guard was active (``fork`` start method): drop
    the parent's guard, whose watcher thread did not survive the fork and whose wakeup pipe
    is the parent's."""
    global _active, _signalled
    if _signalled is not None and _signalled._pid != os.getpid():
        _signalled = None
    inherited = _active
    if inherited is None or inherited._pid == os.getpid():
        return
    _active = None
    inherited._installed = False
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    inherited._restore_handlers()
    inherited._close_pipe()  # this process's copies of the fds only


# ------------------------------------------------------------------------------- reports
def is_lost_peer(exception: BaseException) -> bool:
    """Whether ``exception`` is what a rank gets when a peer stopped taking part (a closed
    connection, a collective's timeout) rather than an error of its own."""
    message = str(exception)
    return any(text in message for text in LOST_PEER_TEXTS)


def _error_text(exception: BaseException) -> str:
    return f"{type(exception).__name__}: {exception}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: someone else's process
        return True
    return True


def make_run_dir() -> str:
    """Creates the folder where the ranks of a run note the error that is reported (see
    :func:`claim_report`), after removing the folders of earlier runs whose launcher has
    exited.  (A failed run leaves its folder behind: its ranks may read it after the launcher
    has exited.)"""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            pid = entry.name[len(_RUN_DIR_PREFIX) :].split("-", 1)[0]
            if not entry.name.startswith(_RUN_DIR_PREFIX) or not pid.isdigit() or _pid_alive(int(pid)):
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if (
                    entry.is_dir(follow_symlinks=False)
                    and info.st_uid == os.getuid()
                    and time.time() - info.st_mtime > 60
                ):
                    shutil.rmtree(entry.path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_RUN_DIR_PREFIX}{os.getpid()}-")


def _report_path() -> str | None:
    run_dir = os.environ.get(RUN_DIR_ENV)
    return os.path.join(run_dir, "reported") if run_dir and os.path.isdir(run_dir) else None


def _read_report(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def _reporter_pid() -> int | None:
    """The process that reported this run's error, if any."""
    path = _report_path()
    report = _read_report(path) if path is not None else None
    pid = report.get("pid") if report is not None else None
    return pid if isinstance(pid, int) else None


def reported_elsewhere() -> bool:
    """Whether a process of this run (other than this one) has reported an error."""
    pid = _reporter_pid()
    return pid is not None and pid != os.getpid()


def claim_report(exception: BaseException, rank: int | None = None) -> bool:
    """Decides whether this rank reports ``exception`` (prints it) or leaves that to the rank
    of the run that found the error, so that the run's output ends with that error, once.

    The first rank to fail with an error of its own (not a lost peer) records it in the run's
    folder (:data:`RUN_DIR_ENV`, made by the ``popen`` launcher) and reports it.  A later
    failure on another rank is left to that rank when it is a consequence of it (a closed
    connection or a timeout: :func:`is_lost_peer`) or the same error (every rank raised it
    alike).  A different error, a lost peer that nobody reported (a rank was killed), and
    every failure outside a ``popen`` run are reported.

    Args:
        exception: The error this rank stops with.
        rank: This rank (recorded with the error).

    Returns:
        Whether to report it.  When not, the exception is marked and the process's
        ``sys.excepthook`` prints nothing for it: uncaught, it ends the process quietly with
        status 1 (code that catches it still gets it).
    """
    path = _report_path()
    if path is None:
        return True
    lost_peer = is_lost_peer(exception)
    text = _error_text(exception)
    if not lost_peer:
        mine = f"{path}.{os.getpid()}"
        try:
            with open(mine, "w") as f:
                json.dump({"pid": os.getpid(), "rank": rank, "error": text}, f)
            os.link(mine, path)  # atomic: fails if another rank reported first
            return True
        except FileExistsError:
            pass
        except OSError:
            return True
    report = _read_report(path)
    if report is None or report.get("pid") == os.getpid():
        return True
    if lost_peer or report.get("error") == text:
        _leave_to_reporter(exception)
        return False
    return True


def _leave_to_reporter(exception: BaseException) -> None:
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exception, _REPORTED_ELSEWHERE, True)
    previous = sys.excepthook
    if getattr(previous, _REPORTED_ELSEWHERE, False):
        return

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if getattr(exc, _REPORTED_ELSEWHERE, False):
            return  # another rank printed the run's error
        previous(exc_type, exc, tb)

    setattr(excepthook, _REPORTED_ELSEWHERE, True)
    sys.excepthook = excepthook


# ------------------------------------------------------------------------------ children
def _watch_launcher(launcher_pid: int, rank: Callable[[], int | None]) -> None:
    """In a rank started by a launcher: when the launcher exits, the rank's collectives fail
    (closed connections) and it stops with its own error; one that has not stopped
    :data:`GRACE` seconds later (stalled, or blocked where it cannot notice) exits (status 1)."""
    global _watched_launcher
    if _watched_launcher == launcher_pid:
        return
    _watched_launcher = launcher_pid
    if os.getppid() != launcher_pid:
        _write("FullGraphStrategy: the launcher has exited; stopping this rank\n")
        _flush_streams()
        os._exit(1)

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(POLL)
        time.sleep(GRACE)
        who = rank()
        prefix = f"[rank {who}] " if who is not None else ""
        _write(f"{prefix}FullGraphStrategy: the launcher exited {GRACE:.0f} s ago; stopping this rank\n")
        _flush_streams()
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
            codes = [(_child_alive(p), _child_exitcode(p)) for p in self._children]
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
                _write(
                    f"[rank 0] FullGraphStrategy: local rank {rank} exited with status {code}; stopping the launcher\n"
                )
            _flush_streams()
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
        if not any(_child_alive(p) for p in children):
            return True
        guard = self.guard
        if guard.signum is not None and guard.received_at is not None:
            stop_children(children, None, guard.received_at + KILL_AFTER)
            return True
        if self.run_failed:
            # A rank that reported the run's error is printing it: the launcher's exit (the
            # shell's prompt) comes after it.  The others wait for this exit to fail.
            reporter = _reporter_pid()
            deadline = time.monotonic() + GRACE
            while (
                any(p.pid == reporter and _child_alive(p) for p in children) and time.monotonic() < deadline
            ):
                time.sleep(0.05)
            return False
        deadline = time.monotonic() + self.wait
        while any(_child_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        if any(_child_alive(p) for p in children):
            _write("[rank 0] FullGraphStrategy: stopping the ranks still running as the launcher exits\n")
            stop_children(children, signal.SIGTERM, time.monotonic() + KILL_AFTER)
        return True


def _timeout_seconds(strategy: Any) -> float:
    timeout = getattr(strategy, "_timeout", None)
    return timeout.total_seconds() if isinstance(timeout, timedelta) else 1800.0


def _preflight(
    trainer: Any, function: Callable, args: tuple, kwargs: dict, load_graph: bool, environment: Any
) -> None:
    """:func:`lightning_fullgraph.preflight.check_before_launch`; an error it finds is raised
    without the checks' own frames (its message says what to fix)."""
    from lightning_fullgraph.preflight import check_before_launch

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
        if self._strategy.num_processes <= 1:
            return super()._wrapping_function(process_idx, *args, **kwargs)
        if self._start_method != "forkserver":
            _watch_launcher(os.getppid(), lambda: self._strategy.global_rank)
        guard = ShutdownGuard(rank=lambda: self._strategy.global_rank)
        with guard.active():
            return super()._wrapping_function(process_idx, *args, **kwargs)
