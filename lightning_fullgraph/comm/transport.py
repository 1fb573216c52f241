"""The halo transport: one asynchronous ``all_to_all_single`` per message, a typed handle back.

A message is the rows this rank sends to every peer, peer-contiguous (``send_counts[p]``
rows for peer ``p``), answered by ``recv_counts[q]`` rows from every peer ``q``.  The
transport moves a tensor's rows as they are -- float rows, or the bytes of an encoded message
(``[sum(nbytes)]`` uint8, one "row" per byte) -- and returns a :class:`Transfer`, which, like
torch's ``Work``, waits and gives what arrived.  It never decides or encodes anything:
compression is composed around it (:mod:`~lightning_fullgraph.comm.messages`: the codec
before :meth:`HaloTransport.start`, the decoding after :meth:`Transfer.wait`, as torch's
``fp16_compress_wrapper`` wraps a plain all-reduce).

Every transfer is counted in :class:`CommStats` under a *kind*:

* ``"message"`` -- the per-epoch messages of the layers (forward rows, backward gradients);
* ``"onetime"`` -- transfers whose result is cached (the batch's input features, degrees);
* ``"control"`` -- the policies' own control rows (aggregation scores, bit-widths).

``skip_transfers`` (the ``compute_only`` benchmark bound) skips the collective of the per-epoch
messages and returns zeros; everything else (gathers, codec, bookkeeping) runs.  One-time and
control transfers always travel: they are not per-epoch cost, and the bound must compute on
the same normalisation (exchanged degrees) and take the same decisions as the real run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_fullgraph.comm.plan import HaloPlan

__all__ = ["KINDS", "CommStats", "HaloTransport", "Transfer"]

KINDS: tuple[str, ...] = ("message", "onetime", "control")

@dataclass
class CommStats:
    """Counters of halo traffic since the last :meth:`reset` (the strategy resets them at
    every training step).

    Byte counts are bytes this rank put on / took off the wire (a rank never sends to
    itself).  ``payload_bits[d]`` / ``values[d]`` count the values of per-epoch messages in
    direction ``d`` (``"forward"``, ``"backward"``) and their bits without row metadata;
    ``wire_bits[d]`` includes it.  Times are seconds.
    """

    bytes_sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes_recv: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    exchanges: int = 0
    forward_exchanges: int = 0
    backward_exchanges: int = 0
    cache_hits: int = 0
    wait_time: float = 0.0
    quant_time: float = 0.0
    values: dict[str, int] = field(default_factory=dict)
    payload_bits: dict[str, int] = field(default_factory=dict)
    wire_bits: dict[str, int] = field(default_factory=dict)
    layer_values: dict[int, int] = field(default_factory=dict)
    layer_bits: dict[int, int] = field(default_factory=dict)

    def reset(self) -> None:
        fresh = CommStats()
        self.__dict__.update(fresh.__dict__)

    def record_message(
        self, layer: int, direction: str, values: int, payload_bits: int, wire_bits: int
    ) -> None:
        self.values[direction] = self.values.get(direction, 0) + values
        self.payload_bits[direction] = self.payload_bits.get(direction, 0) + payload_bits
        self.wire_bits[direction] = self.wire_bits.get(direction, 0) + wire_bits
        self.layer_values[layer] = self.layer_values.get(layer, 0) + values
        self.layer_bits[layer] = self.layer_bits.get(layer, 0) + payload_bits

    @property
    def average_bits(self) -> float:
        """Payload bits per value of the per-epoch messages, both directions (0: none)."""
        n = sum(self.values.values())
        return sum(self.payload_bits.values()) / n if n else 0.0

    @property
    def average_wire_bits(self) -> float:
        """Wire bits per value of the per-epoch messages, row metadata included."""
        n = sum(self.values.values())
        return sum(self.wire_bits.values()) / n if n else 0.0


class Transfer:
    """One all-to-all in flight (``Work``-like): :meth:`wait` waits and returns the received
    tensor ``[sum(recv_counts), *]``.

    The handle refers to its collective, its output buffer and the counters only -- nothing
    refers back to it -- so the buffer dies with the last reference to the handle or to what
    :meth:`wait` returned, never waiting for the garbage collector (at products' size an fp32
    message held until a collection is hundreds of MiB per rank).
    """

    __slots__ = ("_out", "_stats", "_work")

    def __init__(self, work: Any, out: Tensor, stats: CommStats) -> None:
        self._work = work
        self._out = out
        self._stats = stats

    def wait(self) -> Tensor:
        """Waits for the collective (the wait counted in ``wait_time``) and returns what arrived."""
        t = time.perf_counter()
        if self._work is not None:
            self._work.wait()
        self._stats.wait_time += time.perf_counter() - t
        return self._out

    def received(self) -> Tensor:
        """The message as it arrived, to keep: for rows sent as they are, :meth:`wait`'s rows."""
        return self.wait()


class HaloTransport:
    """Moves rows between the ranks of a :class:`HaloPlan` on one process group, as they are.

    Args:
        plan: This rank's plan (its tensors on the features' device).
        group: Process group for halo traffic (``None``: the default group).  With one rank
            no collective is issued.
    """

    def __init__(self, plan: HaloPlan, group: Any = None) -> None:
        self.plan = plan
        self.group = group
        self.stats = CommStats()
        self.skip_transfers = False
        self.distributed = plan.world_size > 1 and dist.is_available() and dist.is_initialized()

    def start(
        self,
        send: Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        *,
        kind: str = "message",
        out: Tensor | None = None,
    ) -> Transfer:
        """Launches one all-to-all of ``send``'s rows without waiting.

        Args:
            send: ``[sum(send_counts), *]`` rows, peer-contiguous (any dtype: float rows, or
                the bytes of an encoded message with per-peer byte counts).
            send_counts, recv_counts: Rows to / from every peer.
            kind: ``"message"``, ``"onetime"`` or ``"control"`` (module docstring).
            out: Contiguous ``[sum(recv_counts), *]`` tensor of ``send``'s dtype to receive
                into (e.g. the halo rows of the buffer a conv reads: no copy afterwards);
                a new one when ``None``.

        Returns:
            The :class:`Transfer`; its :meth:`~Transfer.wait` gives ``[sum(recv_counts), *]``
            rows of ``send``'s dtype (zeros when the bound skips the collective).
        """
        stats = self.stats
        skip = self.skip_transfers and kind == "message"
        transfer = self.distributed and not skip
        stats.exchanges += 1
        shape = (sum(recv_counts),) + tuple(send.shape[1:])
        if out is None:
            out = send.new_zeros(shape) if skip else send.new_empty(shape)
        else:
            if tuple(out.shape) != shape or out.dtype != send.dtype or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous {send.dtype} tensor of shape {shape}")
            if skip:
                out.zero_()
        send = send.contiguous()
        work = None
        if transfer:
            work = dist.all_to_all_single(out, send, recv_counts, send_counts, group=self.group, async_op=True)
        row_bytes = send.element_size() * math.prod(send.shape[1:])
        stats.bytes_sent[kind] += row_bytes * sum(send_counts)
        stats.bytes_recv[kind] += row_bytes * sum(recv_counts)
        return Transfer(work, out, stats)

    def control(self, rows: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        """Synchronous uncompressed all-to-all of small control rows (always transferred)."""
        return self.start(rows, send_counts, recv_counts, kind="control").wait()
