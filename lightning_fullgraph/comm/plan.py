"""The runtime contract between a partition and the halo exchange: HaloPlan and LocalPartition.

Which rows a rank owns, which it borrows, and who sends what.  A rank ``r`` gets a *local
graph* whose destination nodes are exactly the nodes it owns and whose source nodes are its
owned nodes followed by its *halo*: the in-neighbours owned by other ranks.

Local node ids of rank ``r`` are laid out as::

    [0, num_owned)                      owned nodes, in locality order (see
                                        :mod:`lightning_fullgraph.partition.planner`)
    [num_owned, num_owned + num_halo)   halo nodes, grouped by owner rank (ascending),
                                        in first-touch order inside a group

so the halo block is exactly the output of an ``all_to_all`` whose receive splits are the
per-owner halo counts.  Rank ``q`` sends to rank ``r`` the rows ``send_index`` of its own
owned block that ``r`` holds as halo, in ``r``'s order, which is what makes a single
``all_to_all_single`` call fill the halo block in place.  ``n_id`` and ``halo_n_id`` map
local ids back to global ids.

Every edge ``src -> dst`` of the global graph appears exactly once, in the local graph of the
rank owning ``dst`` (original relative order kept), so aggregation over in-neighbours is
exact for directed graphs as well as undirected ones.  Isolated nodes are owned like any
other node and simply have no local edges.

This module imports nothing from :mod:`lightning_fullgraph.partition` (the planner that
builds these objects imports it), so :mod:`lightning_fullgraph.comm` depends on nothing above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch_geometric.data import Data

__all__ = ["DIRECTIONS", "HaloPlan", "LocalPartition"]


#: Message directions: forward rows (owner -> borrower), backward gradients (borrower ->
#: owner).  A backward message travels the forward one's links the other way round.
DIRECTIONS: tuple[str, ...] = ("forward", "backward")


@dataclass
class HaloPlan:
    """Per-rank communication plan for the halo exchange.

    Attributes:
        rank: This rank.
        world_size: Number of ranks (= number of parts).
        num_owned: Rows this rank owns (``N_r``).
        num_halo: Rows this rank borrows from other ranks (``H_r``).
        send_index: ``[S_r]`` int64, local owned row ids to send, concatenated in peer-rank
            order; ``send_counts[p]`` of them go to rank ``p``.
        send_counts: ``[world_size]`` rows sent to each rank (0 to itself).
        recv_counts: ``[world_size]`` halo rows received from each rank (0 from itself);
            sums to ``num_halo``.
        marginal_mask: ``[N_r]`` bool, owned nodes with at least one halo in-neighbour.
    """

    rank: int
    world_size: int
    num_owned: int
    num_halo: int
    send_index: Tensor
    send_counts: list[int]
    recv_counts: list[int]
    marginal_mask: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))

    @property
    def num_send(self) -> int:
        return int(sum(self.send_counts))

    def counts(self, direction: str) -> tuple[list[int], list[int]]:
        """``(send_counts, recv_counts)`` of a message in ``direction``: a backward message
        (halo-row gradients going home) sends ``recv_counts`` and receives ``send_counts``."""
        if direction == "forward":
            return self.send_counts, self.recv_counts
        if direction == "backward":
            return self.recv_counts, self.send_counts
        raise ValueError(f"direction={direction!r}; choose one of {DIRECTIONS}")

    def rows(self, direction: str) -> tuple[int, int]:
        """``(rows sent, rows received)`` by this rank in ``direction``."""
        send, recv = self.counts(direction)
        return int(sum(send)), int(sum(recv))

    def to(self, device: torch.device | str) -> HaloPlan:
        """Returns a copy whose index tensors live on ``device``."""
        return HaloPlan(
            rank=self.rank,
            world_size=self.world_size,
            num_owned=self.num_owned,
            num_halo=self.num_halo,
            send_index=self.send_index.to(device),
            send_counts=list(self.send_counts),
            recv_counts=list(self.recv_counts),
            marginal_mask=self.marginal_mask.to(device),
        )


@dataclass
class LocalPartition:
    """Everything one rank needs: its local graph (a PyG ``Data``) and its halo plan.

    Attributes:
        data: Local graph. Node-level attributes (``x``, ``y``, masks, ...) have ``N_r`` rows
            (owned nodes only); ``edge_index`` is ``[2, E_r]`` with sources in
            ``[0, N_r + H_r)`` and destinations in ``[0, N_r)``; ``n_id`` holds the owned
            nodes' global ids and ``halo_n_id`` the halo nodes' global ids.
        plan: The :class:`HaloPlan` of this rank.
        num_global_nodes: Node count of the whole graph.
    """

    data: Data
    plan: HaloPlan
    num_global_nodes: int

    def state(self) -> dict[str, Any]:
        """A dict of plain tensors/ints (what the on-disk format stores)."""
        plan = self.plan
        out: dict[str, Any] = {
            "rank": plan.rank,
            "world_size": plan.world_size,
            "num_owned": plan.num_owned,
            "num_halo": plan.num_halo,
            "send_index": plan.send_index,
            "send_counts": torch.tensor(plan.send_counts, dtype=torch.long),
            "recv_counts": torch.tensor(plan.recv_counts, dtype=torch.long),
            "marginal_mask": plan.marginal_mask,
            "num_global_nodes": self.num_global_nodes,
            "data": {k: v for k, v in self.data.to_dict().items()},
        }
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LocalPartition:
        plan = HaloPlan(
            rank=int(state["rank"]),
            world_size=int(state["world_size"]),
            num_owned=int(state["num_owned"]),
            num_halo=int(state["num_halo"]),
            send_index=state["send_index"],
            send_counts=[int(c) for c in state["send_counts"].tolist()],
            recv_counts=[int(c) for c in state["recv_counts"].tolist()],
            marginal_mask=state["marginal_mask"],
        )
        data = Data.from_dict(state["data"])
        data.num_nodes = plan.num_owned
        return cls(data=data, plan=plan, num_global_nodes=int(state["num_global_nodes"]))
