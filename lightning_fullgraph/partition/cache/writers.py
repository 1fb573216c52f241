"""Several writers of one cache: writer records, the advisory lock, temporaries of dead writers.

Several jobs may partition the same graph into the same cache at once (a shared cluster file
system makes this normal):

* an advisory ``flock`` on ``<cache_root>/.<folder>.lock`` normally lets one job build while
  the others wait (``lock_timeout``, ``$LIGHTNING_FULLGRAPH_CACHE_LOCK_TIMEOUT``), but
  correctness does not depend on it (NFS may ignore it: :mod:`.store` publishes atomically);
* every writer works in a private temporary sibling folder
  (``.<folder>.tmp-<host>-<pid>-<random>``, :func:`private_sibling`) holding its record
  (:data:`OWNER_FILE`); temporary folders of writers that died (pid gone on this host) or that
  nobody touched for :data:`STALE_TEMP_SECONDS` are removed by the next writer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_fullgraph._os import pid_alive, pid_namespace, proc_start, try_flock
from lightning_fullgraph.partition.cache.manifest import PartitionCacheError

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "LOCK_TIMEOUT_ENV",
    "OWNER_FILE",
    "STALE_TEMP_SECONDS",
    "advisory_lock",
    "clean_stale_temporaries",
    "lock_timeout_seconds",
    "private_sibling",
    "remove_path",
    "writer_record",
]

log = logging.getLogger(__name__)

LOCK_TIMEOUT_ENV = "LIGHTNING_FULLGRAPH_CACHE_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 2 * 3600.0
"""Seconds a job waits for another job building the same partition (env overrides)."""
STALE_TEMP_SECONDS = 6 * 3600.0
"""A temporary folder untouched this long is abandoned (its writer died on another host)."""
#: The file in a temporary folder that holds its writer's record (:func:`writer_record`).
OWNER_FILE = ".owner.json"
_PRIVATE = re.compile(r"^\.(?P<folder>.+)\.(?P<kind>tmp|trash)-")
# temporary folders written by earlier versions: tempfile.mkdtemp(prefix=".<folder>.")
_LEGACY_TMP = re.compile(r"^\.[A-Za-z0-9_]+-[a-z]+-p\d+-s-?\d+-[0-9a-f]{16}\.[A-Za-z0-9_]{8}$")


def remove_path(path: Path) -> None:
    """Deletes a folder, file or link; already gone is fine."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError as err:
        log.warning("could not remove %s: %s", path, err)


# -- writer identity, stale temporary folders -----------------------------------------------------
def writer_record() -> dict[str, Any]:
    """This writer's record (host, pid, process start time, pid namespace, time), as kept in
    :data:`OWNER_FILE` of a temporary folder and in the lock file: tells whether it still runs."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": proc_start(os.getpid()),
            "pidns": pid_namespace(), "time": time.time()}


def _owner_is_dead(owner: dict[str, Any]) -> bool:
    """True only if the recorded writer certainly no longer runs (same host and pid namespace)."""
    if owner.get("host") != socket.gethostname() or owner.get("pidns") != pid_namespace():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    start = proc_start(pid)
    if start is None:  # no /proc
        return not pid_alive(pid)
    return start == "" or (owner.get("start") not in (None, "") and start != owner.get("start"))


def _last_touched(folder: Path) -> float:
    times = [folder.lstat().st_mtime]
    with contextlib.suppress(OSError):
        times += [child.lstat().st_mtime for child in folder.iterdir()]
    return max(times)


def clean_stale_temporaries(cache_root: str | os.PathLike, max_age: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Removes temporary and discarded folders under ``cache_root`` left by writers that died:
    those whose recorded writer process is gone (same host), those untouched for ``max_age``
    seconds, and every discarded (``.trash-``) folder.  Returns what it removed."""
    root = Path(cache_root)
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _PRIVATE.match(entry.name)
        kind = match.group("kind") if match else "legacy" if _LEGACY_TMP.match(entry.name) else None
        if kind is None:
            continue
        try:
            why = None
            if kind == "trash":
                why = "a discarded partition folder"
            else:
                owner = None
                with contextlib.suppress(OSError, ValueError):
                    owner = json.loads((entry / OWNER_FILE).read_text())
                if isinstance(owner, dict) and _owner_is_dead(owner):
                    why = f"its writer, pid {owner.get('pid')} on this host, is gone"
                elif time.time() - _last_touched(entry) > max_age:
                    why = f"untouched for more than {max_age / 3600:g} h"
        except FileNotFoundError:
            continue
        except OSError as err:
            log.debug("cannot inspect %s: %s", entry, err)
            continue
        if why is not None:
            log.warning("removing the stale temporary partition folder %s (%s)", entry, why)
            remove_path(entry)
            removed.append(entry)
    return removed


def private_sibling(folder: Path, kind: str) -> Path:
    """A new name beside ``folder`` that only this process uses: ``.<folder>.<kind>-<host>-<pid>-<random>``
    (``kind`` ``"tmp"`` for a folder being written, ``"trash"`` for one being deleted)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40]
    return folder.parent / f".{folder.name}.{kind}-{host}-{os.getpid()}-{secrets.token_hex(4)}"


# -- advisory lock ------------------------------------------------------------------------------
def lock_timeout_seconds(timeout: float | None) -> float:
    """Seconds to wait for the lock: ``timeout``, else ``$LIGHTNING_FULLGRAPH_CACHE_LOCK_TIMEOUT``, else
    :data:`DEFAULT_LOCK_TIMEOUT`."""
    if timeout is not None:
        return float(timeout)
    env = os.environ.get(LOCK_TIMEOUT_ENV)
    if env:
        try:
            return float(env)
        except ValueError:
            raise ValueError(f"{LOCK_TIMEOUT_ENV}={env!r} is not a number of seconds") from None
    return DEFAULT_LOCK_TIMEOUT


@contextlib.contextmanager
def advisory_lock(folder: Path, timeout: float) -> Iterator[bool]:
    """Holds ``<cache_root>/.<folder>.lock`` (``flock``) while building ``folder``; yields
    whether the lock is held (False where the file system does not support it).

    Raises:
        PartitionCacheError: after ``timeout`` seconds of waiting, naming the holder.
    """
    path = folder.parent / f".{folder.name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start = time.monotonic()
        delay = 0.02
        announced = False
        while True:
            state = try_flock(fd)
            if state is not False:
                break
            waited = time.monotonic() - start
            if waited >= timeout:
                holder = ""
                with contextlib.suppress(OSError, ValueError):
                    info = json.loads(path.read_text())
                    holder = f" by pid {info.get('pid')} on {info.get('host')} since {time.ctime(info.get('time'))}"
                raise PartitionCacheError(
                    f"waited {waited:.0f} s for the partition cache lock {path}, held{holder}: another job is "
                    f"probably partitioning the same graph into {folder}. Wait for it and retry, raise the "
                    f"limit with {LOCK_TIMEOUT_ENV}=<seconds> (or lock_timeout=), or use another cache "
                    f"(cache_dir= / LIGHTNING_FULLGRAPH_CACHE). If no such job runs any more, the holder "
                    f"is stuck: stop it or delete {path}."
                )
            if not announced:
                log.info("waiting for %s: another process is building %s", path, folder)
                announced = True
            time.sleep(min(delay, timeout - waited))
            delay = min(delay * 2, 1.0)
        if state:
            with contextlib.suppress(OSError):  # informational only (may fail on a full disk)
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(writer_record()).encode(), 0)
        else:
            log.debug("no advisory lock on %s (unsupported by the file system)", path)
        yield bool(state)
    finally:
        os.close(fd)  # releases the flock
