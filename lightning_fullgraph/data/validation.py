"""Up-front checks of a global graph before it is partitioned.

:func:`validate_graph` inspects a PyG :class:`~torch_geometric.data.Data` and raises
:class:`GraphValidationError` on the first problem it finds, with a message that names the
problem (which attribute, what was expected, what was found) and says how to fix it.  It is
meant to run in ``FullGraphDataModule.prepare_data`` (before partitioning) and ``setup``,
so that a malformed graph fails with a readable error instead of a shape mismatch deep
inside METIS, the halo plan or a distributed collective.

Every check is vectorised (a handful of reductions over each tensor, no Python loop over
nodes or edges), so validation costs far less than partitioning.  ``data`` is only read,
never modified.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor
from torch_geometric.data import Data

__all__ = [
    "MASK_KEYS",
    "EDGE_KEYS",
    "GraphValidationError",
    "all_finite",
    "mask_dtype_problem",
    "validate_graph",
]

MASK_KEYS: tuple[str, ...] = ("train_mask", "val_mask", "test_mask")
"""Node masks that are checked whenever present (plus ``mask_key``)."""

EDGE_KEYS: tuple[str, ...] = ("edge_weight", "edge_attr")
"""Edge-level attributes that are checked whenever present."""

_INDEX_DTYPES = (torch.int64, torch.int32)


class GraphValidationError(ValueError):
    """The graph cannot be partitioned or trained on; the message says why and how to fix it."""


def _is_integer(t: Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _num_nodes(data: Data) -> int:
    try:
        num_nodes = data.num_nodes
    except Exception as err:  # PyG infers num_nodes from the attributes; malformed ones can break it
        raise GraphValidationError(
            f"cannot determine the number of nodes ({type(err).__name__}: {err}); set data.num_nodes = N "
            "and check that data.edge_index is an int64 tensor of shape [2, E]"
        ) from err
    if num_nodes is None:
        raise GraphValidationError(
            "the graph is empty: data.num_nodes is None (no node-level attribute and no num_nodes); "
            "set data.num_nodes or node features data.x"
        )
    if isinstance(num_nodes, Tensor):
        num_nodes = num_nodes.item() if num_nodes.numel() == 1 else None
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, numbers.Integral):
        raise GraphValidationError(
            f"data.num_nodes must be an int, got {type(data.num_nodes).__name__}; set data.num_nodes = N"
        )
    num_nodes = int(num_nodes)
    if num_nodes <= 0:
        raise GraphValidationError(
            f"the graph is empty: data.num_nodes={num_nodes}; a graph to partition needs at least one node"
        )
    return num_nodes


def _check_num_parts(num_parts: object, num_nodes: int) -> None:
    if isinstance(num_parts, bool) or not isinstance(num_parts, numbers.Integral):
        raise GraphValidationError(f"num_parts must be an int, got {type(num_parts).__name__}")
    num_parts = int(num_parts)
    if num_parts < 1:
        raise GraphValidationError(f"num_parts must be >= 1, got {num_parts}; use num_parts=1 for one rank")
    if num_parts > num_nodes:
        raise GraphValidationError(
            f"num_parts={num_parts} exceeds num_nodes={num_nodes}: every part must own at least one node; "
            f"use at most {num_nodes} parts (fewer ranks) or a larger graph"
        )


def _check_edge_index(data: Data, num_nodes: int) -> int:
    """Checks ``data.edge_index`` and returns the number of edges ``E``."""
    edge_index = data.get("edge_index")
    if edge_index is None:
        raise GraphValidationError(
            "data.edge_index is missing: the graph needs its edges as an int64 tensor of shape [2, E] "
            "(row 0 = sources, row 1 = destinations); graphs stored only as adj_t are not supported, "
            "set data.edge_index (e.g. torch.stack(adj_t.t().coo()[:2]))"
        )
    if not isinstance(edge_index, Tensor):
        raise GraphValidationError(
            f"data.edge_index must be a torch.Tensor of shape [2, E], got {type(edge_index).__name__}; "
            "convert it with torch.as_tensor(edge_index, dtype=torch.long)"
        )
    if edge_index.dtype not in _INDEX_DTYPES:
        raise GraphValidationError(
            f"data.edge_index must have dtype torch.int64 or torch.int32, got {edge_index.dtype}; "
            "convert it with data.edge_index = data.edge_index.long()"
        )
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise GraphValidationError(
            f"data.edge_index must have shape [2, E], got shape {list(edge_index.shape)}; "
            "transpose an [E, 2] edge list with data.edge_index = edge_list.t().contiguous()"
        )
    num_edges = int(edge_index.size(1))
    if num_edges > 0:
        lo, hi = (int(v) for v in torch.aminmax(edge_index))
        if lo < 0:
            raise GraphValidationError(
                f"data.edge_index contains negative node ids (min id {lo}, max id {hi}); node ids must be "
                f"in [0, num_nodes={num_nodes}): remove the invalid edges or relabel the nodes"
            )
        if hi >= num_nodes:
            raise GraphValidationError(
                f"data.edge_index contains node ids out of range [0, num_nodes={num_nodes}): min id {lo}, "
                f"max id {hi}; set data.num_nodes to the true node count or remove the invalid edges"
            )
    return num_edges


def all_finite(t: Tensor) -> bool:
    """Whether every element of ``t`` is finite (no NaN, no +-inf), in one read pass.

    ``torch.isfinite(t).all()`` materialises ``|t|`` and three boolean tensors of ``t``'s
    size (about 9 ns per float32 element on one core, and fresh pages every call); a sum
    is one read and no temporary.  Any NaN or inf makes the sum NaN or inf (``inf - inf``
    is NaN), so a finite sum proves every element finite; a non-finite sum of finite
    elements (overflow past the dtype's largest value) is settled by the element-wise
    check, which then runs once.

    Args:
        t: Any tensor; integer and boolean tensors are always finite.

    Returns:
        ``True`` when no element is NaN or infinite (also for an empty tensor).
    """
    if not (t.dtype.is_floating_point or t.dtype.is_complex) or t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def _non_finite(name: str, t: Tensor, unit: str) -> None:
    """Raises if a floating tensor holds NaN or inf, naming how many and the first row."""
    if not t.dtype.is_floating_point or t.numel() == 0:
        return
    # Reduce first (all_finite's argument) and look closely only at suspect rows: no
    # full-size temporary on the (usual) clean path.  A non-finite sum of finite values
    # (overflow) is caught by the exact check on those rows.
    if bool(torch.isfinite(t.sum())):
        return
    row_sums = t if t.dim() == 1 else t.sum(dim=tuple(range(1, t.dim())))
    suspect = (~torch.isfinite(row_sums)).nonzero().flatten()
    if suspect.numel() == 0:
        return
    rows = t[suspect]
    bad = ~torch.isfinite(rows)
    bad_rows = bad.reshape(rows.size(0), -1).any(dim=1)
    if not bool(bad_rows.any()):
        return
    num_bad = int(bad.count_nonzero())
    num_nan = int(torch.isnan(rows).count_nonzero())
    num_rows = int(bad_rows.count_nonzero())
    first = int(suspect[bad_rows][0])
    raise GraphValidationError(
        f"data.{name} holds {num_bad} non-finite value(s) ({num_nan} NaN, {num_bad - num_nan} inf) in "
        f"{num_rows} {unit}(s), the first at {unit} index {first}; clean them before training, e.g. "
        f"data.{name} = torch.nan_to_num(data.{name}) or impute/drop those {unit}s"
    )


def _check_x(data: Data, num_nodes: int) -> None:
    x = data.get("x")
    if x is None:
        return
    if not isinstance(x, Tensor):
        raise GraphValidationError(f"data.x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.size(0) != num_nodes:
        raise GraphValidationError(
            f"data.x has shape {list(x.shape)} but the graph has num_nodes={num_nodes}: node features need "
            f"one row per node (shape [{num_nodes}, F]); fix data.x or data.num_nodes"
        )
    if not x.dtype.is_floating_point:
        raise GraphValidationError(
            f"data.x must be a floating tensor, got {x.dtype}; convert it with data.x = data.x.float()"
        )
    _non_finite("x", x, "node")


def _check_y(data: Data, num_nodes: int) -> None:
    y = data.get("y")
    if y is None:
        return
    if not isinstance(y, Tensor):
        raise GraphValidationError(f"data.y must be a torch.Tensor, got {type(y).__name__}")
    if y.dim() == 0 or y.size(0) != num_nodes:
        raise GraphValidationError(
            f"data.y has shape {list(y.shape)} but the graph has num_nodes={num_nodes}: labels need one "
            f"entry per node (shape [{num_nodes}] or [{num_nodes}, C]); graph-level labels are not "
            "supported for node-level full-graph training"
        )


def mask_dtype_problem(key: str, mask: Tensor, num_nodes: int) -> str | None:
    """What is wrong with a node mask that is not bool, and how to convert it (``None`` for
    a bool mask).  One message for :func:`validate_graph` and for
    :func:`~lightning_fullgraph.data.datamodule.select_mask_split`, whichever finds it first.

    A floating mask, or an integer one of shape ``[num_nodes, S]`` (one 0/1 column per split),
    is converted with ``!= 0``; any other integer mask looks like an index tensor
    (``index_to_mask``)."""
    if mask.dtype == torch.bool:
        return None
    shape = list(mask.shape)
    multi = mask.dim() == 2 and mask.size(0) == num_nodes
    if _is_integer(mask) and not multi:
        return (
            f"data.{key} has dtype {mask.dtype} and shape {shape}, but node masks must be bool [num_nodes] "
            f"(or [num_nodes, S] for S splits); it looks like an index tensor: convert with index_to_mask, "
            f"e.g. data.{key} = torch_geometric.utils.index_to_mask(data.{key}, size={num_nodes})"
        )
    what = f" (a multi-split mask: S={mask.size(1)} splits, one column each)" if multi else ""
    return (
        f"data.{key} has dtype {mask.dtype} and shape {shape}{what}, but node masks must be bool "
        f"([num_nodes], or [num_nodes, S] for S splits); convert it with data.{key} = data.{key} != 0"
    )


def _check_mask(data: Data, key: str, num_nodes: int) -> None:
    mask = data.get(key)
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise GraphValidationError(f"data.{key} must be a torch.Tensor, got {type(mask).__name__}")
    problem = mask_dtype_problem(key, mask, num_nodes)
    if problem is not None:
        raise GraphValidationError(problem)
    if mask.dim() not in (1, 2) or mask.size(0) != num_nodes:
        raise GraphValidationError(
            f"data.{key} has shape {list(mask.shape)} but the graph has num_nodes={num_nodes}: a node mask "
            f"needs one entry per node (shape [{num_nodes}], or [{num_nodes}, S] for S splits)"
        )


def _check_train(data: Data, mask_key: str, split: int | None = None) -> None:
    mask = data.get(mask_key)
    if mask is None:
        raise GraphValidationError(
            f"data.{mask_key} is missing, so no node is marked for training; add a bool mask "
            f"data.{mask_key} of shape [num_nodes], or pass require_train=False if this graph is not "
            "trained on"
        )
    if split is not None and mask.dim() == 1 and not bool(mask.any()):
        raise GraphValidationError(
            f"data.{mask_key}[:, {split}] has no True entry: split={split} of the multi-split [N, S] masks "
            f"has no training node; choose another split with FullGraphDataModule(split=k), mark the "
            f"training nodes of split {split} in data.{mask_key}[:, {split}], or pass require_train=False if "
            "this graph is not trained on"
        )
    if not bool(mask.any()):
        raise GraphValidationError(
            f"data.{mask_key} has no True entry: there is no training node anywhere in the graph; mark "
            f"the training nodes in data.{mask_key}, or pass require_train=False if this graph is not "
            "trained on"
        )


def _check_edge_attr(data: Data, key: str, num_edges: int) -> None:
    value = data.get(key)
    if value is None:
        return
    if not isinstance(value, Tensor):
        raise GraphValidationError(f"data.{key} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() == 0 or value.size(0) != num_edges:
        raise GraphValidationError(
            f"data.{key} has shape {list(value.shape)} but data.edge_index has E={num_edges} edges: "
            f"edge attributes need one row per edge (shape [{num_edges}, ...]) in edge_index order; "
            "filter them with the same mask as edge_index"
        )
    _non_finite(key, value, "edge")


def validate_graph(
    data: Data,
    num_parts: int | None = None,
    require_train: bool = True,
    mask_key: str = "train_mask",
    split: int | None = None,
) -> None:
    """Checks that ``data`` is a well-formed graph for partitioning and full-graph training.

    The checks, in order: the node count; ``num_parts``; ``edge_index`` (present, a tensor,
    int64/int32, shape ``[2, E]``, ids in ``[0, num_nodes)``); ``x`` (one floating, finite
    row per node); ``y`` (one entry per node); the node masks ``train_mask``, ``val_mask``,
    ``test_mask`` and ``mask_key`` when present (bool, one entry per node; ``[N, S]``
    multi-split masks are accepted); with ``require_train`` at least one node in
    ``data[mask_key]``; ``edge_weight`` / ``edge_attr`` (one finite row per edge).
    Attributes other than these are not inspected.  ``data`` is not modified.

    ``[N, S]`` masks are accepted here because a raw graph may ship them, but training
    needs ``[N]`` ones: ``FullGraphDataModule(split=k)`` keeps column ``k`` of every such
    mask (:func:`~lightning_fullgraph.data.datamodule.select_mask_split`) before it validates
    and partitions the graph, so ``require_train`` then applies to that split.

    Args:
        data: The global graph.
        num_parts: Number of parts it will be split into (the world size), or ``None`` to
            skip that check.
        require_train: Require ``data[mask_key]`` to exist and mark at least one node.
        mask_key: Name of the node mask of the training nodes.
        split: The column of the user's ``[N, S]`` masks that ``data``'s ``[N]`` masks were
            selected from (``FullGraphDataModule(split=k)``), or ``None``; only named in
            messages (a split without a training node names the split and the mask).

    Raises:
        GraphValidationError: (a ``ValueError``) on the first problem found: ``data`` is not a
            ``Data``; an empty graph (``num_nodes`` None or 0); ``num_parts`` < 1 or
            > ``num_nodes``; ``edge_index`` missing, not a tensor, of the wrong dtype or
            shape, or holding negative / out-of-range node ids; ``x`` of the wrong length,
            not floating, or holding NaN/inf; ``y`` of the wrong length; a mask that is not
            bool (an integer index tensor: convert with ``index_to_mask``) or of the wrong
            length; no training node (with ``require_train``); ``edge_weight`` /
            ``edge_attr`` of the wrong length or holding NaN/inf.
    """
    if not isinstance(data, Data):
        raise GraphValidationError(
            f"expected a torch_geometric.data.Data graph, got {type(data).__name__}; pass one homogeneous "
            "graph (convert a HeteroData with data.to_homogeneous())"
        )
    num_nodes = _num_nodes(data)
    if num_parts is not None:
        _check_num_parts(num_parts, num_nodes)
    num_edges = _check_edge_index(data, num_nodes)
    _check_x(data, num_nodes)
    _check_y(data, num_nodes)
    for key in dict.fromkeys((*MASK_KEYS, mask_key)):
        _check_mask(data, key, num_nodes)
    if require_train:
        _check_train(data, mask_key, split)
    for key in EDGE_KEYS:
        _check_edge_attr(data, key, num_edges)
