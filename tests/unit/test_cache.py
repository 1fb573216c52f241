"""Partition cache: computed once, loaded afterwards, stale or damaged caches never used."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("field", ["method", "num_parts", "seed"])
def test_other_settings_get_their_own_partitions(tmp_path, field) -> None:
    data = directed_graph()
    base = dict(num_parts=2, method="metis", seed=0)
    first = ensure_partitions(data, cache_root=tmp_path, **base)
    other = dict(base, **{field: {"method": "random", "num_parts": 3, "seed": 1}[field]})
    second = ensure_partitions(data, cache_root=tmp_path, **other)
    assert second.rebuilt and second.folder != first.folder


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
    assert torch.equal(batch.x, data.x) and batch.edge_index.size(1) == data.edge_index.size(1)
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


def test_datamodule_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="partition"):
        FullGraphDataModule(directed_graph(), partition="kmeans")
    with pytest.raises(ValueError, match="num_parts"):
        FullGraphDataModule(directed_graph(), num_parts=0)


def test_bad_input_is_refused_before_partitioning(tmp_path, monkeypatch) -> None:
    import lightning_fullgraph.partition.partitioner as partitioner
    from lightning_fullgraph.validation import GraphValidationError

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
