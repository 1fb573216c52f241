"""The cache's entry points: a valid partition folder on demand, and one rank's part from it.

Several processes or jobs may call :func:`ensure_partitions` for the same cache at once: each
waits for the advisory lock (:mod:`.writers`), re-checks the cache, and builds and publishes
the partition (:mod:`.store`) only if it is still missing, so all of them end up with the
same, complete folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch_geometric.data import Data

from lightning_fullgraph._os import max_rss_mib
from lightning_fullgraph.comm.plan import LocalPartition
from lightning_fullgraph.partition.cache.manifest import (
    FORMAT_VERSION,
    PartitionCacheError,
    check_manifest,
    file_sha256,
    graph_fingerprint,
    graph_summary,
    partition_folder_name,
    partition_identity,
    read_manifest,
)
from lightning_fullgraph.partition.cache.roots import default_cache_root
from lightning_fullgraph.partition.cache.store import explain_write_errors, write_and_publish
from lightning_fullgraph.partition.cache.writers import (
    advisory_lock,
    clean_stale_temporaries,
    lock_timeout_seconds,
)
from lightning_fullgraph.partition.planner import PartitionPlanner

__all__ = ["PartitionResult", "ensure_partitions", "load_part"]

log = logging.getLogger(__name__)


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
    if verify_checksum and file_sha256(path) != entry["sha256"]:
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
    expected = partition_identity(manifest)
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
            :func:`~lightning_fullgraph.data.datasets.products_like.generated_fingerprint`).
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
    timeout = lock_timeout_seconds(lock_timeout)
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
        with explain_write_errors([cache_root], cache_root, None, []):
            cache_root.mkdir(parents=True, exist_ok=True)
            stack.enter_context(advisory_lock(folder, timeout))
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

        _, adopted = write_and_publish(folder, parts_iter(), meta, expected, needed=needed, on_part=wrote)
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
