"""Partition cache writing (cache/writers.py, cache/store.py): lock, temporaries, write errors, publish.

Stale temporaries, the lock's timeout, write errors, publishing next to a valid or invalid
folder, a part written while the next one is built.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lightning_fullgraph.partition import cache as cache_mod
from lightning_fullgraph.partition.cache import (
    PartitionCacheError,
    ensure_partitions,
    graph_fingerprint,
    load_part,
    read_manifest,
    store,
    writers,
)
from tests.helpers import directed_graph


def _old(path, hours: float = 7) -> None:
    t = time.time() - hours * 3600
    for p in (path, *path.iterdir()):
        os.utime(p, (t, t))


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path) -> None:
    """Removed: a temporary folder whose writer (this host) is gone, one untouched for more than
    STALE_TEMP_SECONDS (other host), an old one from earlier versions, a discarded one.  Kept:
    those of a live writer, a recent one of another host, lock files and partition folders.
    Negative control: none of them was ever removed before (the issue)."""
    name = "metis-edges-p2-s0-0123456789abcdef"
    gone = subprocess.Popen(["true"])
    gone.wait()

    def temp(label: str, owner: dict | None) -> Path:
        path = tmp_path / f".{name}.tmp-{label}"
        path.mkdir()
        (path / "part-00000.pt").write_bytes(b"x")
        if owner is not None:
            (path / ".owner.json").write_text(json.dumps(owner))
        return path

    me = writers.writer_record()
    dead = temp("dead", {**me, "pid": gone.pid, "start": None})
    reused = temp("reused", {**me, "start": "1"})  # this pid, another start time: a reused pid
    live = temp("live", me)
    elsewhere = temp("elsewhere", {**me, "host": "another-host"})
    old_elsewhere = temp("old-elsewhere", {**me, "host": "another-host"})
    _old(old_elsewhere)
    legacy_old, legacy_new = tmp_path / f".{name}.abcd_123", tmp_path / f".{name}.efgh_456"
    for path in (legacy_old, legacy_new):
        path.mkdir()
    _old(legacy_old)
    trash = tmp_path / f".{name}.trash-x"
    trash.mkdir()
    lock = tmp_path / f".{name}.lock"
    lock.write_text("")
    (tmp_path / name).mkdir()
    removed = cache_mod.clean_stale_temporaries(tmp_path)
    assert sorted(removed) == sorted([dead, reused, old_elsewhere, legacy_old, trash])
    assert all(p.exists() for p in (live, elsewhere, legacy_new, lock, tmp_path / name))


def test_waiting_for_the_lock_times_out_with_the_holder_and_the_fix(tmp_path, monkeypatch) -> None:
    import fcntl

    data = directed_graph()
    folder = tmp_path / cache_mod.partition_folder_name(graph_fingerprint(data), "metis", 2, 0)
    lock = tmp_path / f".{folder.name}.lock"
    lock.write_text(json.dumps({"pid": 4242, "host": "node7", "time": time.time()}))
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        start = time.perf_counter()
        with pytest.raises(PartitionCacheError) as info:
            ensure_partitions(data, 2, cache_root=tmp_path, lock_timeout=0.3)
        assert time.perf_counter() - start < 5
        monkeypatch.setenv(cache_mod.LOCK_TIMEOUT_ENV, "0.1")
        with pytest.raises(PartitionCacheError, match="waited"):
            ensure_partitions(data, 2, cache_root=tmp_path)
    message = str(info.value)
    assert str(lock) in message and "pid 4242 on node7" in message and cache_mod.LOCK_TIMEOUT_ENV in message
    assert not folder.exists()
    assert ensure_partitions(data, 2, cache_root=tmp_path).rebuilt  # released: builds
    monkeypatch.setenv(cache_mod.LOCK_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="number of seconds"):
        ensure_partitions(data, 2, cache_root=tmp_path, seed=3)


def test_write_errors_are_wrapped_or_passed_through_and_clean_up(tmp_path, monkeypatch) -> None:
    """torch's stream error (no errno) becomes a PartitionCacheWriteError naming the file; any
    other error passes through unchanged; both leave no temporary folder behind."""
    data = directed_graph()

    def fail(exc):
        def save(state, path):
            path.write_bytes(b"partial")
            raise exc
        return save

    monkeypatch.setattr(store, "_save_part", fail(RuntimeError("PytorchStreamWriter failed writing file data/0")))
    with pytest.raises(cache_mod.PartitionCacheWriteError, match="part-00000.pt") as info:
        ensure_partitions(data, 2, cache_root=tmp_path)
    assert info.value.errno == errno.EIO and "PytorchStreamWriter" in str(info.value)
    assert info.value.needed > 0 and info.value.free > info.value.needed
    monkeypatch.setattr(store, "_save_part", fail(OSError(errno.EDQUOT, "Disk quota exceeded")))
    with pytest.raises(OSError, match="disk quota exceeded") as info:
        ensure_partitions(data, 2, cache_root=tmp_path)
    assert info.value.errno == errno.EDQUOT
    err = pickle.loads(pickle.dumps(info.value))
    assert err.errno == errno.EDQUOT and str(err) == str(info.value) and err.path == info.value.path
    monkeypatch.setattr(store, "_save_part", fail(ValueError("unrelated")))
    with pytest.raises(ValueError, match="unrelated"):
        ensure_partitions(data, 2, cache_root=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == []


def test_write_partitions_keeps_a_valid_folder_and_replaces_an_invalid_one(tmp_path) -> None:
    """Publishing never deletes a valid folder of the same partition (another writer's), and
    replaces an invalid one whole."""
    data = directed_graph()
    result = ensure_partitions(data, 2, cache_root=tmp_path)
    manifest = read_manifest(result.folder)
    parts = [load_part(result.folder, r) for r in range(2)]
    meta = {k: v for k, v in manifest.items() if k not in ("parts", "created", "format_version")}
    assert cache_mod.write_partitions(result.folder, parts, meta)["created"] == manifest["created"]
    part = result.folder / "part-00001.pt"
    raw = bytearray(part.read_bytes())
    raw[-10] ^= 0xFF  # same size, fails only its checksum
    part.write_bytes(bytes(raw))
    rewritten = cache_mod.write_partitions(result.folder, parts, meta)
    assert rewritten["created"] != manifest["created"] and load_part(result.folder, 1).plan.rank == 1
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".trash-" in p.name] == []


def test_a_part_is_written_while_the_next_one_is_built(tmp_path, monkeypatch) -> None:
    """Writing part r runs in a background thread while part r + 1 is built, and part r + 2
    is built only once part r is written (two parts in memory at most); the files are the
    parts, in rank order.  Building and saving are each slowed to 0.3 s and their intervals
    recorded.  Negative controls: saving in the loop's own thread fails the overlap check;
    submitting a write without waiting for the previous one fails the ordering check."""
    from lightning_fullgraph.partition.planner import PartitionPlanner

    data = directed_graph(num_nodes=300, num_edges=1500, seed=5)
    planner = PartitionPlanner(data, torch.arange(300) % 4, 4)
    build: list[tuple[float, float]] = []
    save: list[tuple[float, float]] = []

    def slow_parts():
        for r in range(4):
            t0 = time.monotonic()
            time.sleep(0.3)
            part = planner.part(r)
            build.append((t0, time.monotonic()))
            yield part

    real_save = store._save_part

    def slow_save(state, path):
        t0 = time.monotonic()
        time.sleep(0.3)
        real_save(state, path)
        save.append((t0, time.monotonic()))

    monkeypatch.setattr(store, "_save_part", slow_save)
    meta = {"fingerprint": "f" * 64, "method": "metis", "num_parts": 4, "seed": 0}
    folder = tmp_path / "p"
    manifest, adopted = store.write_and_publish(folder, slow_parts(), meta, meta, needed=1 << 20)
    assert not adopted and [e["file"] for e in manifest["parts"]] == [f"part-{r:05d}.pt" for r in range(4)]
    assert all(s0 < b1 and b0 < s1 for (s0, s1), (b0, b1) in zip(save[:-1], build[1:], strict=True)), (save, build)
    assert all(b0 >= s1 for (_, s1), (b0, _) in zip(save[:-2], build[2:], strict=True)), (save, build)
    for r in range(4):
        loaded = load_part(folder, r)
        assert loaded.plan.rank == r and torch.equal(loaded.data.edge_index, planner.part(r).data.edge_index)
