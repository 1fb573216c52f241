"""The on-disk partition cache: one manifest plus one file per part, built once, checked on every load.

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

One job per module:

* :mod:`.manifest`: the format (:data:`FORMAT_VERSION`, folder names, graph fingerprints, the
  manifest schema) and the checks a reader runs;
* :mod:`.roots`: where the cache lives by default;
* :mod:`.writers`: several writers of one cache (writer records, the advisory lock, removing
  the temporary folders of writers that died);
* :mod:`.store`: writing a folder failure-safely (a private temporary folder, one atomic
  rename; write failures explained by :class:`PartitionCacheWriteError`);
* :mod:`.ensure`: :func:`ensure_partitions` (a valid folder, built only if missing) and
  :func:`load_part` (one rank's part).

Every public name of these modules that callers used before the cache became a package is
importable from here.
"""

from lightning_fullgraph.partition.cache.ensure import PartitionResult, ensure_partitions, load_part
from lightning_fullgraph.partition.cache.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    PartitionCacheError,
    check_manifest,
    graph_fingerprint,
    graph_summary,
    manifest_schema_problem,
    partition_folder_name,
    read_manifest,
)
from lightning_fullgraph.partition.cache.roots import default_cache_root, legacy_cache_root, user_cache_dir
from lightning_fullgraph.partition.cache.store import PartitionCacheWriteError, write_partitions
from lightning_fullgraph.partition.cache.writers import (
    DEFAULT_LOCK_TIMEOUT,
    LOCK_TIMEOUT_ENV,
    STALE_TEMP_SECONDS,
    clean_stale_temporaries,
)

__all__ = [
    # the names of the former module's __all__
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
    # its other public names
    "DEFAULT_LOCK_TIMEOUT",
    "LOCK_TIMEOUT_ENV",
    "MANIFEST",
    "STALE_TEMP_SECONDS",
    "clean_stale_temporaries",
    "graph_summary",
    "legacy_cache_root",
    "manifest_schema_problem",
    "partition_folder_name",
    "write_partitions",
]
