"""Per-epoch halo-traffic metrics: read after every training step, summed over ranks, logged.

The callback only reads (the exchanger's counters and the strategy's ``step_figures``) and
logs; it holds no state, so checkpoints carry nothing of it.  Every figure is per training
epoch (one full-graph step); figures marked *sum* are summed over ranks with one all-reduce,
the others are identical on every rank.  They reach the loggers as one row per epoch (with
``epoch``, at the step of Lightning's epoch-end metrics), ``trainer.callback_metrics``, and,
for ``comm/bytes_sent`` and ``comm/bits``, the progress bar (:meth:`CommMetricsLogger._publish`).

=============================  ===========================================================
``comm/bytes_sent``            sum: bytes of the per-epoch layer messages (forward rows and
                               backward gradients, row metadata included) put on the wire
``comm/bytes_recv``            sum: the same, received
``comm/onetime_bytes``         sum: bytes of cached transfers (input features, degrees)
                               since the last training step, the sanity check's included:
                               the first epoch only; 0 for convs whose first message is a
                               transform of the features (GCN sends ``lin(x)`` each epoch)
``comm/control_bytes``         sum: the policies' control rows (AdaQP's scores, bit-widths)
``comm/bits``                  payload bits per value of the per-epoch messages, both
                               directions (32 for fp32; without row metadata); not logged
                               in an epoch that sends no message (Sylvie's last epoch and
                               the one before a synchronous epoch), nor are the other
                               ``bits`` figures
``comm/wire_bits``             the same with the per-row metadata (min and range)
``comm/bits_forward``,
``comm/bits_backward``         payload bits per value, one direction
``comm/bits_layer{k}``         payload bits per value of layer ``k``'s messages
``comm/exchanges``             sum: collectives issued (all kinds)
``comm/wait_time``             sum: seconds blocked waiting for transfers
``comm/quant_time``            sum: seconds in the codec
``comm/assign_*``              AdaQP's assignment (epochs that ran one)
``comm/staleness_max/mean``    Sylvie: age in epochs of the halo values used
``comm/sync_epoch``            Sylvie: 1 if this epoch exchanged fresh values
``comm/global_loss``           Sylvie's epoch-adaptive rule: the global training loss
=============================  ===========================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_fullgraph.comm.plan import DIRECTIONS

__all__ = ["CommMetricsLogger", "CommTotals"]

_PROGRESS_BAR = ("comm/bytes_sent", "comm/bits")


@dataclass
class CommTotals:
    """Halo traffic of a fit summed over its training epochs and ranks (for the end-of-fit
    line).  ``exact_bytes`` is what fp32 messages of the same rows would have put on the wire
    in every epoch: each epoch's values at 4 bytes, and an epoch that sent nothing counted
    as the largest epoch that did (an exact run sends every epoch)."""

    epochs: int = 0
    epochs_sent: int = 0
    bytes_sent: float = 0.0
    onetime_bytes: float = 0.0
    control_bytes: float = 0.0
    payload_bits: float = 0.0
    values: float = 0.0
    max_epoch_values: float = 0.0

    def add(self, bytes_sent: float, onetime: float, control: float, payload_bits: float, values: float) -> None:
        self.epochs += 1
        self.bytes_sent += bytes_sent
        self.onetime_bytes += onetime
        self.control_bytes += control
        if values > 0:
            self.epochs_sent += 1
            self.payload_bits += payload_bits
            self.values += values
            self.max_epoch_values = max(self.max_epoch_values, values)

    @property
    def mean_bits(self) -> float:
        """Payload bits per value over the epochs that sent (0: none sent)."""
        return self.payload_bits / self.values if self.values else 0.0

    @property
    def exact_bytes(self) -> float:
        return 4.0 * (self.values + (self.epochs - self.epochs_sent) * self.max_epoch_values)

    def summary(self, mode: str) -> str | None:
        """One line: MB sent, mean bits, epochs that sent, against fp32 messages."""
        if not self.epochs:
            return None
        mb = self.bytes_sent / 2**20
        line = (
            f"FullGraphStrategy [{mode}]: {self.epochs} training epoch(s), halo messages {mb:.2f} MB "
            f"(all ranks) in {self.epochs_sent} epoch(s) that sent"
        )
        if self.epochs_sent:
            line += f", {self.mean_bits:.2f} bits per value on average"
        if self.exact_bytes and mode != "exact":
            line += f"; fp32 messages every epoch: {self.exact_bytes / 2**20:.2f} MB ({self.exact_bytes / max(self.bytes_sent, 1.0):.1f}x)"
        line += f"; one-time transfers {self.onetime_bytes / 2**20:.2f} MB"
        return line


class CommMetricsLogger(Callback):
    """Logs the halo traffic of every training step (see the module docstring), and adds it
    to :attr:`totals` (reset when a fit starts)."""

    def __init__(self) -> None:
        self.totals = CommTotals()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.totals = CommTotals()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        strategy = trainer.strategy
        exchanger = getattr(strategy, "exchanger", None)
        if exchanger is None:
            return
        s = exchanger.stats
        layers = sorted(s.layer_values)
        directions = DIRECTIONS
        raw = [
            s.bytes_sent["message"], s.bytes_recv["message"], s.bytes_sent["onetime"], s.bytes_sent["control"],
            s.exchanges, s.wait_time, s.quant_time,
        ]
        raw += [s.payload_bits.get(d, 0) for d in directions] + [s.wire_bits.get(d, 0) for d in directions]
        raw += [s.values.get(d, 0) for d in directions]
        raw += [s.layer_bits[k] for k in layers] + [s.layer_values[k] for k in layers]
        # one all-reduce for every figure (every rank runs the same layers)
        values = torch.tensor(raw, dtype=torch.float64, device=pl_module.device)
        if strategy.world_size > 1 and dist.is_initialized():
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        v = values.tolist()
        payload, wire, count = v[7:9], v[9:11], v[11:13]

        def ratio(a: float, b: float) -> float:
            return a / b if b else 0.0

        self.totals.add(v[0], v[2], v[3], sum(payload), sum(count))
        figures = {
            "comm/bytes_sent": v[0],
            "comm/bytes_recv": v[1],
            "comm/onetime_bytes": v[2],
            "comm/control_bytes": v[3],
            "comm/exchanges": v[4],
            "comm/wait_time": v[5],
            "comm/quant_time": v[6],
        }
        # bits per value of an epoch that sent nothing is undefined, not 0: not logged
        if sum(count):
            figures["comm/bits"] = ratio(sum(payload), sum(count))
            figures["comm/wire_bits"] = ratio(sum(wire), sum(count))
        for d, direction in enumerate(directions):
            if count[d]:
                figures[f"comm/bits_{direction}"] = ratio(payload[d], count[d])
        n = len(layers)
        for i, k in enumerate(layers):
            if v[13 + n + i]:
                figures[f"comm/bits_layer{k}"] = ratio(v[13 + i], v[13 + n + i])
        # (the same on every rank: the policy's schedule is)
        figures.update(exchanger.policy.epoch_figures())
        figures.update(getattr(strategy, "step_figures", {}))
        self._publish(trainer, pl_module, {k: v for k, v in figures.items() if math.isfinite(v)})

    @staticmethod
    def _publish(trainer: pl.Trainer, pl_module: pl.LightningModule, figures: dict[str, float]) -> None:
        """Hands ``figures`` to the loggers (one row, at the step of Lightning's epoch-end
        metrics), to ``trainer.callback_metrics`` and, for :data:`_PROGRESS_BAR`, to the
        progress bar.

        Only the progress-bar figures go through :meth:`LightningModule.log`: each call costs
        about 0.7 ms of CPU (its result collection moves and copies the metric's state on every
        call), so logging all ~20 figures that way took 14 ms per epoch and rank, a third of a
        Cora step in the compressed modes.  Lightning's own monitors (``LearningRateMonitor``,
        ``DeviceStatsMonitor``) write to the loggers directly the same way."""
        for name in _PROGRESS_BAR:
            if name in figures:
                # logger=False: the row below carries it; this call feeds the progress bar
                pl_module.log(name, figures[name], on_step=False, on_epoch=True, reduce_fx="sum", batch_size=1,
                              prog_bar=True, logger=False)
        # as Lightning stores a logged float (a tensor of the default dtype, on the CPU here)
        trainer.callback_metrics.update({k: torch.tensor(v, dtype=torch.get_default_dtype()) for k, v in figures.items()})
        if not trainer.loggers or not figures:
            return
        # Lightning logs epoch-end metrics at the step count before this step's increment,
        # which is what the counter still holds in on_train_batch_end (one step per epoch);
        # its LearningRateMonitor reads the same counter.  Should a Lightning release drop it,
        # the rows fall back to the optimizer steps (one later under automatic optimization:
        # tests/distributed/test_logging.py then fails) rather than stop a run.
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        row = {**figures, "epoch": trainer.current_epoch}
        for logger in trainer.loggers:
            logger.log_metrics(row, step=step)
            logger.save()
