"""The conv adapter registry: which adapter a conv type has, and which convs it refuses, and why.

Convs of a ``MessagePassing`` type without an adapter (:func:`supported_convs` lists those with
one) raise :class:`UnsupportedConvError` at setup, naming the type; :func:`register_conv_adapter`
adds one and returns a :class:`torch.utils.hooks.RemovableHandle` that takes it away again.
It checks what it can at registration: ``"bipartite"`` needs a ``forward`` that takes an
``(x_src, x_dst)`` tuple as ``x`` and a ``size=`` argument, and multi-hop convs (``ChebConv``,
``TAGConv``, ``SGConv``, ``SSGConv``, ``APPNP``, ``ARMAConv``, ``GatedGraphConv``,
``MixHopConv``: one halo exchange per layer only makes their first hop exact) are refused for
both kinds; a callable adapter is the user's own and is not checked.  :func:`check_installable`
applies the same rules to a conv instance (at installation, :mod:`.patch`, and in the
launcher's preflight).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.utils.hooks import RemovableHandle
from torch_geometric.nn import MessagePassing
from torch_geometric.nn.conv import (
    APPNP,
    ARMAConv,
    ChebConv,
    GATConv,
    GatedGraphConv,
    GATv2Conv,
    GCNConv,
    GINConv,
    GINEConv,
    GraphConv,
    MixHopConv,
    SAGEConv,
    SGConv,
    SSGConv,
    TAGConv,
)

from lightning_fullgraph.nn.context import HaloContext
from lightning_fullgraph.nn.errors import UnsupportedConvError
from lightning_fullgraph.nn.families import bipartite_adapter, full_then_slice_adapter
from lightning_fullgraph.nn.gcn import gcn_adapter

__all__ = [
    "ConvAdapter",
    "UnsupportedConvError",
    "check_installable",
    "find_adapter",
    "register_conv_adapter",
    "supported_convs",
]

# ``adapter(conv, forward, ctx, x, edge_index, args, kwargs)`` -> the ``N_r`` owned output rows
# (``forward``: the conv's own; ``ctx``: the rank's :class:`HaloContext`).
ConvAdapter = Callable[[MessagePassing, Callable[..., Any], "HaloContext", Tensor, Any, tuple, dict], Any]


_ADAPTERS: dict[type, ConvAdapter] = {
    GCNConv: gcn_adapter,
    SAGEConv: bipartite_adapter,
    GINConv: bipartite_adapter,
    GINEConv: bipartite_adapter,
    GraphConv: bipartite_adapter,
    GATConv: full_then_slice_adapter,
    GATv2Conv: full_then_slice_adapter,
}
_KINDS: dict[str, ConvAdapter] = {"bipartite": bipartite_adapter, "full_then_slice": full_then_slice_adapter}


# Registrations made with `register_conv_adapter`, per conv type, in registration order (keyed
# by handle id; the newest one wins, the built-in `_ADAPTERS` entry is the floor).  Ordered
# dicts: `RemovableHandle` holds its dict by weak reference, which a plain dict does not allow.
_REGISTERED: dict[type, OrderedDict[int, ConvAdapter]] = {}


# Convs that propagate more than once per forward, and the attribute holding how often: one
# halo exchange per layer gives their owned rows only the first hop exactly.
_MULTI_HOP: dict[type, str] = {
    ChebConv: "K",
    TAGConv: "K",
    SGConv: "K",
    SSGConv: "K",
    APPNP: "K",
    ARMAConv: "num_layers",
    GatedGraphConv: "num_layers",
    MixHopConv: "powers",
}
_MULTI_HOP_REASON = "multi-hop: needs K halo exchanges per layer, not supported"
_ADAPTER_HELP = (
    "if no output row depends on a neighbour's degree (no GCN-style normalisation), register it as "
    "'full_then_slice'; otherwise write a ConvAdapter callable `adapter(conv, forward, ctx, x, "
    "edge_index, args, kwargs)` and register that (see help(lightning_fullgraph.register_conv_adapter) "
    "and the README, 'Supported layers')"
)


def _with_help(reason: str) -> str:
    """``reason`` and what to do instead; a multi-hop conv gets no registration advice."""
    return reason if _MULTI_HOP_REASON in reason else f"{reason}; {_ADAPTER_HELP}"


def _multi_hop(conv: MessagePassing | type) -> str | None:
    """Why ``conv`` (an instance, or a class) is multi-hop, or ``None``.

    A class is multi-hop when it is one of ``_MULTI_HOP``; an instance when its hop count
    (``K``, ``num_layers`` or ``max(powers)`` for those classes, an integer ``K`` attribute for
    any other) is above 1."""
    cls = conv if isinstance(conv, type) else type(conv)
    attr = next((a for c, a in _MULTI_HOP.items() if issubclass(cls, c)), None)
    if isinstance(conv, type):
        return None if attr is None else f"{cls.__name__} is {_MULTI_HOP_REASON} (its `{attr}` sets the hops)"
    # ChebConv keeps no `K`: one linear map per Chebyshev term.
    hops = len(conv.lins) if isinstance(conv, ChebConv) else getattr(conv, attr or "K", None)
    if isinstance(hops, (list, tuple)) and hops and all(isinstance(h, int) for h in hops):
        hops = max(hops)
    if isinstance(hops, bool) or not isinstance(hops, int) or hops <= 1:
        return None
    return f"{cls.__name__} is {_MULTI_HOP_REASON} ({attr or 'K'}={hops})"


def _may_be_tuple(annotation: Any) -> bool:
    """Whether a parameter annotated ``annotation`` may receive a tuple (``True`` unless it
    names only classes a tuple is not an instance of)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_may_be_tuple(a) for a in typing.get_args(annotation))
    target = origin if origin is not None else annotation
    if isinstance(target, type):
        return issubclass(tuple, target)
    return True  # a form it cannot judge (TypeVar, Annotated, a string it could not resolve)


def _bipartite_refusal(cls: type) -> str | None:
    """Why ``"bipartite"`` cannot run ``cls``, or ``None``.

    :func:`bipartite_adapter` calls ``forward((x_full, x), edge_index_or_adjacency, *args,
    size=(N_r + H_r, N_r), **kwargs)``: ``forward`` must take an ``x`` that may be a tuple and
    a ``size`` keyword (or ``**kwargs``)."""
    name = cls.__name__
    multi = _multi_hop(cls)
    if multi is not None:
        return multi
    try:
        sig = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None  # nothing to read: the user's call
    params = list(sig.parameters.values())[1:]  # drop `self`
    kinds = {p.kind for p in params}
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 2:
            return f"{name}.forward takes fewer than two positional arguments (x, edge_index)"
        x = positional[0]
        try:
            hints = typing.get_type_hints(cls.forward)
        except Exception:  # unresolvable string annotations: judge what is there
            hints = {}
        annotation = hints.get(x.name, x.annotation)
        if not isinstance(annotation, str) and not _may_be_tuple(annotation):
            shown = getattr(annotation, "__name__", None) or repr(annotation)
            return (
                f"{name}.forward's `{x.name}` is annotated `{shown}`, not a (x_src, x_dst) tuple, so the "
                f"bipartite adapter cannot pass the [owned | halo] source rows apart from the owned targets"
            )
    size = sig.parameters.get("size")
    if inspect.Parameter.VAR_KEYWORD not in kinds and (size is None or size.kind is size.POSITIONAL_ONLY):
        return f"{name}.forward takes no `size` argument, so the bipartite adapter cannot pass the halo shape"
    return None


def register_conv_adapter(cls: type[MessagePassing], adapter: str | ConvAdapter = "bipartite") -> RemovableHandle:
    """Declares how a conv type is made partition-aware.

    Args:
        cls: A ``MessagePassing`` subclass.
        adapter: ``"bipartite"`` for convs whose ``forward`` accepts an ``(x_src, x_dst)`` tuple
            as ``x`` and ``size=`` (exact when the output at a node depends only on it, its
            in-neighbours and in-edges), ``"full_then_slice"`` for convs that accept only one
            feature matrix but whose owned outputs do not depend on the rows of halo nodes
            beyond their messages (no degree of a neighbour), or a callable
            ``adapter(conv, forward, ctx, x, edge_index, args, kwargs)`` (``forward`` is the
            conv's own; ``ctx`` a :class:`HaloContext`, ``ctx.exchange(x)`` gives the
            ``[N_r + H_r, F]`` rows; the result is the ``N_r`` owned output rows).

    Raises:
        UnsupportedConvError: ``"bipartite"`` for a ``forward`` without ``size`` or whose ``x``
            is annotated as a tensor only, or either kind for a multi-hop conv (``ChebConv``,
            ``TAGConv``, ``SGConv``, ``SSGConv``, ``APPNP``, ``ARMAConv``, ``GatedGraphConv``,
            ``MixHopConv``), with the reason.  A callable is not checked.  At installation,
            a conv registered with a kind whose instance has an integer ``K`` above 1 is
            refused the same way.

    Returns:
        A :class:`torch.utils.hooks.RemovableHandle`: ``handle.remove()`` (idempotent) takes
        this registration away; the type's adapter is then again the one it replaced (an
        earlier registration still in place, else the built-in one, else none).  Also a
        context manager.  Convs already patched keep their adapter until re-installed.
    """
    if not (isinstance(cls, type) and issubclass(cls, MessagePassing)):
        raise TypeError(f"expected a MessagePassing subclass, got {cls!r}")
    if isinstance(adapter, str):
        if adapter not in _KINDS:
            raise ValueError(f"unknown adapter kind {adapter!r}; use one of {sorted(_KINDS)} or a callable")
        reason = _bipartite_refusal(cls) if adapter == "bipartite" else _multi_hop(cls)
        if reason is not None:
            raise UnsupportedConvError(f"cannot register {cls.__name__} as {adapter!r}: {_with_help(reason)}.")
        adapter = _KINDS[adapter]
    elif not callable(adapter):
        raise TypeError(f"adapter must be one of {sorted(_KINDS)} or a callable, got {adapter!r}")
    registrations = _REGISTERED.setdefault(cls, OrderedDict())
    handle = RemovableHandle(registrations)
    registrations[handle.id] = adapter
    return handle


def _adapter_of(cls: type) -> ConvAdapter | None:
    registrations = _REGISTERED.get(cls)
    if registrations:
        return next(reversed(registrations.values()))
    return _ADAPTERS.get(cls)


def supported_convs() -> list[str]:
    """Names of the conv types with an adapter."""
    return sorted({c.__name__ for c in _ADAPTERS} | {c.__name__ for c, r in _REGISTERED.items() if r})


def find_adapter(conv: MessagePassing) -> ConvAdapter | None:
    """The adapter of ``conv``'s type or its nearest base class (newest registration first),
    or ``None``."""
    for cls in type(conv).__mro__:
        adapter = _adapter_of(cls)
        if adapter is not None:
            return adapter
        if cls is MessagePassing:
            break
    return None

def check_installable(conv: MessagePassing) -> None:
    """Raises :class:`UnsupportedConvError` for a conv without an adapter, or registered with
    a kind its instance cannot run (multi-hop, or a ``forward`` without what ``"bipartite"``
    passes); the hint to register it is given only where registration would be accepted."""
    name = type(conv).__name__
    adapter = find_adapter(conv)
    if adapter is None:
        head = f"{name} cannot be made exact by FullGraphStrategy"
        multi = _multi_hop(conv)
        if multi is not None:
            raise UnsupportedConvError(f"{head}: {multi}. Supported: {', '.join(supported_convs())}.")
        head += f": no partition adapter is registered for it. Supported: {', '.join(supported_convs())}."
        reason = _bipartite_refusal(type(conv))
        if reason is not None:
            raise UnsupportedConvError(f"{head} It cannot be registered as 'bipartite': {_with_help(reason)}.")
        raise UnsupportedConvError(
            f"{head} Its forward takes (x_src, x_dst) tuples and `size=`: if each output row depends only "
            f"on the node and its in-neighbours, register it with "
            f"`lightning_fullgraph.register_conv_adapter({name}, 'bipartite')`."
        )
    if adapter is bipartite_adapter or adapter is full_then_slice_adapter:
        reason = _multi_hop(conv)
        if reason is not None and not isinstance(conv, tuple(_MULTI_HOP)):
            # A `K` of the user's own class: it may mean something else.
            reason += " (if `K` is not its hop count, a callable adapter is not checked)"
        elif reason is None and adapter is bipartite_adapter:
            reason = _bipartite_refusal(type(conv))
        if reason is not None:
            raise UnsupportedConvError(f"{name} cannot be made exact by FullGraphStrategy: {_with_help(reason)}.")

