"""Graph partitioning, the per-rank partition plan and the on-disk partition cache."""

from lightning_fullgraph.partition.cache import (
    PartitionCacheError,
    PartitionCacheWriteError,
    PartitionResult,
    ensure_partitions,
    graph_fingerprint,
    load_part,
)
from lightning_fullgraph.partition.partitioner import (
    BALANCE_MODES,
    PARTITION_METHODS,
    partition_graph,
    partition_stats,
)
from lightning_fullgraph.partition.plan import HaloPlan, LocalPartition, build_local_partitions

__all__ = [
    "BALANCE_MODES",
    "PARTITION_METHODS",
    "HaloPlan",
    "LocalPartition",
    "PartitionCacheError",
    "PartitionCacheWriteError",
    "PartitionResult",
    "build_local_partitions",
    "ensure_partitions",
    "graph_fingerprint",
    "load_part",
    "partition_graph",
    "partition_stats",
]
