r"""Make unmodified PyG convs partition-aware, exactly.

A rank holds the rows of the nodes it owns (``x``: ``[N_r, F]``) and a local ``edge_index``
whose sources index ``[owned | halo]`` (``N_r + H_r`` ids) and whose destinations are owned.
Every supported conv is patched (an instance attribute ``forward``, removed again on
teardown) so that the user's call ``conv(x, edge_index, ...)`` becomes

.. math::
    \mathbf{X}^{full}_r = \mathbf{X}_r \,\Vert\, \mathrm{halo}(\mathbf{X}), \qquad
    \mathbf{X}'_r = \mathrm{conv}\big((\mathbf{X}^{full}_r, \mathbf{X}_r),\ \mathcal{E}_r\big)

with the conv's own code doing the maths, on a bipartite graph (sources ``N_r + H_r``,
destinations ``N_r``).  Because ``E_r`` contains *every* in-edge of every owned node, any
conv whose output at node :math:`i` depends only on :math:`x_i`, its in-neighbours'
features and in-edge attributes is exact.  Three families:

* ``bipartite`` (``SAGEConv``, ``GINConv``, ``GINEConv``, ``GraphConv``): called with the tuple
  ``(x_full, x)`` and ``size=(N_r + H_r, N_r)``.
* ``full_then_slice`` (``GATConv``, ``GATv2Conv``): called on ``x_full`` as a homogeneous graph;
  their self-loops for halo rows only reach halo outputs, which are dropped, so the owned
  rows are exact and no projection runs twice.
* ``GCNConv``: normalised with *global* degrees,
  :math:`\hat{A}_{ij} = w_{ji} / \sqrt{\hat d_i \hat d_j}` with
  :math:`\hat d_i = \sum_{j \to i} w_{ji}` after PyG's self-loop rule.  The local graph
  knows the in-degree of every owned node (all its in-edges are local) but not of a halo
  node, so each rank computes its owned degrees and receives the halo degrees through the
  same exchange (once, then cached).

Convs of any other ``MessagePassing`` type raise :class:`UnsupportedConvError` at setup,
naming the type; :func:`register_conv_adapter` adds one.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.nn import MessagePassing
from torch_geometric.nn.conv import (
    GATConv,
    GATv2Conv,
    GCNConv,
    GINConv,
    GINEConv,
    GraphConv,
    SAGEConv,
)
from torch_geometric.utils import add_remaining_self_loops, scatter

from lightning_fullgraph.comm.exchange import HaloExchanger

__all__ = [
    "HaloContext",
    "UnsupportedConvError",
    "install_adapters",
    "register_conv_adapter",
    "supported_convs",
    "uninstall_adapters",
]

ConvAdapter = Callable[[MessagePassing, Callable[..., Any], "HaloContext", Tensor, Any, tuple, dict], Any]


class UnsupportedConvError(TypeError):
    """A message-passing layer the strategy cannot make exact across partitions."""


class HaloContext:
    """State shared by the patched convs of one module: the exchanger and small caches.

    Args:
        exchanger: Moves halo rows for this rank.
    """

    def __init__(self, exchanger: HaloExchanger, overlap: bool = False, check_finite: bool = False) -> None:
        self.exchanger = exchanger
        self.overlap = overlap
        self.check_finite = check_finite
        self._norm_cache: dict[tuple, tuple[weakref.ref, Any, tuple[Tensor, Tensor]]] = {}
        self._split_cache: tuple[weakref.ref, int, int, Any] | None = None

    def split(self, edge_index: Tensor, weight: Tensor | None = None) -> _Split | None:
        """Central/marginal split of the local edges, or ``None`` when overlap cannot help.

        Central nodes: owned nodes without a halo in-neighbour; their edges (sources all
        owned) are aggregated while the exchange is in flight.  Marginal nodes: the rest.
        Destinations are renumbered within each set.
        """
        cached = self._split_cache
        if (
            cached is not None
            and cached[0]() is edge_index
            and cached[1] == edge_index._version
            and cached[2] == (id(weight) if weight is not None else 0)
        ):
            return cached[3]
        n = self.num_owned
        src, dst = edge_index[0], edge_index[1]
        marginal = torch.zeros(n, dtype=torch.bool, device=edge_index.device)
        marginal[dst[src >= n]] = True
        central_idx = (~marginal).nonzero().flatten()
        marginal_idx = marginal.nonzero().flatten()
        result = None
        if central_idx.numel() and marginal_idx.numel():
            pos = torch.empty(n, dtype=torch.long, device=edge_index.device)
            pos[central_idx] = torch.arange(central_idx.numel(), device=edge_index.device)
            pos[marginal_idx] = torch.arange(marginal_idx.numel(), device=edge_index.device)
            to_m = marginal[dst]
            ei_c = torch.stack([src[~to_m], pos[dst[~to_m]]])
            ei_m = torch.stack([src[to_m], pos[dst[to_m]]])
            w_c = weight[~to_m] if weight is not None else None
            w_m = weight[to_m] if weight is not None else None
            result = _Split(central_idx, marginal_idx, ei_c, ei_m, w_c, w_m)
        self._split_cache = (weakref.ref(edge_index), edge_index._version, id(weight) if weight is not None else 0, result)
        return result

    @property
    def num_owned(self) -> int:
        return self.exchanger.plan.num_owned

    @property
    def num_full(self) -> int:
        return self.exchanger.plan.num_owned + self.exchanger.plan.num_halo

    def check_input(self, conv: nn.Module, x: Any, edge_index: Any) -> None:
        if isinstance(x, (tuple, list)):
            raise ValueError(
                f"{type(conv).__name__} was called with a (source, target) tuple; under "
                f"FullGraphStrategy call it with the rank's node features `batch.x`-like tensor "
                f"of {self.num_owned} rows, the halo is added for you"
            )
        if not isinstance(x, Tensor) or x.size(0) != self.num_owned:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"{type(conv).__name__} expects the {self.num_owned} rows this rank owns "
                f"(the batch's node features or a layer output computed from them), got {got}"
            )
        if not isinstance(edge_index, Tensor):
            raise ValueError(
                f"{type(conv).__name__}: only `edge_index` tensors are supported under "
                f"FullGraphStrategy (got {type(edge_index).__name__}); pass `batch.edge_index`"
            )

    def exchange(self, x: Tensor) -> Tensor:
        """``[N_r, F] -> [N_r + H_r, F]``: owned rows followed by the halo rows."""
        return self.exchanger.exchange(x)

    def gcn_norm(
        self, edge_index: Tensor, edge_weight: Tensor | None, improved: bool, add_self_loops: bool, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """Local edges with GCN weights computed from GLOBAL degrees (see module docstring).

        Returns:
            ``edge_index [2, E'_r]`` (self-loops added for owned nodes) and ``weight [E'_r]``.
        """
        cacheable = edge_weight is None or not edge_weight.requires_grad
        key = (
            id(edge_index),
            edge_index._version,
            None if edge_weight is None else (id(edge_weight), edge_weight._version),
            improved,
            add_self_loops,
            dtype,
        )
        hit = self._norm_cache.get(key)
        if cacheable and hit is not None and hit[0]() is edge_index:
            if edge_weight is None or (hit[1] is not None and hit[1]() is edge_weight):
                return hit[2]
        original_edge_index, original_weight = edge_index, edge_weight
        n = self.num_owned
        if edge_weight is None:
            edge_weight = torch.ones(edge_index.size(1), dtype=dtype, device=edge_index.device)
        if add_self_loops:
            edge_index, edge_weight = add_remaining_self_loops(
                edge_index, edge_weight, 2.0 if improved else 1.0, num_nodes=n
            )
        row, col = edge_index[0], edge_index[1]
        deg = scatter(edge_weight, col, dim=0, dim_size=n, reduce="sum")
        # Halo degrees are only known to their owners: they travel like any other row.
        deg_full = self.exchanger.exchange(deg.unsqueeze(-1), exact=True).squeeze(-1)
        deg_inv_sqrt = deg_full.pow(-0.5)
        deg_inv_sqrt = deg_inv_sqrt.masked_fill(deg_inv_sqrt == float("inf"), 0.0)
        result = (edge_index, deg_inv_sqrt[row] * edge_weight * deg_inv_sqrt[col])
        if cacheable:
            self._norm_cache = {k: v for k, v in self._norm_cache.items() if v[0]() is not None}
            w_ref = None if original_weight is None else weakref.ref(original_weight)
            self._norm_cache[key] = (weakref.ref(original_edge_index), w_ref, result)
        return result


# -- adapters ---------------------------------------------------------------------------


class _Split:
    __slots__ = ("central", "marginal", "ei_c", "ei_m", "w_c", "w_m")

    def __init__(self, central, marginal, ei_c, ei_m, w_c, w_m) -> None:
        self.central, self.marginal, self.ei_c, self.ei_m, self.w_c, self.w_m = central, marginal, ei_c, ei_m, w_c, w_m


def _merge(n: int, split: _Split, out_c: Tensor, out_m: Tensor) -> Tensor:
    out = out_c.new_zeros((n,) + tuple(out_c.shape[1:]))
    return out.index_copy(0, split.central, out_c).index_copy(0, split.marginal, out_m)


def _bipartite(conv, forward, ctx: HaloContext, x: Tensor, edge_index, args: tuple, kwargs: dict):
    if kwargs.get("size") is not None:
        raise ValueError(f"{type(conv).__name__}: do not pass `size=` under FullGraphStrategy; it is set for you")
    split = ctx.split(edge_index) if ctx.overlap and not args and not kwargs else None
    if split is None:
        kwargs["size"] = (ctx.num_full, ctx.num_owned)
        return forward((ctx.exchange(x), x), edge_index, *args, **kwargs)
    # Central rows need no halo: aggregate them while the exchange is in flight.
    pending = ctx.exchanger.exchange_async(x)
    out_c = forward((x, x[split.central]), split.ei_c, size=(ctx.num_owned, split.central.numel()))
    x_full = torch.cat([x, pending.wait()], dim=0)
    out_m = forward((x_full, x[split.marginal]), split.ei_m, size=(ctx.num_full, split.marginal.numel()))
    return _merge(ctx.num_owned, split, out_c, out_m)


def _slice_output(out: Any, n: int) -> Any:
    if isinstance(out, Tensor):
        return out[:n]
    if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
        return (out[0][:n],) + tuple(out[1:])
    return out


def _full_then_slice(conv, forward, ctx: HaloContext, x: Tensor, edge_index, args: tuple, kwargs: dict):
    if kwargs.get("size") is not None:
        raise ValueError(f"{type(conv).__name__}: do not pass `size=` under FullGraphStrategy; it is set for you")
    return _slice_output(forward(ctx.exchange(x), edge_index, *args, **kwargs), ctx.num_owned)


def _gcn(conv: GCNConv, forward, ctx: HaloContext, x: Tensor, edge_index, args: tuple, kwargs: dict):
    edge_weight = args[0] if args else kwargs.pop("edge_weight", None)
    if not conv.normalize:
        return _slice_output(forward(ctx.exchange(x), edge_index, edge_weight), ctx.num_owned)
    if conv.flow != "source_to_target":
        raise UnsupportedConvError("GCNConv with flow='target_to_source' is not supported by FullGraphStrategy")
    edge_index, weight = ctx.gcn_norm(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype)
    split = ctx.split(edge_index, weight) if ctx.overlap else None
    if split is not None:
        # out = A_hat (X W) + b, computed as central rows (owned sources only) while the halo
        # is in flight, then marginal rows; lin is applied once per row.
        pending = ctx.exchanger.exchange_async(x)
        h = conv.lin(x)
        out_c = conv.propagate(split.ei_c, x=h, edge_weight=split.w_c, size=(ctx.num_owned, split.central.numel()))
        h_full = torch.cat([h, conv.lin(pending.wait())], dim=0)
        out_m = conv.propagate(split.ei_m, x=h_full, edge_weight=split.w_m, size=(ctx.num_full, split.marginal.numel()))
        out = _merge(ctx.num_owned, split, out_c, out_m)
        return out + conv.bias if conv.bias is not None else out
    # The conv's own code does lin/propagate/bias; only its normalisation is replaced.
    conv.normalize = False
    try:
        out = forward(ctx.exchange(x), edge_index, weight)
    finally:
        conv.normalize = True
    return out[: ctx.num_owned]


_ADAPTERS: dict[type, ConvAdapter] = {
    GCNConv: _gcn,
    SAGEConv: _bipartite,
    GINConv: _bipartite,
    GINEConv: _bipartite,
    GraphConv: _bipartite,
    GATConv: _full_then_slice,
    GATv2Conv: _full_then_slice,
}
_KINDS: dict[str, ConvAdapter] = {"bipartite": _bipartite, "full_then_slice": _full_then_slice}


def register_conv_adapter(cls: type[MessagePassing], adapter: str | ConvAdapter = "bipartite") -> None:
    """Declares how a conv type is made partition-aware.

    Args:
        cls: A ``MessagePassing`` subclass.
        adapter: ``"bipartite"`` for convs that accept ``(x_src, x_dst)`` tuples and ``size=``
            (exact when the output at a node depends only on it, its in-neighbours and
            in-edges), ``"full_then_slice"`` for convs that accept only one feature matrix
            but whose owned outputs do not depend on the rows of halo nodes beyond their
            messages, or a callable ``adapter(conv, forward, ctx, x, edge_index, args, kwargs)``.
    """
    if not (isinstance(cls, type) and issubclass(cls, MessagePassing)):
        raise TypeError(f"expected a MessagePassing subclass, got {cls!r}")
    if isinstance(adapter, str):
        if adapter not in _KINDS:
            raise ValueError(f"unknown adapter kind {adapter!r}; use one of {sorted(_KINDS)} or a callable")
        adapter = _KINDS[adapter]
    _ADAPTERS[cls] = adapter


def supported_convs() -> list[str]:
    """Names of the conv types with an adapter."""
    return sorted(c.__name__ for c in _ADAPTERS)


def _find_adapter(conv: MessagePassing) -> ConvAdapter | None:
    for cls in type(conv).__mro__:
        if cls in _ADAPTERS:
            return _ADAPTERS[cls]
        if cls is MessagePassing:
            break
    return None


def _split_x_edge_index(args: tuple, kwargs: dict) -> tuple[Any, Any, tuple, dict]:
    args = list(args)
    x = kwargs.pop("x") if "x" in kwargs else args.pop(0)
    edge_index = kwargs.pop("edge_index") if "edge_index" in kwargs else args.pop(0)
    return x, edge_index, tuple(args), kwargs


_PATCH_ATTR = "_fullgraph_original_forward"


def install_adapters(module: nn.Module, ctx: HaloContext) -> list[MessagePassing]:
    """Patches every ``MessagePassing`` submodule of ``module`` to run on the partition.

    Raises:
        UnsupportedConvError: naming the first conv type without an adapter (nothing is
            patched in that case).

    Returns:
        The patched convs (pass to :func:`uninstall_adapters`).
    """
    names = {id(m): n for n, m in module.named_modules()}
    convs = [m for m in module.modules() if isinstance(m, MessagePassing)]
    for conv in convs:
        if _find_adapter(conv) is None:
            raise UnsupportedConvError(
                f"{type(conv).__name__} cannot be made exact by FullGraphStrategy: no partition "
                f"adapter is registered for it. Supported: {', '.join(supported_convs())}. If it "
                f"accepts (x_src, x_dst) tuples and `size=` and each output row depends only on "
                f"the node and its in-neighbours, register it with "
                f"`lightning_fullgraph.register_conv_adapter({type(conv).__name__}, 'bipartite')`."
            )
    for conv in convs:
        if _PATCH_ATTR in conv.__dict__:
            uninstall_adapters([conv])
        adapter = _find_adapter(conv)
        original = types.MethodType(type(conv).forward, conv)

        forward = _make_forward(conv, original, adapter, names.get(id(conv), "?"), ctx)
        object.__setattr__(conv, _PATCH_ATTR, original)
        object.__setattr__(conv, "forward", forward)
    return convs


def _make_forward(
    conv: MessagePassing, original: Callable[..., Any], adapter: ConvAdapter, name: str, ctx: HaloContext
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        x, edge_index, rest, kw = _split_x_edge_index(args, kwargs)
        ctx.check_input(conv, x, edge_index)
        out = adapter(conv, original, ctx, x, edge_index, rest, kw)
        if ctx.check_finite:
            _check_finite(out, name, conv, ctx)
        return out

    return forward


def _check_finite(out: Any, name: str, conv: nn.Module, ctx: HaloContext) -> None:
    value = out[0] if isinstance(out, tuple) else out
    if isinstance(value, Tensor) and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).any(dim=-1).sum()) if value.dim() > 1 else int((~torch.isfinite(value)).sum())
        raise FloatingPointError(
            f"rank {ctx.exchanger.plan.rank}: layer '{name}' ({type(conv).__name__}) produced non-finite values "
            f"in {bad} of its {value.size(0)} output rows; training stopped. Lower the learning rate, check "
            f"the input features, or pass FullGraphStrategy(check_finite=False) to skip this check."
        )


def uninstall_adapters(convs: list[MessagePassing]) -> None:
    """Restores the convs' own ``forward``."""
    for conv in convs:
        conv.__dict__.pop("forward", None)
        conv.__dict__.pop(_PATCH_ATTR, None)
