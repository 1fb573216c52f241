"""How a run that fails says why: each error reported once, by the rank that found it.

* Configuration errors every rank would hit (parts that do not match the ranks, a graph
  without training nodes, an unsupported conv, no FullGraphDataModule) are found by the
  launcher before it starts any rank (:mod:`lightning_fullgraph.launch.preflight`): one ordinary
  exception, no rank started, no process-group timeout.
* In a ``popen`` run, the rank that finds an error reports it (prints it) and its peers,
  which then lose it (closed connection, timeout) or raise the same error, end quietly with
  status 1 (:func:`claim_report`): the output ends with that error, once, and without the
  halo-exchange paragraph, which is kept for a peer that stopped without a word (killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from lightning_fullgraph._os import pid_alive

__all__ = ["claim_report", "explain_lost_peer", "is_lost_peer", "make_run_dir", "reported_elsewhere"]

#: Environment variable naming the folder where the ranks of one ``popen`` run note which
#: error is reported (:func:`claim_report`).
RUN_DIR_ENV = "LIGHTNING_FULLGRAPH_RUN_DIR"
#: Prefix of those folders (in the temporary directory).
RUN_DIR_PREFIX = "lightning_fullgraph-run-"
#: What the error of a rank whose peer stopped says (gloo's closed connection, a timeout).
LOST_PEER_TEXTS = ("Timed out", "timed out", "Connection closed", "Connection reset")
#: Attribute marking an exception another rank has reported (printed by no one here).
_REPORTED_ELSEWHERE = "_fullgraph_reported_elsewhere"


def is_lost_peer(exception: BaseException) -> bool:
    """Whether ``exception`` is what a rank gets when a peer stopped taking part (a closed
    connection, a collective's timeout) rather than an error of its own."""
    message = str(exception)
    return any(text in message for text in LOST_PEER_TEXTS)


def explain_lost_peer(exception: BaseException) -> None:
    """Appends to a lost-peer error (:func:`is_lost_peer`) what it means for the halo exchange
    and where to look (in place: the exception's first argument)."""
    exception.args = (
        f"{exception}\n\nFullGraphStrategy: another rank stopped taking part in the halo "
        "exchange (it crashed, was killed, or ran a different number of layers/steps). "
        "Check the other ranks' logs; every rank must run the same model, and a loss that "
        "does not depend on the model output on some rank skips its backward exchanges.",
    ) + tuple(exception.args[1:])


def _error_text(exception: BaseException) -> str:
    return f"{type(exception).__name__}: {exception}"


def make_run_dir() -> str:
    """Creates the folder where the ranks of a run note the error that is reported (see
    :func:`claim_report`), after removing the folders of earlier runs whose launcher has
    exited.  (A failed run leaves its folder behind: its ranks may read it after the launcher
    has exited.)"""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            pid = entry.name[len(RUN_DIR_PREFIX) :].split("-", 1)[0]
            if not entry.name.startswith(RUN_DIR_PREFIX) or not pid.isdigit() or pid_alive(int(pid)):
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if (
                    entry.is_dir(follow_symlinks=False)
                    and info.st_uid == os.getuid()
                    and time.time() - info.st_mtime > 60
                ):
                    shutil.rmtree(entry.path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")


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


def reporter_pid() -> int | None:
    """The process that reported this run's error, if any."""
    path = _report_path()
    report = _read_report(path) if path is not None else None
    pid = report.get("pid") if report is not None else None
    return pid if isinstance(pid, int) else None


def reported_elsewhere() -> bool:
    """Whether a process of this run (other than this one) has reported an error."""
    pid = reporter_pid()
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
