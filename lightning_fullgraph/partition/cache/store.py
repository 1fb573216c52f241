"""Failure-safe writing of a partition folder: a private temporary folder, published by one rename.

* a partition is written into a private temporary sibling folder
  (:func:`~lightning_fullgraph.partition.cache.writers.private_sibling`) and published with
  one atomic ``rename``; a folder under its final name is therefore always complete;
* a process that loses the race (the final folder appeared meanwhile) checks the winner's
  folder (manifest, sizes and checksums), deletes its own copy and uses the winner's; a
  valid published folder is never deleted or overwritten.

Write failures (no space, quota, permission, read-only file system, also as torch's
``iostream error``) raise :class:`PartitionCacheWriteError` naming the path, the bytes needed
and free, and what to do; the partial temporary folder is removed first.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_fullgraph.comm.plan import LocalPartition
from lightning_fullgraph.partition.cache.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    PartitionCacheError,
    check_manifest,
    file_sha256,
    partition_identity,
    read_manifest,
)
from lightning_fullgraph.partition.cache.writers import (
    OWNER_FILE,
    private_sibling,
    remove_path,
    writer_record,
)

__all__ = ["PartitionCacheWriteError", "explain_write_errors", "write_and_publish", "write_partitions"]

log = logging.getLogger(__name__)

_CACHE_ADVICE = (
    "point the cache at another file system with FullGraphDataModule(cache_dir=...), "
    "`lightning-fullgraph partition --cache-dir ...` or the LIGHTNING_FULLGRAPH_CACHE environment variable"
)


class PartitionCacheWriteError(PartitionCacheError, OSError):
    """Writing the partition cache failed (no space, quota, permission, read-only file system).

    Both a :class:`PartitionCacheError` and an :class:`OSError` (``errno`` is set).  The
    message names the path, the bytes needed and free, and what to do.

    Attributes:
        path: The file or folder whose write failed.
        needed: Estimated bytes the partition files need (``None`` if unknown).
        free: Free bytes on that file system after cleaning up (``None`` if unknown).
    """

    def __init__(
        self, message: str, err: int | None = None, path: str | os.PathLike | None = None,
        needed: int | None = None, free: int | None = None,
    ) -> None:
        super().__init__(message)
        self.errno = err
        self.path = None if path is None else Path(path)
        self.needed = needed
        self.free = free

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.errno, self.path, self.needed, self.free))


# -- failure-safe writing ---------------------------------------------------------------------
_WRITE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}
_TORCH_WRITE_FAILURES = ("iostream error", "PytorchStreamWriter failed", "file write failed", "unexpected pos")


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "an unknown number of bytes"
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _state_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of the tensor storages in ``obj`` (what ``torch.save`` writes, shared storages once)."""
    seen = set() if seen is None else seen
    if isinstance(obj, Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return int(storage.nbytes()) + 512  # + its zip record
    if isinstance(obj, dict):
        return sum(_state_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v, seen) for v in obj)
    return 0


def _write_failure(exc: BaseException) -> int | None:
    """The errno of a disk-full / quota / permission / read-only failure in ``exc`` or the
    exceptions it chains (torch wraps the OSError of a file object in a RuntimeError), else None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    torch_failure = False
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _WRITE_ERRNOS:
            return cur.errno
        if isinstance(cur, RuntimeError) and any(s in str(cur) for s in _TORCH_WRITE_FAILURES):
            torch_failure = True
        cur = cur.__cause__ or cur.__context__
    return errno.EIO if torch_failure else None


def _write_error(exc: BaseException, path: Path, root: Path, needed: int | None) -> PartitionCacheWriteError | None:
    """A :class:`PartitionCacheWriteError` for ``exc`` if it is a write failure, else None.
    Call after removing the partial folder: the free bytes are then what a retry would get."""
    code = _write_failure(exc)
    if code is None:
        return None
    if isinstance(exc, OSError) and exc.filename:
        path = Path(exc.filename)
    free = _free_bytes(root)
    if code == errno.EIO:  # torch's stream error without an errno: judge by the free space
        code = errno.ENOSPC if free is not None and needed is not None and free < needed + (1 << 20) else code
    what = _WRITE_ERRNOS.get(code, f"write error ({exc})")
    sizes = f"{_fmt_bytes(free)} are free there"
    if needed is not None:
        sizes = f"the partition files need about {_fmt_bytes(needed)} and {sizes}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        todo = f"free space (or quota) on that file system, or {_CACHE_ADVICE}"
    elif code == errno.EIO:
        todo = f"check the file system, or {_CACHE_ADVICE}"
    elif code == errno.EROFS:
        todo = f"remount it read-write, or {_CACHE_ADVICE}"
    else:
        todo = f"make {path.parent} writable for this user, or {_CACHE_ADVICE}"
    return PartitionCacheWriteError(
        f"cannot write the partition cache: {what} ({errno.errorcode.get(code, code)}) at {path}; {sizes}. "
        f"To fix it, {todo}.",
        code, path, needed, free,
    )


@contextlib.contextmanager
def explain_write_errors(path_ref: list[Path], root: Path, needed: int | None, cleanup: list[Path]) -> Iterator[None]:
    """Turns a write failure inside the block into a :class:`PartitionCacheWriteError` naming
    ``path_ref[0]`` (the file being written); removes the folders in ``cleanup`` on any error."""
    try:
        yield
    except BaseException as exc:
        for folder in cleanup:
            remove_path(folder)
        err = _write_error(exc, path_ref[0], root, needed) if isinstance(exc, Exception) else None
        if err is None:
            raise
        raise err from exc


# -- writing and publishing ---------------------------------------------------------------------
def _save_part(state: dict[str, Any], path: Path) -> None:
    # through a Python file object: a failed write then carries its OSError (ENOSPC, ...)
    with open(path, "wb") as f:
        torch.save(state, f)


def _write_part(
    part: LocalPartition, tmp: Path, path_ref: list[Path], identity: dict[str, Any]
) -> dict[str, Any]:
    """Saves one part under ``tmp``, with its record (format version, ``identity`` of the
    partition: :func:`partition_identity` of the manifest), and returns its manifest entry."""
    name = f"part-{part.plan.rank:05d}.pt"
    path_ref[0] = tmp / name
    _save_part({**part.state(), "format_version": FORMAT_VERSION, "partition": dict(identity)}, tmp / name)
    return {
        "file": name,
        "bytes": (tmp / name).stat().st_size,
        "sha256": file_sha256(tmp / name),
        "num_owned": part.plan.num_owned,
        "num_halo": part.plan.num_halo,
        "num_edges": int(part.data.edge_index.size(1)),
    }


def _write_temporary(
    folder: Path, partitions: Iterable[LocalPartition], meta: dict[str, Any], path_ref: list[Path],
    on_part: Callable[[float], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Writes parts and manifest into a new private sibling of ``folder``.  ``partitions``
    may be a generator: a part is written (saved and checksummed) in a background thread
    while the next one is taken from ``partitions``, so at most two parts are in memory at a
    time (one writing, one being built) and each is dropped once written.
    ``on_part(seconds)`` is told how long the caller waited for each part's file beyond
    building the next one."""
    tmp = private_sibling(folder, "tmp")
    path_ref[0] = tmp
    os.mkdir(tmp)
    try:
        (tmp / OWNER_FILE).write_text(json.dumps(writer_record()))
        entries = []

        def wait(pending: Future[dict[str, Any]]) -> None:
            t0 = time.perf_counter()
            entries.append(pending.result())  # a failed write raises here, in this thread
            if on_part is not None:
                on_part(time.perf_counter() - t0)

        # torch.save's writes and the checksum's reads release the GIL, so writing part r
        # overlaps building part r + 1; one write at a time keeps two parts in memory at most.
        with ThreadPoolExecutor(1, thread_name_prefix="partition-writer") as writer:
            pending: Future[dict[str, Any]] | None = None
            for part in partitions:
                if pending is not None:
                    wait(pending)
                pending = writer.submit(_write_part, part, tmp, path_ref, partition_identity(meta))
                del part
            if pending is not None:
                wait(pending)
        manifest = {"format_version": FORMAT_VERSION, **meta, "parts": entries, "created": time.time()}
        path_ref[0] = tmp / MANIFEST
        with open(tmp / MANIFEST, "w") as f:
            f.write(json.dumps(manifest, indent=1))
        (tmp / OWNER_FILE).unlink()
    except BaseException:
        remove_path(tmp)
        raise
    return tmp, manifest


def _publish(tmp: Path, folder: Path, expected: dict[str, Any], path_ref: list[Path]) -> bool:
    """Renames the complete ``tmp`` to ``folder``.  If ``folder`` exists and is valid (manifest,
    sizes, checksums), ``tmp`` is deleted and the existing one kept (returns True); an invalid
    ``folder`` is moved aside and deleted first (returns False)."""
    path_ref[0] = folder
    for _ in range(8):
        try:
            os.rename(tmp, folder)
            return False
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise
        reason = check_manifest(folder, expected, verify_checksums=True)
        if reason is None:
            log.info("another process published %s first; using it", folder)
            remove_path(tmp)
            return True
        log.info("replacing %s (%s)", folder, reason)
        trash = private_sibling(folder, "trash")
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            continue
        remove_path(trash)
    raise PartitionCacheError(
        f"could not publish {folder}: other processes kept replacing it with partitions that do not "
        f"match this one; make sure all jobs sharing the cache run the same version of this package, "
        f"or give them separate caches (cache_dir= / LIGHTNING_FULLGRAPH_CACHE)"
    )


def write_and_publish(
    folder: Path, partitions: Iterable[LocalPartition], meta: dict[str, Any], expected: dict[str, Any],
    needed: int | None = None, on_part: Callable[[float], None] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Writes ``partitions`` into a private temporary folder and publishes it as ``folder``.
    Returns the manifest in effect and whether an existing equal folder was adopted instead.
    ``needed`` (bytes, for the error message of a failed write) is computed from
    ``partitions`` when they are a list; pass an estimate with a generator."""
    if needed is None:
        partitions = list(partitions)
        needed = sum(_state_bytes(p.state()) + 4096 for p in partitions) + 4096
    path_ref = [folder.parent]
    cleanup: list[Path] = []
    with explain_write_errors(path_ref, folder.parent, needed, cleanup):
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp, manifest = _write_temporary(folder, partitions, meta, path_ref, on_part)
        cleanup.append(tmp)
        adopted = _publish(tmp, folder, expected, path_ref)
    if adopted:
        manifest = read_manifest(folder)
    return manifest, adopted


def write_partitions(
    folder: str | os.PathLike, partitions: list[LocalPartition], meta: dict[str, Any]
) -> dict[str, Any]:
    """Writes part files and the manifest into a private temporary folder renamed into place, so
    a crash mid-write never leaves a folder that looks complete and concurrent writers never
    see each other's partial output.  An existing valid folder for the same partition (same
    fingerprint, method, balance, parts and seed; intact files) is kept; an invalid one is
    replaced.  Returns the manifest of the folder.

    Raises:
        PartitionCacheWriteError: on no space, quota, permission or read-only errors.
    """
    folder = Path(folder)
    return write_and_publish(folder, partitions, meta, partition_identity(meta))[0]
