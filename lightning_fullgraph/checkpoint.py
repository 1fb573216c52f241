"""The compression policies' state in a Lightning checkpoint: what is written, and when it is restored.

Every rank's :meth:`~lightning_fullgraph.comm.policies.base.CompressionPolicy.state_dict`
(stale halo buffers, per-row bit-widths, rounding streams, smoothing averages) is gathered
into the checkpoint under :data:`CHECKPOINT_KEY`, with the world size and the identity of the
partitions it belongs to.  On resume it is restored only for the same world size and the same
partitions: the per-rank state belongs to rows this rank may no longer own otherwise.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["CHECKPOINT_KEY", "PARTITION_KEYS", "gather_policy_states", "reset_reason"]

#: Key of the policies' state in a Lightning checkpoint.
CHECKPOINT_KEY = "fullgraph_policy"
#: The manifest entries that identify a graph's partitions (a checkpoint's policy state is
#: restored only into the same ones).  ``format_version`` too: the on-disk layout decides the
#: order of a rank's owned and halo rows, which Sylvie's stale buffers are laid out in.
PARTITION_KEYS = ("fingerprint", "method", "balance", "num_parts", "seed", "format_version")


def gather_policy_states(
    state: dict[str, Any], rank: int, world_size: int, partition_id: dict[str, Any]
) -> dict[str, Any]:
    """The checkpoint entry: every rank's policy ``state`` (one all-gather when distributed;
    every rank calls it), the world size and ``partition_id`` (the :data:`PARTITION_KEYS`
    of this run's manifest)."""
    state = dict(state, rank=rank)
    if world_size > 1 and dist.is_initialized():
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, state)
    else:
        gathered = [state]
    return {"world_size": world_size, "partition": dict(partition_id), "ranks": gathered}


def reset_reason(entry: dict[str, Any], world_size: int, partition_id: dict[str, Any]) -> str | None:
    """Why a checkpoint entry's policy state must not be restored into this run (another world
    size, other partitions), or ``None`` when it may."""
    saved_world = entry.get("world_size")
    saved_partition = entry.get("partition")
    if saved_world != world_size:
        return f"it was written by {saved_world} ranks and this run has {world_size}"
    if saved_partition is not None and saved_partition != partition_id:
        changed = sorted(k for k in PARTITION_KEYS if saved_partition.get(k) != partition_id.get(k))
        return f"its graph partitions differ from this run's ({', '.join(changed)})"
    return None
