"""Public datasets, read by their real PyG / OGB loader classes from a root and normalised.

:func:`load_public` runs the real loader class (``Planetoid``, ``CitationFull``,
``HeterophilousGraphDataset``, ``LINKXDataset``, ``Actor``, ``Reddit``,
``PygNodePropPredDataset``) for a :class:`~lightning_fullgraph.data.datasets.registry.DatasetSpec`
and normalises its graph into a single :class:`~torch_geometric.data.Data` with

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
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch_geometric.data import Data

from lightning_fullgraph.data.datasets.registry import DatasetSpec
from lightning_fullgraph.data.datasets.splits import fraction_split, planetoid_split

__all__ = ["CACHE_ENV_VAR", "load_public"]

#: Environment variable overriding the default writable cache folder.
CACHE_ENV_VAR = "LIGHTNING_FULLGRAPH_DATA_CACHE"

log = logging.getLogger(__name__)


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


def _dataset_subdir(spec: DatasetSpec, root: Path) -> str:
    """Folder, relative to the loader's ``root``, that holds ``raw/`` and ``processed/``."""
    if spec.family in ("Planetoid", "CitationFull", "Heterophilous", "LINKX"):
        return spec.name
    if spec.family == "ogb":
        dir_name = spec.name.replace("-", "_")
        # PygNodePropPredDataset prefers an existing "<dir>_pyg" folder.
        return dir_name + "_pyg" if (root / (dir_name + "_pyg")).exists() else dir_name
    return ""  # Actor, Reddit: raw/ and processed/ sit directly under root


def _content_dir(spec: DatasetSpec, dataset_dir: Path) -> Path:
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


def _resolve_root(spec: DatasetSpec, root: Path) -> Path:
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


def _instantiate(spec: DatasetSpec, root: str, planetoid_split: str) -> tuple[Data, dict[str, Tensor] | None]:
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


def _finalize(spec: DatasetSpec, data: Data, ogb_split: dict[str, Tensor] | None, options: dict[str, Any]) -> Data:
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
                planetoid_split(
                    y, num_classes, options["train_per_class"], options["num_val"], options["num_test"], gen
                )
            )
        else:  # LINKX without shipped splits
            masks = list(fraction_split(y, 0.5, 0.25, gen))

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



def load_public(spec: DatasetSpec, root: str | os.PathLike[str] | None = None, **kwargs: Any) -> Data:
    """Loads the public dataset ``spec`` with its loader class, as one normalised graph.

    What :func:`~lightning_fullgraph.data.datasets.load_dataset` does for a public name: its
    docstring lists the names, what ``root`` may be and the keyword arguments (``cache_dir``,
    ``split``, ``seed``, ``train_per_class``, ``num_val``, ``num_test``, ``planetoid_split``).

    Raises:
        TypeError: For an unexpected keyword argument.
        ValueError: For an out-of-range ``split``.
    """
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
