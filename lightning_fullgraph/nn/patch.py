r"""Patching: installs the adapters on a module's convs and takes them off again, exactly.

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
features and in-edge attributes is exact.  How each conv type is called is its adapter
(:mod:`.families`, :mod:`.gcn`), looked up in :mod:`.registry`.  :func:`install_adapters`
returns an :class:`AdapterHandle` whose ``remove()`` restores every patched conv exactly.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.nn import MessagePassing
from torch_geometric.nn.conv import GCNConv

from lightning_fullgraph.data.validation import all_finite
from lightning_fullgraph.nn.context import HaloContext
from lightning_fullgraph.nn.families import SPARSE_VALUES
from lightning_fullgraph.nn.registry import ConvAdapter, check_installable, find_adapter

__all__ = ["AdapterHandle", "install_adapters", "uninstall_adapters"]


def _split_x_edge_index(args: tuple, kwargs: dict) -> tuple[Any, Any, tuple, dict]:
    args = list(args)
    x = kwargs.pop("x") if "x" in kwargs else args.pop(0)
    edge_index = kwargs.pop("edge_index") if "edge_index" in kwargs else args.pop(0)
    return x, edge_index, tuple(args), kwargs


# Instance attribute holding a patched conv's `_Patch` record (removed with the patch).
_PATCH_ATTR = "_fullgraph_patch"
_MISSING = object()


class _Patch:
    """What :func:`install_adapters` set on one conv's instance dict, and what was there before."""

    __slots__ = ("saved",)

    def __init__(self) -> None:
        self.saved: dict[str, Any] = {}

    def set(self, conv: nn.Module, name: str, value: Any) -> None:
        if name not in self.saved:
            self.saved[name] = conv.__dict__.get(name, _MISSING)
        # object.__setattr__: nn.Module.__setattr__ would route Modules/Parameters elsewhere.
        object.__setattr__(conv, name, value)

    def undo(self, conv: nn.Module) -> None:
        for name, before in reversed(self.saved.items()):
            if before is _MISSING:
                conv.__dict__.pop(name, None)
            else:
                conv.__dict__[name] = before
        self.saved.clear()


def _unpatch(conv: nn.Module, patch: _Patch | None = None) -> None:
    """Restores ``conv`` if it carries a patch (only ``patch`` when given)."""
    current = conv.__dict__.get(_PATCH_ATTR)
    if current is None or (patch is not None and current is not patch):
        return
    del conv.__dict__[_PATCH_ATTR]
    current.undo(conv)


class AdapterHandle:
    """The patches :func:`install_adapters` made; ``remove()`` takes them all back.

    After ``remove()`` every conv's instance dict is what it was before installation (an
    instance-level ``forward`` the user had set is put back; attributes that were not there
    are gone).  Idempotent; a conv re-patched since by another installation is left alone.
    Iterating gives the patched convs; also a context manager.
    """

    def __init__(self, patches: list[tuple[MessagePassing, _Patch]]) -> None:
        self._patches = patches

    @property
    def convs(self) -> list[MessagePassing]:
        return [conv for conv, _ in self._patches]

    def __iter__(self):
        return iter(self.convs)

    def __len__(self) -> int:
        return len(self._patches)

    def remove(self) -> None:
        patches, self._patches = self._patches, []
        for conv, patch in reversed(patches):
            _unpatch(conv, patch)

    def __enter__(self) -> AdapterHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def install_adapters(module: nn.Module, ctx: HaloContext) -> AdapterHandle:
    """Patches every ``MessagePassing`` submodule of ``module`` to run on the partition.

    A conv that is already patched (by an earlier installation) is restored first.

    Raises:
        UnsupportedConvError: naming the first conv type without an adapter (nothing is
            patched in that case).

    Returns:
        An :class:`AdapterHandle`; ``handle.remove()`` (or ``uninstall_adapters(handle)``)
        restores every patched conv exactly.
    """
    names = {id(m): n for n, m in module.named_modules()}
    convs = [m for m in module.modules() if isinstance(m, MessagePassing)]
    for conv in convs:
        check_installable(conv)
    patches: list[tuple[MessagePassing, _Patch]] = []
    for conv in convs:
        _unpatch(conv)
        adapter = find_adapter(conv)
        assert adapter is not None
        # The forward a plain call runs now: an instance-level one if the user set one.
        original = conv.__dict__.get("forward") or types.MethodType(type(conv).forward, conv)
        patch = _Patch()
        patch.set(conv, "forward", _make_forward(conv, original, adapter, names.get(id(conv), "?"), ctx))
        if type(conv) in SPARSE_VALUES or type(conv) is GCNConv:
            own = conv.__dict__.get("message_and_aggregate") or types.MethodType(
                type(conv).message_and_aggregate, conv
            )
            patch.set(conv, "message_and_aggregate", _make_message_and_aggregate(conv, own, ctx))
        object.__setattr__(conv, _PATCH_ATTR, patch)
        patches.append((conv, patch))
    return AdapterHandle(patches)


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


def _make_message_and_aggregate(conv: MessagePassing, own: Callable[..., Any], ctx: HaloContext) -> Callable[..., Any]:
    # These convs' own fused step is `spmm(adj_t, x_src, reduce=conv.aggr)`; on the adapters'
    # cached CSR blocks the same product runs with a transpose built once for the backward.
    def message_and_aggregate(adj_t: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        handed_over = ctx.take_aggregation(adj_t)
        if handed_over is not None:
            return handed_over
        if not (isinstance(adj_t, Tensor) and adj_t.layout == torch.sparse_csr):
            return own(adj_t, x, *args, **kwargs)
        src = x[0] if isinstance(x, tuple) else x
        dtype = src.dtype
        # CSR kernels have no half/bfloat16 versions, and autocast ("bf16-mixed") would cast
        # the product's inputs down: it runs in the CSR's dtype with autocast off, and the
        # result goes back to the features' dtype.
        src = src.to(adj_t.dtype)
        with torch.autocast(device_type=src.device.type, enabled=False):
            out = ctx.aggregate(adj_t, src, conv.aggr)
            if out is None:
                out = own(adj_t, (src,) + tuple(x[1:]) if isinstance(x, tuple) else src, *args, **kwargs)
        return out.to(dtype)

    return message_and_aggregate


def _check_finite(out: Any, name: str, conv: nn.Module, ctx: HaloContext) -> None:
    value = out[0] if isinstance(out, tuple) else out
    if isinstance(value, Tensor) and not all_finite(value):
        bad = int((~torch.isfinite(value)).any(dim=-1).sum()) if value.dim() > 1 else int((~torch.isfinite(value)).sum())
        raise FloatingPointError(
            f"rank {ctx.exchanger.plan.rank}: layer '{name}' ({type(conv).__name__}) produced non-finite values "
            f"in {bad} of its {value.size(0)} output rows; training stopped. Lower the learning rate, check "
            f"the input features, or pass FullGraphStrategy(check_finite=False) to skip this check."
        )


def uninstall_adapters(patched: AdapterHandle | Iterable[MessagePassing] | None) -> None:
    """Restores patched convs exactly: ``uninstall_adapters(handle)`` is ``handle.remove()``;
    an iterable of convs (or ``None``/``[]``) is also accepted, each restored if patched."""
    if patched is None:
        return
    if isinstance(patched, AdapterHandle):
        patched.remove()
        return
    for conv in list(patched):
        _unpatch(conv)
