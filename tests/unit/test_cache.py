"""Partition cache: computed once, loaded afterwards, stale or damaged caches never used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.partition import cache as cache_mod
from lightning_fullgraph.partition.cache import (
    PartitionCacheError,
    check_manifest,
    ensure_partitions,
    graph_fingerprint,
    load_part,
    read_manifest,
)
from lightning_fullgraph.partition.cache.manifest import file_sha256
from tests.helpers import directed_graph


def test_second_run_loads_instead_of_recomputing(tmp_path, monkeypatch) -> None:
    data = directed_graph()
    first = ensure_partitions(data, 3, cache_root=tmp_path)
    assert first.rebuilt
    calls = []
    import lightning_fullgraph.partition.partitioner as partitioner

    original = partitioner.partition_graph
    monkeypatch.setattr(partitioner, "partition_graph", lambda *a, **k: calls.append(1) or original(*a, **k))
    second = ensure_partitions(data, 3, cache_root=tmp_path)
    assert not second.rebuilt and second.reason == "cache hit"
    assert second.folder == first.folder
    assert calls == []


def test_changed_graph_is_detected(tmp_path) -> None:
    data = directed_graph()
    first = ensure_partitions(data, 2, cache_root=tmp_path)
    changed = data.clone()
    changed.x = changed.x.clone()
    changed.x[0, 0] += 1.0  # a single feature differs
    second = ensure_partitions(changed, 2, cache_root=tmp_path)
    assert second.rebuilt
    assert second.folder != first.folder
    assert graph_fingerprint(changed) != graph_fingerprint(data)
    # pointing the expectation of one graph at the other's folder is refused with a reason
    reason = check_manifest(first.folder, {"fingerprint": graph_fingerprint(changed)})
    assert reason is not None and "fingerprint" in reason


@pytest.mark.parametrize("field", ["method", "num_parts", "seed", "balance"])
def test_other_settings_get_their_own_partitions(tmp_path, field) -> None:
    data = directed_graph()
    base = dict(num_parts=2, method="metis", seed=0, balance="edges")
    first = ensure_partitions(data, cache_root=tmp_path, **base)
    other = dict(base, **{field: {"method": "random", "num_parts": 3, "seed": 1, "balance": "nodes"}[field]})
    second = ensure_partitions(data, cache_root=tmp_path, **other)
    assert second.rebuilt and second.folder != first.folder


def _hub_data(num_nodes: int = 400, num_hubs: int = 4, hub_in: int = 200):
    """A directed graph with a heavy-tailed in-degree: ``num_hubs`` nodes get ``hub_in`` extra
    in-edges each."""
    data = directed_graph(num_nodes=num_nodes, num_edges=5 * num_nodes, num_isolated=0)
    g = torch.Generator().manual_seed(1)
    hub_src = torch.randint(0, num_nodes, (num_hubs * hub_in,), generator=g)
    hub_dst = torch.arange(num_hubs).repeat_interleave(hub_in) * (num_nodes // num_hubs)
    data.edge_index = torch.cat([data.edge_index, torch.stack([hub_src, hub_dst])], dim=1)
    return data


def test_edge_balanced_request_after_node_balanced_one_rebuilds(tmp_path, monkeypatch) -> None:
    """balance is part of the cache key: nodes, then edges rebuilds (another folder), and both
    are cache hits afterwards; each manifest records its balance and per-part counts.

    Negative control: without balance in the folder name / expected keys, the edge-balanced
    request would be a cache hit on the node-balanced partition (edge imbalance 1.89 > 1.1)."""
    from lightning_fullgraph.partition.partitioner import partition_graph, partition_stats

    data = _hub_data()
    nodes = ensure_partitions(data, 4, cache_root=tmp_path, balance="nodes")
    edges = ensure_partitions(data, 4, cache_root=tmp_path)  # default: edges
    assert nodes.rebuilt and edges.rebuilt and edges.folder != nodes.folder
    assert "edges" in edges.folder.name and "nodes" in nodes.folder.name
    calls = []
    import lightning_fullgraph.partition.partitioner as partitioner

    monkeypatch.setattr(partitioner, "partition_graph", lambda *a, **k: calls.append(1) or partition_graph(*a, **k))
    for balance, first in (("nodes", nodes), ("edges", edges)):
        again = ensure_partitions(data, 4, cache_root=tmp_path, balance=balance)
        assert not again.rebuilt and again.folder == first.folder
    assert calls == []

    for balance, result in (("nodes", nodes), ("edges", edges)):
        manifest = read_manifest(result.folder)
        assert manifest["balance"] == balance
        parts = partition_graph(data.edge_index, data.num_nodes, 4, balance=balance)
        stats = partition_stats(data.edge_index, parts, 4)
        assert manifest["nodes_per_part"] == stats["nodes_per_part"].tolist()
        assert manifest["edges_per_part"] == stats["edges_per_part"].tolist()
        assert manifest["nodes_per_part"] == [e["num_owned"] for e in manifest["parts"]]
        assert manifest["node_imbalance"] == pytest.approx(stats["node_imbalance"])
        assert manifest["edge_imbalance"] == pytest.approx(stats["edge_imbalance"])
    assert read_manifest(edges.folder)["edge_imbalance"] <= 1.1
    assert read_manifest(nodes.folder)["edge_imbalance"] > 1.3


def test_manifest_without_balance_is_stale(tmp_path) -> None:
    """A manifest written before `balance` existed is rebuilt (with the reason), not used or
    crashed on.  Negative control: without "balance" in the expected keys it is a cache hit."""
    data = directed_graph()
    result = ensure_partitions(data, 2, cache_root=tmp_path)
    manifest = read_manifest(result.folder)
    del manifest["balance"]
    (result.folder / "manifest.json").write_text(json.dumps(manifest))
    again = ensure_partitions(data, 2, cache_root=tmp_path)
    assert again.rebuilt and again.folder == result.folder and "balance" in again.reason
    assert read_manifest(again.folder)["balance"] == "edges"


def test_unknown_balance_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="edges, nodes"):
        ensure_partitions(directed_graph(), 2, cache_root=tmp_path, balance="degree")
    assert not any(tmp_path.iterdir())


def test_truncated_part_file_is_rebuilt_or_refused(tmp_path) -> None:
    data = directed_graph()
    result = ensure_partitions(data, 2, cache_root=tmp_path)
    part = result.folder / "part-00001.pt"
    part.write_bytes(part.read_bytes()[:50])
    with pytest.raises(PartitionCacheError, match="truncated"):
        load_part(result.folder, 1)
    again = ensure_partitions(data, 2, cache_root=tmp_path)
    assert again.rebuilt and "truncated" in again.reason
    assert load_part(again.folder, 1).plan.rank == 1


def test_corrupted_part_fails_checksum(tmp_path) -> None:
    result = ensure_partitions(directed_graph(), 2, cache_root=tmp_path)
    part = result.folder / "part-00000.pt"
    raw = bytearray(part.read_bytes())
    raw[-10] ^= 0xFF
    part.write_bytes(bytes(raw))
    with pytest.raises(PartitionCacheError, match="checksum"):
        load_part(result.folder, 0)


def test_other_format_version_is_rebuilt(tmp_path) -> None:
    data = directed_graph()
    result = ensure_partitions(data, 2, cache_root=tmp_path)
    manifest = read_manifest(result.folder)
    manifest["format_version"] = cache_mod.FORMAT_VERSION + 1
    (result.folder / "manifest.json").write_text(json.dumps(manifest))
    again = ensure_partitions(data, 2, cache_root=tmp_path)
    assert again.rebuilt and "format version" in again.reason


def _graft_part(target: Path, source: Path, rank: int) -> Path:
    """The hand edit of issue 29 (item 7): copies ``source``'s part file of ``rank`` and its
    manifest entry (size, checksum, counts) into ``target``; returns the grafted file."""
    name = f"part-{rank:05d}.pt"
    (target / name).write_bytes((source / name).read_bytes())
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["parts"][rank] = json.loads((source / "manifest.json").read_text())["parts"][rank]
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target / name


def test_a_part_file_of_another_graph_is_refused_naming_the_file(tmp_path) -> None:
    """Part 1 of another graph's cache, grafted with its manifest entry (so every size and
    checksum matches), is refused by ``load_part``, naming the file and what to do; so is part 1
    of another partition of the same graph (another seed).  Negative control: part files
    without the record of their graph and partition (the former ``_write_part``) -> load_part
    returns the foreign part and this test fails ("DID NOT RAISE")."""
    one = ensure_partitions(directed_graph(seed=0), 2, cache_root=tmp_path / "one")
    other = ensure_partitions(directed_graph(seed=1), 2, cache_root=tmp_path / "other")
    grafted = _graft_part(one.folder, other.folder, 1)
    assert check_manifest(one.folder, {}, verify_checksums=True) is None, "only the content tells"
    with pytest.raises(PartitionCacheError) as err:
        load_part(one.folder, 1)
    message = str(err.value)
    assert str(grafted) in message and "another graph" in message
    assert f"delete {one.folder}" in message and "rebuild" in message
    assert load_part(one.folder, 0).plan.rank == 0  # rank 0's own part is intact

    data = directed_graph(seed=2)
    seed0 = ensure_partitions(data, 2, method="random", seed=0, cache_root=tmp_path / "seeds")
    seed1 = ensure_partitions(data, 2, method="random", seed=1, cache_root=tmp_path / "seeds")
    grafted = _graft_part(seed0.folder, seed1.folder, 1)
    with pytest.raises(PartitionCacheError, match=rf"{grafted}.*seed"):
        load_part(seed0.folder, 1)


def test_a_part_file_without_its_record_is_refused(tmp_path) -> None:
    """A part file written without the record (an older version's file grafted into a current
    folder) is refused, not trusted.  Negative control: the former load_part never looked ->
    this test fails ("DID NOT RAISE")."""
    result = ensure_partitions(directed_graph(), 2, cache_root=tmp_path)
    path = result.folder / "part-00001.pt"
    state = torch.load(path, weights_only=True)
    for key in ("partition", "format_version"):
        state.pop(key, None)
    torch.save(state, path)
    manifest = json.loads((result.folder / "manifest.json").read_text())
    manifest["parts"][1].update(bytes=path.stat().st_size, sha256=file_sha256(path))
    (result.folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        PartitionCacheError, match=rf"{path} records no graph fingerprint.*delete {result.folder}"
    ):
        load_part(result.folder, 1)


def test_each_rank_loads_only_its_own_part(tmp_path, monkeypatch) -> None:
    result = ensure_partitions(directed_graph(), 3, cache_root=tmp_path)
    opened = []
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda path, *a, **k: opened.append(str(path)) or original(path, *a, **k))
    part = load_part(result.folder, 2)
    assert opened == [str(result.folder / "part-00002.pt")]
    assert part.plan.rank == 2 and part.plan.world_size == 3


def test_missing_rank_has_a_clear_error(tmp_path) -> None:
    result = ensure_partitions(directed_graph(), 2, cache_root=tmp_path)
    with pytest.raises(PartitionCacheError, match="as many parts as there are ranks"):
        load_part(result.folder, 5)


def test_datamodule_single_process_uses_the_cache(tmp_path) -> None:
    data = directed_graph()
    dm = FullGraphDataModule(data, cache_dir=tmp_path)
    dm.setup("fit")
    assert dm.partition_result is not None and dm.partition_result.rebuilt
    batch = next(iter(dm.train_dataloader()))
    # one part holds every node, in the plan's locality order: n_id maps rows back
    assert torch.equal(batch.n_id.sort().values, torch.arange(data.num_nodes))
    assert torch.equal(batch.x, data.x[batch.n_id]) and batch.edge_index.size(1) == data.edge_index.size(1)
    assert dm.num_features == data.x.size(1) and dm.num_classes == int(data.y.max()) + 1
    dm2 = FullGraphDataModule(data, cache_dir=tmp_path)
    dm2.setup("fit")
    assert dm2.partition_result is not None and not dm2.partition_result.rebuilt


def test_datamodule_accepts_a_partition_folder(tmp_path) -> None:
    data = directed_graph()
    result = ensure_partitions(data, 1, cache_root=tmp_path)
    dm = FullGraphDataModule(str(result.folder))
    dm.setup("fit")
    assert dm.local_partition is not None and dm.local_partition.plan.num_owned == data.num_nodes
    with pytest.raises(RuntimeError, match="partition folder"):
        dm.global_graph()


def test_datamodule_passes_balance_through(tmp_path) -> None:
    """FullGraphDataModule(balance=...) reaches the partitioner and the cache key; default edges.
    Negative control: if it were dropped, both manifests would say "edges" (the default)."""
    data = directed_graph()
    dm = FullGraphDataModule(data, cache_dir=tmp_path, balance="nodes")
    dm.setup("fit")
    assert dm.manifest["balance"] == "nodes"
    default = FullGraphDataModule(data, cache_dir=tmp_path)
    default.setup("fit")
    assert default.balance == "edges" and default.manifest["balance"] == "edges"
    assert default.partition_result is not None and default.partition_result.rebuilt


def test_datamodule_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="partition"):
        FullGraphDataModule(directed_graph(), partition="kmeans")
    with pytest.raises(ValueError, match=r"balance='degree'.*'edges', 'nodes'"):
        FullGraphDataModule(directed_graph(), balance="degree")
    with pytest.raises(ValueError, match="num_parts"):
        FullGraphDataModule(directed_graph(), num_parts=0)


def test_bad_input_is_refused_before_partitioning(tmp_path, monkeypatch) -> None:
    import lightning_fullgraph.partition.partitioner as partitioner
    from lightning_fullgraph.data.validation import GraphValidationError

    monkeypatch.setattr(partitioner, "partition_graph", lambda *a, **k: pytest.fail("partitioned bad input"))
    data = directed_graph()
    data.x[3, 1] = float("nan")
    with pytest.raises(GraphValidationError, match="NaN"):
        FullGraphDataModule(data, cache_dir=tmp_path).setup("fit")
    data = directed_graph()
    data.edge_index[0, 0] = data.num_nodes + 5
    with pytest.raises(GraphValidationError, match="edge_index"):
        FullGraphDataModule(data, cache_dir=tmp_path).setup("fit")
    with pytest.raises(GraphValidationError, match="num_parts"):
        FullGraphDataModule(directed_graph(num_nodes=10, num_edges=20, num_isolated=0), num_parts=11,
                            cache_dir=tmp_path).setup("fit")


# -- manifest schema ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "damage, what",
    [
        (lambda m: m["parts"][0].pop("bytes"), "parts[0] has no 'bytes'"),
        (lambda m: m.pop("parts"), "no 'parts' key"),
        (lambda m: m.update(num_parts="2"), "'num_parts' is \"2\" (str), expected int"),
        (lambda m: m["parts"][1].update(file="../../etc/passwd"), "parts[1]['file']"),
        (lambda m: m["parts"][0].update(sha256=None), "parts[0]['sha256'] is null"),
        (lambda m: m.update(num_classes=True), "'num_classes' is true (bool)"),
    ],
)
def test_manifest_with_another_schema_is_explained_not_a_key_error(tmp_path, damage, what) -> None:
    """Valid JSON with another schema: every reader names the manifest, what is wrong and what to
    do; ensure_partitions rebuilds it.  Negative control: before the schema check this raised
    ``KeyError: 'bytes'`` (check_manifest / load_part) or used the wrong types."""
    data = directed_graph()
    result = ensure_partitions(data, 2, cache_root=tmp_path)
    manifest = read_manifest(result.folder)
    damage(manifest)
    (result.folder / "manifest.json").write_text(json.dumps(manifest))
    reason = check_manifest(result.folder, {})
    assert reason is not None and "does not match the expected schema" in reason and what in reason
    assert str(result.folder / "manifest.json") in reason and "delete the folder" in reason
    for call in (lambda: read_manifest(result.folder), lambda: load_part(result.folder, 0),
                 lambda: FullGraphDataModule(str(result.folder), num_parts=2).prepare_data()):
        with pytest.raises(PartitionCacheError, match="does not match the expected schema"):
            call()
    again = ensure_partitions(data, 2, cache_root=tmp_path)
    assert again.rebuilt and "schema" in again.reason and load_part(again.folder, 1).plan.rank == 1


def test_manifest_that_is_not_an_object_is_explained(tmp_path) -> None:
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "manifest.json").write_text("[1, 2]")
    reason = check_manifest(folder, {})
    assert reason is not None and "top level is a JSON list" in reason
    with pytest.raises(PartitionCacheError, match="top level is a JSON list"):
        load_part(folder, 0)


def test_reported_peak_covers_the_forked_orderings(tmp_path, monkeypatch) -> None:
    """Parts numbered in forked children allocate memory this process's own high-water mark
    never sees; ``forked_peak_mib`` adds the children that ran at once.  Each child here
    writes 128 MiB before ordering, two run at once, so the bound is at least this process's
    peak before planning plus 256 MiB.  Negative control: without the children's private
    peaks the bound is this process's mark alone and the assertion fails."""
    from lightning_fullgraph.partition import planner as plan_module

    real = plan_module.locality_order

    def heavy(src, dst, n):
        block = torch.ones(128 * 2**20 // 8, dtype=torch.int64)
        del block
        return real(src, dst, n)

    monkeypatch.setattr(plan_module, "locality_order", heavy)
    monkeypatch.setattr(plan_module, "ORDER_MIN_ROWS", 0)  # fork the parts of this small graph
    monkeypatch.setattr(plan_module, "ORDER_FORK_MIN_EDGES", 0)
    monkeypatch.setattr(plan_module, "_order_workers", lambda *args: 2)
    data = directed_graph(num_nodes=4000, num_edges=30_000, seed=4)
    result = ensure_partitions(data, 2, cache_root=tmp_path)
    assert result.rebuilt
    assert result.forked_peak_mib >= result.peak_rss_mib["metis"] + 2 * 128, result
