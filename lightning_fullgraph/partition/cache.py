"""On-disk partition cache: one manifest plus one file per part.

Layout of a partition folder::

    <cache_root>/<method>-<balance>-p<num_parts>-s<seed>-<fingerprint[:16]>/
        manifest.json       format version, graph fingerprint, method, balance, part count,
                            seed, per-part node/edge counts and their imbalance (max/mean),
                            and per part: file name, byte size, sha256, node/halo/edge counts
        part-00000.pt       LocalPartition.state() of rank 0 (torch.save, tensors only)
        part-00001.pt       ...

A rank reads the manifest and ONLY its own part file, so per-rank memory shrinks as ranks
are added.  Every load re-checks the manifest against what the caller expects (graph
fingerprint, method, part count, seed, format version) and the part file against its
recorded size and checksum, so a stale or truncated cache is rebuilt or refused with the
reason, never used silently.

``balance`` (``"edges"`` or ``"nodes"``, see
:func:`~lightning_fullgraph.partition.partitioner.partition_graph`) is part of what
identifies a partition: a node-balanced partition is never reused for an edge-balanced
request, and a manifest written before ``balance`` existed (no ``balance`` key) is treated
as stale and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch_geometric.data import Data

from lightning_fullgraph.partition.plan import LocalPartition, build_local_partitions

__all__ = [
    "FORMAT_VERSION",
    "PartitionCacheError",
    "PartitionResult",
    "default_cache_root",
    "ensure_partitions",
    "graph_fingerprint",
    "load_part",
    "read_manifest",
    "check_manifest",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class PartitionCacheError(RuntimeError):
    """A partition folder cannot be used; the message says why and how to fix it."""


@dataclass
class PartitionResult:
    """Where the partitions are and whether this call computed them.

    Attributes:
        folder: The partition folder (holds ``manifest.json``).
        rebuilt: True if partitions were computed by this call, False if loaded from cache.
        reason: Why they were (re)built, or ``"cache hit"``.
        seconds: Wall time of partitioning + writing (0 on a cache hit).
    """

    folder: Path
    rebuilt: bool
    reason: str
    seconds: float = 0.0


def default_cache_root() -> Path:
    """``$LIGHTNING_FULLGRAPH_CACHE`` or ``<tmp>/lightning_fullgraph/partitions``."""
    env = os.environ.get("LIGHTNING_FULLGRAPH_CACHE")
    if env:
        return Path(env)
    return Path(tempfile.gettempdir()) / "lightning_fullgraph" / "partitions"


def _hash_tensor(h: Any, name: str, t: Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())


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


def partition_folder_name(fingerprint: str, method: str, num_parts: int, seed: int, balance: str = "edges") -> str:
    """Folder of a partition under the cache root, e.g. ``metis-edges-p4-s0-0123456789abcdef``."""
    return f"{method}-{balance}-p{num_parts}-s{seed}-{fingerprint[:16]}"


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """Reads ``manifest.json`` of a partition folder.

    Raises:
        PartitionCacheError: if it is missing or not valid JSON.
    """
    path = Path(folder) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise PartitionCacheError(f"no partition manifest at {path}") from err
    except json.JSONDecodeError as err:
        raise PartitionCacheError(f"partition manifest {path} is not valid JSON ({err})") from err


def check_manifest(folder: str | os.PathLike, expected: dict[str, Any], verify_files: bool = True) -> str | None:
    """Returns ``None`` if the folder holds usable partitions matching ``expected``, else the
    reason it does not (a sentence for the user).

    Args:
        folder: Partition folder.
        expected: Keys of the manifest that must match, e.g. ``fingerprint``, ``method``,
            ``balance``, ``num_parts``, ``seed``.  ``format_version`` is always checked; a
            key missing from the manifest (e.g. ``balance`` in one written by an older
            version) does not match.
        verify_files: Also check that every part file exists with its recorded byte size.
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
    if verify_files:
        for entry in manifest.get("parts", []):
            path = folder / entry["file"]
            if not path.exists():
                return f"part file {path} is missing"
            if path.stat().st_size != entry["bytes"]:
                return f"part file {path} has {path.stat().st_size} bytes, the manifest says {entry['bytes']} (truncated?)"
        if len(manifest.get("parts", [])) != manifest.get("num_parts"):
            return f"manifest in {folder} lists {len(manifest.get('parts', []))} parts for num_parts={manifest.get('num_parts')}"
    return None


def write_partitions(
    folder: str | os.PathLike, partitions: list[LocalPartition], meta: dict[str, Any]
) -> dict[str, Any]:
    """Writes part files and the manifest atomically (a temp folder renamed into place), so a
    crash mid-write never leaves a folder that looks complete."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        entries = []
        for part in partitions:
            name = f"part-{part.plan.rank:05d}.pt"
            torch.save(part.state(), tmp / name)
            entries.append(
                {
                    "file": name,
                    "bytes": (tmp / name).stat().st_size,
                    "sha256": _file_sha256(tmp / name),
                    "num_owned": part.plan.num_owned,
                    "num_halo": part.plan.num_halo,
                    "num_edges": int(part.data.edge_index.size(1)),
                }
            )
        manifest = {"format_version": FORMAT_VERSION, **meta, "parts": entries, "created": time.time()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def load_part(folder: str | os.PathLike, rank: int, verify_checksum: bool = True) -> LocalPartition:
    """Loads the part of ``rank`` (and nothing else) from a partition folder.

    Raises:
        PartitionCacheError: if the manifest or the file is missing, truncated or corrupted.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    parts = manifest.get("parts", [])
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
    state = torch.load(path, map_location="cpu", weights_only=True)
    part = LocalPartition.from_state(state)
    if part.plan.rank != rank:
        raise PartitionCacheError(f"{path} holds the part of rank {part.plan.rank}, not {rank}")
    return part


def ensure_partitions(
    data: Data,
    num_parts: int,
    method: str = "metis",
    seed: int = 0,
    cache_root: str | os.PathLike | None = None,
    fingerprint: str | None = None,
    balance: str = "edges",
) -> PartitionResult:
    """Returns a partition folder for ``data``, computing and saving it only if no valid one
    exists under ``cache_root``.

    Args:
        data: The global graph.
        num_parts: Number of parts (= ranks that will train on it).
        method: ``"metis"`` or ``"random"``.
        seed: Partitioner seed; partitions are deterministic for (graph, method, balance,
            parts, seed).
        cache_root: Folder holding partition folders; default :func:`default_cache_root`.
        fingerprint: Precomputed :func:`graph_fingerprint` of ``data`` (computed if None).
        balance: ``"edges"`` (default: balance the in-edges each part aggregates) or
            ``"nodes"`` (balance node counts); part of the cache key (``"random"`` ignores
            it but the key still records what was asked for).
    """
    from lightning_fullgraph.partition.partitioner import check_balance, imbalance, partition_graph

    check_balance(balance)
    cache_root = Path(cache_root) if cache_root is not None else default_cache_root()
    fingerprint = fingerprint or graph_fingerprint(data)
    folder = cache_root / partition_folder_name(fingerprint, method, num_parts, seed, balance)
    expected = {
        "fingerprint": fingerprint,
        "method": method,
        "balance": balance,
        "num_parts": num_parts,
        "seed": seed,
    }
    reason = check_manifest(folder, expected)
    if reason is None:
        log.info("partition cache hit: %s", folder)
        return PartitionResult(folder=folder, rebuilt=False, reason="cache hit")
    log.info(
        "partitioning %d nodes into %d parts with %s, balance=%s (%s)",
        data.num_nodes, num_parts, method, balance, reason,
    )
    start = time.perf_counter()
    parts = partition_graph(
        data.edge_index, int(data.num_nodes), num_parts, method=method, seed=seed, balance=balance
    )
    partitions = build_local_partitions(data, parts, num_parts)
    nodes_per_part = [int(p.plan.num_owned) for p in partitions]
    edges_per_part = [int(p.data.edge_index.size(1)) for p in partitions]
    meta = {
        "fingerprint": fingerprint,
        "method": method,
        "balance": balance,
        "num_parts": num_parts,
        "seed": seed,
        "num_nodes": int(data.num_nodes),
        "num_edges": int(data.edge_index.size(1)),
        "total_halo": int(sum(p.plan.num_halo for p in partitions)),
        "nodes_per_part": nodes_per_part,
        "edges_per_part": edges_per_part,
        "node_imbalance": imbalance(nodes_per_part),
        "edge_imbalance": imbalance(edges_per_part),
        **graph_summary(data),
    }
    write_partitions(folder, partitions, meta)
    return PartitionResult(folder=folder, rebuilt=True, reason=reason, seconds=time.perf_counter() - start)
