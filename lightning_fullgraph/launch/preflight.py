"""Checks run by the launcher before any rank starts.

A configuration error that every rank would run into (parts that do not match the ranks, a
graph without training nodes, a conv no adapter can make exact, no
:class:`~lightning_fullgraph.FullGraphDataModule`) is cheaper to find in the process that
calls ``trainer.fit``, before it starts the other ranks: no rank is started, no process group
waits for a peer, and the error is raised once, as an ordinary Python exception, with the
same type and message as where it was found before (so ``except ValueError`` still works).

The launchers of :mod:`lightning_fullgraph.launch.launchers` call :func:`check_before_launch` first
thing in ``launch``.  Lightning calls ``launch(trainer_fn, *args)`` *before* it attaches the
model and the datamodule to the trainer, so the model and the datamodule are read from the
arguments of ``trainer_fn`` (:func:`launch_target`).

The global graph is only validated where that costs nothing extra: in the process that
would load it anyway (``prepare_data`` runs on local rank 0, which the ``popen`` launcher
is) or whose memory the ranks inherit (``fork``); it stays cached on the datamodule
(:meth:`~lightning_fullgraph.FullGraphDataModule.global_graph`), so it is loaded once.
Layers a module builds in ``configure_model`` do not exist yet and are checked at setup.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch_geometric.nn import MessagePassing

from lightning_fullgraph.data.datamodule import FullGraphDataModule, selected_anyway

__all__ = [
    "check_before_launch",
    "check_convs",
    "check_data",
    "launch_target",
    "missing_datamodule_error",
    "require_datamodule",
    "world_size",
]

log = logging.getLogger(__name__)

#: The trainer functions Lightning hands to ``launch`` (``Trainer._fit_impl`` ...).
_TRAINER_FUNCTIONS = ("_fit_impl", "_validate_impl", "_test_impl", "_predict_impl")
#: Arguments of those functions that may hold a LightningDataModule instead of dataloaders.
_LOADER_ARGUMENTS = ("train_dataloaders", "dataloaders")


def world_size(strategy: Any) -> int:
    """The number of ranks a strategy will run: ``num_nodes * num_processes`` (its
    ``world_size`` is only known once the process group exists)."""
    return max(1, int(getattr(strategy, "num_nodes", 1) or 1)) * max(
        1, int(getattr(strategy, "num_processes", 1) or 1)
    )


def missing_datamodule_error(datamodule: object) -> TypeError:
    """The error for a run whose data does not come from a FullGraphDataModule."""
    got = type(datamodule).__name__ if datamodule is not None else "no datamodule"
    return TypeError(
        "FullGraphStrategy trains on graph partitions and needs a FullGraphDataModule: "
        f"call `trainer.fit(model, datamodule=FullGraphDataModule(data))` (got {got})"
    )


def require_datamodule(datamodule: object) -> FullGraphDataModule:
    """Returns ``datamodule`` if it is a FullGraphDataModule.

    Raises:
        TypeError: :func:`missing_datamodule_error` otherwise.
    """
    if not isinstance(datamodule, FullGraphDataModule):
        raise missing_datamodule_error(datamodule)
    return datamodule


def check_convs(module: torch.nn.Module) -> None:
    """Checks that every ``MessagePassing`` submodule of ``module`` has a partition adapter
    that can run it, as the strategy's setup does (:func:`~lightning_fullgraph.nn.patch.install_adapters`).

    Raises:
        UnsupportedConvError: for the first conv without one, with setup's message (the
            supported convs, and how to register an adapter where that is possible).
    """
    # The same check as installation (one implementation, one message); nothing is patched.
    from lightning_fullgraph.nn.registry import check_installable

    for conv in module.modules():
        if isinstance(conv, MessagePassing):
            check_installable(conv)


def check_data(
    datamodule: FullGraphDataModule, world_size: int, load_graph: bool, mask_key: str = "train_mask"
) -> None:
    """The datamodule's own checks before partitioning, for a run of ``world_size`` ranks.

    ``num_parts`` against the world size; a partition folder's part count; with
    ``load_graph`` (or a graph already loaded), the global graph
    (:func:`~lightning_fullgraph.data.validation.validate_graph`: masks, a training node with
    ``require_train``, ids, shapes...).  The loaded graph stays cached on the datamodule.

    Args:
        datamodule: The run's datamodule.
        world_size: The run's ranks.
        load_graph: Whether this process may load the global graph (it would anyway).
        mask_key: The strategy's ``mask_key``.  The graph is only loaded here when the
            datamodule would select the same masks as with the trainer attached (a
            ``mask_key`` ending in ``_mask``); otherwise ``prepare_data`` checks it.

    Raises:
        ValueError: parts differ from ranks.
        PartitionCacheError: a partition folder with another number of parts.
        GraphValidationError: the graph cannot be trained on (the message has the fix).
    """
    parts = datamodule.expected_parts(world_size)
    same_masks = selected_anyway(mask_key)
    datamodule.check_data(parts, load_graph=load_graph and same_masks)


def launch_target(
    trainer: Any, function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[LightningModule | None, LightningDataModule | None] | None:
    """The model and datamodule the trainer function handed to ``launch`` will run on.

    Lightning's ``fit`` passes ``(model, train_dataloaders, val_dataloaders, datamodule, ...)``,
    ``validate``/``test`` ``(model, dataloaders, ckpt_path, verbose, datamodule, ...)`` and
    ``predict`` ``(model, dataloaders, datamodule, ...)``; a datamodule may come as the
    dataloaders argument, and a missing model or datamodule is the one already attached.

    Returns:
        ``(model, datamodule)`` (either may be ``None``), or ``None`` for a function that is
        not one of the trainer's entry points.
    """
    if getattr(function, "__name__", None) not in _TRAINER_FUNCTIONS:
        return None
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    model = bound.get("model")
    if model is None:
        model = getattr(trainer, "lightning_module", None)
    datamodule = bound.get("datamodule")
    if datamodule is None:
        datamodule = next(
            (bound[k] for k in _LOADER_ARGUMENTS if isinstance(bound.get(k), LightningDataModule)), None
        )
    if datamodule is None:
        datamodule = getattr(trainer, "datamodule", None)
    return model, datamodule


def check_before_launch(
    trainer: Any,
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    load_graph: bool,
    node_rank: int = 0,
) -> None:
    """Runs every check that does not need the ranks, before they start.

    In order: the data comes from a FullGraphDataModule (:func:`require_datamodule`);
    ``num_parts`` against the world size and, where ``load_graph`` allows, the global
    graph (:func:`check_data`); the model's convs (:func:`check_convs`).

    Args:
        trainer: The trainer (``launch``'s ``trainer=``); nothing is checked without one.
        function: The trainer function given to ``launch``, with its ``args``/``kwargs``.
        load_graph: This process may load the global graph (see :func:`check_data`); only
            where ``prepare_data`` would run (every node's local rank 0, or node 0 when the
            datamodule sets ``prepare_data_per_node=False``).
        node_rank: This process's node.

    Raises:
        TypeError, ValueError, PartitionCacheError, GraphValidationError, UnsupportedConvError:
            what the ranks would have raised, with the same message.
    """
    if trainer is None:
        return
    target = launch_target(trainer, function, args, kwargs)
    if target is None:
        return
    model, datamodule = target
    strategy = trainer.strategy
    dm = require_datamodule(datamodule)
    loads_here = load_graph and (dm.prepare_data_per_node or node_rank == 0)
    check_data(dm, world_size(strategy), loads_here, getattr(strategy, "mask_key", "train_mask"))
    if isinstance(model, torch.nn.Module):
        check_convs(model)
    log.debug(
        "preflight checks passed (%d rank(s), graph %s)",
        world_size(strategy),
        "checked" if loads_here else "not loaded",
    )
