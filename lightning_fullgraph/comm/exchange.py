"""Halo exchange: the transport (one ``all_to_all_single`` per exchange) and its autograd.

Forward, for a layer input ``X_r`` (``[N_r, F]``, the rows rank ``r`` owns)::

    H_r = all_to_all( X_q[send_index_q -> r]  for every rank q )          # [H_r, F]
    X_full_r = cat(X_r, H_r)                                             # [N_r + H_r, F]

Backward, given ``dL/dH_r`` for the borrowed rows, the gradients travel back to their owners
and are *added* into the owners' gradient (a node can be borrowed by several ranks)::

    dL/dX_q += index_add( send_index_q, all_to_all( dL/dH_r  for every rank r ) )

This is the adjoint of the forward gather, so it is exact for directed graphs (no symmetry
is assumed) and for ranks that own no training node (they still send zero gradients).

Halo traffic runs on its own process group so it never interleaves with the gradient
all-reduce on the default group.  Every rank must call :meth:`HaloExchanger.exchange` the
same number of times in the same order (one call per message-passing layer), which holds
because every rank runs the same model.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fullgraph.comm.staleness import StalenessState
from lightning_fullgraph.partition.plan import HaloPlan

__all__ = ["CommStats", "HaloExchanger"]


@dataclass
class CommStats:
    """Counters of halo traffic, reset by the logger at every epoch.

    All byte counts are payload bytes this rank put on / took off the wire (rows sent to
    itself are not counted: a rank never sends to itself).  Times are seconds.
    """

    bytes_sent: int = 0
    bytes_recv: int = 0
    exchanges: int = 0
    wait_time: float = 0.0
    forward_exchanges: int = 0
    backward_exchanges: int = 0
    cache_hits: int = 0
    quant_time: float = 0.0
    values_sent: int = 0
    bits_sent: int = 0
    layer_values: dict[int, int] = field(default_factory=dict)
    layer_bits: dict[int, int] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.bytes_sent = self.bytes_recv = self.exchanges = 0
        self.forward_exchanges = self.backward_exchanges = self.cache_hits = 0
        self.wait_time = self.quant_time = 0.0
        self.values_sent = self.bits_sent = 0
        self.layer_values.clear()
        self.layer_bits.clear()
        self.extra.clear()

    def record_bits(self, layer: int, values: int, bits: int) -> None:
        """Counts ``values`` sent by forward exchanges of ``layer`` at ``bits`` bits in total."""
        self.values_sent += values
        self.bits_sent += bits
        self.layer_values[layer] = self.layer_values.get(layer, 0) + values
        self.layer_bits[layer] = self.layer_bits.get(layer, 0) + bits

    @property
    def average_bits(self) -> float:
        """Mean bits per sent value of training exchanges (32 for fp32; 0 if none)."""
        return self.bits_sent / self.values_sent if self.values_sent else 0.0


class HaloExchanger:
    """Moves halo rows between ranks according to a :class:`HaloPlan`.

    Args:
        plan: This rank's plan; its tensors must be on the device the features live on.
        group: Process group for halo traffic (``None``: the default group).  With a world
            size of 1 no collective is issued at all.
    """

    def __init__(
        self,
        plan: HaloPlan,
        group: Any = None,
        bits: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if bits is not None and bits not in (1, 2, 4, 8, 32):
            raise ValueError(f"bits must be 1, 2, 4, 8 or 32 (or None: no compression), got {bits!r}")
        self.plan = plan
        self.group = group
        self.stats = CommStats()
        self.bits = bits
        self.generator = generator
        # Compression is on only inside training steps (evaluation exchanges fp32).
        self.compress = False
        self._layer = 0
        # Per layer: (bits of every sent row [S], bits of every halo row [H]); uniform
        # `bits` where a layer has no entry.
        self.layer_bits: dict[int, tuple[Tensor, Tensor]] = {}
        # Per layer: max - min of every sent row at the last compressed forward (for the
        # bit-width assignment's variance model).
        self.row_range: dict[int, Tensor] = {}
        self.layer_dims: dict[int, int] = {}
        self._static_refs: list[weakref.ref] = []
        # Benchmark bound: the collectives are skipped, every computation of the mode runs
        # (gathers, codec, pipeline); received rows are zeros, so results are WRONG.
        self.skip_transfers = False
        # Sylvie's asynchronous pipeline (None: every exchange is synchronous).
        self.staleness: StalenessState | None = None
        self._sync = True
        # Exact cache for tensors that do not change between calls (layer-0 input
        # features): keyed on object identity + version counter, never on data_ptr, which a
        # later tensor may reuse.
        self._static: dict[int, tuple[weakref.ref, int, Tensor]] = {}
        self._distributed = plan.world_size > 1 and dist.is_available() and dist.is_initialized()

    def begin_step(self, compress: bool, epoch: int = 0) -> None:
        """Called at the start of every training step (``compress=True``) and after it."""
        self._layer = 0
        self.compress = compress and self.bits is not None
        if self.compress and self.staleness is not None:
            self._sync = self.staleness.begin_epoch(epoch)

    def register_static(self, tensor: Tensor) -> None:
        """Marks a tensor (e.g. the batch's features) as constant: its halo rows are fetched
        once in fp32 and reused while the tensor is alive and unmodified, in every mode."""
        self._static_refs = [r for r in self._static_refs if r() is not None]
        self._static_refs.append(weakref.ref(tensor))

    def _is_static(self, x: Tensor) -> bool:
        return any(r() is x for r in self._static_refs)

    def bits_for(self, layer: int) -> tuple[Tensor, Tensor]:
        """Per-row bit-widths ``([S] sent rows, [H] halo rows)`` of ``layer`` (uint8)."""
        if layer in self.layer_bits:
            return self.layer_bits[layer]
        assert self.bits is not None
        device = self.plan.send_index.device
        return (
            torch.full((self.plan.num_send,), self.bits, dtype=torch.uint8, device=device),
            torch.full((self.plan.num_halo,), self.bits, dtype=torch.uint8, device=device),
        )

    # -- transport ------------------------------------------------------------------------
    def _all_to_all(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        """Synchronous uncompressed all-to-all of rows (also used for small metadata)."""
        # Control traffic (bit-widths, scores): sent even by the benchmark bound, whose mode
        # needs it to make the same decisions as the real run.
        return self._start(send, send_counts, recv_counts, None, forward=False, always=True)()

    def _start(
        self,
        rows: Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        layer: int | None,
        forward: bool,
        always: bool = False,
    ):
        """Launches one all-to-all without waiting and returns a closure that waits and returns
        the received rows.  ``layer=None`` or 32 bits: rows travel in their own dtype; else
        quantized at the layer's bit-widths (``forward=False``: the reverse direction, for
        gradients)."""
        from lightning_fullgraph.comm.codec import decode_rows, encode_rows, message_nbytes

        if layer is not None and self.bits == 32:
            if forward:
                self.layer_dims[layer] = rows.size(1)
                self.stats.record_bits(layer, rows.numel(), rows.numel() * 32)
            layer, forward = None, False
        # Benchmark bound: everything this call computes (gather, codec, bookkeeping) runs,
        # only the collective is skipped, and the received rows are zeros.
        skip = self.skip_transfers and not always
        transfer = self._distributed and not skip
        if layer is None:
            shape = (sum(recv_counts),) + tuple(rows.shape[1:])
            out = rows.new_zeros(shape) if skip else rows.new_empty(shape)
            send = rows.contiguous()
            work = None
            if transfer:
                work = dist.all_to_all_single(out, send, recv_counts, send_counts, group=self.group, async_op=True)
            row_bytes = rows.element_size() * math.prod(rows.shape[1:])
            self.stats.bytes_sent += row_bytes * sum(send_counts)
            self.stats.bytes_recv += row_bytes * sum(recv_counts)
            self.stats.exchanges += 1
            if forward and rows.is_floating_point():
                self.stats.record_bits(-1, send.numel(), send.numel() * 8 * send.element_size())

            def finish() -> Tensor:
                t = time.perf_counter()
                if work is not None:
                    work.wait()
                self.stats.wait_time += time.perf_counter() - t
                return out

            return finish
        send_bits, recv_bits = self.bits_for(layer)
        if not forward:
            send_bits, recv_bits = recv_bits, send_bits
        row_len = rows.size(1)
        t0 = time.perf_counter()
        enc = encode_rows(rows.detach().float(), send_bits, send_counts, generator=self.generator)
        recv_nbytes = message_nbytes(recv_bits, recv_counts, row_len)
        self.stats.quant_time += time.perf_counter() - t0
        if forward:
            self.row_range[layer] = enc.rng
            self.layer_dims[layer] = row_len
            self.stats.record_bits(layer, rows.numel(), int(send_bits.sum()) * row_len)
        alloc = torch.zeros if skip else torch.empty
        buf = alloc(sum(recv_nbytes), dtype=torch.uint8, device=rows.device)
        work = None
        if transfer:
            work = dist.all_to_all_single(buf, enc.buffer, recv_nbytes, enc.nbytes, group=self.group, async_op=True)
        self.stats.bytes_sent += sum(enc.nbytes)
        self.stats.bytes_recv += sum(recv_nbytes)
        self.stats.exchanges += 1
        dtype = rows.dtype

        def finish_compressed() -> Tensor:
            t = time.perf_counter()
            if work is not None:
                work.wait()
            t1 = time.perf_counter()
            out = decode_rows(buf, recv_bits, recv_counts, row_len).to(dtype)
            self.stats.wait_time += t1 - t
            self.stats.quant_time += time.perf_counter() - t1
            return out

        return finish_compressed

    def exchange_async(self, x: Tensor, exact: bool = False) -> _Pending:
        """Starts the exchange of ``x``'s halo rows and returns at once; ``.wait()`` gives the
        halo rows ``[H_r, *]`` (differentiable in ``x``).  In backward the gradient transfer
        likewise overlaps whatever autograd computes between the two halves."""
        if self.staleness is not None and self.compress:
            # the pipeline already hides the transfer; no second overlap mechanism
            halo = self._halo(x, exact)
            return _Pending(lambda: halo)
        grad = x.requires_grad and torch.is_grad_enabled()
        layer = self._next_layer(x, grad, exact)
        if not grad and layer is None:
            halo = self._fetch_static(x)
            return _Pending(lambda: halo)
        if x.size(0) != self.plan.num_owned:
            raise ValueError(
                f"halo exchange expects the {self.plan.num_owned} rows this rank owns, got {x.size(0)} rows"
            )
        self.stats.forward_exchanges += 1
        if not grad:
            finish = self._start(x.index_select(0, self.plan.send_index), self.plan.send_counts, self.plan.recv_counts, layer, True)
            return _Pending(finish)
        state: dict[str, Any] = {}
        token = _StartFn.apply(x, self, layer, state)
        return _Pending(lambda: _WaitFn.apply(token, self, layer, state))

    def _next_layer(self, x: Tensor, grad: bool, exact: bool) -> int | None:
        if self.compress and not exact and (grad or not self._is_static(x)):
            layer = self._layer
            self._layer += 1
            return layer
        return None

    def fetch(self, x: Tensor, layer: int | None = None) -> Tensor:
        """Halo rows of ``x`` (no autograd): ``[N_r, *] -> [H_r, *]``.

        With ``layer`` given and compression on, rows travel quantized at that layer's
        bit-widths; otherwise in ``x``'s dtype.
        """
        plan = self.plan
        if x.size(0) != plan.num_owned:
            raise ValueError(
                f"halo exchange expects the {plan.num_owned} rows this rank owns, got {x.size(0)} rows"
            )
        send = x.index_select(0, plan.send_index)
        return self._start(send, plan.send_counts, plan.recv_counts, layer, forward=True)()

    def push_back(self, grad_halo: Tensor, layer: int | None = None) -> Tensor:
        """Sends halo-row gradients home and sums them at the owners: ``[H_r, *] -> [N_r, *]``.

        With ``layer`` given the gradients travel quantized at the bit-widths of that layer's
        forward rows (the same row, the opposite direction).
        """
        plan = self.plan
        recv = self._start(grad_halo, plan.recv_counts, plan.send_counts, layer, forward=False)()
        grad = grad_halo.new_zeros((plan.num_owned,) + tuple(grad_halo.shape[1:]))
        return grad.index_add_(0, plan.send_index, recv)

    # -- autograd entry point -------------------------------------------------------------
    def exchange(self, x: Tensor, exact: bool = False) -> Tensor:
        """Returns ``cat(x, halo(x))`` of shape ``[N_r + H_r, *]``, differentiable in ``x``.

        Args:
            x: ``[N_r, *]`` rows this rank owns.
            exact: Never compress (for metadata such as degrees).

        Tensors registered with :meth:`register_static` (the batch's features) that are the
        very same object at the same version as in an earlier call reuse that call's halo
        rows (fp32): static features cross the wire once.  Inside a training step with compression on, every other exchange (forward
        rows and, in backward, their gradients) is quantized at the current layer's
        bit-widths; layers are numbered by call order within the step.
        """
        return torch.cat([x, self._halo(x, exact)], dim=0)

    def _halo(self, x: Tensor, exact: bool) -> Tensor:
        grad = x.requires_grad and torch.is_grad_enabled()
        layer = self._next_layer(x, grad, exact)
        if grad and layer is not None and self.staleness is not None:
            st = self.staleness
            self.stats.forward_exchanges += 1
            if not self._sync:
                return _StaleFn.apply(x, self, layer)
            halo = _HaloExchangeFn.apply(x, self, layer)
            pipe = st.layer(layer)
            pipe.halo, pipe.halo_epoch, pipe.halo_avg = halo.detach(), st.epoch, None
            st.record_age(layer, 0)
            return halo
        if grad:
            self.stats.forward_exchanges += 1
            return _HaloExchangeFn.apply(x, self, layer)
        if layer is not None:
            self.stats.forward_exchanges += 1
            return self.fetch(x, layer)
        return self._fetch_static(x)

    def _fetch_static(self, x: Tensor) -> Tensor:
        # Only registered tensors (the batch's own, the same role on every rank) are cached:
        # a hit skips a collective, so hits must happen on all ranks or on none.
        if not self._is_static(x):
            self.stats.forward_exchanges += 1
            return self.fetch(x.detach())
        entry = self._static.get(id(x))
        if entry is not None and entry[0]() is x and entry[1] == x._version:
            self.stats.cache_hits += 1
            return entry[2]
        halo = self.fetch(x.detach())
        self.stats.forward_exchanges += 1
        # Keep only live entries; a tensor that died can never be hit again.
        self._static = {k: v for k, v in self._static.items() if v[0]() is not None}
        self._static[id(x)] = (weakref.ref(x), x._version, halo)
        return halo

    def clear_cache(self) -> None:
        self._static.clear()


class _HaloExchangeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, exchanger: HaloExchanger, layer: int | None) -> Tensor:
        ctx.exchanger = exchanger
        ctx.layer = layer
        return exchanger.fetch(x.detach(), layer)

    @staticmethod
    def backward(ctx: Any, grad_halo: Tensor) -> tuple[Tensor, None, None]:
        exchanger: HaloExchanger = ctx.exchanger
        exchanger.stats.backward_exchanges += 1
        return exchanger.push_back(grad_halo.contiguous(), ctx.layer), None, None


class _Pending:
    """A halo exchange in flight; :meth:`wait` returns the halo rows."""

    __slots__ = ("_finish",)

    def __init__(self, finish: Any) -> None:
        self._finish = finish

    def wait(self) -> Tensor:
        return self._finish()


class _StartFn(torch.autograd.Function):
    """First half of an overlapped exchange: launches the forward transfer; its backward
    waits for the gradient transfer that :class:`_WaitFn`'s backward launched."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, exchanger: HaloExchanger, layer: int | None, state: dict) -> Tensor:
        plan = exchanger.plan
        state["finish"] = exchanger._start(x.detach().index_select(0, plan.send_index), plan.send_counts, plan.recv_counts, layer, True)
        ctx.exchanger, ctx.state = exchanger, state
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _grad_token: Tensor) -> tuple[Tensor, None, None, None]:
        exchanger: HaloExchanger = ctx.exchanger
        plan = exchanger.plan
        recv = ctx.state.pop("finish_back")()
        grad = recv.new_zeros((plan.num_owned,) + tuple(recv.shape[1:]))
        return grad.index_add_(0, plan.send_index, recv), None, None, None


class _WaitFn(torch.autograd.Function):
    """Second half: waits for the forward transfer; its backward launches the gradient
    transfer without waiting."""

    @staticmethod
    def forward(ctx: Any, token: Tensor, exchanger: HaloExchanger, layer: int | None, state: dict) -> Tensor:
        ctx.exchanger, ctx.layer, ctx.state = exchanger, layer, state
        return state.pop("finish")()

    @staticmethod
    def backward(ctx: Any, grad_halo: Tensor) -> tuple[Tensor, None, None, None]:
        exchanger: HaloExchanger = ctx.exchanger
        plan = exchanger.plan
        exchanger.stats.backward_exchanges += 1
        ctx.state["finish_back"] = exchanger._start(grad_halo.contiguous(), plan.recv_counts, plan.send_counts, ctx.layer, False)
        return grad_halo.new_empty(0), None, None, None


class _StaleFn(torch.autograd.Function):
    """Asynchronous step of one layer: consume the halo rows sent last epoch, launch this
    epoch's; in backward add last epoch's returned gradients, launch this epoch's."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, exchanger: HaloExchanger, layer: int) -> Tensor:
        st = exchanger.staleness
        assert st is not None
        plan = exchanger.plan
        pipe = st.layer(layer)
        fresh = pipe.fwd_pending is not None
        pipe.land_forward()
        if pipe.halo is None:  # no earlier exchange of this layer (e.g. a new layer): go synchronous
            pipe.halo, pipe.halo_epoch = exchanger.fetch(x.detach(), layer), st.epoch
        else:
            pipe.fwd_pending = exchanger._start(
                x.detach().index_select(0, plan.send_index), plan.send_counts, plan.recv_counts, layer, True
            )
            pipe.fwd_epoch = st.epoch
        st.record_age(layer, st.epoch - pipe.halo_epoch)
        ctx.exchanger, ctx.layer = exchanger, layer
        return st.smooth_halo(pipe, fresh).clone()

    @staticmethod
    def backward(ctx: Any, grad_halo: Tensor) -> tuple[Tensor, None, None]:
        exchanger: HaloExchanger = ctx.exchanger
        st = exchanger.staleness
        assert st is not None
        plan = exchanger.plan
        pipe = st.layer(ctx.layer)
        pipe.land_gradient()
        stale = pipe.grad
        pipe.grad = None
        exchanger.stats.backward_exchanges += 1
        pipe.grad_pending = exchanger._start(grad_halo.contiguous(), plan.recv_counts, plan.send_counts, ctx.layer, False)
        grad = grad_halo.new_zeros((plan.num_owned,) + tuple(grad_halo.shape[1:]))
        if stale is not None:
            grad.index_add_(0, plan.send_index, st.smooth_grad(pipe, stale))
        return grad, None, None
