"""The on-disk format of a partition folder: its names, fingerprints, manifest schema and checks.

:func:`read_manifest` checks a manifest against the schema of :data:`FORMAT_VERSION`;
:func:`check_manifest` also against what the caller expects (graph fingerprint, method,
balance, part count, seed) and the part files against their recorded sizes and checksums.

``balance`` (``"edges"`` or ``"nodes"``, see
:func:`~lightning_fullgraph.partition.partitioner.partition_graph`) is part of what
identifies a partition: a node-balanced partition is never reused for an edge-balanced
request, and a manifest written before ``balance`` existed (no ``balance`` key) is treated
as stale and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch_geometric.data import Data

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "PartitionCacheError",
    "check_manifest",
    "file_sha256",
    "graph_fingerprint",
    "graph_summary",
    "manifest_schema_problem",
    "partition_folder_name",
    "partition_identity",
    "read_manifest",
]

# 2: owned nodes and each owner's halo in locality order (partition/planner.py), not ascending
# global id; a version-1 folder is rebuilt, never read with the other layout.
# 3: the locality order numbers owned nodes by recursive-bisection blocks, not reverse
# Cuthill-McKee; a version-2 folder holds the same rows in another order and is rebuilt.
# 4: every part file records the format version and the identity of its partition (graph
# fingerprint, method, balance, parts, seed), checked against the manifest when a rank loads it;
# a version-3 folder (part files without it) is rebuilt, and refused where given as data.
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
_PART_FILE = re.compile(r"^part-\d{5,}\.pt$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PartitionCacheError(RuntimeError):
    """A partition folder cannot be used; the message says why and how to fix it."""


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


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file's bytes, read in 4 MiB chunks."""
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


def partition_identity(meta: dict[str, Any]) -> dict[str, Any]:
    """The keys of a manifest (or of its metadata) that identify a partition: graph fingerprint,
    method, balance, part count, seed and, where set, ``metis_max_edges``."""
    keys = ("fingerprint", "method", "balance", "num_parts", "seed", "metis_max_edges")
    return {k: meta[k] for k in keys if k in meta}


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
                    if file_sha256(path) != entry["sha256"]:
                        return f"part file {path} fails its checksum"
                except OSError as err:
                    return f"cannot read part file {path}: {err}"
        if len(manifest["parts"]) != manifest["num_parts"]:
            return f"manifest in {folder} lists {len(manifest['parts'])} parts for num_parts={manifest['num_parts']}"
    return None
