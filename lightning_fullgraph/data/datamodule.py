"""``FullGraphDataModule``: partition a graph once, give each rank its own part.

``prepare_data`` (one process per node) loads the global graph, partitions it and writes
the partition folder, unless a valid one is cached.  ``setup`` (every rank) reads only the
manifest and that rank's part file.  Every dataloader yields one batch per epoch: the
rank's local graph as a PyG ``Data`` (see :class:`~lightning_fullgraph.comm.plan.LocalPartition`).

Multi-split node masks (``[N, S]``, as tolokers, Actor, WikiCS and the LINKX sets ship
them) never reach training: the datamodule keeps column ``split`` of every such mask
before the graph is fingerprinted and partitioned (:func:`select_mask_split`), so each
split has its own partition cache folder and every rank sees ``[N]`` masks.
"""

from __future__ import annotations

import copy
import logging
import numbers
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torch_geometric.data import Data

from lightning_fullgraph.comm.plan import LocalPartition
from lightning_fullgraph.data.validation import (
    MASK_KEYS,
    GraphValidationError,
    mask_dtype_problem,
    validate_graph,
)
from lightning_fullgraph.partition.cache import (
    PartitionCacheError,
    PartitionResult,
    check_manifest,
    ensure_partitions,
    load_part,
    read_manifest,
)
from lightning_fullgraph.partition.partitioner import BALANCE_MODES, PARTITION_METHODS

__all__ = ["FullGraphDataModule", "check_num_parts", "load_graph", "select_mask_split", "selected_anyway"]

log = logging.getLogger(__name__)


class _OneGraph(Dataset):
    """A dataset of exactly one item: this rank's local graph."""

    def __init__(self, data: Data) -> None:
        self.data = data

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> Data:
        return self.data


def _identity(item: Any) -> Any:
    return item


def load_graph(data: Any, root: str | os.PathLike | None = None, **kwargs: Any) -> Data:
    """Turns what a user passes as ``data`` into one PyG ``Data``.

    Args:
        data: A ``Data``; a PyG dataset (its first graph); or a dataset name for
            :func:`lightning_fullgraph.data.datasets.load_dataset` (with ``root``).
        root: Folder of the dataset for named datasets.
        **kwargs: Passed to ``load_dataset`` for named datasets.
    """
    if isinstance(data, Data):
        return data
    if isinstance(data, str):
        from lightning_fullgraph.data.datasets import load_dataset

        return load_dataset(data, root=root, **kwargs)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        if len(data) != 1:
            raise ValueError(f"expected a dataset holding one graph, got {len(data)} graphs")
        graph = data[0]
        if not isinstance(graph, Data):
            raise TypeError(f"the dataset's item is a {type(graph).__name__}, not a torch_geometric Data")
        return graph
    raise TypeError(f"`data` must be a torch_geometric Data, a PyG dataset or a dataset name; got {type(data).__name__}")


def selected_anyway(mask_key: str) -> bool:
    """Whether :func:`select_mask_split` selects the node mask ``mask_key`` whatever the
    strategy's ``mask_key`` is: ``train_mask``, ``val_mask``, ``test_mask`` and every key
    ending in ``_mask`` (another ``mask_key`` changes what is selected)."""
    return mask_key in MASK_KEYS or mask_key.endswith("_mask")


def check_num_parts(num_parts: int | None, world_size: int) -> int:
    """The number of parts a run of ``world_size`` ranks trains on.

    Args:
        num_parts: ``FullGraphDataModule(num_parts=...)``; ``None`` means one per rank.
        world_size: The run's ranks (``num_nodes * devices``).

    Raises:
        ValueError: ``num_parts`` is set and differs from ``world_size`` (each rank trains
            exactly one part), with the two ways to fix it.
    """
    parts = num_parts or world_size
    if parts != world_size:
        raise ValueError(
            f"FullGraphDataModule(num_parts={parts}) but the trainer runs {world_size} rank(s); each rank "
            f"trains one part: set num_parts=None (or {world_size}), or run with {parts} devices"
        )
    return parts


def _check_split(split: Any) -> int:
    if isinstance(split, bool) or not isinstance(split, numbers.Integral) or split < 0:
        raise ValueError(f"split must be a non-negative int (a column of the [N, S] node masks), got {split!r}")
    return int(split)


def _multi_split_keys(data: Data, mask_keys: Iterable[str] = ()) -> list[str]:
    """Names of the bool ``[N, S]`` node masks of ``data`` (``MASK_KEYS``, ``*_mask``, ``mask_keys``)."""
    try:
        num_nodes = int(data.num_nodes)
    except Exception:  # malformed graph: validate_graph reports it with the fix
        return []
    keys = dict.fromkeys((*MASK_KEYS, *(k for k in data.keys() if k.endswith("_mask")), *mask_keys))
    return [
        key
        for key in keys
        if isinstance(mask := data.get(key), Tensor)
        and mask.dtype == torch.bool
        and mask.dim() == 2
        and mask.size(0) == num_nodes
    ]


def select_mask_split(data: Data, split: int = 0, mask_keys: Iterable[str] = ()) -> Data:
    """Keeps column ``split`` of every multi-split node mask of ``data``.

    A multi-split mask is a bool tensor of shape ``[N, S]`` (``N = data.num_nodes``) stored
    under ``train_mask``, ``val_mask``, ``test_mask``, any other key ending in ``_mask``,
    or a key of ``mask_keys``; it becomes ``mask[:, split]`` of shape ``[N]``, as PyG's
    examples do (``data.train_mask[:, split]``).  Other attributes, and masks that are not
    ``[N, S]`` (``validate_graph`` reports those), are left as they are; an ``[N, S]`` mask
    that is not bool under ``train_mask``, ``val_mask``, ``test_mask`` or a key of
    ``mask_keys`` is refused with :func:`~lightning_fullgraph.data.validation.mask_dtype_problem`'s
    message (convert it with ``mask != 0``), whatever ``split``.

    Args:
        data: The graph (a global graph or one rank's part: only the rows differ).
        split: The column to keep, ``0 <= split < S``.
        mask_keys: Further attribute names to treat as node masks.

    Returns:
        ``data`` itself if it has no multi-split mask, else a shallow copy with the
        selected masks; ``data`` is never modified.

    Raises:
        ValueError: ``split`` is not in ``[0, S)`` for a mask with ``S`` columns; or
            ``split != 0`` but no mask has several splits (the split asked for does not
            exist, and silently training on the only one would be a different experiment);
            or (a :class:`~lightning_fullgraph.data.validation.GraphValidationError`) an ``[N, S]``
            node mask is not bool.
    """
    split = _check_split(split)
    try:
        num_nodes = int(data.num_nodes)
    except Exception:  # malformed graph: validate_graph reports it with the fix
        num_nodes = -1
    for key in dict.fromkeys((*MASK_KEYS, *mask_keys)):
        mask = data.get(key)
        if isinstance(mask, Tensor) and mask.dim() == 2 and mask.size(0) == num_nodes:
            problem = mask_dtype_problem(key, mask, num_nodes)
            if problem is not None:  # a multi-split mask all the same: say what is wrong with it
                raise GraphValidationError(f"{problem}; then split={split} selects its column {split}")
    selected: dict[str, Tensor] = {}
    for key in _multi_split_keys(data, mask_keys):
        mask = data[key]
        num_splits = int(mask.size(1))
        if not split < num_splits:
            raise ValueError(
                f"data.{key} has S={num_splits} splits (shape {list(mask.shape)}); split={split} is out of "
                f"range: choose 0 <= split < {num_splits}"
            )
        selected[key] = mask[:, split].contiguous()
    if not selected:
        if split != 0:
            raise ValueError(
                f"split={split} but the graph has no multi-split [N, S] node mask (its masks are [N], a single "
                "split): there is no split to choose; leave split=0"
            )
        return data
    out = copy.copy(data)
    for key, mask in selected.items():
        out[key] = mask
    return out


class FullGraphDataModule(pl.LightningDataModule):
    """Partitions a graph and serves each rank its part, one full-graph batch per epoch.

    Args:
        data: The graph: a PyG ``Data``, a PyG dataset with one graph, a dataset name
            (``"community"``, Planetoid names, OGB node-property names, ... see
            :func:`lightning_fullgraph.data.datasets.load_dataset`), or the path of a partition
            folder written by ``lightning-fullgraph partition`` (then the global graph is
            never loaded).
        num_parts: Number of parts; default (``None``) the trainer's world size.  It must
            equal the world size when training.
        partition: ``"metis"`` (minimises communication volume) or ``"random"``.
        cache_dir: Folder for partition folders; default ``$LIGHTNING_FULLGRAPH_CACHE`` or
            ``$XDG_CACHE_HOME/lightning-fullgraph/partitions`` (``~/.cache/lightning-fullgraph/partitions``;
            see :func:`~lightning_fullgraph.partition.cache.default_cache_root`).
        root: Dataset folder for named datasets.
        seed: Partitioner seed.
        dataset_kwargs: Extra arguments of ``load_dataset`` for named datasets (e.g. the
            size of the generated ``"community"`` graph).  The split is chosen by ``split``
            alone: a ``"split"`` entry here must equal it.
        require_train: Refuse a graph without any node in ``train_mask`` (set False for
            graphs used only to validate, test or predict).
        balance: What ``"metis"`` balances across the ranks: ``"edges"`` (default; the
            in-edges each rank aggregates, which dominate its compute time) or ``"nodes"``
            (node counts). Part of the partition cache key. Ignored by ``"random"`` and when
            ``data`` is a partition folder (it was balanced when it was written).
        split: Which split of multi-split node masks to train and evaluate on (default 0,
            as PyG's examples use ``data.train_mask[:, 0]``).  Every bool node mask of shape
            ``[N, S]`` (``train_mask``, ``val_mask``, ``test_mask``, any other ``*_mask``
            and the strategy's ``mask_key``) becomes its column ``split`` before the graph
            is partitioned, so each split has its own partition cache folder and every rank
            sees ``[N]`` masks; named datasets (tolokers, Actor, ...) receive it as
            ``load_dataset(..., split=split)``.  ``ValueError`` if ``split >= S``, or if
            ``split != 0`` and the graph has only ``[N]`` masks.  A partition folder given as
            ``data`` keeps the split it was written with (``[N, S]`` masks in it are
            selected per rank the same way).

    Attributes:
        local_partition: This rank's :class:`LocalPartition` after ``setup``.
        partition_result: What ``prepare_data`` did (cache hit or rebuild, and why), on the
            process that ran it.
    """

    def __init__(
        self,
        data: Any = "community",
        num_parts: int | None = None,
        partition: str = "metis",
        cache_dir: str | os.PathLike | None = None,
        root: str | os.PathLike | None = None,
        seed: int = 0,
        dataset_kwargs: dict[str, Any] | None = None,
        require_train: bool = True,
        balance: str = "edges",
        split: int = 0,
    ) -> None:
        super().__init__()
        if partition not in PARTITION_METHODS:
            raise ValueError(f"partition={partition!r}; choose one of {PARTITION_METHODS}")
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance={balance!r}; choose one of {BALANCE_MODES}")
        if num_parts is not None and (not isinstance(num_parts, int) or num_parts < 1):
            raise ValueError(f"num_parts must be a positive int or None, got {num_parts!r}")
        self.data = data
        self.num_parts = num_parts
        self.partition = partition
        self.balance = balance
        self.cache_dir = cache_dir
        self.root = root
        self.seed = seed
        self.split = _check_split(split)
        self.dataset_kwargs = dict(dataset_kwargs or {})
        if "split" in self.dataset_kwargs:
            given = self.dataset_kwargs.pop("split")
            if given != self.split:
                raise ValueError(
                    f"dataset_kwargs={{'split': {given!r}}} conflicts with split={self.split}: the split is "
                    f"chosen by FullGraphDataModule(split=...) alone; pass split={given!r} and drop it from "
                    "dataset_kwargs"
                )
        self.require_train = require_train
        self.local_partition: LocalPartition | None = None
        self.partition_result: PartitionResult | None = None
        self._folder: Path | None = None
        self._graph: Data | None = None
        self._manifest: dict[str, Any] | None = None
        # What the loaded state was made for: the masks selected in ``_graph``; the part count
        # and masks of ``_folder`` (prepare_data); the rank, world size and masks of
        # ``local_partition`` (setup).  A setup for other ranks (e.g. a setup() without a
        # trainer before trainer.fit) is redone, never reused.
        self._graph_mask_keys: tuple[str, ...] = ()
        self._graph_split_keys: frozenset[str] = frozenset()  # masks of _graph selected from [N, S]
        self._prepared_as: tuple[int, tuple[str, ...]] | None = None
        self._loaded_as: tuple[int, int, tuple[str, ...]] | None = None

    # -- helpers --------------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def expected_parts(self, world_size: int | None = None) -> int:
        """The number of parts: ``num_parts``, which must equal the world size (``world_size``,
        default the attached trainer's; without a trainer ``num_parts`` is not checked).

        Raises:
            ValueError: :func:`check_num_parts`'s, parts that differ from the ranks.
        """
        if world_size is None:
            _, world_size = self._world()
            if self.trainer is None:
                return self.num_parts or world_size
        return check_num_parts(self.num_parts, world_size)

    def _partition_folder_given(self) -> Path | None:
        if isinstance(self.data, (str, os.PathLike)) and (Path(self.data) / "manifest.json").is_file():
            return Path(self.data)
        return None

    def _mask_keys(self) -> tuple[str, ...]:
        """The strategy's ``mask_key`` (when a trainer is attached), selected like ``*_mask``."""
        strategy = getattr(self.trainer, "strategy", None) if self.trainer is not None else None
        key = getattr(strategy, "mask_key", None)
        return (key,) if isinstance(key, str) else ()

    def _selection_keys(self) -> tuple[str, ...]:
        """The keys of :meth:`_mask_keys` that change what :func:`select_mask_split` selects
        (``train_mask``, ``val_mask``, ``test_mask`` and ``*_mask`` are selected anyway): what a
        loaded graph, partition folder or part must have been made for to be reused."""
        return tuple(k for k in self._mask_keys() if not selected_anyway(k))

    def global_graph(self) -> Data:
        """The whole graph (loaded on first use) with column ``split`` of every ``[N, S]``
        node mask (see :func:`select_mask_split`). Not available for partition-folder data."""
        keys = self._mask_keys()
        if self._graph is not None and self._graph_mask_keys != self._selection_keys():
            self._graph = None  # selected for another mask_key (e.g. before a trainer was attached)
        if self._graph is None:
            if self._partition_folder_given() is not None:
                raise RuntimeError(f"data={self.data!r} is a partition folder: the global graph is not loaded")
            kwargs = dict(self.dataset_kwargs)
            remaining = self.split
            from lightning_fullgraph.data.datasets import is_synthetic_name

            if isinstance(self.data, str) and not is_synthetic_name(self.data):
                # load_dataset selects the split itself (and drops the other columns).
                kwargs["split"] = self.split
                remaining = 0
            graph = load_graph(self.data, root=self.root, **kwargs)
            self._graph = select_mask_split(graph, remaining, keys)
            self._graph_mask_keys = self._selection_keys()
            if remaining == 0 and self.split != 0:  # load_dataset selected the split of its masks
                self._graph_split_keys = frozenset(MASK_KEYS)
            else:
                self._graph_split_keys = frozenset(
                    k
                    for k in self._graph.keys()
                    if isinstance(graph[k], Tensor) and graph[k].dim() == 2 and self._graph[k] is not graph[k]
                )
        return self._graph

    def check_data(self, parts: int, load_graph: bool = True) -> Path | None:
        """The checks before partitioning (``prepare_data``; also the launcher's, before any
        rank starts: :mod:`lightning_fullgraph.launch.preflight`).  A partition folder given as
        ``data`` must hold ``parts`` parts; otherwise the global graph must pass
        :func:`validate_graph` (checked when ``load_graph`` or already loaded; it stays
        cached).  Returns the partition folder given as ``data``, if any."""
        given = self._partition_folder_given()
        if given is not None:
            read_manifest(given)  # (its own error for a missing or malformed manifest)
            reason = check_manifest(given, {"num_parts": parts})
            if reason is not None:
                raise PartitionCacheError(
                    f"cannot use partition folder {given}: {reason}. Each rank trains one part: write a "
                    f"folder with {parts} part(s) (`lightning-fullgraph partition --data <graph> --num-parts "
                    f"{parts}`) and pass that one, or pass the graph itself as data (it is partitioned for "
                    f"the run's ranks)"
                )
            return given
        if (load_graph and not self._generated()) or self._graph is not None:
            # Before any partitioning or process-group work: bad input fails here, with the fix.
            # (A generated graph is valid by construction and is not built just to check it.)
            graph = self.global_graph()
            split = self.split if "train_mask" in self._graph_split_keys else None
            validate_graph(graph, num_parts=parts, require_train=self.require_train, split=split)
        return None

    # -- Lightning hooks ------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Partitions the graph into the cache unless a valid partition exists (once per node)."""
        parts = self.expected_parts()
        given = self.check_data(parts)
        self._prepared_as = None
        if given is not None:
            manifest = read_manifest(given)
            self._folder = given
            self._prepared_as = (parts, self._selection_keys())
            self.partition_result = PartitionResult(folder=given, rebuilt=False, reason="partition folder given")
            log.info("using partition folder %s (%s)", given, manifest.get("method"))
            return
        graph: Any = self.global_graph
        fingerprint = None
        if self._generated():
            # keyed by (name, arguments, generator version): a cache hit never generates it
            from lightning_fullgraph.data.datasets import generated_fingerprint

            fingerprint = generated_fingerprint(self.data, **self.dataset_kwargs)
        if fingerprint is None or self._graph is not None:
            graph = graph()
        self.partition_result = ensure_partitions(
            graph, parts, method=self.partition, seed=self.seed, cache_root=self.cache_dir, balance=self.balance,
            fingerprint=fingerprint,
        )
        self._folder = self.partition_result.folder
        self._manifest = None
        self._prepared_as = (parts, self._selection_keys())
        if isinstance(self.data, (str, os.PathLike)):
            # a graph this datamodule loaded itself is not kept through training (each rank
            # holds only its part); global_graph() loads it again if asked
            del graph
            self._graph = None

    def _generated(self) -> bool:
        """Whether ``data`` names a generated graph (:mod:`lightning_fullgraph.data.datasets.products_like`)."""
        from lightning_fullgraph.data.datasets import is_generated_name

        return is_generated_name(self.data)

    def setup(self, stage: str | None = None) -> None:
        """Loads this rank's part (and only it).

        With a trainer attached, the part of the trainer's rank among its ``world_size`` ranks;
        a part loaded for other ranks (a ``setup()`` without a trainer before ``trainer.fit``,
        or another trainer) is dropped and the graph partitioned for these ranks.

        Without a trainer (a user's call, e.g. to read :attr:`num_features` before
        ``trainer.fit``), the partition folder for ``num_parts`` parts (default 1) is made and
        its manifest read; the one part of a one-part partition is loaded (one process trains
        the whole graph), no part of a larger one (there is no rank to load it for).  Nothing
        of it is pinned: the trainer's setup chooses each rank's part.
        """
        rank, world = self._world()
        trainer = self.trainer
        if trainer is not None and world > 1:
            # (an attribute, not an isinstance check: the strategy imports this module)
            if not getattr(trainer.strategy, "trains_on_partitions", False):
                raise TypeError(
                    f"FullGraphDataModule with {world} ranks needs the full-graph strategy: "
                    f"Trainer(strategy='fullgraph_quant') (got {type(trainer.strategy).__name__})"
                )
        keys, ident = self._mask_keys(), self._selection_keys()
        if self.local_partition is not None and self._loaded_as == (rank, world, ident):
            return  # (later fit/validate/test calls of the same trainer keep the partition)
        if self.local_partition is not None:
            plan = self.local_partition.plan
            log.info(
                "dropping part %d of %d loaded by an earlier setup(): this one is for rank %d of %d",
                plan.rank,
                plan.world_size,
                rank,
                world,
            )
        self.local_partition = None
        self._loaded_as = None
        if trainer is None:
            parts = self.expected_parts()
            if self._folder is None or self._prepared_as != (parts, ident):
                self.prepare_data()
            folder = self._folder
            if parts != 1:
                log.info(
                    "setup() without a trainer: %s holds %d parts, one per rank; no part is loaded until "
                    "a trainer with %d ranks calls setup()",
                    folder,
                    parts,
                    parts,
                )
                return
        else:
            if (
                rank == 0
                and trainer.local_rank == 0
                and (self._folder is None or self._prepared_as != (world, ident))
            ):
                self.prepare_data()  # (Lightning has normally run it for these ranks already)
            folder = self._folder
            if world > 1:
                # every rank loads from rank 0's folder, whatever it prepared itself before
                folder = trainer.strategy.broadcast(folder, src=0)
        if folder is None:
            raise RuntimeError("no partition folder: prepare_data() did not run")
        if Path(folder) != self._folder:
            self._manifest = None
        self._folder = Path(folder)
        part = load_part(self._folder, rank)
        # A folder this datamodule wrote already has [N] masks (a no-op); a given folder may
        # hold [N, S] masks: selecting rows then a column = selecting a column then rows.
        given = self._partition_folder_given() is not None
        if given and self.split != 0 and not _multi_split_keys(part.data, keys):
            raise ValueError(
                f"split={self.split} but the partition folder {self._folder} holds single-split [N] masks: "
                "its split was chosen when it was written (e.g. lightning-fullgraph partition NAME "
                "--dataset-kwargs '{\"split\": k}'); leave split=0 with a partition folder"
            )
        part.data = select_mask_split(part.data, self.split if given else 0, keys)
        if part.plan.world_size != world:
            raise PartitionCacheError(
                f"{self._folder} holds {part.plan.world_size} parts but {world} rank(s) run; each rank trains "
                f"one part: give data as the graph itself with num_parts=None (it is partitioned for the "
                f"trainer's ranks), or a partition folder of {world} parts, or run {part.plan.world_size} ranks"
            )
        self.local_partition = part
        self._loaded_as = (rank, world, ident)

    @property
    def manifest(self) -> dict[str, Any]:
        """The partition manifest (after ``setup``): sizes, method, fingerprint, per-part counts."""
        if self._folder is None:
            raise RuntimeError("call setup() first")
        if self._manifest is None:
            self._manifest = read_manifest(self._folder)
        return self._manifest

    @property
    def num_features(self) -> int | None:
        """Input feature width of the graph (after ``setup``)."""
        return self.manifest.get("num_features")

    @property
    def num_classes(self) -> int | None:
        """Number of classes, ``max(y) + 1`` over the whole graph (after ``setup``)."""
        return self.manifest.get("num_classes")

    def move_to(self, device: torch.device | str) -> None:
        """Moves the local graph to ``device`` once, so no batch is copied per epoch."""
        if self.local_partition is not None:
            self.local_partition.data = self.local_partition.data.to(device)

    def _loader(self) -> DataLoader:
        if self.local_partition is None:
            prepared = self._prepared_as
            if (
                self.trainer is None
                and self._folder is not None
                and prepared is not None
                and prepared[0] != 1
            ):
                parts = prepared[0]
                raise RuntimeError(
                    f"FullGraphDataModule(num_parts={parts}) was set up without a trainer: {self._folder} holds "
                    f"{parts} parts, one per rank, and no rank is known here, so no part is loaded. Train "
                    f"with Trainer(devices={parts}, strategy='fullgraph_quant') (its setup loads each rank's "
                    f"part), or use num_parts=None (one part) to iterate the whole graph in this process"
                )
            raise RuntimeError("call setup() (the Trainer does) before asking for dataloaders")
        return DataLoader(_OneGraph(self.local_partition.data), batch_size=None, collate_fn=_identity)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()

    def teardown(self, stage: str | None = None) -> None:
        # Keep the partition for later fit/validate/test calls of the same trainer.
        return None
