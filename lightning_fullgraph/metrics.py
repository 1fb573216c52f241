"""Per-epoch halo-traffic metrics: read after every training step, summed over ranks, logged.

The callback only reads (the exchanger's counters and the strategy's ``step_figures``) and
logs; it holds no state, so checkpoints carry nothing of it.  Every figure is per training
epoch (one full-graph step); figures marked *sum* are summed over ranks with one all-reduce,
the others are identical on every rank.

=============================  ===========================================================
``comm/bytes_sent``            sum: bytes of the per-epoch layer messages (forward rows and
                               backward gradients, row metadata included) put on the wire
``comm/bytes_recv``            sum: the same, received
``comm/onetime_bytes``         sum: bytes of cached transfers (input features, degrees):
                               the first epoch only; 0 for convs whose first message is a
                               transform of the features (GCN sends ``lin(x)`` each epoch)
``comm/control_bytes``         sum: the policies' control rows (AdaQP's scores, bit-widths)
``comm/bits``                  payload bits per value of the per-epoch messages, both
                               directions (32 for fp32; without row metadata)
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
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

__all__ = ["CommMetricsLogger"]

_PROGRESS_BAR = ("comm/bytes_sent", "comm/bits")


class CommMetricsLogger(Callback):
    """Logs the halo traffic of every training step (see the module docstring)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        strategy = trainer.strategy
        exchanger = getattr(strategy, "exchanger", None)
        if exchanger is None:
            return
        s = exchanger.stats
        layers = sorted(s.layer_values)
        directions = ("forward", "backward")
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

        figures = {
            "comm/bytes_sent": v[0],
            "comm/bytes_recv": v[1],
            "comm/onetime_bytes": v[2],
            "comm/control_bytes": v[3],
            "comm/exchanges": v[4],
            "comm/wait_time": v[5],
            "comm/quant_time": v[6],
            "comm/bits": ratio(sum(payload), sum(count)),
            "comm/wire_bits": ratio(sum(wire), sum(count)),
            "comm/bits_forward": ratio(payload[0], count[0]),
            "comm/bits_backward": ratio(payload[1], count[1]),
        }
        n = len(layers)
        for i, k in enumerate(layers):
            figures[f"comm/bits_layer{k}"] = ratio(v[13 + i], v[13 + n + i])
        st = exchanger.policy.pipeline
        if st is not None:
            # the schedule is identical on every rank: these are this rank's (= every rank's)
            ages = [a for _, _, a in st.ages]
            figures["comm/staleness_max"] = float(max(ages, default=0))
            figures["comm/staleness_mean"] = sum(ages) / len(ages) if ages else 0.0
            figures["comm/sync_epoch"] = float(exchanger.policy.synchronous)
        figures.update(getattr(strategy, "step_figures", {}))
        for name, value in figures.items():
            if math.isfinite(value):
                pl_module.log(
                    name, value, on_step=False, on_epoch=True, reduce_fx="sum", batch_size=1,
                    prog_bar=name in _PROGRESS_BAR,
                )
