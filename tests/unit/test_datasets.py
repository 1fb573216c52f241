"""Tests for :mod:`lightning_fullgraph.datasets`."""

from __future__ import annotations

import gzip
import os
import shutil
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv
from torch_geometric.utils import contains_self_loops, degree, homophily, is_undirected

from lightning_fullgraph.datasets import CACHE_ENV_VAR, community_graph, dataset_names, load_dataset

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


def _check_normalised(data: Data) -> None:
    n = data.num_nodes
    assert data.x.dtype == torch.float32 and data.x.dim() == 2 and data.x.size(0) == n
    assert data.y.dtype == torch.int64 and data.y.shape == (n,)
    assert data.edge_index.dtype == torch.int64 and data.edge_index.size(0) == 2
    assert int(data.edge_index.max()) < n and int(data.edge_index.min()) >= 0
    masks = [data.train_mask, data.val_mask, data.test_mask]
    for mask in masks:
        assert mask.dtype == torch.bool and mask.shape == (n,)
        assert mask.any()
        assert (data.y[mask] >= 0).all(), "unlabelled nodes must not be in a mask"
    total = sum(mask.long() for mask in masks)
    assert int(total.max()) <= 1, "masks must be disjoint"


def _set_tree_mode(root: Path, mode: int) -> None:
    for path in [root, *root.rglob("*")]:
        if path.is_dir():
            path.chmod(mode)


# --------------------------------------------------------------------------- #
# community_graph
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def default_graph() -> Data:
    return community_graph()


def _assert_equal_data(a: Data, b: Data) -> None:
    assert a.num_nodes == b.num_nodes
    for key in ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(a[key], b[key]), key


def test_community_deterministic(default_graph: Data) -> None:
    _assert_equal_data(default_graph, community_graph(seed=0))
    other = community_graph(seed=1)
    assert not torch.equal(default_graph.y, other.y)
    assert not torch.equal(default_graph.x, other.x)
    assert default_graph.edge_index.shape != other.edge_index.shape or not torch.equal(
        default_graph.edge_index, other.edge_index
    )


def test_community_does_not_touch_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    community_graph(num_nodes=200)
    assert torch.equal(torch.rand(3), expected)


def test_community_shapes_and_dtypes(default_graph: Data) -> None:
    d = default_graph
    assert d.num_nodes == 3000
    assert d.x.shape == (3000, 64) and d.x.dtype == torch.float32
    assert d.y.shape == (3000,) and d.y.dtype == torch.int64
    assert set(d.y.unique().tolist()) == set(range(5))
    assert d.edge_index.dtype == torch.int64 and d.edge_index.size(0) == 2
    _check_normalised(d)
    # Mean degree close to the requested one.
    assert d.edge_index.size(1) / d.num_nodes == pytest.approx(8.0, rel=0.05)


def test_community_masks(default_graph: Data) -> None:
    d = default_graph
    assert int(d.train_mask.sum()) == 5 * 20
    assert torch.equal(torch.bincount(d.y[d.train_mask], minlength=5), torch.full((5,), 20))
    assert int(d.val_mask.sum()) == 500
    assert int(d.test_mask.sum()) == 1000
    assert not (d.train_mask & d.val_mask).any()
    assert not (d.train_mask & d.test_mask).any()
    assert not (d.val_mask & d.test_mask).any()


def test_community_small_graph_clips_masks() -> None:
    d = community_graph(num_nodes=60, num_classes=3, train_per_class=5, num_val=30, num_test=100)
    assert int(d.train_mask.sum()) == 15
    assert int(d.val_mask.sum()) == 30
    assert int(d.test_mask.sum()) == 15
    assert int((d.train_mask.long() + d.val_mask.long() + d.test_mask.long()).max()) == 1


def test_community_no_self_loops_and_undirected(default_graph: Data) -> None:
    assert not contains_self_loops(default_graph.edge_index)
    assert is_undirected(default_graph.edge_index, num_nodes=default_graph.num_nodes)
    # Coalesced: no duplicates.
    keys = default_graph.edge_index[0] * default_graph.num_nodes + default_graph.edge_index[1]
    assert keys.unique().numel() == keys.numel()


def test_community_directed() -> None:
    d = community_graph(directed=True)
    assert not contains_self_loops(d.edge_index)
    assert not is_undirected(d.edge_index, num_nodes=d.num_nodes)
    assert d.edge_index.size(1) / d.num_nodes == pytest.approx(8.0, rel=0.05)
    assert homophily(d.edge_index, d.y) == pytest.approx(0.8, abs=0.03)


def test_community_isolated_nodes() -> None:
    n = 2000
    d = community_graph(num_nodes=n, isolated_fraction=0.1)
    deg = degree(d.edge_index.flatten(), num_nodes=n)
    num_isolated = int((deg == 0).sum())
    assert 200 <= num_isolated <= 210  # a couple may be isolated by chance
    assert is_undirected(d.edge_index, num_nodes=n)
    assert int((degree(community_graph(num_nodes=n).edge_index.flatten(), num_nodes=n) == 0).sum()) < 10
    everything = community_graph(num_nodes=100, isolated_fraction=1.0)
    assert everything.edge_index.shape == (2, 0)


@pytest.mark.parametrize("h", [0.0, 0.3, 0.8, 1.0])
def test_community_homophily(h: float) -> None:
    d = community_graph(homophily=h)
    assert homophily(d.edge_index, d.y, method="edge") == pytest.approx(h, abs=0.03)


def test_community_single_class_and_no_edges() -> None:
    d = community_graph(num_nodes=50, num_classes=1, homophily=0.0)
    assert (d.y == 0).all() and d.edge_index.size(1) > 0
    assert not contains_self_loops(d.edge_index)
    d = community_graph(num_nodes=50, avg_degree=0.0)
    assert d.edge_index.shape == (2, 0) and d.edge_index.dtype == torch.int64
    d = community_graph(num_nodes=5, num_classes=5)
    assert d.num_nodes == 5


def test_community_feature_noise() -> None:
    d = community_graph(num_nodes=500, feature_noise=0.0)
    # Without noise every node carries exactly its class centroid.
    for c in range(5):
        rows = d.x[d.y == c]
        assert torch.equal(rows, rows[:1].expand_as(rows))


def test_community_large_graph() -> None:
    start = time.perf_counter()
    d = community_graph(num_nodes=100_000)
    elapsed = time.perf_counter() - start
    assert d.num_nodes == 100_000 and d.x.shape == (100_000, 64)
    assert d.edge_index.size(1) == pytest.approx(800_000, rel=0.02)
    print(f"community_graph(num_nodes=100_000) took {elapsed:.2f}s")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_nodes": 0},
        {"num_nodes": 3, "num_classes": 5},
        {"num_classes": 0},
        {"num_features": 0},
        {"avg_degree": -1.0},
        {"avg_degree": float("inf")},
        {"homophily": -0.1},
        {"homophily": 1.5},
        {"homophily": float("nan")},
        {"feature_noise": -1.0},
        {"isolated_fraction": 1.1},
        {"train_per_class": -1},
        {"num_val": -1},
        {"num_test": -5},
        {"num_nodes": 10.5},
        {"directed": "yes"},
    ],
)
def test_community_argument_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        community_graph(**kwargs)


# --------------------------------------------------------------------------- #
# Learnability of the default graph
# --------------------------------------------------------------------------- #
class _GCN(torch.nn.Module):
    def __init__(self, dim_in: int, hidden: int, dim_out: int) -> None:
        super().__init__()
        self.conv1 = GCNConv(dim_in, hidden)
        self.conv2 = GCNConv(hidden, dim_out)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, 0.5, self.training)
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, 0.5, self.training)
        return self.conv2(x, edge_index)


class _MLP(torch.nn.Module):
    def __init__(self, dim_in: int, hidden: int, dim_out: int) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(dim_in, hidden)
        self.lin2 = torch.nn.Linear(hidden, dim_out)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, 0.5, self.training)
        x = F.relu(self.lin1(x))
        x = F.dropout(x, 0.5, self.training)
        return self.lin2(x)


def _train_and_test(model: torch.nn.Module, data: Data, epochs: int = 100) -> float:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    for _ in range(epochs):
        model.train()
        optimizer.zero_grad()
        out = model(data.x, data.edge_index)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        pred = model(data.x, data.edge_index).argmax(-1)
    return float((pred[data.test_mask] == data.y[data.test_mask]).float().mean())


def test_default_graph_is_learnable(default_graph: Data) -> None:
    d = default_graph
    num_classes = int(d.y.max()) + 1
    with torch.random.fork_rng():
        torch.manual_seed(0)
        gcn_acc = _train_and_test(_GCN(d.num_features, 64, num_classes), d)
        torch.manual_seed(0)
        mlp_acc = _train_and_test(_MLP(d.num_features, 64, num_classes), d)
    print(f"default community graph: GCN test acc {gcn_acc:.3f}, MLP test acc {mlp_acc:.3f}")
    assert 0.7 <= gcn_acc <= 0.97
    assert mlp_acc < gcn_acc - 0.3
    assert mlp_acc > 1.0 / num_classes - 0.05  # features are not pure noise either


# --------------------------------------------------------------------------- #
# load_dataset: names, kwargs, synthetic
# --------------------------------------------------------------------------- #
def test_dataset_names() -> None:
    names = dataset_names()
    for name in ("community", "synthetic", "Cora", "CiteSeer", "PubMed", "cora_ml", "tolokers"):
        assert name in names
    for name in ("cornell5", "penn94", "Actor", "Reddit", "ogbn-arxiv", "ogbn-products"):
        assert name in names
    assert len(set(n.lower() for n in names)) == len(names)


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="known datasets: .*Cora"):
        load_dataset("not-a-dataset")


def test_unknown_kwarg(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        load_dataset("Cora", tmp_path, cache_dir=tmp_path, bogus=1)


def test_load_synthetic() -> None:
    a = load_dataset("community", num_nodes=400, seed=3)
    b = load_dataset("SYNTHETIC", root="/nonexistent", cache_dir="/nonexistent", num_nodes=400, seed=3)
    _assert_equal_data(a, b)
    _assert_equal_data(a, community_graph(num_nodes=400, seed=3))


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

    from lightning_fullgraph.datasets import _ogb_pickle_allowlist

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
    from lightning_fullgraph.datasets import _select_split

    one = torch.zeros(5, dtype=torch.bool)
    assert _select_split(one, 0, "train_mask") is one
    with pytest.raises(ValueError, match="ships one split"):
        _select_split(one, 3, "train_mask")
    with pytest.raises(ValueError, match="split=-1"):
        _select_split(torch.zeros(5, 2, dtype=torch.bool), -1, "train_mask")
    assert _select_split(torch.eye(2, dtype=torch.bool), 1, "train_mask").tolist() == [False, True]
