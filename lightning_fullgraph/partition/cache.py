"""On-disk partition cache: one manifest plus one file per part.

Layout of a partition folder::

    <cache_root>/<method>-<balance>-p<num_parts>-s<seed>-<fingerprint[:16]>/
        manifest.json       format version, graph fingerprint, method, balance, part count,
                            seed, per-part node/edge counts and their imbalance (max/mean),
                            and per part: file name, byte size, sha256, node/halo/edge counts
        part-00000.pt       LocalPartition.state() of rank 0 (torch.save, tensors and plain
                            values) plus its record: the format version and the identity of
                            the partition it belongs to (graph fingerprint, method, balance,
                            part count, seed)
        part-00001.pt       ...

A rank reads the manifest and ONLY its own part file, so per-rank memory shrinks as ranks
are added.  Every load re-checks the manifest against its schema and against what the caller
expects (graph fingerprint, method, part count, seed, format version), the part file against
its recorded size and checksum, and the part file's record against the manifest, so a stale,
truncated or foreign cache (also a part file copied from another graph's folder together with
its manifest entry) is rebuilt or refused with the reason, never used silently.

``balance`` (``"edges"`` or ``"nodes"``, see
:func:`~lightning_fullgraph.partition.partitioner.partition_graph`) is part of what
identifies a partition: a node-balanced partition is never reused for an edge-balanced
request, and a manifest written before ``balance`` existed (no ``balance`` key) is treated
as stale and rebuilt.

Several jobs may partition the same graph into the same cache at once (a shared cluster file
system makes this normal):

* a partition is written into a private temporary sibling folder
  (``.<folder>.tmp-<host>-<pid>-<random>``) and published with one atomic ``rename``; a
  folder under its final name is therefore always complete;
* a process that loses the race (the final folder appeared meanwhile) checks the winner's
  folder (manifest, sizes and checksums), deletes its own copy and uses the winner's; a
  valid published folder is never deleted or overwritten;
* an advisory ``flock`` on ``<cache_root>/.<folder>.lock`` normally lets one job build while
  the others wait (``lock_timeout``, ``$LIGHTNING_FULLGRAPH_CACHE_LOCK_TIMEOUT``), but
  correctness does not depend on it (NFS may ignore it);
* temporary folders of writers that died (pid gone on this host) or that nobody touched for
  :data:`STALE_TEMP_SECONDS` are removed by the next writer.

Write failures (no space, quota, permission, read-only file system, also as torch's
``iostream error``) raise :class:`PartitionCacheWriteError` naming the path, the bytes needed
and free, and what to do; the partial temporary folder is removed first.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch_geometric.data import Data

from lightning_fullgraph._os import max_rss_mib, pid_alive, pid_namespace, proc_start, try_flock
from lightning_fullgraph.comm.plan import LocalPartition
from lightning_fullgraph.partition.planner import PartitionPlanner

__all__ = [
    "FORMAT_VERSION",
    "PartitionCacheError",
    "PartitionCacheWriteError",
    "PartitionResult",
    "default_cache_root",
    "user_cache_dir",
    "ensure_partitions",
    "graph_fingerprint",
    "load_part",
    "read_manifest",
    "check_manifest",
]

log = logging.getLogger(__name__)

# 2: owned nodes and each owner's halo in locality order (partition/planner.py), not ascending
# global id; a version-1 folder is rebuilt, never read with the other layout.
# 3: the locality order numbers owned nodes by recursive-bisection blocks, not reverse
# Cuthill-McKee; a version-2 folder holds the same rows in another order and is rebuilt.
# 4: every part file records the format version and the identity of its partition (graph
# fingerprint, method, balance, parts, seed), checked against the manifest when a rank loads it;
# a version-3 folder (part files without it) is rebuilt, and refused where given as data.
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
LOCK_TIMEOUT_ENV = "LIGHTNING_FULLGRAPH_CACHE_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 2 * 3600.0
"""Seconds a job waits for another job building the same partition (env overrides)."""
STALE_TEMP_SECONDS = 6 * 3600.0
"""A temporary folder untouched this long is abandoned (its writer died on another host)."""

_OWNER = ".owner.json"
_PRIVATE = re.compile(r"^\.(?P<folder>.+)\.(?P<kind>tmp|trash)-")
# temporary folders written by earlier versions: tempfile.mkdtemp(prefix=".<folder>.")
_LEGACY_TMP = re.compile(r"^\.[A-Za-z0-9_]+-[a-z]+-p\d+-s-?\d+-[0-9a-f]{16}\.[A-Za-z0-9_]{8}$")
_PART_FILE = re.compile(r"^part-\d{5,}\.pt$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CACHE_ADVICE = (
    "point the cache at another file system with FullGraphDataModule(cache_dir=...), "
    "`lightning-fullgraph partition --cache-dir ...` or the LIGHTNING_FULLGRAPH_CACHE environment variable"
)


class PartitionCacheError(RuntimeError):
    """A partition folder cannot be used; the message says why and how to fix it."""


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


@dataclass
class PartitionResult:
    """Where the partitions are and whether this call computed them.

    Attributes:
        folder: The partition folder (holds ``manifest.json``).
        rebuilt: True if partitions were computed by this call, False if loaded from cache.
        reason: Why they were (re)built, or ``"cache hit"``.
        seconds: Wall time of partitioning + writing (0 on a cache hit).
        timings: Wall seconds per phase of this call: ``check`` (fingerprint and cache
            lookup), and on a rebuild ``load`` (building a lazily given graph), ``metis``
            (the partitioner), ``plan`` (halo plans and local graphs) and ``write`` (part
            files, checksums, manifest: the time spent waiting for them beyond building the
            next part, which a part's writing overlaps).
        peak_rss_mib: The process's resident-set high-water mark (:func:`max_rss_mib`, MiB)
            at the end of each phase of ``timings``: the phase where it jumps set the peak.
        forked_peak_mib: Where the planner numbered parts in forked children
            (:class:`~lightning_fullgraph.partition.planner.PartitionPlanner`'s
            ``order_workers``), an upper bound on this process and those children together
            (MiB): this process's high-water mark after the planner plus the private peaks of
            as many of the largest children as ran at once; 0 where none was forked.
    """

    folder: Path
    rebuilt: bool
    reason: str
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_mib: dict[str, float] = field(default_factory=dict)
    forked_peak_mib: float = 0.0


def user_cache_dir() -> Path:
    """This package's folder in the user's cache: ``$XDG_CACHE_HOME/lightning-fullgraph``,
    else ``~/.cache/lightning-fullgraph`` (``<tmp>/lightning-fullgraph-<uid>`` where no home
    folder is known).

    The hyphen matters: a folder named like the package (``lightning_fullgraph``) in the
    folder Python starts from, or beside a script, is imported as an empty namespace package
    instead of this one (the former default ``<tmp>/lightning_fullgraph/partitions`` broke
    ``from lightning_fullgraph import ...`` for Python started from the temporary folder)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # (the XDG specification ignores a relative path)
        return Path(xdg) / "lightning-fullgraph"
    try:
        return Path.home() / ".cache" / "lightning-fullgraph"
    except (RuntimeError, KeyError):  # no $HOME and no password-database entry
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        return Path(tempfile.gettempdir()) / f"lightning-fullgraph-{uid}"


def legacy_cache_root() -> Path:
    """Where earlier versions kept partitions by default: ``<tmp>/lightning_fullgraph/partitions``
    (never used now: it shadows the package, and its partitions are of an older format)."""
    return Path(tempfile.gettempdir()) / "lightning_fullgraph" / "partitions"


_WARNED: set[Path] = set()


def _name_legacy_cache(new: Path) -> None:
    """One warning per process if an earlier version's default partition cache exists."""
    old = legacy_cache_root()
    if old in _WARNED or not old.is_dir():
        return
    _WARNED.add(old)
    log.warning(
        "the partition cache of an earlier version, %s, is not used any more (partitions are now "
        "cached in %s and rebuilt there when needed); as long as %s exists, Python started from %s "
        "cannot `import lightning_fullgraph`. Remove it: rm -rf %s && rmdir %s",
        old,
        new,
        old.parent,
        old.parent.parent,
        old,
        old.parent,
    )


def default_cache_root() -> Path:
    """``$LIGHTNING_FULLGRAPH_CACHE``, else ``partitions`` in :func:`user_cache_dir`
    (``$XDG_CACHE_HOME/lightning-fullgraph/partitions`` or
    ``~/.cache/lightning-fullgraph/partitions``), created if missing; where that cannot be
    created or written (a read-only home), ``<tmp>/lightning-fullgraph-<uid>/partitions``, with
    one warning line naming both.

    Where an earlier version's default (:func:`legacy_cache_root`) exists, one warning line
    per process says how to remove it (its partitions are not used)."""
    env = os.environ.get("LIGHTNING_FULLGRAPH_CACHE")
    if env:
        return Path(env)
    root = user_cache_dir() / "partitions"
    problem = _not_writable(root)
    if problem is not None:
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        fallback = Path(tempfile.gettempdir()) / f"lightning-fullgraph-{uid}" / "partitions"
        if root not in _WARNED:
            _WARNED.add(root)
            log.warning(
                "cannot use the default partition cache %s (%s); caching partitions in %s instead "
                "(choose a folder with LIGHTNING_FULLGRAPH_CACHE or cache_dir=)",
                root,
                problem,
                fallback,
            )
        root = fallback
    _name_legacy_cache(root)
    return root


def _not_writable(folder: Path) -> str | None:
    """Why ``folder`` cannot be created or written by this user, or ``None``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "not writable for this user"
    return None


def _hash_tensor(h: Any, name: str, t: Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
    if t.numel():
        # the tensor's own bytes through the buffer protocol, in chunks: no copy of a large
        # tensor (the former .tobytes() duplicated edge_index); same digest as hashing it whole
        flat = (t.view(-1).view(torch.uint8) if t.dtype != torch.bool else t.view(-1)).numpy()
        step = 1 << 26
        for lo in range(0, flat.size, step):
            h.update(flat[lo : lo + step])


def graph_fingerprint(data: Data) -> str:
    """sha256 over the node count and every tensor attribute of ``data`` (names, dtypes,
    shapes, bytes).  Any change to the graph, its features, labels or masks changes it."""
    h = hashlib.sha256()
    h.update(f"num_nodes={int(data.num_nodes)};".encode())
    for key in sorted(data.keys()):
        value = data[key]
        if isinstance(value, Tensor):
            _hash_tensor(h, key, value)
    return h.hexdigest()


def graph_summary(data: Data) -> dict[str, Any]:
    """Sizes a model needs without loading the graph: ``num_features`` and ``num_classes``
    (``None`` where the graph has no ``x`` / integer ``y``)."""
    x, y = data.get("x"), data.get("y")
    num_features = int(x.size(-1)) if isinstance(x, Tensor) and x.dim() == 2 else None
    num_classes = None
    if isinstance(y, Tensor) and not y.is_floating_point() and y.numel():
        num_classes = int(y.max()) + 1 if y.dim() == 1 else int(y.size(-1))
    return {"num_features": num_features, "num_classes": num_classes}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def partition_folder_name(
    fingerprint: str, method: str, num_parts: int, seed: int, balance: str = "edges", metis_max_edges: int | None = None
) -> str:
    """Folder of a partition under the cache root, e.g. ``metis-edges-p4-s0-0123456789abcdef``
    (``...-s0-m20000000-...`` when METIS saw at most that many edges)."""
    bound = f"-m{metis_max_edges}" if metis_max_edges is not None else ""
    return f"{method}-{balance}-p{num_parts}-s{seed}{bound}-{fingerprint[:16]}"


# -- manifest schema ------------------------------------------------------------------------
_INT = (int,)
_NUM = (int, float)
_REQUIRED = {"format_version": _INT, "fingerprint": (str,), "method": (str,), "num_parts": _INT,
             "seed": _INT, "parts": (list,)}
_OPTIONAL = {"balance": (str,), "metis_max_edges": _INT, "num_nodes": _INT, "num_edges": _INT, "total_halo": _INT,
             "nodes_per_part": (list,), "edges_per_part": (list,), "node_imbalance": _NUM,
             "edge_imbalance": _NUM, "num_features": (int, type(None)), "num_classes": (int, type(None)),
             "created": _NUM}
_PART_REQUIRED = {"file": (str,), "bytes": _INT, "sha256": (str,), "num_owned": _INT, "num_halo": _INT,
                  "num_edges": _INT}


def _type_problem(where: str, value: Any, types: tuple[type, ...]) -> str | None:
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        return f"{where} is {json.dumps(value)[:40]} ({type(value).__name__}), expected {names}"
    return None


def manifest_schema_problem(manifest: Any) -> str | None:
    """``None`` if ``manifest`` (parsed JSON) has the keys and types this package reads, else
    what is wrong (e.g. ``"parts[0] has no 'bytes'"``).  Unknown extra keys are allowed."""
    if not isinstance(manifest, dict):
        return f"the top level is a JSON {type(manifest).__name__}, expected an object"
    for key, types in _REQUIRED.items():
        if key not in manifest:
            return f"no {key!r} key"
        if (problem := _type_problem(repr(key), manifest[key], types)) is not None:
            return problem
    for key, types in _OPTIONAL.items():
        if key in manifest and (problem := _type_problem(repr(key), manifest[key], types)) is not None:
            return problem
    for i, entry in enumerate(manifest["parts"]):
        if not isinstance(entry, dict):
            return f"parts[{i}] is a {type(entry).__name__}, expected an object"
        for key, types in _PART_REQUIRED.items():
            if key not in entry:
                return f"parts[{i}] has no {key!r}"
            if (problem := _type_problem(f"parts[{i}][{key!r}]", entry[key], types)) is not None:
                return problem
        if not _PART_FILE.match(entry["file"]):
            return f"parts[{i}]['file'] is {entry['file']!r}, expected a name like 'part-00000.pt'"
        if not _SHA256.match(entry["sha256"]):
            return f"parts[{i}]['sha256'] is not 64 lowercase hex digits"
        if min(entry[k] for k in ("bytes", "num_owned", "num_halo", "num_edges")) < 0:
            return f"parts[{i}] has a negative size or count"
    return None


def _schema_error(path: Path, what: str) -> PartitionCacheError:
    return PartitionCacheError(
        f"partition manifest at {path} does not match the expected schema ({what}); delete the folder "
        f"{path.parent} or rebuild it from the graph (FullGraphDataModule(<graph>, ...) or "
        f"`lightning-fullgraph partition <graph>` rebuild a cached partition automatically)"
    )


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """Reads ``manifest.json`` of a partition folder and checks it against the schema of this
    package's format version (a manifest of another format version is returned unchecked:
    :func:`check_manifest` reports the version).

    Raises:
        PartitionCacheError: if it is missing, unreadable, not valid JSON or does not match
            the schema.
    """
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise PartitionCacheError(f"no partition manifest at {path}") from err
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise PartitionCacheError(f"partition manifest {path} is not valid JSON ({err})") from err
    except OSError as err:
        raise PartitionCacheError(f"cannot read the partition manifest {path}: {err}") from err
    if not isinstance(manifest, dict):
        raise _schema_error(path, f"the top level is a JSON {type(manifest).__name__}, expected an object")
    if manifest.get("format_version") == FORMAT_VERSION:
        what = manifest_schema_problem(manifest)
        if what is not None:
            raise _schema_error(path, what)
    return manifest


def check_manifest(
    folder: str | os.PathLike, expected: dict[str, Any], verify_files: bool = True, verify_checksums: bool = False
) -> str | None:
    """Returns ``None`` if the folder holds usable partitions matching ``expected``, else the
    reason it does not (a sentence for the user).

    Args:
        folder: Partition folder.
        expected: Keys of the manifest that must match, e.g. ``fingerprint``, ``method``,
            ``balance``, ``num_parts``, ``seed``.  ``format_version`` and the manifest schema
            are always checked; a key missing from the manifest (e.g. ``balance`` in one
            written by an older version) does not match.
        verify_files: Also check that every part file exists with its recorded byte size.
        verify_checksums: Also check every part file's sha256 (reads them all).
    """
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except PartitionCacheError as err:
        return str(err)
    if manifest.get("format_version") != FORMAT_VERSION:
        return (
            f"format version {manifest.get('format_version')} in {folder} differs from this "
            f"package's {FORMAT_VERSION}"
        )
    for key, value in expected.items():
        if manifest.get(key) != value:
            return f"{key} is {manifest.get(key)!r} in {folder}, expected {value!r}"
    if verify_files or verify_checksums:
        for entry in manifest["parts"]:
            path = folder / entry["file"]
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                return f"part file {path} is missing"
            except OSError as err:
                return f"cannot read part file {path}: {err}"
            if size != entry["bytes"]:
                return f"part file {path} has {size} bytes, the manifest says {entry['bytes']} (truncated?)"
            if verify_checksums:
                try:
                    if _file_sha256(path) != entry["sha256"]:
                        return f"part file {path} fails its checksum"
                except OSError as err:
                    return f"cannot read part file {path}: {err}"
        if len(manifest["parts"]) != manifest["num_parts"]:
            return f"manifest in {folder} lists {len(manifest['parts'])} parts for num_parts={manifest['num_parts']}"
    return None


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
def _writing(path_ref: list[Path], root: Path, needed: int | None, cleanup: list[Path]) -> Iterator[None]:
    """Turns a write failure inside the block into a :class:`PartitionCacheWriteError` naming
    ``path_ref[0]`` (the file being written); removes the folders in ``cleanup`` on any error."""
    try:
        yield
    except BaseException as exc:
        for folder in cleanup:
            _remove(folder)
        err = _write_error(exc, path_ref[0], root, needed) if isinstance(exc, Exception) else None
        if err is None:
            raise
        raise err from exc


def _remove(path: Path) -> None:
    """Deletes a folder, file or link; already gone is fine."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError as err:
        log.warning("could not remove %s: %s", path, err)


# -- writer identity, stale temporary folders -----------------------------------------------------
def _owner() -> dict[str, Any]:
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
                    owner = json.loads((entry / _OWNER).read_text())
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
            _remove(entry)
            removed.append(entry)
    return removed


def _private_sibling(folder: Path, kind: str) -> Path:
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40]
    return folder.parent / f".{folder.name}.{kind}-{host}-{os.getpid()}-{secrets.token_hex(4)}"


# -- advisory lock ------------------------------------------------------------------------------
def _lock_timeout(timeout: float | None) -> float:
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
def _advisory_lock(folder: Path, timeout: float) -> Iterator[bool]:
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
                os.pwrite(fd, json.dumps(_owner()).encode(), 0)
        else:
            log.debug("no advisory lock on %s (unsupported by the file system)", path)
        yield bool(state)
    finally:
        os.close(fd)  # releases the flock


# -- writing and publishing ---------------------------------------------------------------------
def _save_part(state: dict[str, Any], path: Path) -> None:
    # through a Python file object: a failed write then carries its OSError (ENOSPC, ...)
    with open(path, "wb") as f:
        torch.save(state, f)


def _identity(meta: dict[str, Any]) -> dict[str, Any]:
    keys = ("fingerprint", "method", "balance", "num_parts", "seed", "metis_max_edges")
    return {k: meta[k] for k in keys if k in meta}


def _write_part(
    part: LocalPartition, tmp: Path, path_ref: list[Path], identity: dict[str, Any]
) -> dict[str, Any]:
    """Saves one part under ``tmp``, with its record (format version, ``identity`` of the
    partition: :func:`_identity` of the manifest), and returns its manifest entry."""
    name = f"part-{part.plan.rank:05d}.pt"
    path_ref[0] = tmp / name
    _save_part({**part.state(), "format_version": FORMAT_VERSION, "partition": dict(identity)}, tmp / name)
    return {
        "file": name,
        "bytes": (tmp / name).stat().st_size,
        "sha256": _file_sha256(tmp / name),
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
    tmp = _private_sibling(folder, "tmp")
    path_ref[0] = tmp
    os.mkdir(tmp)
    try:
        (tmp / _OWNER).write_text(json.dumps(_owner()))
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
                pending = writer.submit(_write_part, part, tmp, path_ref, _identity(meta))
                del part
            if pending is not None:
                wait(pending)
        manifest = {"format_version": FORMAT_VERSION, **meta, "parts": entries, "created": time.time()}
        path_ref[0] = tmp / MANIFEST
        with open(tmp / MANIFEST, "w") as f:
            f.write(json.dumps(manifest, indent=1))
        (tmp / _OWNER).unlink()
    except BaseException:
        _remove(tmp)
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
            _remove(tmp)
            return True
        log.info("replacing %s (%s)", folder, reason)
        trash = _private_sibling(folder, "trash")
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            continue
        _remove(trash)
    raise PartitionCacheError(
        f"could not publish {folder}: other processes kept replacing it with partitions that do not "
        f"match this one; make sure all jobs sharing the cache run the same version of this package, "
        f"or give them separate caches (cache_dir= / LIGHTNING_FULLGRAPH_CACHE)"
    )


def _write_and_publish(
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
    with _writing(path_ref, folder.parent, needed, cleanup):
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
    return _write_and_publish(folder, partitions, meta, _identity(meta))[0]


def load_part(folder: str | os.PathLike, rank: int, verify_checksum: bool = True) -> LocalPartition:
    """Loads the part of ``rank`` (and nothing else) from a partition folder.

    Raises:
        PartitionCacheError: if the manifest or the file is missing, truncated, corrupted, of
            another format version or does not match the manifest schema, or if the file's
            record names another graph or partition than the manifest (a part file copied
            from another folder), naming the file and what to do.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise PartitionCacheError(
            f"{folder} has format version {manifest.get('format_version')}, this package reads "
            f"{FORMAT_VERSION}; delete {folder} and rebuild it from the graph"
        )
    parts = manifest["parts"]
    if not 0 <= rank < len(parts):
        raise PartitionCacheError(
            f"rank {rank} has no part in {folder} ({len(parts)} parts); partition the graph "
            f"into as many parts as there are ranks"
        )
    entry = parts[rank]
    path = folder / entry["file"]
    if not path.exists():
        raise PartitionCacheError(f"part file {path} is missing; delete {folder} to rebuild it")
    if path.stat().st_size != entry["bytes"]:
        raise PartitionCacheError(
            f"part file {path} has {path.stat().st_size} bytes but the manifest says {entry['bytes']}: "
            f"the cache is truncated or was overwritten; delete {folder} to rebuild it"
        )
    if verify_checksum and _file_sha256(path) != entry["sha256"]:
        raise PartitionCacheError(f"part file {path} fails its checksum; delete {folder} to rebuild it")
    # mmap: the tensors are backed by the file's pages (copy-on-write), not copied into
    # anonymous memory, so ranks sharing a machine share the page cache
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    _check_part_record(state, path, manifest)
    part = LocalPartition.from_state(state)
    if part.plan.rank != rank:
        raise PartitionCacheError(f"{path} holds the part of rank {part.plan.rank}, not {rank}")
    return part


def _check_part_record(state: Any, path: Path, manifest: dict[str, Any]) -> None:
    """Refuses a part file whose record (format version, graph fingerprint, method, balance,
    parts, seed) differs from the manifest of its folder: a part of another graph or another
    partition, which a size and checksum copied along with it cannot reveal."""
    folder = path.parent
    rebuild = (
        f"delete {folder} and rebuild it from the graph (FullGraphDataModule(<graph>, ...) and "
        f"`lightning-fullgraph partition <graph>` rebuild a missing partition automatically)"
    )
    record = state.get("partition") if isinstance(state, dict) else None
    if not isinstance(record, dict) or state.get("format_version") != FORMAT_VERSION:
        raise PartitionCacheError(
            f"part file {path} records no graph fingerprint of format version {FORMAT_VERSION} (it was "
            f"written by another version of this package, or copied in by hand), so it cannot be "
            f"checked against the manifest of {folder}; {rebuild}"
        )
    expected = _identity(manifest)
    differ = [k for k in dict.fromkeys((*expected, *record)) if record.get(k) != expected.get(k)]
    if not differ:
        return
    if "fingerprint" in differ:
        theirs, ours = str(record.get("fingerprint"))[:16], str(expected.get("fingerprint"))[:16]
        what = f"another graph (fingerprint {theirs}..., the manifest's is {ours}...)"
    else:
        what = (
            "another partition of this graph ("
            + ", ".join(f"{k} {record.get(k)!r}, the manifest's {expected.get(k)!r}" for k in differ)
            + ")"
        )
    raise PartitionCacheError(
        f"part file {path} belongs to {what}: it was copied from another partition folder, with or "
        f"without its manifest entry, and would train this rank on other data; {rebuild}"
    )


def _estimate_bytes(data: Data, planner: PartitionPlanner) -> int:
    """About what the part files of ``planner`` take on disk (for a failed write's message)."""
    per_row = 8 + 1  # n_id, marginal_mask
    for key in planner.node_keys:
        value = data[key]
        per_row += value.element_size() * (value[0].numel() if value.dim() > 1 and value.size(0) else 1)
    per_edge = 16
    for key in planner.edge_keys:
        value = data[key]
        per_edge += value.element_size() * (value[0].numel() if value.dim() > 1 and value.size(0) else 1)
    halo = sum(int(h.numel()) for h in planner.halos)
    return (
        int(planner.num_owned.sum()) * per_row + int(planner.num_edges_per_part.sum()) * per_edge + 16 * halo
        + planner.num_parts * (4096 + 8 * 512)
    )


def ensure_partitions(
    data: Data | Callable[[], Data],
    num_parts: int,
    method: str = "metis",
    seed: int = 0,
    cache_root: str | os.PathLike | None = None,
    fingerprint: str | None = None,
    balance: str = "edges",
    lock_timeout: float | None = None,
    metis_max_edges: int | None = None,
) -> PartitionResult:
    """Returns a partition folder for ``data``, computing and saving it only if no valid one
    exists under ``cache_root``.  Safe when several processes or jobs call it at once for the
    same cache (see the module docstring): all of them end up with the same, complete folder.

    Memory: the parts are built and written one at a time
    (:class:`~lightning_fullgraph.partition.planner.PartitionPlanner`), so beyond the graph and
    METIS' own needs only one part's local graph and ``O(E)`` bytes of bookkeeping are held.

    Args:
        data: The global graph, or a function returning it (called only when the partition
            must be computed, e.g. a generated graph; ``fingerprint`` is then required).
        num_parts: Number of parts (= ranks that will train on it).
        method: ``"metis"`` or ``"random"``.
        seed: Partitioner seed; partitions are deterministic for (graph, method, balance,
            parts, seed).
        cache_root: Folder holding partition folders; default :func:`default_cache_root`.
        fingerprint: Precomputed :func:`graph_fingerprint` of ``data`` (computed if None), or
            any string that identifies the graph (e.g.
            :func:`~lightning_fullgraph.generated.generated_fingerprint`).
        balance: ``"edges"`` (default: balance the in-edges each part aggregates) or
            ``"nodes"`` (balance node counts); part of the cache key (``"random"`` ignores
            it but the key still records what was asked for).
        lock_timeout: Seconds to wait while another process builds the same partition
            (default ``$LIGHTNING_FULLGRAPH_CACHE_LOCK_TIMEOUT`` or 2 hours).
        metis_max_edges: Bound METIS' memory by giving it a sample of at most this many
            undirected edges (see :func:`~lightning_fullgraph.partition.partitioner.partition_graph`);
            part of the cache key when set.

    Raises:
        PartitionCacheWriteError: the cache cannot be written (no space, quota, permission,
            read-only); the message names the path, the bytes needed and free.
        PartitionCacheError: the lock wait timed out.
        ValueError: ``data`` is a function but no ``fingerprint`` is given.
    """
    from lightning_fullgraph.partition.partitioner import check_balance, imbalance, partition_graph

    check_balance(balance)
    lazy = not isinstance(data, Data) and callable(data)  # (PyG Data objects are callable too)
    if lazy and fingerprint is None:
        raise ValueError("ensure_partitions(data=<function>) needs fingerprint=: it identifies the graph unbuilt")
    timeout = _lock_timeout(lock_timeout)
    cache_root = Path(cache_root) if cache_root is not None else default_cache_root()
    timings: dict[str, float] = {}
    peaks: dict[str, float] = {}
    clock = [time.perf_counter()]

    def phase(name: str) -> None:
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - clock[0]
        peaks[name] = max_rss_mib()
        clock[0] = now

    fingerprint = fingerprint or graph_fingerprint(data)  # type: ignore[arg-type]
    bound = metis_max_edges if method == "metis" else None
    folder = cache_root / partition_folder_name(fingerprint, method, num_parts, seed, balance, bound)
    expected = {
        "fingerprint": fingerprint,
        "method": method,
        "balance": balance,
        "num_parts": num_parts,
        "seed": seed,
        **({"metis_max_edges": bound} if bound is not None else {}),
    }
    reason = check_manifest(folder, expected)
    if reason is None:
        log.info("partition cache hit: %s", folder)
        phase("check")
        return PartitionResult(folder=folder, rebuilt=False, reason="cache hit", timings=timings, peak_rss_mib=peaks)
    with contextlib.ExitStack() as stack:
        with _writing([cache_root], cache_root, None, []):
            cache_root.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_advisory_lock(folder, timeout))
        if check_manifest(folder, expected) is None:
            log.info("partition cache hit after waiting for another process: %s", folder)
            phase("check")
            return PartitionResult(
                folder=folder, rebuilt=False, reason="cache hit (built by another process)", timings=timings,
                peak_rss_mib=peaks,
            )
        clean_stale_temporaries(cache_root)
        phase("check")
        start = time.perf_counter()
        if lazy:
            data = data()  # type: ignore[operator]
            phase("load")
        log.info(
            "partitioning %d nodes into %d parts with %s, balance=%s (%s)",
            data.num_nodes, num_parts, method, balance, reason,
        )
        parts = partition_graph(
            data.edge_index, int(data.num_nodes), num_parts, method=method, seed=seed, balance=balance,
            **({"metis_max_edges": bound} if bound is not None else {}),
        )
        phase("metis")
        planner = PartitionPlanner(data, parts, num_parts)
        del parts
        children = sorted(planner.order_child_peak_bytes)[-planner.order_workers :]
        forked_peak = max_rss_mib() + sum(children) / 2**20 if children else 0.0
        nodes_per_part = [int(c) for c in planner.num_owned.tolist()]
        edges_per_part = [int(c) for c in planner.num_edges_per_part.tolist()]
        meta = {
            "fingerprint": fingerprint,
            "method": method,
            "balance": balance,
            "num_parts": num_parts,
            "seed": seed,
            **({"metis_max_edges": bound} if bound is not None else {}),
            "num_nodes": int(data.num_nodes),
            "num_edges": int(data.edge_index.size(1)),
            "total_halo": int(sum(int(h.numel()) for h in planner.halos)),
            "nodes_per_part": nodes_per_part,
            "edges_per_part": edges_per_part,
            "node_imbalance": imbalance(nodes_per_part),
            "edge_imbalance": imbalance(edges_per_part),
            **graph_summary(data),
        }
        needed = _estimate_bytes(data, planner)
        phase("plan")
        write_s = [0.0]

        def parts_iter() -> Iterator[LocalPartition]:
            for r in range(num_parts):
                yield planner.part(r)

        def wrote(seconds: float) -> None:
            write_s[0] += seconds

        _, adopted = _write_and_publish(folder, parts_iter(), meta, expected, needed=needed, on_part=wrote)
        total = time.perf_counter() - clock[0]
        timings["write"] = write_s[0]
        timings["plan"] += total - write_s[0]  # building the local graphs, interleaved with writing
        peaks["write"] = peaks["plan"] = max_rss_mib()
        if adopted:
            reason = f"{reason}; another process published the same partitions first, which are used"
        return PartitionResult(
            folder=folder, rebuilt=True, reason=reason, seconds=time.perf_counter() - start, timings=timings,
            peak_rss_mib=peaks, forked_peak_mib=forked_peak,
        )
