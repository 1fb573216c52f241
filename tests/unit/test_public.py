"""Tests for :mod:`lightning_fullgraph.data.datasets.public` (PyG / OGB datasets from a root)."""

from __future__ import annotations

import gzip
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.data import Data

from lightning_fullgraph.data.datasets import CACHE_ENV_VAR, load_dataset
from tests.unit.dataset_checks import assert_equal_data as _assert_equal_data
from tests.unit.dataset_checks import check_normalised as _check_normalised

# ../shared/datasets beside the repo (LIGHTNING_FULLGRAPH_SHARED overrides ../shared, as in conftest.py).
SHARED = (
    Path(os.environ.get("LIGHTNING_FULLGRAPH_SHARED", Path(__file__).resolve().parents[2].parent / "shared"))
    / "datasets"
)

# (name, loader root relative to SHARED, raw folder relative to SHARED, num_nodes, num_classes)
OFFLINE = [
    ("Cora", "Planetoid", "Planetoid/Cora/raw", 2708, 7),
    ("CiteSeer", "Planetoid", "Planetoid/CiteSeer/raw", 3327, 6),
    ("cora_ml", "CitationFull", "CitationFull/cora_ml/raw", 2995, 7),
    ("tolokers", "Heterophilous", "Heterophilous/tolokers/raw", 11758, 2),
    ("Actor", "Actor", "Actor/raw", 7600, 5),
    ("cornell5", "LINKX", "LINKX/cornell5/raw", 18660, 2),
]


def _require(raw: str) -> Path:
    path = SHARED / raw
    if not path.is_dir():
        pytest.skip(f"offline dataset not found at {path}")
    return path


def _processed_dirs(root: Path) -> set[Path]:
    return set(root.rglob("processed")) if root.is_dir() else set()


def _set_tree_mode(root: Path, mode: int) -> None:
    for path in [root, *root.rglob("*")]:
        if path.is_dir():
            path.chmod(mode)


# --------------------------------------------------------------------------- #
# load_dataset on the offline copies (read-only shared folder)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(("name", "root", "raw", "num_nodes", "num_classes"), OFFLINE)
def test_load_offline(
    name: str, root: str, raw: str, num_nodes: int, num_classes: int, tmp_path: Path
) -> None:
    _require(raw)
    before = _processed_dirs(SHARED)
    data = load_dataset(name, SHARED / root, cache_dir=tmp_path)
    _check_normalised(data)
    assert data.num_nodes == num_nodes
    assert int(data.y.max()) + 1 == num_classes
    # processed/ went to the cache, never into the shared folder.
    assert _processed_dirs(SHARED) == before
    assert _processed_dirs(tmp_path)
    if name == "Cora":
        assert data.edge_index.size(1) == 10556
        assert (int(data.train_mask.sum()), int(data.val_mask.sum()), int(data.test_mask.sum())) == (
            140,
            500,
            1000,
        )
    if name == "cornell5":
        labelled = int((data.y >= 0).sum())
        assert labelled < num_nodes
        assert int(data.train_mask.sum()) == labelled // 2


def test_load_offline_parent_root_and_case(tmp_path: Path) -> None:
    _require("Planetoid/Cora/raw")
    a = load_dataset("cora", SHARED, cache_dir=tmp_path)
    b = load_dataset("CORA", str(SHARED / "Planetoid"), cache_dir=tmp_path)
    assert a.num_nodes == 2708
    _assert_equal_data(a, b)


def test_citationfull_split_seeded(tmp_path: Path) -> None:
    _require("CitationFull/cora_ml/raw")
    root = SHARED / "CitationFull"
    a = load_dataset("cora_ml", root, cache_dir=tmp_path)
    b = load_dataset("CORA_ML", root, cache_dir=tmp_path, seed=0)
    c = load_dataset("cora_ml", root, cache_dir=tmp_path, seed=1, train_per_class=5, num_val=100)
    assert torch.equal(a.train_mask, b.train_mask) and torch.equal(a.test_mask, b.test_mask)
    assert not torch.equal(a.train_mask, c.train_mask)
    assert torch.equal(torch.bincount(a.y[a.train_mask]), torch.full((7,), 20))
    assert int(c.train_mask.sum()) == 35 and int(c.val_mask.sum()) == 100


def test_multi_split_selection(tmp_path: Path) -> None:
    _require("Actor/raw")
    root = SHARED / "Actor"
    a = load_dataset("Actor", root, cache_dir=tmp_path)
    b = load_dataset("actor", root, cache_dir=tmp_path, split=1)
    assert not torch.equal(a.train_mask, b.train_mask)
    with pytest.raises(ValueError, match="split"):
        load_dataset("Actor", root, cache_dir=tmp_path, split=10)


def test_read_only_root_is_mirrored(tmp_path: Path) -> None:
    src = _require("Planetoid/Cora/raw")
    root = tmp_path / "ro" / "Planetoid"
    shutil.copytree(src, root / "Cora" / "raw")
    cache = tmp_path / "cache"
    _set_tree_mode(root, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    try:
        data = load_dataset("Cora", root, cache_dir=cache)
        assert data.num_nodes == 2708
        assert not _processed_dirs(root)
        processed = cache / "Planetoid" / "Cora" / "processed" / "data.pt"
        assert processed.is_file()
        assert sorted(p.name for p in (cache / "Planetoid").iterdir()) == ["Cora"]
        mtime = processed.stat().st_mtime_ns
        load_dataset("Cora", root, cache_dir=cache)  # second load reuses the cache
        assert processed.stat().st_mtime_ns == mtime
        # A changed raw file invalidates the mirrored copy and its processed data.
        changed = root / "Cora" / "raw" / "ind.cora.y"
        os.utime(changed, (changed.stat().st_atime, changed.stat().st_mtime - 100))
        assert load_dataset("Cora", root, cache_dir=cache).num_nodes == 2708
        assert processed.stat().st_mtime_ns != mtime
        cached = cache / "Planetoid" / "Cora" / "raw" / "ind.cora.y"
        assert int(cached.stat().st_mtime) == int(changed.stat().st_mtime)
    finally:
        _set_tree_mode(root, 0o755)


def test_cache_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _require("Planetoid/Cora/raw")
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "env-cache"))
    data = load_dataset("Cora", SHARED / "Planetoid")
    assert data.num_nodes == 2708
    assert (tmp_path / "env-cache" / "Planetoid" / "Cora" / "processed").is_dir()


def test_writable_root_is_used_in_place(tmp_path: Path) -> None:
    src = _require("Planetoid/Cora/raw")
    root = tmp_path / "Planetoid"
    shutil.copytree(src, root / "Cora" / "raw")
    cache = tmp_path / "cache"
    data = load_dataset("Cora", root, cache_dir=cache)
    assert data.num_nodes == 2708
    assert (root / "Cora" / "processed").is_dir()
    assert not (cache / "Planetoid").exists()


# --------------------------------------------------------------------------- #
# Real loaders on tiny generated raw files (datasets not available offline)
# --------------------------------------------------------------------------- #
def _write_csv_gz(path: Path, array: np.ndarray, fmt: str) -> None:
    with gzip.open(path, "wt") as f:
        np.savetxt(f, array, fmt=fmt, delimiter=",")


def test_ogb_loader_read_only(tmp_path: Path) -> None:
    """PygNodePropPredDataset on a tiny fake ogbn-arxiv (exercises torch.load weights_only)."""
    pytest.importorskip("ogb")
    root = tmp_path / "ogb"
    d = root / "ogbn_arxiv"
    (d / "raw").mkdir(parents=True)
    (d / "split" / "time").mkdir(parents=True)
    (d / "RELEASE_v1.txt").write_text("test\n")
    n, m = 40, 120
    rng = np.random.default_rng(0)
    _write_csv_gz(d / "raw" / "edge.csv.gz", rng.integers(0, n, size=(m, 2)), "%d")
    _write_csv_gz(d / "raw" / "node-feat.csv.gz", rng.normal(size=(n, 6)), "%.6f")
    _write_csv_gz(d / "raw" / "node-label.csv.gz", rng.integers(0, 40, size=(n, 1)), "%d")
    _write_csv_gz(d / "raw" / "node_year.csv.gz", rng.integers(2000, 2020, size=(n, 1)), "%d")
    _write_csv_gz(d / "raw" / "num-node-list.csv.gz", np.array([[n]]), "%d")
    _write_csv_gz(d / "raw" / "num-edge-list.csv.gz", np.array([[m]]), "%d")
    perm = rng.permutation(n)
    for split, idx in (("train", perm[:20]), ("valid", perm[20:30]), ("test", perm[30:])):
        _write_csv_gz(d / "split" / "time" / f"{split}.csv.gz", idx[:, None], "%d")
    _set_tree_mode(root, stat.S_IRUSR | stat.S_IXUSR)
    try:
        data = load_dataset("OGBN-Arxiv", root, cache_dir=tmp_path / "cache")
    finally:
        _set_tree_mode(root, 0o755)
    _check_normalised(data)
    assert data.num_nodes == n and data.edge_index.size(1) == m
    assert torch.equal(data.train_mask.nonzero().view(-1), torch.from_numpy(np.sort(perm[:20])))
    assert (int(data.val_mask.sum()), int(data.test_mask.sum())) == (10, 10)
    assert not _processed_dirs(root)
    assert (tmp_path / "cache" / "ogb" / "ogbn_arxiv" / "processed").is_dir()


def test_ogb_pickle_allowlist_does_not_patch_torch_load(tmp_path: Path) -> None:
    """OGB's processed file (``torch.save(InMemoryDataset.collate([data]))``, here with a numpy
    ``num_nodes`` as the binary ``.npz`` datasets produce) loads with a bare ``torch.load(path)``
    -- OGB's own call -- inside the allowlist block; ``torch.load`` stays the original function
    during and after it; other globals are still refused; the allowlist is restored after.

    Negative control: the former ``_torch_load_full_pickle`` (a replaced ``torch.load`` with
    ``weights_only=False``) fails the identity checks and loads the ``Fraction`` file."""
    import fractions
    import pickle

    from torch_geometric.data import InMemoryDataset

    from lightning_fullgraph.data.datasets.public import _ogb_pickle_allowlist

    data = Data(x=torch.randn(5, 3), edge_index=torch.tensor([[0, 1, 2], [1, 2, 3]]))
    data.num_nodes = np.int64(5)
    data.node_year = torch.arange(5)[:, None]
    data.y = torch.tensor([[1], [0], [1], [0], [1]])
    path = tmp_path / "geometric_data_processed.pt"
    torch.save(InMemoryDataset.collate([data]), path)
    other = tmp_path / "other.pt"
    torch.save({"x": fractions.Fraction(1, 3)}, other)

    original = torch.load
    before = set(torch.serialization.get_safe_globals())
    weights_only_default = torch.__version__ >= "2.6"  # torch.load's default became weights_only
    if weights_only_default:
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path)  # refused without the allowlist
    with _ogb_pickle_allowlist():
        assert torch.load is original
        loaded, slices = torch.load(path)  # exactly how PygNodePropPredDataset calls it
        if weights_only_default:
            with pytest.raises(pickle.UnpicklingError):
                torch.load(other)  # still a restricted unpickler
    assert torch.load is original
    assert set(torch.serialization.get_safe_globals()) == before  # PyG's own entries kept too
    assert slices is None and int(loaded.num_nodes) == 5
    for key in ("x", "edge_index", "node_year", "y"):
        assert torch.equal(loaded[key], data[key])


def test_reddit_loader(tmp_path: Path) -> None:
    sp = pytest.importorskip("scipy.sparse")
    raw = tmp_path / "Reddit" / "raw"
    raw.mkdir(parents=True)
    n = 30
    rng = np.random.default_rng(0)
    node_types = np.array([1] * 15 + [2] * 5 + [3] * 10)
    np.savez(
        raw / "reddit_data.npz",
        feature=rng.normal(size=(n, 4)).astype(np.float32),
        label=rng.integers(0, 3, size=n),
        node_types=node_types,
    )
    adj = sp.coo_matrix((np.ones(60), (rng.integers(0, n, 60), rng.integers(0, n, 60))), shape=(n, n))
    sp.save_npz(raw / "reddit_graph.npz", adj)
    data = load_dataset("reddit", tmp_path, cache_dir=tmp_path / "cache")  # parent root
    _check_normalised(data)
    assert data.num_nodes == n
    assert (int(data.train_mask.sum()), int(data.val_mask.sum()), int(data.test_mask.sum())) == (15, 5, 10)


def test_default_cache_dir_untouched_with_explicit_cache(tmp_path: Path) -> None:
    _require("Planetoid/Cora/raw")
    home_cache = Path(os.path.expanduser("~")) / ".cache" / "lightning-fullgraph" / "datasets" / "Planetoid"
    existed = home_cache.exists()
    load_dataset("Cora", SHARED / "Planetoid", cache_dir=tmp_path)
    assert home_cache.exists() == existed


def test_a_split_that_does_not_exist_is_refused() -> None:
    """``split=3`` on a dataset that ships one split (``[N]`` masks) or a negative split raises
    instead of silently training the public split. Negative control: returning ``[N]`` masks
    unchanged for any split (the earlier behaviour) makes both ``raises`` fail."""
    from lightning_fullgraph.data.datasets.public import _select_split

    one = torch.zeros(5, dtype=torch.bool)
    assert _select_split(one, 0, "train_mask") is one
    with pytest.raises(ValueError, match="ships one split"):
        _select_split(one, 3, "train_mask")
    with pytest.raises(ValueError, match="split=-1"):
        _select_split(torch.zeros(5, 2, dtype=torch.bool), -1, "train_mask")
    assert _select_split(torch.eye(2, dtype=torch.bool), 1, "train_mask").tolist() == [False, True]
