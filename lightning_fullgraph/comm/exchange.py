r"""Halo exchange: what the adapted convs call, and its autograd.

Forward, for a layer input ``X_r`` (``[N_r, F]``, the rows rank ``r`` owns)::

    H_r = all_to_all( X_q[send_index_q -> r]  for every rank q )          # [H_r, F]
    X_full_r = cat(X_r, H_r)                                             # [N_r + H_r, F]

Backward, given ``dL/dH_r`` for the borrowed rows, the gradients travel back to their owners
and are *added* into the owners' gradient (a node can be borrowed by several ranks)::

    dL/dX_q += index_add( send_index_q, all_to_all( dL/dH_r  for every rank r ) )

This is the adjoint of the forward gather, so it is exact for directed graphs (no symmetry
is assumed) and for ranks that own no training node (they still send zero gradients).

:class:`HaloExchanger` numbers the message-passing layers of a training step by call order,
asks its :class:`~lightning_fullgraph.comm.policies.base.CompressionPolicy` for the bit-widths
of each message (forward and backward separately), encodes around the
:class:`~lightning_fullgraph.comm.transport.HaloTransport` accordingly
(:mod:`~lightning_fullgraph.comm.messages`), and runs every training layer's differentiable
exchange through the policy's halo path (:mod:`~lightning_fullgraph.comm.path`): the
synchronous and overlapped exchanges below by default, or the policy's own (Sylvie's
pipeline).  It knows no method by name.  Outside training steps every exchange is fp32 and
synchronous.

Halo traffic runs on its own process group so it never interleaves with the gradient
all-reduce on the default group.  Every rank must call :meth:`HaloExchanger.exchange` the
same number of times in the same order (one call per message-passing layer), which holds
because every rank runs the same model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fullgraph.comm.codec import LayoutCache, ReceivedRows
from lightning_fullgraph.comm.messages import Message, send_encoded, send_rows
from lightning_fullgraph.comm.path import Pending, append_halo, halo_buffer, split_halo_grad
from lightning_fullgraph.comm.plan import HaloPlan
from lightning_fullgraph.comm.policies.base import CompressionPolicy
from lightning_fullgraph.comm.policies.exact import ExactPolicy
from lightning_fullgraph.comm.transport import CommStats, HaloTransport

__all__ = ["HaloExchanger"]


class HaloExchanger:
    """Moves halo rows between ranks according to a :class:`HaloPlan`.

    Args:
        plan: This rank's plan; its tensors must be on the device the features live on.
        group: Process group for halo traffic (``None``: the default group).  With a world
            size of 1 no collective is issued at all.
        policy: Decides the bit-widths and the halo path (synchronous, or e.g. Sylvie's
            pipeline) of training messages; default
            :class:`~lightning_fullgraph.comm.policies.exact.ExactPolicy` (fp32).
    """

    def __init__(self, plan: HaloPlan, group: Any = None, policy: CompressionPolicy | None = None) -> None:
        self.transport = HaloTransport(plan, group)
        self.policy = policy if policy is not None else ExactPolicy()
        # message layouts per bit-width table: recomputed only when a policy re-assigns
        self.layouts = LayoutCache()
        # inside a training step (the policy decides) or not (fp32, synchronous)
        self.training = False
        self._layer = 0
        self._static_refs: list[weakref.ref] = []
        # Exact cache for tensors that do not change between calls (layer-0 input
        # features): keyed on object identity + version counter, never on data_ptr, which a
        # later tensor may reuse.
        self._static: dict[int, tuple[weakref.ref, int, Tensor]] = {}
        #: ``(layer, width)`` of a training message whose input has the shape of a registered
        #: static tensor without being it (dropout on the features before the first conv):
        #: rows that could travel once travel every epoch.  Set once, by the first step.
        self.transformed_input: tuple[int, int] | None = None
        self._input_checked = False

    @property
    def plan(self) -> HaloPlan:
        return self.transport.plan

    @property
    def stats(self) -> CommStats:
        return self.transport.stats

    @property
    def skip_transfers(self) -> bool:
        """Benchmark bound: collectives skipped, received rows are zeros (results WRONG)."""
        return self.transport.skip_transfers

    @skip_transfers.setter
    def skip_transfers(self, value: bool) -> None:
        self.transport.skip_transfers = bool(value)

    def begin_step(self, training: bool) -> None:
        """Called at the start of every training step (``True``) and after its backward."""
        self._layer = 0
        self.training = training

    def register_static(self, tensor: Tensor) -> None:
        """Marks a tensor (e.g. the batch's features) as constant: its halo rows are fetched
        once in fp32 and reused while the tensor is alive and unmodified, in every mode."""
        self._static_refs = [r for r in self._static_refs if r() is not None]
        self._static_refs.append(weakref.ref(tensor))

    def is_static(self, x: Tensor) -> bool:
        """Whether ``x`` is a registered static tensor (its halo rows cross the wire once)."""
        return any(r() is x for r in self._static_refs)

    # -- sending --------------------------------------------------------------------------
    def launch(
        self, rows: Tensor, layer: int | None, direction: str, kind: str = "message",
        out: Tensor | None = None, index: Tensor | None = None,
    ) -> Message:
        """Starts one message: ``rows`` are the sent rows (forward: ``[S, F]`` in send order;
        backward: ``[H, F]`` gradients in halo order), or with ``index`` the rows
        ``rows[index]`` (forward: the owned rows ``[N_r, F]`` and the plan's ``send_index``).
        Inside a training step a layer's message travels at the bit-widths its policy gives
        (encoded around the transport, the codec reading the indexed rows where they lie, the
        rows' ranges handed back to the policy); otherwise as it is (gathered first).  Returns
        the message in flight: ``wait()`` gives the received rows (received or decoded straight
        into ``out`` when given), ``received()`` them as they arrived."""
        counts = self.plan.counts(direction)
        bits = None
        if self.training and layer is not None:
            bits = self.policy.message_bits(layer, direction)
        if bits is None:
            if index is not None:
                rows = rows.index_select(0, index)
            return send_rows(self.transport, rows, *counts, kind=kind, layer=layer, direction=direction, out=out)
        message, row_range = send_encoded(
            self.transport, rows, *counts, bits,
            generator=self.policy.generator, kind=kind, layer=layer, direction=direction,
            layouts=self.layouts, out=out, index=index,
        )
        self.policy.observe(layer, direction, row_range, rows.size(1))
        return message

    def send_forward(self, x: Tensor, layer: int | None, kind: str = "message", out: Tensor | None = None) -> Message:
        """Starts the forward message of ``x``'s halo rows (``x``: the ``[N_r, F]`` rows this
        rank owns, not differentiated): :meth:`launch` of ``x[send_index]``."""
        return self.launch(x.detach(), layer, "forward", kind, out=out, index=self.plan.send_index)

    def check_rows(self, x: Tensor) -> None:
        """Refuses ``x`` unless it has the ``N_r`` rows this rank owns."""
        if x.size(0) != self.plan.num_owned:
            raise ValueError(
                f"halo exchange expects the {self.plan.num_owned} rows this rank owns, got {x.size(0)} rows"
            )

    def fetch(self, x: Tensor, layer: int | None = None, kind: str = "message", full: bool = False) -> Tensor:
        """Halo rows of ``x`` (no autograd): ``[N_r, *] -> [H_r, *]``; quantized when inside a
        training step the policy says so for ``layer``.  With ``full``, ``cat(x, halo)``
        ``[N_r + H_r, *]`` with the halo rows received (or decoded) straight into it."""
        self.check_rows(x)
        if not full:
            return self.send_forward(x, layer, kind).wait()
        buffer, halo = halo_buffer(x.detach(), self.plan.num_halo)
        self.send_forward(x, layer, kind, out=halo).wait()
        return buffer

    def push_back(self, grad_halo: Tensor, layer: int | None = None) -> Tensor:
        """Sends halo-row gradients home and sums them at the owners: ``[H_r, *] -> [N_r, *]``."""
        return self.add_home(self.launch(grad_halo.contiguous(), layer, "backward"))

    def add_home(self, recv: Tensor | ReceivedRows | Message, owned: Tensor | None = None) -> Tensor:
        """``[S, *]`` received gradient rows summed at their owners, ``[N_r, *]``; added to
        ``owned`` (the owned rows' gradient from the same output, not modified) when given, so
        the sum is one new tensor rather than a zero-filled one that autograd adds up.

        ``recv``: the rows, a message kept as it arrived, or a message in flight (waited for
        here).  A compressed message is decoded straight into the sum
        (:meth:`~lightning_fullgraph.comm.codec.ReceivedRows.add_into`), never into ``[S, *]``
        rows of its own."""
        plan = self.plan
        if not isinstance(recv, (Tensor, ReceivedRows)):
            recv = recv.received()
        if isinstance(recv, ReceivedRows):
            if owned is not None:
                grad = owned.clone(memory_format=torch.contiguous_format)
            else:
                grad = torch.zeros((plan.num_owned, recv.row_len), dtype=recv.dtype, device=recv.buffer.device)
            return recv.add_into(grad, plan.send_index)
        if owned is not None:
            return torch.index_add(owned, 0, plan.send_index, recv.to(owned.dtype))
        grad = recv.new_zeros((plan.num_owned,) + tuple(recv.shape[1:]))
        return grad.index_add_(0, plan.send_index, recv)

    # -- autograd entry points ------------------------------------------------------------
    def exchange(
        self, x: Tensor, exact: bool = False, score: Callable[[], Tensor] | None = None, source: Tensor | None = None
    ) -> Tensor:
        """Returns ``cat(x, halo(x))`` of shape ``[N_r + H_r, *]``, differentiable in ``x``.

        Args:
            x: ``[N_r, *]`` rows this rank owns.
            exact: Never compress, never number as a layer (metadata such as degrees; counted
                as one-time traffic).
            score: Lazily gives the ``[H_r]`` receiver-side aggregation score of every halo row
                for the conv being run (AdaQP's variance weights).
            source: The layer input ``x`` was computed from, when the message is not the input
                itself (a projection ``X W``: ``HaloContext.sends_projection``); only the
                check for a transformed copy of the batch's features reads it.

        Tensors registered with :meth:`register_static` (the batch's features) that are the
        very same object at the same version as in an earlier call reuse that call's halo
        rows (fp32): static features cross the wire once.  Inside a training step every other
        exchange is a layer message: numbered by call order, encoded as the policy decides.
        """
        return self._halo(x, exact, score, full=True, source=source)

    def halo(
        self, x: Tensor, exact: bool = False, score: Callable[[], Tensor] | None = None, source: Tensor | None = None
    ) -> Tensor:
        """The halo rows alone, ``[N_r, *] -> [H_r, *]``: what :meth:`exchange` appends to
        ``x``, through the same path (numbering, encoding, caching, autograd)."""
        return self._halo(x, exact, score, source=source)

    def exchange_async(
        self, x: Tensor, exact: bool = False, score: Callable[[], Tensor] | None = None, source: Tensor | None = None
    ) -> Pending:
        """Starts the exchange of ``x``'s halo rows and returns at once; ``.wait()`` gives the
        halo rows ``[H_r, *]`` (differentiable in ``x``).  In backward the gradient transfer
        likewise overlaps whatever autograd computes between the two halves (by default: the
        policy's halo path decides, :meth:`start_overlapped`)."""
        grad = x.requires_grad and torch.is_grad_enabled()
        layer = self._next_layer(x, grad, exact, score, source)
        if layer is None:
            halo = self._fetch_unnumbered(x, exact)
            return Pending(lambda: halo)
        self.check_rows(x)
        self.stats.forward_exchanges += 1
        if not grad:
            return Pending(self.send_forward(x, layer).wait)
        return self.policy.start_halo(self, x, layer)

    def exchange_synchronous(self, x: Tensor, layer: int | None, full: bool = False) -> Tensor:
        """The synchronous differentiable exchange of ``x``'s halo rows (``cat(x, halo)`` with
        ``full``): the default halo path of a training layer, and every exchange outside one
        that needs a gradient."""
        return _HaloExchangeFn.apply(x, self, layer, full)

    def start_overlapped(self, x: Tensor, layer: int | None) -> Pending:
        """The overlapped differentiable exchange (the default :meth:`exchange_async` path): the
        forward transfer runs until ``wait()``, the gradient transfer until autograd reaches
        the start."""
        state: dict[str, Any] = {}
        token = _StartFn.apply(x, self, layer, state)
        return Pending(lambda: _WaitFn.apply(token, self, layer, state))

    def _next_layer(
        self, x: Tensor, grad: bool, exact: bool, score: Callable[[], Tensor] | None, source: Tensor | None = None
    ) -> int | None:
        if self.training and not exact and (grad or not self.is_static(x)):
            layer = self._layer
            self._layer += 1
            if layer == 0 and not self._input_checked:
                self._input_checked = True
                # (a layer input that needs no gradient is a transform of constant data only;
                # GCN's lin(x) of the same shape needs one and travels every epoch anyway.
                # A projected message is judged by the input it was computed from.)
                src = x if source is None else source
                src_grad = grad if source is None else source.requires_grad and torch.is_grad_enabled()
                if not src_grad and self._looks_like_static(src):
                    self.transformed_input = (layer, int(x[0].numel()) if x.dim() > 1 else 1)
            self.policy.observe_score(layer, score)
            return layer
        return None

    def _looks_like_static(self, x: Tensor) -> bool:
        """A tensor with the shape and dtype of a registered static tensor, not that tensor
        (e.g. ``dropout(batch.x)``)."""
        if self.is_static(x) or x.size(0) != self.plan.num_owned:
            return False
        for ref in self._static_refs:
            t = ref()
            if t is not None and t.shape == x.shape and t.dtype == x.dtype:
                return True
        return False

    def _halo(
        self, x: Tensor, exact: bool, score: Callable[[], Tensor] | None, full: bool = False,
        source: Tensor | None = None,
    ) -> Tensor:
        """The halo rows ``[H_r, *]``, or with ``full`` ``cat(x, halo)`` ``[N_r + H_r, *]``:
        the autograd functions then take the concatenation's gradient whole and add its owned
        rows into the rows that come home (:meth:`add_home`)."""
        grad = x.requires_grad and torch.is_grad_enabled()
        layer = self._next_layer(x, grad, exact, score, source)
        if layer is None:
            if grad:
                self.stats.forward_exchanges += 1
                return self.exchange_synchronous(x, None, full)
            return append_halo(x, self._fetch_unnumbered(x, exact), full)
        self.check_rows(x)
        self.stats.forward_exchanges += 1
        if grad:
            return self.policy.exchange_halo(self, x, layer, full)
        return self.fetch(x, layer, full=full)

    def _fetch_unnumbered(self, x: Tensor, exact: bool) -> Tensor:
        # Only registered tensors (the batch's own, the same role on every rank) are cached:
        # a hit skips a collective, so hits must happen on all ranks or on none.
        if not self.is_static(x):
            self.stats.forward_exchanges += 1
            return self.fetch(x, kind="onetime" if exact else "message")
        entry = self._static.get(id(x))
        if entry is not None and entry[0]() is x and entry[1] == x._version:
            self.stats.cache_hits += 1
            return entry[2]
        halo = self.fetch(x, kind="onetime")
        self.stats.forward_exchanges += 1
        # Keep only live entries; a tensor that died can never be hit again.
        self._static = {k: v for k, v in self._static.items() if v[0]() is not None}
        self._static[id(x)] = (weakref.ref(x), x._version, halo)
        return halo

    def clear_cache(self) -> None:
        self._static.clear()


class _HaloExchangeFn(torch.autograd.Function):
    """Synchronous exchange; with ``full`` the output is ``cat(x, halo)``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, exchanger: HaloExchanger, layer: int | None, full: bool = False) -> Tensor:
        ctx.exchanger, ctx.layer = exchanger, layer
        ctx.full, ctx.num_owned = full, x.size(0)
        return exchanger.fetch(x, layer, full=full)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        exchanger: HaloExchanger = ctx.exchanger
        exchanger.stats.backward_exchanges += 1
        grad_halo, owned = split_halo_grad(ctx, grad)
        message = exchanger.launch(grad_halo.contiguous(), ctx.layer, "backward")
        return exchanger.add_home(message, owned), None, None, None


class _StartFn(torch.autograd.Function):
    """First half of an overlapped exchange: launches the forward transfer; its backward
    waits for the gradient transfer that :class:`_WaitFn`'s backward launched."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, exchanger: HaloExchanger, layer: int | None, state: dict) -> Tensor:
        state["message"] = exchanger.send_forward(x, layer)
        ctx.exchanger, ctx.state = exchanger, state
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _grad_token: Tensor) -> tuple[Tensor, None, None, None]:
        exchanger: HaloExchanger = ctx.exchanger
        return exchanger.add_home(ctx.state.pop("message_back")), None, None, None


class _WaitFn(torch.autograd.Function):
    """Second half: waits for the forward transfer; its backward launches the gradient
    transfer without waiting."""

    @staticmethod
    def forward(ctx: Any, token: Tensor, exchanger: HaloExchanger, layer: int | None, state: dict) -> Tensor:
        ctx.exchanger, ctx.layer, ctx.state = exchanger, layer, state
        return state.pop("message").wait()

    @staticmethod
    def backward(ctx: Any, grad_halo: Tensor) -> tuple[Tensor, None, None, None]:
        exchanger: HaloExchanger = ctx.exchanger
        exchanger.stats.backward_exchanges += 1
        ctx.state["message_back"] = exchanger.launch(grad_halo.contiguous(), ctx.layer, "backward")
        return grad_halo.new_empty(0), None, None, None
