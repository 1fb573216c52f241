"""Offline partitioning: the node -> rank assignment, the planner and the on-disk cache.

``HaloPlan`` and ``LocalPartition`` (the runtime contract) are re-exported from
:mod:`lightning_fullgraph.comm.plan`.
"""

from lightning_fullgraph.comm.plan import HaloPlan, LocalPartition
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
from lightning_fullgraph.partition.planner import build_local_partitions

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
