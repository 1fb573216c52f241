"""Node-classification datasets for full-graph training.

Two entry points:

* :func:`community_graph` builds the package's embedded default dataset: a
  stochastic-block-model-like graph with community structure, class-dependent
  Gaussian features and Planetoid-style masks.  Nothing is downloaded; it is
  fully vectorised and deterministic for a given ``seed`` (it only uses a
  private :class:`torch.Generator`), and it scales to millions of nodes.
* :func:`load_dataset` loads a named public dataset through the real PyG / OGB
  loader classes (``Planetoid``, ``CitationFull``, ``HeterophilousGraphDataset``,
  ``LINKXDataset``, ``Actor``, ``Reddit``, ``PygNodePropPredDataset``) and
  normalises it into a single :class:`~torch_geometric.data.Data` with

  ============== ============ ======================================
  attribute      dtype        shape
  ============== ============ ======================================
  ``x``          float32      ``[N, F]``
  ``y``          int64        ``[N]`` (``-1`` marks unlabelled nodes)
  ``edge_index`` int64        ``[2, E]``
  ``train_mask`` bool         ``[N]``
  ``val_mask``   bool         ``[N]``
  ``test_mask``  bool         ``[N]``
  ``num_nodes``  int          ``N``
  ============== ============ ======================================

Read-only dataset roots (e.g. a shared offline copy) are supported: PyG writes
``processed/`` beside ``raw/``, so when that location is not writable, the raw
files of the requested dataset (only that one) are mirrored into a writable
cache folder and loaded from there.  The cache folder is, in order of
precedence, the ``cache_dir`` keyword, the ``LIGHTNING_FULLGRAPH_DATA_CACHE``
environment variable, or ``$XDG_CACHE_HOME/lightning-fullgraph/datasets``
(``~/.cache/lightning-fullgraph/datasets``; an earlier version's
``~/.cache/lightning_fullgraph/datasets`` is used while the new one does not exist, with a
warning saying how to move it).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.utils import coalesce, to_undirected

__all__ = ["community_graph", "load_dataset", "dataset_names", "is_synthetic_name", "CACHE_ENV_VAR"]

#: Environment variable overriding the default writable cache folder.
CACHE_ENV_VAR = "LIGHTNING_FULLGRAPH_DATA_CACHE"

log = logging.getLogger(__name__)

# Rows of the feature matrix filled per step (bounds the temporary memory).
_FEATURE_CHUNK = 1 << 16

# Spread of the class centroids relative to the per-node feature noise.  Tuned
# so that, at the default settings, a 2-layer GCN reaches ~88-89% test accuracy
# while an MLP on the features alone stays far below.
_CENTROID_STD = 0.1


# --------------------------------------------------------------------------- #
# Synthetic community graph
# --------------------------------------------------------------------------- #
def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_float(name: str, value: Any, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not (low <= value <= high) or math.isnan(value):
        bounds = f"in [{low}, {high}]" if math.isfinite(high) else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    if math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def community_graph(
    num_nodes: int = 3000,
    num_classes: int = 5,
    num_features: int = 64,
    avg_degree: float = 8.0,
    homophily: float = 0.8,
    feature_noise: float = 1.0,
    directed: bool = False,
    isolated_fraction: float = 0.0,
    train_per_class: int = 20,
    num_val: int = 500,
    num_test: int = 1000,
    seed: int = 0,
) -> Data:
    """Generate a synthetic graph with community structure (the default dataset).

    Every node is assigned a class (its community) uniformly at random.
    ``round(num_nodes * avg_degree / 2)`` edges are then drawn (``num_nodes *
    avg_degree`` when ``directed``): the source is a uniformly random node and,
    with probability ``homophily``, the destination is a uniformly random node of
    the same class, otherwise a uniformly random node of another class.  Self
    loops and duplicate edges are removed and, unless ``directed``, every edge is
    stored in both directions, so the edge homophily of the result is close to
    ``homophily`` and the mean degree close to ``avg_degree``.  A random
    ``isolated_fraction`` of the nodes then loses all its edges.

    Features are ``centroid[y] + feature_noise * N(0, I)`` where each class has
    a random centroid drawn from ``N(0, 0.1^2 I)``.  At the default settings the
    features alone are only weakly informative (an MLP gets ~25-30% test accuracy,
    chance being 20%) whereas neighbourhood aggregation makes the classes separable
    (a 2-layer GCN gets ~88-89%).

    Masks follow the Planetoid protocol: ``train_per_class`` random nodes of each
    class for training (fewer if a class is smaller), then ``num_val`` and
    ``num_test`` random nodes among the rest, clipped to the nodes available.
    The three masks are disjoint.

    The whole construction is vectorised (no per-node or per-edge Python loop)
    and uses only a private :class:`torch.Generator` seeded with ``seed``, so the
    result is deterministic for a given seed and torch version.  A graph with
    10^6 nodes takes a few seconds and well under 1 GiB of memory.

    Args:
        num_nodes: Number of nodes ``N``; must be ``>= num_classes``.
        num_classes: Number of classes / communities ``C``; ``>= 1``.
        num_features: Feature dimension ``F``; ``>= 1``.
        avg_degree: Target mean degree (mean out-degree if ``directed``); ``>= 0``.
        homophily: Fraction of edges joining nodes of the same class, in
            ``[0, 1]``.  With ``num_classes == 1`` every edge is intra-class.
        feature_noise: Standard deviation of the Gaussian feature noise; ``>= 0``.
        directed: Keep the sampled edges directed instead of symmetrising them.
        isolated_fraction: Fraction of nodes, in ``[0, 1]``, that get all their
            edges removed.
        train_per_class: Training nodes per class; ``>= 0``.
        num_val: Validation nodes (clipped to what remains); ``>= 0``.
        num_test: Test nodes (clipped to what remains); ``>= 0``.
        seed: Seed of the private random generator.

    Returns:
        A :class:`~torch_geometric.data.Data` with ``x`` ``[N, F]`` float32,
        ``y`` ``[N]`` int64 in ``[0, C)``, ``edge_index`` ``[2, E]`` int64
        (coalesced, no self loops), boolean ``train_mask`` / ``val_mask`` /
        ``test_mask`` ``[N]`` and ``num_nodes = N``.

    Raises:
        ValueError: If an argument is out of range.
    """
    num_classes = _check_int("num_classes", num_classes, 1)
    num_nodes = _check_int("num_nodes", num_nodes, 1)
    if num_nodes < num_classes:
        raise ValueError(f"num_nodes ({num_nodes}) must be >= num_classes ({num_classes})")
    num_features = _check_int("num_features", num_features, 1)
    avg_degree = _check_float("avg_degree", avg_degree, 0.0)
    homophily = _check_float("homophily", homophily, 0.0, 1.0)
    feature_noise = _check_float("feature_noise", feature_noise, 0.0)
    isolated_fraction = _check_float("isolated_fraction", isolated_fraction, 0.0, 1.0)
    train_per_class = _check_int("train_per_class", train_per_class, 0)
    num_val = _check_int("num_val", num_val, 0)
    num_test = _check_int("num_test", num_test, 0)
    seed = _check_int("seed", seed, -(2**63))
    if not isinstance(directed, bool):
        raise ValueError(f"directed must be a bool, got {directed!r}")

    gen = torch.Generator().manual_seed(seed)
    n, c = num_nodes, num_classes

    # Labels, and the nodes grouped by class: order[starts[k] : starts[k] + counts[k]]
    # are the nodes of class k.
    y = torch.randint(c, (n,), generator=gen)
    order = torch.argsort(y, stable=True)
    counts = torch.bincount(y, minlength=c)
    starts = torch.cumsum(counts, 0) - counts
    centroids = torch.randn(c, num_features, generator=gen) * _CENTROID_STD

    # Edges.
    num_draws = round(n * avg_degree / (1 if directed else 2))
    src = torch.randint(n, (num_draws,), generator=gen)
    src_class = y[src]
    intra = torch.rand(num_draws, generator=gen) < homophily
    u = torch.rand(num_draws, generator=gen, dtype=torch.float64)
    same = counts[src_class]
    other = n - same
    intra |= other == 0  # a single non-empty class: nowhere else to go
    # Uniform position inside the source's class range ...
    intra_pos = starts[src_class] + (u * same).long().clamp_max(same - 1)
    # ... or uniform position outside it (skip over the class range).
    r = (u * other).long().clamp_max((other - 1).clamp_min(0))
    inter_pos = torch.where(r < starts[src_class], r, r + same)
    dst = order[torch.where(intra, intra_pos, inter_pos)]
    del src_class, intra, u, same, other, intra_pos, r, inter_pos

    keep = src != dst
    edge_index = torch.stack([src[keep], dst[keep]])
    del src, dst, keep
    if directed:
        edge_index = coalesce(edge_index, num_nodes=n)
    else:
        edge_index = to_undirected(edge_index, num_nodes=n)

    num_isolated = round(isolated_fraction * n)
    if num_isolated > 0 and edge_index.numel() > 0:
        isolated = torch.zeros(n, dtype=torch.bool)
        isolated[torch.randperm(n, generator=gen)[:num_isolated]] = True
        edge_index = edge_index[:, ~(isolated[edge_index[0]] | isolated[edge_index[1]])]

    # Features: class centroid plus Gaussian noise, filled in chunks.
    x = torch.randn(n, num_features, generator=gen)
    if feature_noise != 1.0:
        x.mul_(feature_noise)
    for lo in range(0, n, _FEATURE_CHUNK):
        hi = min(lo + _FEATURE_CHUNK, n)
        x[lo:hi] += centroids[y[lo:hi]]

    train_mask, val_mask, test_mask = _planetoid_split(y, c, train_per_class, num_val, num_test, gen)
    return Data(
        x=x,
        y=y,
        edge_index=edge_index,
        train_mask=train_mask,
        val_mask=val_mask,
        test_mask=test_mask,
        num_nodes=n,
    )


# --------------------------------------------------------------------------- #
# Split helpers
# --------------------------------------------------------------------------- #
def _planetoid_split(
    y: Tensor,
    num_classes: int,
    train_per_class: int,
    num_val: int,
    num_test: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor, Tensor]:
    """Planetoid-style random split over labelled nodes (``y >= 0``).

    Returns disjoint boolean masks ``[N]``: ``train_per_class`` nodes per class
    (all of a class if it is smaller), then ``num_val`` and ``num_test`` nodes
    drawn from the remaining labelled nodes (clipped to what is available).
    """
    n = y.numel()
    labelled = (y >= 0).nonzero().view(-1)
    perm = labelled[torch.randperm(labelled.numel(), generator=generator)]
    perm_y = y[perm]
    # A stable sort by class keeps the random order inside each class.
    by_class = torch.sort(perm_y, stable=True)
    counts = torch.bincount(perm_y, minlength=num_classes)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(perm.numel()) - starts[by_class.values]
    train_mask = torch.zeros(n, dtype=torch.bool)
    train_mask[perm[by_class.indices[rank < train_per_class]]] = True

    rest = perm[~train_mask[perm]]  # still in random order
    n_val = min(num_val, rest.numel())
    n_test = min(num_test, rest.numel() - n_val)
    val_mask = torch.zeros(n, dtype=torch.bool)
    val_mask[rest[:n_val]] = True
    test_mask = torch.zeros(n, dtype=torch.bool)
    test_mask[rest[n_val : n_val + n_test]] = True
    return train_mask, val_mask, test_mask


def _fraction_split(
    y: Tensor, train: float, val: float, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """Random ``train`` / ``val`` / rest split over labelled nodes (``y >= 0``)."""
    n = y.numel()
    labelled = (y >= 0).nonzero().view(-1)
    perm = labelled[torch.randperm(labelled.numel(), generator=generator)]
    n_train = int(train * perm.numel())
    n_val = int(val * perm.numel())
    masks = [torch.zeros(n, dtype=torch.bool) for _ in range(3)]
    masks[0][perm[:n_train]] = True
    masks[1][perm[n_train : n_train + n_val]] = True
    masks[2][perm[n_train + n_val :]] = True
    return masks[0], masks[1], masks[2]


# --------------------------------------------------------------------------- #
# Named datasets
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _Spec:
    family: str  # loader family; also the sub-folder name under a parent root / the cache
    name: str  # name passed to the loader class
    display: str  # canonical public name


_SYNTHETIC = ("community", "synthetic")

_SPECS: list[_Spec] = [
    _Spec("Planetoid", "Cora", "Cora"),
    _Spec("Planetoid", "CiteSeer", "CiteSeer"),
    _Spec("Planetoid", "PubMed", "PubMed"),
    # CitationFull's "cora" / "citeseer" / "pubmed" clash (case-insensitively)
    # with the Planetoid names, so they are exposed with a ``_full`` suffix.
    _Spec("CitationFull", "cora", "cora_full"),
    _Spec("CitationFull", "cora_ml", "cora_ml"),
    _Spec("CitationFull", "citeseer", "citeseer_full"),
    _Spec("CitationFull", "dblp", "dblp"),
    _Spec("CitationFull", "pubmed", "pubmed_full"),
    *(
        _Spec("Heterophilous", n, n)
        for n in ("roman_empire", "amazon_ratings", "minesweeper", "tolokers", "questions")
    ),
    *(
        _Spec("LINKX", n, n)
        for n in ("penn94", "reed98", "amherst41", "cornell5", "johnshopkins55", "genius")
    ),
    _Spec("Actor", "Actor", "Actor"),
    _Spec("Reddit", "Reddit", "Reddit"),
    *(_Spec("ogb", n, n) for n in ("ogbn-arxiv", "ogbn-products", "ogbn-papers100M")),
]


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def is_synthetic_name(name: str) -> bool:
    """Whether ``name`` names a graph this package generates (``"community"``, the
    products-like family): valid by construction, nothing to download."""
    from lightning_fullgraph.generated import is_generated_name

    return _key(name) in _SYNTHETIC or is_generated_name(name)


_BY_KEY: dict[str, _Spec] = {_key(s.display): s for s in _SPECS}
# Unambiguous aliases.
_BY_KEY.update({f"citationfull_{_key(s.name)}": s for s in _SPECS if s.family == "CitationFull"})
_BY_KEY.update({"corafull": _BY_KEY["cora_full"], "film": _BY_KEY["actor"]})


def dataset_names() -> list[str]:
    """Return the canonical names accepted by :func:`load_dataset`.

    Matching is case-insensitive and treats ``-`` and ``_`` alike; a few
    aliases (``"citationfull_cora"``, ``"corafull"``, ``"film"``) are accepted too.

    Returns:
        The names, synthetic and generated ones first.
    """
    from lightning_fullgraph.generated import GENERATED_NAMES

    return [*_SYNTHETIC, *GENERATED_NAMES, *(s.display for s in _SPECS)]


_LEGACY_NAMED: set[Path] = set()


def _default_cache_dir() -> Path:
    """``$LIGHTNING_FULLGRAPH_DATA_CACHE``, else ``datasets`` in
    :func:`~lightning_fullgraph.partition.cache.user_cache_dir` (a hyphenated folder: one
    named like the package shadows it for Python started beside it).  An earlier version's
    ``~/.cache/lightning_fullgraph/datasets`` is used while the new folder does not exist
    (its downloads stay usable offline), with one warning per process saying how to move it."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    from lightning_fullgraph.partition.cache import user_cache_dir

    new = user_cache_dir() / "datasets"
    try:
        old = Path.home() / ".cache" / "lightning_fullgraph" / "datasets"
    except (RuntimeError, KeyError):
        return new
    if new.exists() or not old.is_dir():
        return new
    if old not in _LEGACY_NAMED:
        _LEGACY_NAMED.add(old)
        log.warning(
            "using the dataset cache of an earlier version, %s; move it to the current default (a folder "
            "named lightning_fullgraph shadows the package for Python started in %s): mkdir -p %s && mv %s %s",
            old,
            old.parent.parent,
            new.parent,
            old,
            new,
        )
    return old


def _dataset_subdir(spec: _Spec, root: Path) -> str:
    """Folder, relative to the loader's ``root``, that holds ``raw/`` and ``processed/``."""
    if spec.family in ("Planetoid", "CitationFull", "Heterophilous", "LINKX"):
        return spec.name
    if spec.family == "ogb":
        dir_name = spec.name.replace("-", "_")
        # PygNodePropPredDataset prefers an existing "<dir>_pyg" folder.
        return dir_name + "_pyg" if (root / (dir_name + "_pyg")).exists() else dir_name
    return ""  # Actor, Reddit: raw/ and processed/ sit directly under root


def _content_dir(spec: _Spec, dataset_dir: Path) -> Path:
    """What must be mirrored to process the dataset elsewhere."""
    # OGB keeps split/, mapping/ and RELEASE_v*.txt beside raw/ (and may rename raw files).
    return dataset_dir if spec.family == "ogb" else dataset_dir / "raw"


def _is_writable(path: Path) -> bool:
    """Whether ``path`` (or, if missing, its nearest existing ancestor) can be written.

    Besides :func:`os.access`, a directory without any write permission bit is
    treated as read-only even for root, who bypasses permission checks.
    """
    path = path.absolute()
    while not path.exists():
        if path.parent == path:
            return False
        path = path.parent
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return os.access(path, os.W_OK) and bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _resolve_root(spec: _Spec, root: Path) -> Path:
    """Accept either the loader's root or a parent folder holding ``<family>/``."""
    here = root / _dataset_subdir(spec, root)
    family_root = root / spec.family
    there = family_root / _dataset_subdir(spec, family_root)
    if not _content_dir(spec, here).exists() and _content_dir(spec, there).exists():
        return family_root
    return root


def _mirror(src: Path, dst: Path, stale_dirs: list[Path], exclude: tuple[str, ...] = ()) -> None:
    """Make ``dst`` hold copies of the regular files under ``src``.

    Files whose size or modification time differ are re-copied (atomically, via a
    temporary name and :func:`os.replace`), and ``stale_dirs`` (processed outputs
    derived from the old files) are deleted when anything changed.
    """
    changed: list[Path] = []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if rel.parts[0] in exclude or not path.is_file():
            continue
        target = dst / rel
        st = path.stat()
        if target.is_file():
            tst = target.stat()
            if tst.st_size == st.st_size and int(tst.st_mtime) == int(st.st_mtime):
                continue
        changed.append(rel)
    if not changed:
        return
    for stale in stale_dirs:
        shutil.rmtree(stale, ignore_errors=True)
    for rel in changed:
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        try:
            shutil.copy2(src / rel, tmp)
            tmp.chmod(tmp.stat().st_mode | stat.S_IWUSR)  # the source may be read-only
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _file_lock(cache_dir: Path, key: str) -> Iterator[None]:
    """Inter-process lock (POSIX ``flock``) so that concurrent ranks do not
    copy or process the same dataset at the same time.  A no-op when locking
    is unavailable."""
    from lightning_fullgraph._os import flock_exclusive

    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    with flock_exclusive(cache_dir / ".locks" / f"{digest}.lock"):
        yield


# Serialises in-process OGB loads: torch's allowlist below is one process-wide set, and a
# second block's exit would otherwise drop entries a concurrent block still needs.
_OGB_ALLOWLIST_LOCK = threading.Lock()


def _ogb_pickle_globals() -> list[Any]:
    """The globals OGB's processed node-property files pickle beyond tensors and containers.

    ``PygNodePropPredDataset`` saves ``InMemoryDataset.collate([data])`` -- a PyG ``Data`` (with
    its ``GlobalStorage`` and the ``DataEdgeAttr``/``DataTensorAttr`` attribute classes) and
    ``slices`` -- and reads it back with a bare ``torch.load(path)``.  Where ``num_nodes`` comes
    from a numpy array (the binary ``.npz`` datasets, e.g. ogbn-papers100M), ``Data`` holds a
    numpy integer scalar: ``numpy.core.multiarray.scalar`` with an int32/int64 ``numpy.dtype``.
    """
    import importlib

    import numpy as np
    from torch_geometric.data.storage import GlobalStorage

    found: list[Any] = [Data, GlobalStorage]
    with contextlib.suppress(ImportError):  # absent from older PyG releases
        from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr

        found += [DataEdgeAttr, DataTensorAttr]
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1
        multiarray = importlib.import_module("numpy.core.multiarray")
    found += [np.dtype, multiarray.scalar, (multiarray.scalar, "numpy.core.multiarray.scalar")]
    found += [type(np.dtype(t)) for t in (np.int32, np.int64)]
    return found


@contextlib.contextmanager
def _ogb_pickle_allowlist() -> Iterator[None]:
    """Let ``torch.load``'s default (``weights_only=True``) unpickler read OGB's processed files.

    OGB (<= 1.3.6) calls ``torch.load`` on its own processed files (pickled ``Data`` objects),
    which torch >= 2.6 refuses by default.  Inside the block the few PyG/numpy classes those
    files contain (:func:`_ogb_pickle_globals`) are added to torch's ``weights_only`` allowlist
    with ``torch.serialization.safe_globals``; ``torch.load`` itself is not replaced, loading
    stays restricted (anything else in a file is still refused), and only the entries that
    were not allowlisted already (PyG registers ``Data`` itself) are added and removed again.
    The allowlist is process-wide while the block runs; blocks are serialised by a lock.
    """
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:  # pragma: no cover - torch < 2.5: torch.load defaults to full pickle
        yield
        return
    with _OGB_ALLOWLIST_LOCK:
        registered = set(torch.serialization.get_safe_globals())
        with safe_globals([g for g in _ogb_pickle_globals() if g not in registered]):
            yield


def _instantiate(spec: _Spec, root: str, planetoid_split: str) -> tuple[Data, dict[str, Tensor] | None]:
    """Run the real loader; returns the raw ``Data`` and OGB's index split if any."""
    if spec.family == "Planetoid":
        from torch_geometric.datasets import Planetoid

        return Planetoid(root, spec.name, split=planetoid_split)[0], None
    if spec.family == "CitationFull":
        from torch_geometric.datasets import CitationFull

        return CitationFull(root, spec.name)[0], None
    if spec.family == "Heterophilous":
        from torch_geometric.datasets import HeterophilousGraphDataset

        return HeterophilousGraphDataset(root, spec.name)[0], None
    if spec.family == "LINKX":
        from torch_geometric.datasets import LINKXDataset

        return LINKXDataset(root, spec.name)[0], None
    if spec.family == "Actor":
        from torch_geometric.datasets import Actor

        return Actor(root)[0], None
    if spec.family == "Reddit":
        from torch_geometric.datasets import Reddit

        return Reddit(root)[0], None
    if spec.family == "ogb":
        from ogb.nodeproppred import PygNodePropPredDataset

        with _ogb_pickle_allowlist():
            dataset = PygNodePropPredDataset(spec.name, root)
            split = dataset.get_idx_split()
            return dataset[0], split
    raise AssertionError(f"unhandled family {spec.family}")  # pragma: no cover


def _select_split(mask: Tensor, split: int, name: str) -> Tensor:
    if split < 0:
        raise ValueError(f"split={split}: choose a split index >= 0")
    if mask.dim() == 1:
        if split != 0:
            raise ValueError(f"{name} ships one split (its mask has shape [N]); split={split} does not exist")
        return mask
    if split >= mask.size(1):
        raise ValueError(f"{name} has {mask.size(1)} splits; split={split} is out of range")
    return mask[:, split]


def _finalize(spec: _Spec, data: Data, ogb_split: dict[str, Tensor] | None, options: dict[str, Any]) -> Data:
    """Convert a loader's ``Data`` into the normalised single-graph form."""
    num_nodes = int(data.num_nodes)
    if data.x is None:
        raise ValueError(f"dataset {spec.display} has no node features")
    x = data.x if data.x.dtype == torch.float32 else data.x.to(torch.float32)

    y = data.y
    if y.dim() == 2 and y.size(1) == 1:
        y = y.view(-1)
    if y.dim() != 1:
        raise ValueError(f"dataset {spec.display} has multi-target labels of shape {tuple(y.shape)}")
    if y.is_floating_point():  # e.g. ogbn-papers100M: NaN marks unlabelled nodes
        y = torch.nan_to_num(y, nan=-1.0)
    y = y.to(torch.int64)

    if ogb_split is not None:
        masks = []
        for key in ("train", "valid", "test"):
            mask = torch.zeros(num_nodes, dtype=torch.bool)
            mask[ogb_split[key]] = True
            masks.append(mask)
    elif getattr(data, "train_mask", None) is not None:
        masks = [
            _select_split(data[key], options["split"], spec.display).to(torch.bool)
            for key in ("train_mask", "val_mask", "test_mask")
        ]
    else:
        gen = torch.Generator().manual_seed(options["seed"])
        if spec.family == "CitationFull":
            num_classes = int(y.max()) + 1 if y.numel() else 0
            masks = list(
                _planetoid_split(
                    y, num_classes, options["train_per_class"], options["num_val"], options["num_test"], gen
                )
            )
        else:  # LINKX without shipped splits
            masks = list(_fraction_split(y, 0.5, 0.25, gen))

    return Data(
        x=x,
        y=y,
        edge_index=data.edge_index.to(torch.int64),
        train_mask=masks[0],
        val_mask=masks[1],
        test_mask=masks[2],
        num_nodes=num_nodes,
    )


_LOAD_OPTIONS: dict[str, Any] = {
    "cache_dir": None,
    "split": 0,
    "seed": 0,
    "train_per_class": 20,
    "num_val": 500,
    "num_test": 1000,
    "planetoid_split": "public",
}


def load_dataset(name: str, root: str | os.PathLike[str] | None = None, **kwargs: Any) -> Data:
    """Load a named node-classification dataset as a single normalised graph.

    Supported names (see :func:`dataset_names`; case-insensitive, ``-`` == ``_``):

    * ``"community"`` / ``"synthetic"``: :func:`community_graph` called with
      ``**kwargs`` (``root`` and ``cache_dir`` are ignored).
    * ``"products-like"``: :func:`lightning_fullgraph.generated.products_like_graph`, a
      generated graph with ogbn-products' statistics (``num_nodes=...`` scales it at the
      same mean degree; ``root`` and ``cache_dir`` are ignored).
    * ``"Cora"``, ``"CiteSeer"``, ``"PubMed"``: ``Planetoid(root, name)``, public split.
    * ``"cora_ml"``, ``"dblp"``, ``"cora_full"``, ``"citeseer_full"``,
      ``"pubmed_full"``: ``CitationFull(root, name)`` (the ``_full`` names map to
      CitationFull's ``cora`` / ``citeseer`` / ``pubmed``), with a seeded
      Planetoid-style split (``train_per_class`` / ``num_val`` / ``num_test``).
    * ``"roman_empire"``, ``"amazon_ratings"``, ``"minesweeper"``, ``"tolokers"``,
      ``"questions"``: ``HeterophilousGraphDataset(root, name)``, split ``split``
      of the 10 shipped ones.
    * ``"penn94"``, ``"reed98"``, ``"amherst41"``, ``"cornell5"``,
      ``"johnshopkins55"``, ``"genius"``: ``LINKXDataset(root, name)``; shipped
      splits where present (penn94), otherwise a seeded random 50/25/25 split
      over the labelled nodes (``y >= 0``; ``y == -1`` is unlabelled).
    * ``"Actor"``: ``Actor(root)``, split ``split`` of the 10 shipped ones.
    * ``"Reddit"``: ``Reddit(root)``.
    * ``"ogbn-arxiv"``, ``"ogbn-products"``, ``"ogbn-papers100M"``:
      ``ogb.nodeproppred.PygNodePropPredDataset(name, root)`` with masks from
      ``get_idx_split()`` and ``y`` flattened to ``[N]`` (NaN labels become -1).

    ``root`` is the folder the loader class expects (e.g. the one holding
    ``Cora/raw/`` for Planetoid, ``raw/`` itself for Actor).  A parent folder
    holding ``<family>/`` (``Planetoid``, ``CitationFull``, ``Heterophilous``,
    ``LINKX``, ``Actor``, ``Reddit``, ``ogb``) is accepted too.  With
    ``root=None`` the dataset lives (and is downloaded, if the loader can) under
    the cache folder.  If the folder where ``processed/`` would be written is not
    writable, this dataset's raw files are mirrored into the cache folder
    (``<cache>/<family>/...``) and processed there; the root is never written.

    Args:
        name: Dataset name.
        root: Loader root folder, or ``None`` for the cache folder.
        **kwargs: For the synthetic dataset, :func:`community_graph` arguments.
            Otherwise: ``cache_dir`` (writable cache folder; default from the
            ``LIGHTNING_FULLGRAPH_DATA_CACHE`` env var or
            ``~/.cache/lightning-fullgraph/datasets``), ``split`` (int, column of
            multi-split masks, default 0), ``seed`` (int, for generated splits,
            default 0), ``train_per_class`` / ``num_val`` / ``num_test`` (generated
            Planetoid-style splits, default 20 / 500 / 1000) and
            ``planetoid_split`` (Planetoid's ``split`` argument, default
            ``"public"``).

    Returns:
        A :class:`~torch_geometric.data.Data` with ``x`` ``[N, F]`` float32, ``y``
        ``[N]`` int64, ``edge_index`` ``[2, E]`` int64, boolean ``train_mask`` /
        ``val_mask`` / ``test_mask`` ``[N]`` and ``num_nodes``.  Other attributes
        of the source dataset are dropped.

    Raises:
        ValueError: For an unknown name (the message lists the known names) or
            an out-of-range ``split``.
        TypeError: For an unexpected keyword argument.
    """
    if not isinstance(name, str):
        raise ValueError(f"dataset name must be a str, got {name!r}")
    key = _key(name)
    if key in _SYNTHETIC:
        kwargs.pop("cache_dir", None)
        return community_graph(**kwargs)
    from lightning_fullgraph.generated import is_generated_name, products_like_graph

    if is_generated_name(name):
        kwargs.pop("cache_dir", None)
        return products_like_graph(**kwargs)
    spec = _BY_KEY.get(key)
    if spec is None:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(dataset_names())}")

    unexpected = sorted(set(kwargs) - set(_LOAD_OPTIONS))
    if unexpected:
        raise TypeError(
            f"load_dataset({spec.display!r}) got unexpected keyword argument(s) {unexpected}; "
            f"accepted: {sorted(_LOAD_OPTIONS)}"
        )
    options = {**_LOAD_OPTIONS, **kwargs}
    cache_dir = Path(options["cache_dir"]).expanduser() if options["cache_dir"] else _default_cache_dir()

    root_path = (cache_dir / spec.family) if root is None else _resolve_root(spec, Path(root).expanduser())
    root_path = root_path.absolute()
    dataset_dir = root_path / _dataset_subdir(spec, root_path)
    source = _content_dir(spec, dataset_dir)
    load_root = root_path
    if not _is_writable(dataset_dir / "processed"):
        # Process (or download) in the cache; the root itself is never written.
        load_root = (cache_dir / spec.family).absolute()
    cached_dir = load_root / _dataset_subdir(spec, root_path)

    with _file_lock(cache_dir, str(cached_dir)):
        if load_root != root_path and source.is_dir():
            _mirror(
                source,
                _content_dir(spec, cached_dir),
                stale_dirs=[cached_dir / "processed"],
                exclude=("processed",) if spec.family == "ogb" else (),
            )
        data, ogb_split = _instantiate(spec, str(load_root), options["planetoid_split"])
    return _finalize(spec, data, ogb_split, options)
