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
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["GRACE", "KILL_AFTER", "ShutdownGuard", "active_guard", "stop_children"]

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

_active: ShutdownGuard | None = None
#: A guard that received a signal stays reachable after its ``launch`` returned: Lightning's
#: exception path (``on_exception``, ``teardown``) runs outside the launcher.
_signalled: ShutdownGuard | None = None


def active_guard() -> ShutdownGuard | None:
    """The guard of the run in progress in this process, or the one that received a signal
    and has not finished yet (``None`` otherwise)."""
    return _active if _active is not None else _signalled


def write_stderr(message: str) -> None:
    # os.write: no lock a blocked main thread could hold (print/logging would need them)
    with contextlib.suppress(OSError):
        os.write(2, message.encode(errors="replace"))


def flush_streams(timeout: float = 0.5) -> None:
    """Flushes stdout/stderr before ``os._exit`` without risking to block on their locks."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    t = threading.Thread(target=flush, daemon=True, name="fullgraph-flush")
    t.start()
    t.join(timeout)


def child_alive(proc: Any) -> bool:
    try:
        if hasattr(proc, "poll"):  # subprocess.Popen
            return proc.poll() is None
        return bool(proc.is_alive())  # multiprocessing.Process
    except Exception:  # pragma: no cover - a process we cannot query is treated as gone
        return False


def child_exitcode(proc: Any) -> int | None:
    return proc.returncode if hasattr(proc, "poll") else proc.exitcode


def _signal_child(proc: Any, signum: int) -> None:
    if child_alive(proc):
        with contextlib.suppress(ProcessLookupError, OSError):
            os.kill(proc.pid, signum)


def stop_children(children: Sequence[Any], first_signal: int | None, kill_at: float) -> None:
    """Sends ``first_signal`` (unless ``None``) to the live ``children``, waits for them until
    ``kill_at`` (a ``time.monotonic()`` value), then SIGKILLs and reaps those still alive."""
    if first_signal is not None:
        for proc in children:
            _signal_child(proc, first_signal)
    while any(child_alive(p) for p in children) and time.monotonic() < kill_at:
        time.sleep(0.05)
    for proc in children:
        _signal_child(proc, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while any(child_alive(p) for p in children) and time.monotonic() < deadline:
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
        write_stderr(f"{who}FullGraphStrategy: received {name}; stopping this process{also}{status}\n")
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
            write_stderr(
                f"{self._prefix()}FullGraphStrategy: the main thread is blocked (in a collective or native "
                f"code) {UNRESPONSIVE:.1f} s after the signal; exiting now\n"
            )
            self.exit_now()
        time.sleep(max(0.0, start + self.grace - time.monotonic()))
        if not self._exiting:
            write_stderr(
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
        flush_streams()
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
