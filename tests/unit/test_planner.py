"""The planner (partition/planner.py): local graphs cover every edge once; send/receive lists line up."""

from __future__ import annotations

import pytest
import torch

from lightning_fullgraph.comm.plan import LocalPartition
from lightning_fullgraph.partition.partitioner import partition_graph
from lightning_fullgraph.partition.planner import (
    NODE_ORDERS,
    ORDER_BLOCK_ROWS,
    ORDER_MIN_ROWS,
    PartitionPlanner,
    build_local_partitions,
    locality_order,
    rcm_order,
)
from tests.helpers import directed_graph


def _partitions(num_parts: int, method: str = "metis", seed: int = 0, node_order: str = "locality"):
    data = directed_graph(num_nodes=80, num_edges=400, seed=seed)
    data.edge_weight = torch.rand(data.edge_index.size(1))
    parts = partition_graph(data.edge_index, data.num_nodes, num_parts, method=method)
    return data, parts, build_local_partitions(data, parts, num_parts, node_order=node_order)


def _shuffled_grid(side: int, seed: int = 0):
    """A ``side x side`` grid graph (undirected) whose global ids are a random permutation,
    so the graph's own numbering carries no locality; plus the random ``parts`` of 2 ranks
    split along a column (each part is a grid half)."""
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(side * side).view(side, side)
    right = torch.stack([ids[:, :-1].flatten(), ids[:, 1:].flatten()])
    down = torch.stack([ids[:-1, :].flatten(), ids[1:, :].flatten()])
    edges = torch.cat([right, down], dim=1)
    edges = torch.cat([edges, edges.flip(0)], dim=1)
    perm = torch.randperm(side * side, generator=g)  # grid position -> global id
    data = Data(edge_index=perm[edges], num_nodes=side * side)
    data.x = torch.randn(side * side, 4, generator=g)
    column = torch.arange(side * side) % side
    parts = torch.empty(side * side, dtype=torch.long)
    parts[perm] = (column >= side // 2).long()
    return data, parts


@pytest.mark.parametrize("node_order", NODE_ORDERS)
@pytest.mark.parametrize("num_parts", [1, 2, 3, 4])
@pytest.mark.parametrize("method", ["metis", "random"])
def test_local_graphs_cover_every_edge_once(num_parts: int, method: str, node_order: str) -> None:
    """Negative control: the destination check used to read ``assert int(dst.max()) if
    dst.numel() else -1 < num_owned`` (a conditional expression: it asserted the truthy int
    ``dst.max()``), which passes with a halo node as destination; the checks below fail then."""
    data, parts, locals_ = _partitions(num_parts, method, node_order=node_order)
    recovered = []
    for r, p in enumerate(locals_):
        ids = torch.cat([p.data.n_id, p.data.halo_n_id])  # local id -> global id
        src, dst = p.data.edge_index
        # destinations are owned: local ids in [0, N_r), exactly the owned nodes with an in-edge
        assert bool(((dst >= 0) & (dst < p.plan.num_owned)).all()), "destinations must be owned"
        owned_with_in_edges = sorted(set(data.edge_index[1][parts[data.edge_index[1]] == r].tolist()))
        assert sorted(set(ids[dst].tolist())) == owned_with_in_edges
        assert (int(src.max()) if src.numel() else -1) < p.plan.num_owned + p.plan.num_halo
        recovered.append(torch.stack([ids[src], ids[dst]]))
        # edge attributes follow their edges
        glob = torch.stack([ids[src], ids[dst]])
        key = glob[0] * data.num_nodes + glob[1]
        gkey = data.edge_index[0] * data.num_nodes + data.edge_index[1]
        for k, w in zip(key.tolist(), p.data.edge_weight.tolist()):
            assert w in data.edge_weight[gkey == k].tolist()
    all_edges = torch.cat(recovered, dim=1)
    assert all_edges.size(1) == data.edge_index.size(1)
    as_set = lambda e: sorted(map(tuple, e.t().tolist()))  # noqa: E731
    assert as_set(all_edges) == as_set(data.edge_index)


@pytest.mark.parametrize("node_order", NODE_ORDERS)
@pytest.mark.parametrize("num_parts", [2, 3, 4])
def test_owned_nodes_partition_the_graph_and_features_follow(num_parts: int, node_order: str) -> None:
    data, parts, locals_ = _partitions(num_parts, node_order=node_order)
    owned = torch.cat([p.data.n_id for p in locals_])
    assert sorted(owned.tolist()) == list(range(data.num_nodes))
    for r, p in enumerate(locals_):
        mine = (parts == r).nonzero().flatten()
        if node_order == "global":
            assert torch.equal(p.data.n_id, mine)
        else:
            assert torch.equal(p.data.n_id.sort().values, mine)
        assert torch.equal(p.data.x, data.x[p.data.n_id])
        assert torch.equal(p.data.y, data.y[p.data.n_id])
        assert torch.equal(p.data.train_mask, data.train_mask[p.data.n_id])
        assert p.data.num_nodes == p.plan.num_owned
        # halo: remote in-neighbours only, each once, grouped by owner
        halo = p.data.halo_n_id
        assert bool((parts[halo] != r).all())
        assert halo.unique().numel() == halo.numel()
        owners = parts[halo]
        assert torch.equal(owners, owners.sort(stable=True).values)
        assert torch.equal(torch.bincount(owners, minlength=num_parts), torch.tensor(p.plan.recv_counts))
        if node_order == "global":  # ascending global id inside a group
            for group in torch.split(halo, p.plan.recv_counts):
                assert torch.equal(group, group.sort().values)


@pytest.mark.parametrize("node_order", NODE_ORDERS)
@pytest.mark.parametrize("num_parts", [2, 3, 4])
def test_simulated_all_to_all_fills_the_halo(num_parts: int, node_order: str) -> None:
    """What q sends to r (send_index, in rank order) is exactly r's halo block from q."""
    data, parts, locals_ = _partitions(num_parts, node_order=node_order)
    for r, p in enumerate(locals_):
        received = []
        for other in locals_:
            offsets = [0] + torch.cumsum(torch.tensor(other.plan.send_counts), 0).tolist()
            rows = other.plan.send_index[offsets[r] : offsets[r + 1]]
            received.append(other.data.n_id[rows])
        assert torch.equal(torch.cat(received), p.data.halo_n_id)
        assert p.plan.send_counts[r] == 0 and p.plan.recv_counts[r] == 0


def test_marginal_nodes_are_those_with_remote_in_neighbours() -> None:
    data, parts, locals_ = _partitions(3)
    for p in locals_:
        src, dst = p.data.edge_index
        expect = torch.zeros(p.plan.num_owned, dtype=torch.bool)
        expect[dst[src >= p.plan.num_owned]] = True
        assert torch.equal(p.plan.marginal_mask, expect)


def test_isolated_nodes_are_owned_without_edges() -> None:
    data, parts, locals_ = _partitions(2)
    isolated = set(range(data.num_nodes - 6, data.num_nodes))
    for p in locals_:
        ids = torch.cat([p.data.n_id, p.data.halo_n_id])
        used = set(ids[p.data.edge_index.flatten()].tolist())
        assert not (used & isolated)
    assert isolated <= set(torch.cat([p.data.n_id for p in locals_]).tolist())


def test_wrong_parts_shape_is_refused() -> None:
    data = directed_graph()
    with pytest.raises(ValueError, match="parts"):
        build_local_partitions(data, torch.zeros(3, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="node_order"):
        PartitionPlanner(data, torch.zeros(data.num_nodes, dtype=torch.long), 1, node_order="degree")


def _owned_gaps(p: LocalPartition) -> torch.Tensor:
    src, dst = p.data.edge_index
    inner = src < p.plan.num_owned
    return (src[inner] - dst[inner]).abs().float()


def test_locality_order_puts_neighbours_close_together() -> None:
    """On a grid whose global ids are shuffled, the owned rows an output row gathers lie
    within about one grid row (``side``) of it in locality order, against about a third of
    the part in the graph's own order.  Negative control: with ``_number_owned`` a no-op
    (ascending global ids, the "global" order) the mean gap is ~10x larger and the max ~N_r."""
    side = 40
    data, parts = _shuffled_grid(side)
    for node_order, mean_bound in (("locality", 0.75 * side), ("global", None)):
        for p in build_local_partitions(data, parts, 2, node_order=node_order):
            gaps = _owned_gaps(p)
            if mean_bound is not None:
                assert gaps.mean() < mean_bound and gaps.max() <= 2 * side, (gaps.mean(), gaps.max())
            else:
                assert gaps.mean() > 3 * side  # the control: shuffled ids are far apart


def test_halo_rows_follow_the_first_owned_row_that_reads_them() -> None:
    """Inside each owner group the halo rows are sorted by the smallest local id of an owned
    row they feed, so the halo block is also read front to back.  Negative control: the
    global order (halo by ascending global id) is not sorted by first touch on this graph."""
    side = 30
    data, parts = _shuffled_grid(side)
    for node_order in NODE_ORDERS:
        sorted_by_touch = []
        for p in build_local_partitions(data, parts, 2, node_order=node_order):
            src, dst = p.data.edge_index
            n = p.plan.num_owned
            first = torch.full((p.plan.num_halo,), n, dtype=torch.long)
            remote = src >= n
            first.scatter_reduce_(0, src[remote] - n, dst[remote], reduce="amin")
            assert bool((first < n).all())  # every halo row feeds some owned row
            groups = torch.split(first, p.plan.recv_counts)
            sorted_by_touch.append(all(bool((g[1:] >= g[:-1]).all()) for g in groups))
        assert all(sorted_by_touch) == (node_order != "global")


def test_locality_order_keeps_a_small_world_part_in_cache_sized_blocks() -> None:
    """On a products-like graph (hidden communities, random ids, long edges) the default
    order puts about half of a part's owned-to-owned edges inside one block of
    ``ORDER_BLOCK_ROWS`` rows and halves the median distance many times over; reverse
    Cuthill-McKee's breadth-first levels span thousands of rows there.  Negative control:
    with ``_start_part`` calling ``rcm_order`` for "locality" too, the same-block share
    falls to ~0.13 and the median distance to ~3.9k rows, and the assertions fail.  (Its
    parts are large enough to be numbered in forked children.)"""
    from lightning_fullgraph.data.datasets import products_like_graph

    n = 40_000
    data = products_like_graph(num_nodes=n, seed=0)
    parts = partition_graph(data.edge_index, n, 2)
    share, median = {}, {}
    for node_order in ("locality", "rcm"):
        for p in build_local_partitions(data, parts, 2, node_order=node_order):
            assert p.plan.num_owned > ORDER_MIN_ROWS  # the blocked path, not the small-part one
            src, dst = p.data.edge_index
            inner = src < p.plan.num_owned
            src, dst = src[inner], dst[inner]
            share.setdefault(node_order, []).append(
                (src // ORDER_BLOCK_ROWS == dst // ORDER_BLOCK_ROWS).float().mean().item()
            )
            median.setdefault(node_order, []).append((src - dst).abs().float().median().item())
    assert min(share["locality"]) > 0.35 and min(share["locality"]) > 2.5 * max(share["rcm"]), share
    assert max(median["locality"]) < ORDER_BLOCK_ROWS and max(median["locality"]) * 4 < min(median["rcm"]), median


def test_locality_order_is_a_deterministic_permutation() -> None:
    """Directed edges, duplicates, self-loops, isolated nodes and no edges at all: always a
    permutation of ``range(num_nodes)``, the same one on every call, on the blocked path
    (``block_rows`` below the node count, so METIS runs) and the small-graph one."""
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 50, (300,), generator=g)
    dst = torch.randint(0, 50, (300,), generator=g)
    src = torch.cat([src, src[:10], torch.tensor([7])])  # duplicates and a self-loop
    dst = torch.cat([dst, dst[:10], torch.tensor([7])])
    for n in (50, 60):  # 60: ten isolated nodes
        for block_rows in (8, 1024):
            kw = dict(block_rows=block_rows, max_edges_per_node=2, min_rows=0)
            order = locality_order(src, dst, n, **kw)
            assert torch.equal(order.sort().values, torch.arange(n))
            assert torch.equal(order, locality_order(src, dst, n, **kw))
        assert torch.equal(rcm_order(src, dst, n).sort().values, torch.arange(n))
    assert torch.equal(locality_order(src[:0], dst[:0], 5), torch.arange(5))
    assert torch.equal(locality_order(src[:0], dst[:0], 5, block_rows=2, min_rows=0), torch.arange(5))
    assert locality_order(src[:0], dst[:0], 0).numel() == 0
    loops = torch.arange(20)  # self-loops only: nothing for METIS to split
    assert torch.equal(locality_order(loops, loops, 20, block_rows=4, min_rows=0), torch.arange(20))


def _plan_fields(planner: PartitionPlanner) -> list[dict]:
    return [planner.part(r).state() for r in range(planner.num_parts)]


def _assert_same_plan(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            if k == "data":
                assert x[k].keys() == y[k].keys()
                for kk in x[k]:
                    u, v = x[k][kk], y[k][kk]
                    assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, kk
            elif isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


@pytest.mark.slow
def test_large_parts_are_numbered_in_forked_children_at_once(monkeypatch, tmp_path) -> None:
    """With ``order_workers=2`` every part above the METIS threshold is numbered in a process
    other than this one, two of them at the same time, and the plan is the one numbered
    here.  The numbering is wrapped to record its process id and running interval (and to
    take 0.5 s, so overlapping runs are unmistakable).  Negative controls: numbering in this
    process (``ForkedCall`` replaced by a direct call) fails the process check; finishing
    each part before starting the next (no part in flight) fails the overlap check; without
    the edge threshold the small parts at the end are forked too."""
    import os
    import time

    from lightning_fullgraph.partition import planner as plan_module

    real = plan_module.locality_order

    def recording(src, dst, n):
        start = time.monotonic()
        time.sleep(0.5)
        out = real(src, dst, n)
        (tmp_path / f"{os.getpid()}-{n}-{time.monotonic_ns()}").write_text(f"{start} {time.monotonic()}")
        return out

    monkeypatch.setattr(plan_module, "locality_order", recording)
    monkeypatch.setattr(plan_module, "ORDER_MIN_ROWS", 0)
    monkeypatch.setattr(plan_module, "ORDER_FORK_MIN_EDGES", 0)  # fork parts of this small graph
    data = directed_graph(num_nodes=4500, num_edges=40_000, seed=1)
    parts = partition_graph(data.edge_index, data.num_nodes, 3)
    assert int(torch.bincount(parts).min()) > ORDER_BLOCK_ROWS  # every part is forked

    forked = PartitionPlanner(data, parts, 3, order_workers=2)
    records = [(int(f.name.split("-")[0]), *map(float, f.read_text().split())) for f in tmp_path.iterdir()]
    assert len(records) == 3 and forked.order_workers == 2 and len(forked.order_child_peak_bytes) == 3
    assert all(pid != os.getpid() for pid, _, _ in records), records
    intervals = sorted((a, b) for _, a, b in records)
    assert any(intervals[i + 1][0] < intervals[i][1] for i in range(len(intervals) - 1)), intervals

    for f in tmp_path.iterdir():
        f.unlink()
    here = PartitionPlanner(data, parts, 3, order_workers=1)
    assert [int(f.name.split("-")[0]) for f in tmp_path.iterdir()] == [os.getpid()] * 3
    assert here.order_child_peak_bytes == []
    _assert_same_plan(_plan_fields(forked), _plan_fields(here))

    # parts below ORDER_FORK_MIN_EDGES owned-to-owned edges are not worth a fork
    for f in tmp_path.iterdir():
        f.unlink()
    monkeypatch.setattr(plan_module, "ORDER_FORK_MIN_EDGES", 1 << 21)
    small = PartitionPlanner(data, parts, 3, order_workers=2)
    assert [int(f.name.split("-")[0]) for f in tmp_path.iterdir()] == [os.getpid()] * 3
    assert small.order_child_peak_bytes == []


@pytest.mark.parametrize("workers", [2, 3])
def test_forked_metis_numbering_gives_the_plan_numbered_here(monkeypatch, workers: int) -> None:
    """The real METIS ordering (blocks of 64 rows, so the small parts of this test take the
    METIS path) run in forked children gives the plan that ``order_workers=1`` computes in
    this process, field for field, for 2 and 3 orderings in flight.  Negative control: the
    child's result read one word off in the shared buffer, or the parts finished out of
    rank order, makes the plans differ."""
    import functools

    from lightning_fullgraph.partition import planner as plan_module

    monkeypatch.setattr(
        plan_module, "locality_order", functools.partial(plan_module.locality_order, block_rows=64, min_rows=0)
    )
    monkeypatch.setattr(plan_module, "ORDER_MIN_ROWS", 0)
    monkeypatch.setattr(plan_module, "ORDER_FORK_MIN_EDGES", 0)
    monkeypatch.setattr(plan_module, "ORDER_BLOCK_ROWS", 64)
    data = directed_graph(num_nodes=5000, num_edges=50_000, seed=2)
    data.x = torch.randn(5000, 3)
    parts = partition_graph(data.edge_index, data.num_nodes, 4)
    forked = PartitionPlanner(data, parts, 4, order_workers=workers)
    assert len(forked.order_child_peak_bytes) == 4
    here = PartitionPlanner(data, parts, 4, order_workers=1)
    _assert_same_plan(_plan_fields(forked), _plan_fields(here))
    # and the order is METIS's blocks, not the identity
    assert not torch.equal(here.local_id, PartitionPlanner(data, parts, 4, node_order="global").local_id)


def test_a_daemonic_process_numbers_parts_itself(monkeypatch) -> None:
    """A daemonic process may not start children: there the planner numbers the parts itself
    (``order_workers`` 1) and succeeds.  Negative control: without the daemon check the
    child's ``Process.start`` raises and the daemonic process exits with status 1."""
    import multiprocessing

    from lightning_fullgraph.partition import planner as plan_module

    monkeypatch.setattr(
        plan_module, "locality_order", __import__("functools").partial(plan_module.locality_order, block_rows=64)
    )
    monkeypatch.setattr(plan_module, "ORDER_MIN_ROWS", 0)
    monkeypatch.setattr(plan_module, "ORDER_FORK_MIN_EDGES", 0)
    data = directed_graph(num_nodes=3000, num_edges=20_000, seed=3)
    parts = partition_graph(data.edge_index, data.num_nodes, 2)

    def build() -> None:
        planner = PartitionPlanner(data, parts, 2, order_workers=2)
        raise SystemExit(0 if planner.order_workers == 1 else 3)

    proc = multiprocessing.get_context("fork").Process(target=build, daemon=True)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


def test_order_workers_is_validated() -> None:
    """A clear error for a worker count that is not a positive int."""
    data = directed_graph(num_nodes=50, num_edges=200, seed=0)
    parts = partition_graph(data.edge_index, data.num_nodes, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="order_workers"):
            PartitionPlanner(data, parts, 2, order_workers=bad)
