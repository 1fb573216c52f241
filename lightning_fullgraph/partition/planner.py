"""The offline planner: builds every rank's LocalPartition from a node -> rank assignment.

Given an assignment ``parts[v] = owner rank of node v``, every rank ``r`` gets a local graph
laid out as :mod:`lightning_fullgraph.comm.plan` describes: owned rows first, then its halo
grouped by owner rank; this module decides the order of the rows inside those blocks.

Locality order (``node_order="locality"``, the default): the owned nodes are numbered block
by block, the blocks being METIS's recursive bisection of the part's owned-to-owned edges
(made undirected) into pieces of at most :data:`ORDER_BLOCK_ROWS` rows, in METIS's nested
numbering (the two halves of every bisection get consecutive block ids, so nearby blocks are
near each other at every scale); the halo nodes of one owner are numbered by the smallest
local id of an owned node they point to (ties by global id).  A destination row's
neighbours then sit in its own block or a nearby one, so the gathers of a sparse aggregation
``out[i] = sum_j A[i, j] x[j]`` hit cache far more often than with the graph's own
numbering: on the largest part of a 10^6-node products-like graph the product takes
21.8 ns per edge instead of 31.9 (reverse Cuthill-McKee, the order of format version 2) and
41.9 (ascending global id), one thread, 128 features (``benchmarks/bench_locality.py``).
``node_order="rcm"`` numbers the owned nodes in reverse Cuthill-McKee order alone (a
breadth-first order, which keeps neighbours close on mesh-like graphs but spreads them over
the whole part on small-world ones); parts of at most :data:`ORDER_MIN_ROWS` rows use it
under ``"locality"`` too.
``node_order="global"`` keeps the owned nodes and each owner's halo in ascending global id.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import Data

from lightning_fullgraph.comm.plan import HaloPlan, LocalPartition

from .forked import ForkedCall, can_fork

__all__ = [
    "NODE_ORDERS",
    "ORDER_BLOCK_ROWS",
    "ORDER_EDGES_PER_NODE",
    "ORDER_FORK_MIN_EDGES",
    "ORDER_MIN_ROWS",
    "PartitionPlanner",
    "build_local_partitions",
    "iter_local_partitions",
    "locality_order",
    "rcm_order",
]

NodeOrder = Literal["locality", "rcm", "global"]
NODE_ORDERS: tuple[str, ...] = ("locality", "rcm", "global")

#: Rows per block of the locality order: 1,024 rows of 128 float32 features are 512 KiB, which
#: stay in one core's L2 cache while a sparse product gathers them.
ORDER_BLOCK_ROWS = 1024
#: Undirected edges per node the locality order's METIS sees at most; a part with more hands it
#: a deterministic symmetric hash sample (as ``partition --metis-max-edges`` does).  On a
#: full-size products-like part (mean degree 50) blocks from a sample of about 6 per node gave
#: the same product time as blocks from every edge (24.1 ns per edge) for 0.4x the METIS time.
ORDER_EDGES_PER_NODE = 8
#: Parts of at most this many rows keep :func:`rcm_order` under the locality order: 16,384 rows
#: of 128 fp32 features are 8 MiB, which the last-level cache holds in any order, so METIS's
#: cost would not be repaid (and small graphs keep format 2's numbering).
ORDER_MIN_ROWS = 16_384
#: Owned-to-owned edges from which a part's locality order runs in a forked child when several
#: run at once (``PartitionPlanner(order_workers=...)``): about 0.3 s of METIS on a
#: products-like part, where the fork's own cost (copying the page tables, the child's
#: copy-on-write pages, about 30 MiB at 10^5 nodes) is small beside it.
ORDER_FORK_MIN_EDGES = 1 << 21


def _local_ids(parts: Tensor, num_parts: int) -> tuple[Tensor, Tensor]:
    """Position of every node inside its owner's block, and the block sizes.

    Returns:
        ``local_id [N]`` (index of ``v`` among the nodes owned by ``parts[v]``, ascending
        global id) and ``sizes [num_parts]``.
    """
    num_nodes = parts.numel()
    order = torch.argsort(parts, stable=True)  # grouped by part, ascending id inside
    sizes = torch.bincount(parts, minlength=num_parts)
    offsets = torch.cumsum(sizes, 0) - sizes
    local_id = torch.empty(num_nodes, dtype=torch.long)
    local_id[order] = torch.arange(num_nodes) - offsets[parts[order]]
    return local_id, sizes


# scipy's reverse Cuthill-McKee takes int32 CSR indices only.
_INT32_MAX = 2**31 - 1


def locality_order(
    src: Tensor,
    dst: Tensor,
    num_nodes: int,
    block_rows: int = ORDER_BLOCK_ROWS,
    max_edges_per_node: int = ORDER_EDGES_PER_NODE,
    seed: int = 0,
    min_rows: int = ORDER_MIN_ROWS,
) -> Tensor:
    r"""A numbering of ``num_nodes`` nodes that puts neighbours in the same small block.

    METIS's recursive bisection (``pymetis``, ``recursive=True``) splits the undirected simple
    graph of the edges ``src[k] -- dst[k]`` into :math:`k = \lceil n / b \rceil` pieces of
    about ``b = block_rows`` nodes with few edges between them; nodes are numbered piece by
    piece in METIS's piece order, ascending id inside a piece.  Recursive bisection numbers
    the two halves of every split consecutively, so pieces close in the order are close in
    the graph at every scale: a sparse product's gathers stay inside a few cache-sized
    pieces.  A reverse Cuthill-McKee order (:func:`rcm_order`) is breadth-first: on a
    small-world graph its levels grow to a large share of the nodes, so neighbours land far
    apart (median distance 88k rows on a 595k-row products-like part, against 0.6-1.3k
    here).  Graphs of at most ``max(block_rows, min_rows)`` nodes get :func:`rcm_order`.

    Args:
        src: ``[E]`` int64 node ids in ``[0, num_nodes)``.
        dst: ``[E]`` int64 node ids in ``[0, num_nodes)``.
        num_nodes: Number of nodes (isolated ones included).
        block_rows: Nodes per piece (the last pieces may hold fewer; METIS balances them
            within its default 3 % tolerance).
        max_edges_per_node: At most ``max_edges_per_node * num_nodes`` undirected edges go
            to METIS; a denser graph gives it a deterministic symmetric hash sample.
        seed: METIS's and the sample's seed.
        min_rows: Graphs of at most this many nodes get :func:`rcm_order` (they fit the
            cache in any order).

    Returns:
        ``order [num_nodes]`` int64, a permutation: ``order[k]`` is the node placed at position
        ``k``.  Deterministic: the same arguments give the same permutation.
    """
    if num_nodes <= max(block_rows, min_rows) or src.numel() == 0:
        return rcm_order(src, dst, num_nodes)
    import pymetis

    from .partitioner import symmetric_simple_csr

    idx_dtype = pymetis.zero_copy_dtype()
    degree, adjncy = symmetric_simple_csr(
        (src, dst), num_nodes, max_edges=max_edges_per_node * num_nodes, seed=seed
    )
    if adjncy.size == 0:
        return torch.arange(num_nodes)
    if max(num_nodes, adjncy.size) > np.iinfo(idx_dtype).max:
        return rcm_order(src, dst, num_nodes)
    xadj = np.zeros(num_nodes + 1, dtype=idx_dtype)
    np.cumsum(degree, out=xadj[1:])
    del degree
    result = pymetis.part_graph(
        -(-num_nodes // block_rows),
        pymetis.CSRAdjacency(xadj, adjncy.astype(idx_dtype, copy=False)),
        options=pymetis.Options(seed=seed),
        recursive=True,  # nested piece numbering: consecutive pieces are neighbours
    )
    del adjncy, xadj
    piece = torch.as_tensor(np.asarray(result.vertex_part, dtype=np.int64))
    return torch.argsort(piece, stable=True)  # ties: ascending node id


def rcm_order(src: Tensor, dst: Tensor, num_nodes: int) -> Tensor:
    r"""The reverse Cuthill-McKee order (scipy's) of the undirected graph ``src[k] -- dst[k]``.

    A breadth-first order from a low-degree node, children by ascending degree, reversed.
    It keeps the bandwidth ``max |pos(u) - pos(v)|`` small on mesh-like graphs.

    Args:
        src: ``[E]`` int64 node ids in ``[0, num_nodes)``.
        dst: ``[E]`` int64 node ids in ``[0, num_nodes)``.
        num_nodes: Number of nodes (isolated ones included).

    Returns:
        ``order [num_nodes]`` int64, a permutation (``order[k]`` is the node at position
        ``k``), deterministic.  The identity when ``2 E`` exceeds int32 (scipy's index type).
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    num_edges = src.numel()
    if num_nodes == 0 or num_edges == 0 or 2 * num_edges > _INT32_MAX or num_nodes > _INT32_MAX:
        return torch.arange(num_nodes)
    # Both directions, grouped by row: a CSR built directly (no scipy COO, which would add
    # an int64 copy and a value array summed over duplicates).  Duplicates are harmless to a
    # breadth-first search.
    rows = torch.cat([dst, src])
    perm = torch.argsort(rows, stable=True)
    cols = torch.cat([src, dst])[perm].to(torch.int32)
    indptr = torch.zeros(num_nodes + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.bincount(rows, minlength=num_nodes), 0).to(torch.int32)
    del rows, perm
    ones = np.ones(cols.numel(), dtype=np.int8)
    adj = csr_matrix((ones, cols.numpy(), indptr.numpy()), shape=(num_nodes, num_nodes), copy=False)
    order = reverse_cuthill_mckee(adj, symmetric_mode=True)
    return torch.from_numpy(np.asarray(order, dtype=np.int64))


def build_local_partitions(
    data: Data, parts: Tensor, num_parts: int, node_order: NodeOrder = "locality"
) -> list[LocalPartition]:
    """Splits a global graph into one :class:`LocalPartition` per part.

    Vectorised over nodes and edges (one Python iteration per part).  Node-level attributes
    of ``data`` are sliced to each part's owned nodes; edge-level attributes follow their
    edges into the owner of the destination.  Holds every part at once; to write parts one
    at a time (bounded memory on large graphs) use :func:`iter_local_partitions`.

    Args:
        data: The global graph; ``edge_index[0]`` are sources, ``edge_index[1]`` destinations.
        parts: ``[N]`` int64 owner rank of every node, values in ``[0, num_parts)``.
        num_parts: Number of parts (ranks).
        node_order: ``"locality"`` (default), ``"rcm"`` or ``"global"``: the local numbering, see the
            module docstring.

    Returns:
        ``num_parts`` partitions, index ``r`` for rank ``r``.
    """
    plans = PartitionPlanner(data, parts, num_parts, node_order=node_order)
    return [plans.part(r) for r in range(num_parts)]


def iter_local_partitions(
    data: Data, parts: Tensor, num_parts: int, node_order: NodeOrder = "locality"
) -> Iterator[LocalPartition]:
    """The partitions of :func:`build_local_partitions`, built one at a time (rank order).

    Only one part's local graph exists at a time, so a caller that writes and drops each
    part holds about ``E / P`` local edges instead of ``E``.
    """
    plans = PartitionPlanner(data, parts, num_parts, node_order=node_order)
    for r in range(num_parts):
        yield plans.part(r)


def _order_workers(order_workers: int | None, num_parts: int, node_order: str) -> int:
    """Parts numbered at once: ``order_workers``, or the CPUs this process may use; at most one
    per part, and one where nothing is forked (not Linux, see :func:`~lightning_fullgraph.
    partition.forked.can_fork`; a daemonic process; an order other than ``"locality"``)."""
    if order_workers is None:
        try:
            order_workers = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            order_workers = os.cpu_count() or 1
    elif isinstance(order_workers, bool) or not isinstance(order_workers, int) or order_workers < 1:
        raise ValueError(f"`order_workers` must be a positive int or None, got {order_workers!r}")
    if node_order != "locality" or not can_fork() or multiprocessing.current_process().daemon:
        # (a daemonic process may not start children)
        return 1
    return max(1, min(order_workers, num_parts))


@dataclass
class _PendingPart:
    """A part whose halo is known and whose owned nodes' numbering may still be running.

    Attributes:
        rank: The part.
        order: Its owned nodes' numbering (a permutation of ``[0, N_r)``), or the forked call
            computing it; ``None`` for ``node_order="global"``.
        remote_src: ``[R_r]`` global ids of the sources of its remote edges.
        remote_dst: ``[R_r]`` global ids of their destinations (``None`` for ``"global"``).
        keys: ``[H_r]`` its halo, grouped by owner rank, ascending global id inside.
        owner: ``[H_r]`` the owner rank of every halo node.
    """

    rank: int
    order: ForkedCall | Tensor | None
    remote_src: Tensor
    remote_dst: Tensor | None
    keys: Tensor
    owner: Tensor


class PartitionPlanner:
    """Builds the parts of a global graph one at a time, in bounded memory.

    The constructor makes one pass over the edges per part to number its owned nodes and to
    find its halo (the send lists of a part depend on the numbering and the halos of all the
    others); :meth:`part` then builds that part's local graph.  Memory beyond the global
    graph: the destination owner of every edge as ``int8``/``int16`` (``E`` or ``2 E``
    bytes), the local id of every node (``8 N`` bytes), the halos (``O(sum H_r)``), and per
    part an ``[N]`` halo mark (``N`` bytes) and an ``[N]`` position table (``8 N``: halo rows
    are found by one lookup per edge, not by sorting or searching the remote edges), and one
    part's edges (a few ``[E_r]`` int64 temporaries; the locality order adds one
    ``[2 E_r]`` int64 buffer of the part's owned-to-owned edges in both directions, then
    METIS on at most ``ORDER_EDGES_PER_NODE * N_r`` of them; ``"rcm"`` an int32 CSR).  No ``[E]`` int64
    temporary and no per-part boolean mask over all ``E`` edges that outlives its pass is
    kept.

    Under ``"locality"`` the owned nodes of up to ``order_workers`` parts are numbered at
    once, each METIS ordering in a forked child (:class:`~lightning_fullgraph.partition.
    forked.ForkedCall`: METIS holds the GIL and uses the process-wide ``rand()`` state, so
    threads could not run two calls deterministically).  On a machine with several cores the
    parts' orderings, the largest share of planning a big graph, then overlap each other and
    the extraction of the next part's edges.  Each ordering in flight keeps its part's
    owned-to-owned edges (two ``[E_r]`` int64) alive here and its METIS input in the child
    (:attr:`order_child_peak_bytes`).  The plan is the same for any ``order_workers``.

    Args:
        data: The global graph.
        parts: ``[N]`` owner rank of every node.
        num_parts: Number of parts.
        node_order: ``"locality"``, ``"rcm"`` or ``"global"``, see the module docstring.
        order_workers: Parts numbered at once; default: the CPUs this process may run on
            (``os.sched_getaffinity``), at most ``num_parts``.  ``1`` numbers them one after
            another in this process (parts small enough for :func:`rcm_order`, or with fewer
            than :data:`ORDER_FORK_MIN_EDGES` owned-to-owned edges, always are).

    Attributes:
        num_edges_per_part: ``[P]`` edges whose destination each part owns.
        num_owned: ``[P]`` nodes each part owns.
        local_id: ``[N]`` every node's local id in its owner's block.
        halos: Global ids of each part's halo, grouped by owner rank, in the part's order.
        order_workers: Parts numbered at once (1 off Linux, in a daemonic process, or when the
            order is not ``"locality"``).
        order_child_peak_bytes: Peak memory of every forked ordering beyond what it shared
            with this process (empty when none was forked).
    """

    def __init__(
        self,
        data: Data,
        parts: Tensor,
        num_parts: int,
        node_order: NodeOrder = "locality",
        order_workers: int | None = None,
    ) -> None:
        num_nodes = int(data.num_nodes)
        parts = parts.to(torch.long).cpu()
        if parts.shape != (num_nodes,):
            raise ValueError(f"`parts` must have shape [{num_nodes}], got {list(parts.shape)}")
        if node_order not in NODE_ORDERS:
            raise ValueError(f"`node_order` must be one of {NODE_ORDERS}, got {node_order!r}")
        self.data = data
        self.num_parts = num_parts
        self.num_nodes = num_nodes
        self.node_order = node_order
        self.parts = parts
        edge_index = data.edge_index
        if edge_index.dtype != torch.long:
            edge_index = edge_index.to(torch.long)
        self.src, self.dst = edge_index[0].cpu(), edge_index[1].cpu()
        self.local_id, sizes = _local_ids(parts, num_parts)
        self.num_owned = sizes
        small = torch.int8 if num_parts <= 127 else torch.int16 if num_parts <= 32767 else torch.int32
        self._parts_small = parts.to(small)
        self._dst_part = self._parts_small[self.dst]  # [E], 1-2 bytes per edge
        self.num_edges_per_part = self._count_edges()
        self.node_keys = [k for k in data.keys() if k != "edge_index" and data.is_node_attr(k)]
        self.edge_keys = [k for k in data.keys() if k != "edge_index" and data.is_edge_attr(k)]

        self.halos: list[Tensor] = []
        self._halo_counts: list[Tensor] = []
        self._is_halo = torch.zeros(num_nodes, dtype=torch.bool)
        #: Peak bytes of each forked numbering beyond what it shared with this process.
        self.order_child_peak_bytes: list[int] = []
        self.order_workers = _order_workers(order_workers, num_parts, node_order)
        # Part r's numbering runs in a forked child while this process extracts part r + 1's
        # edges; at most `order_workers` numberings are in flight, and parts are finished in
        # rank order, so the plan does not depend on the timing.
        pending: deque[_PendingPart] = deque()
        for r in range(num_parts):
            pending.append(self._start_part(r))
            while len(pending) >= self.order_workers:
                self._finish_part(pending.popleft())
        while pending:
            self._finish_part(pending.popleft())
        del self._is_halo
        # send lists: rank q sends to rank r the halo rows of r owned by q, in r's order.
        self._send: list[list[Tensor]] = [[] for _ in range(num_parts)]
        for r in range(num_parts):
            chunks = torch.split(self.halos[r], self._halo_counts[r].tolist())
            for q in range(num_parts):
                self._send[q].append(self.local_id[chunks[q]])

    def _start_part(self, r: int) -> _PendingPart:
        """Part ``r``'s edges: starts the numbering of its owned nodes (in a forked child when
        several run at once and the part is large enough for METIS) and finds its halo,
        ascending global id grouped by owner rank."""
        e = self._edges_of(r)
        s = self.src[e]
        d = self.dst[e] if self.node_order != "global" else None
        del e
        remote = self._parts_small[s] != r
        order: ForkedCall | Tensor | None = None
        if d is not None:
            # local_id[owned of r] is still 0..n-1 (ascending global id): numberings of other
            # parts only write their own nodes' entries.
            n = int(self.num_owned[r])
            number = locality_order if self.node_order == "locality" else rcm_order
            args = (self.local_id[s[~remote]], self.local_id[d[~remote]], n)
            forked = (
                self.order_workers > 1
                and number is locality_order
                and n > max(ORDER_BLOCK_ROWS, ORDER_MIN_ROWS)  # METIS, not rcm_order
                and args[0].numel() >= ORDER_FORK_MIN_EDGES
            )
            order = ForkedCall(number, args, n) if forked else number(*args)
            del args
            d = d[remote]
        s = s[remote]
        del remote
        # The halo sorted by (owner, global id), which is the all_to_all receive layout:
        # marks over the N nodes, not a sort of the remote edges (linear time).
        is_halo = self._is_halo
        is_halo[s] = True
        keys = is_halo.nonzero().view(-1)  # ascending global id
        is_halo[keys] = False
        owner = self.parts[keys]
        by_owner = torch.argsort(owner, stable=True)
        return _PendingPart(r, order, s, d, keys[by_owner], owner[by_owner])

    def _finish_part(self, part: _PendingPart) -> None:
        """Applies part ``r``'s numbering and orders its halo by first touch."""
        r, keys, owner = part.rank, part.keys, part.owner
        if part.order is not None:
            order = part.order
            if isinstance(order, ForkedCall):
                call, order = order, order.result()
                self.order_child_peak_bytes.append(call.private_peak_bytes)
                del call
            owned = self._owned_ascending(r)
            self.local_id[owned[order]] = torch.arange(owned.numel())
            del order, owned
            if keys.numel():
                # First touch: the smallest local id of an owned node each halo row feeds.
                inverse = self._positions(keys)[part.remote_src]
                first = torch.full((keys.numel(),), int(self.num_owned[r]), dtype=torch.long)
                first.scatter_reduce_(0, inverse, self.local_id[part.remote_dst], reduce="amin")
                del inverse
                by_first = torch.argsort(first, stable=True)  # ties keep ascending global id
                del first
                by_first = by_first[torch.argsort(owner[by_first], stable=True)]
                keys, owner = keys[by_first], owner[by_first]
        self.halos.append(keys)
        self._halo_counts.append(torch.bincount(owner, minlength=self.num_parts))

    def _positions(self, ids: Tensor) -> Tensor:
        """``[N]`` table with ``table[ids[k]] = k`` (other entries undefined): a lookup that
        costs one gather per edge, in the order of the edges, instead of a binary search."""
        table = torch.empty(self.num_nodes, dtype=torch.long)
        table[ids] = torch.arange(ids.numel())
        return table

    def _owned_ascending(self, r: int) -> Tensor:
        return (self.parts == r).nonzero().flatten()

    def _count_edges(self) -> Tensor:
        counts = torch.zeros(self.num_parts, dtype=torch.long)
        step = 1 << 22
        for lo in range(0, self._dst_part.numel(), step):
            counts += torch.bincount(self._dst_part[lo : lo + step].long(), minlength=self.num_parts)
        return counts

    def _edges_of(self, r: int) -> Tensor:
        """Ids of the edges whose destination part ``r`` owns, ascending (original order)."""
        return (self._dst_part == r).nonzero().view(-1)

    def part(self, r: int) -> LocalPartition:
        """The :class:`LocalPartition` of rank ``r``."""
        num_nodes, num_parts = self.num_nodes, self.num_parts
        e = self._edges_of(r)
        n_owned = int(self.num_owned[r])
        halo = self.halos[r]
        # Every source is owned or in the halo: one [N] lookup (local ids, halo rows patched
        # in) maps them all, written straight into the edge_index rows.
        lookup = self.local_id.clone()
        lookup[halo] = torch.arange(n_owned, n_owned + halo.numel())
        edge_index = torch.empty(2, e.numel(), dtype=torch.long)
        s_local, d_local = edge_index[0], edge_index[1]
        torch.index_select(self.src, 0, e, out=d_local)  # the global sources, for a moment
        remote = self._parts_small[d_local] != r
        torch.index_select(lookup, 0, d_local, out=s_local)
        del lookup
        torch.index_select(self.dst, 0, e, out=d_local)
        d_local.copy_(self.local_id[d_local])
        marginal = torch.zeros(n_owned, dtype=torch.bool)
        marginal[d_local[remote]] = True
        del remote, s_local, d_local
        local = Data(edge_index=edge_index)
        del edge_index
        ascending = self._owned_ascending(r)
        owned = torch.empty_like(ascending)
        owned[self.local_id[ascending]] = ascending  # local id -> global id
        del ascending
        for k in self.node_keys:
            local[k] = self.data[k][owned]
        for k in self.edge_keys:
            local[k] = self.data[k][e]
        del e
        local.n_id = owned
        local.halo_n_id = halo
        local.num_nodes = owned.numel()
        send = self._send[r]
        plan = HaloPlan(
            rank=r,
            world_size=num_parts,
            num_owned=owned.numel(),
            num_halo=halo.numel(),
            send_index=torch.cat(send) if send else torch.zeros(0, dtype=torch.long),
            send_counts=[int(t.numel()) for t in send],
            recv_counts=[int(c) for c in self._halo_counts[r].tolist()],
            marginal_mask=marginal,
        )
        return LocalPartition(data=local, plan=plan, num_global_nodes=num_nodes)
