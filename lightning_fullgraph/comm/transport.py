"""The halo transport: one asynchronous ``all_to_all_single`` per message, codec around it.

A message is the rows this rank sends to every peer, peer-contiguous (``send_counts[p]``
rows for peer ``p``), answered by ``recv_counts[q]`` rows from every peer ``q``.  The
transport either moves the rows as they are (``bits=None``: their own dtype) or, when handed
per-row bit-widths, encodes them with the stochastic k-bit codec
(:func:`~lightning_fullgraph.comm.codec.encode_rows`), moves the bytes and decodes at the
receiver.  It never decides anything: bit-widths come from the caller (the policy), the
rounding stream too.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fullgraph.comm.codec import ReceivedRows, decode_rows, encode_rows, message_nbytes
from lightning_fullgraph.comm.plan import HaloPlan
from lightning_fullgraph.comm.quantize import META_NBYTES

__all__ = ["KINDS", "CommStats", "HaloTransport"]

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


class HaloTransport:
    """Moves rows between the ranks of a :class:`HaloPlan` on one process group.

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
        rows: Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        *,
        bits: tuple[Tensor, Tensor] | None = None,
        generator: torch.Generator | None = None,
        kind: str = "message",
        layer: int | None = None,
        direction: str = "forward",
        on_range: Callable[[Tensor], None] | None = None,
    ) -> Callable[[], Tensor]:
        """Launches one all-to-all without waiting; the returned closure waits and returns the
        received rows ``[sum(recv_counts), *rows.shape[1:]]``.  For a compressed message the
        closure has an attribute ``received`` that waits instead of it and returns what
        arrived without decoding it, a :class:`~lightning_fullgraph.comm.codec.ReceivedRows`
        (for keeping it small).  Call one of the two, once.  (Neither closure refers to the
        other's owner: a reference cycle would keep every message buffer alive until the
        garbage collector runs.)

        Args:
            rows: ``[sum(send_counts), *]`` rows, peer-contiguous.
            bits: ``(bits of every sent row, bits of every received row)`` (uint8), or
                ``None`` to send ``rows`` in their own dtype.  Two-dimensional rows only.
            generator: Random stream of the stochastic rounding.
            kind: ``"message"``, ``"onetime"`` or ``"control"`` (module docstring).
            layer, direction: Which message this is (for the per-layer counters).
            on_range: Called with the ``[S]`` per-row ``max - min`` of encoded rows.
        """
        stats = self.stats
        skip = self.skip_transfers and kind == "message"
        transfer = self.distributed and not skip
        stats.exchanges += 1
        if bits is None:
            shape = (sum(recv_counts),) + tuple(rows.shape[1:])
            out = rows.new_zeros(shape) if skip else rows.new_empty(shape)
            send = rows.contiguous()
            work = None
            if transfer:
                work = dist.all_to_all_single(
                    out, send, recv_counts, send_counts, group=self.group, async_op=True
                )
            row_bytes = rows.element_size() * math.prod(rows.shape[1:])
            stats.bytes_sent[kind] += row_bytes * sum(send_counts)
            stats.bytes_recv[kind] += row_bytes * sum(recv_counts)
            if kind == "message" and layer is not None:
                vbits = 8 * rows.element_size()
                stats.record_message(
                    layer, direction, send.numel(), send.numel() * vbits, send.numel() * vbits
                )

            def finish() -> Tensor:
                t = time.perf_counter()
                if work is not None:
                    work.wait()
                stats.wait_time += time.perf_counter() - t
                return out

            return finish
        send_bits, recv_bits = bits
        row_len = rows.size(1)
        t0 = time.perf_counter()
        enc = encode_rows(rows.detach().float(), send_bits, send_counts, generator=generator)
        recv_nbytes = message_nbytes(recv_bits, recv_counts, row_len)
        stats.quant_time += time.perf_counter() - t0
        if on_range is not None:
            on_range(enc.rng)
        if layer is not None:
            payload = int(send_bits.sum()) * row_len
            stats.record_message(
                layer, direction, rows.numel(), payload, payload + 8 * META_NBYTES * rows.size(0)
            )
        alloc = torch.zeros if skip else torch.empty
        buf = alloc(sum(recv_nbytes), dtype=torch.uint8, device=rows.device)
        work = None
        if transfer:
            work = dist.all_to_all_single(
                buf, enc.buffer, recv_nbytes, enc.nbytes, group=self.group, async_op=True
            )
        stats.bytes_sent[kind] += sum(enc.nbytes)
        stats.bytes_recv[kind] += sum(recv_nbytes)
        dtype = rows.dtype

        def finish_compressed() -> Tensor:
            t = time.perf_counter()
            if work is not None:
                work.wait()
            t1 = time.perf_counter()
            out = decode_rows(buf, recv_bits, recv_counts, row_len).to(dtype)
            stats.wait_time += t1 - t
            stats.quant_time += time.perf_counter() - t1
            return out

        def received() -> ReceivedRows:
            t = time.perf_counter()
            if work is not None:
                work.wait()
            stats.wait_time += time.perf_counter() - t
            return ReceivedRows(buf, recv_bits, recv_counts, row_len, dtype, stats)

        finish_compressed.received = received  # type: ignore[attr-defined]
        return finish_compressed

    def control(self, rows: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        """Synchronous uncompressed all-to-all of small control rows (always transferred)."""
        return self.start(rows, send_counts, recv_counts, kind="control")()
