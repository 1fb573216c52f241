"""One benchmark configuration, run in a fresh process: ``python benchmarks/run.py --worker SPEC``.

The worker builds the model and a :class:`FullGraphDataModule` over a partition folder that
the orchestrator wrote beforehand (so no rank ever loads the whole graph), launches the
Lightning ``Trainer`` with ``FullGraphStrategy(start_method="fork")`` on CPU/gloo, and waits.
Each rank measures itself with :class:`BenchCallback` and writes ``rank<r>.json`` into the
run folder (the fork launcher sends nothing else back); once ``fit`` (and ``test`` for
accuracy runs) returned, this process merges the rank files into ``result.json``.

What a rank records, per training epoch (``time.perf_counter``, seconds)::

    on_train_epoch_start ─ on_train_batch_start ─ on_before_backward ─ on_after_backward
        ─ on_before_optimizer_step ─ on_train_batch_end ─ on_train_epoch_end

* ``forward``   batch start -> ``on_before_backward`` (training_step incl. halo exchanges
  of the forward pass, plus the strategy's per-step bookkeeping, e.g. AdaQP's bit-width
  assignment and Sylvie's drain before a synchronous epoch),
* ``backward``  ``on_before_backward`` -> ``on_after_backward`` (autograd incl. the halo
  gradient exchanges),
* ``allreduce`` ``on_after_backward`` -> ``on_before_optimizer_step`` (the strategy's
  ``post_backward``: the weight-gradient all-reduce on the default group),
* ``optimizer`` ``on_before_optimizer_step`` -> batch end (Adam step),
* ``wait``/``quant`` the rank's own ``HaloExchanger.stats`` (seconds blocked in halo
  collectives / quantizing + dequantizing), which happen inside forward and backward,
* ``assign``    AdaQP bit-width assignment (timed around the strategy's
  ``comm/assign_time`` of the strategy's ``step_figures``), before forward,
* ``compute``   ``forward + backward - wait - quant - assign``,
* ``other``     ``epoch - (forward + backward + allreduce + optimizer)``: Lightning's
  loop, the strategy's per-epoch metric all-reduce, logging.

CPU accounting per epoch (``getrusage`` of the rank process, all threads, and
``time.thread_time`` of the main thread): ``cpu_user``, ``cpu_sys``, ``cpu_main_thread`` and
``cpu_other_threads`` (= user + sys - main thread: gloo's transport threads, which copy every
halo byte through the kernel's loopback TCP stack) plus ``minor_faults``.

The strategy a rank actually ran is recorded too (``strategy``: mode, ``compute_only``,
``overlap``, bits, whether the exchanger skips transfers and runs Sylvie's pipeline), so a
report can show that a bound ran its own mode's path; the mode names map to strategy settings
in ``bench_modes``.

Memory (MiB): ``rss_baseline`` is the rank's resident set right before it loads its part
(torch, Lightning and PyG imported, process group up, model built), ``rss_after_load`` right
after, ``peak_rss`` the high-water mark (``VmHWM``; ``ru_maxrss`` recorded too) at the end of
training; ``peak_above_baseline = peak_rss - rss_baseline`` is what the rank's graph,
activations and buffers cost.  On CUDA ``torch.cuda.max_memory_allocated`` is recorded too.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

MiB = 1024.0 * 1024.0


def proc_memory() -> dict[str, float]:
    """``VmRSS`` / ``VmHWM`` of this process (MiB) from ``/proc/self/status`` and ``ru_maxrss``."""
    from lightning_fullgraph._os import status_kib

    out: dict[str, float] = {}
    for key in ("VmRSS", "VmHWM"):
        kib = status_kib(key)
        if kib is not None:  # (not Linux: absent)
            out[key] = kib / 1024.0
    # ru_maxrss is KiB on Linux
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return out


def _datamodule_class():
    from lightning_fullgraph import FullGraphDataModule

    class BenchDataModule(FullGraphDataModule):
        """Records the rank's memory right before and after it loads its part."""

        mem_before_load: dict[str, float] | None = None
        mem_after_load: dict[str, float] | None = None

        def setup(self, stage: str | None = None) -> None:
            if self.local_partition is None:
                self.mem_before_load = proc_memory()
            super().setup(stage)
            if self.mem_after_load is None:
                self.mem_after_load = proc_memory()

    return BenchDataModule


def _partition_record(part: Any) -> dict[str, Any]:
    """Owned, halo and sent rows and the in-edges (aggregation work) of a rank's part."""
    data = part.data
    edges = None
    edge_index = getattr(data, "edge_index", None)
    if edge_index is not None:
        edges = int(edge_index.size(1))
    else:  # a part that keeps only a sparse adjacency
        adj = getattr(data, "adj_t", None)
        if adj is not None:
            edges = int(adj._nnz()) if hasattr(adj, "_nnz") else int(adj.nnz())
    return {
        "owned": int(part.plan.num_owned),
        "halo": int(part.plan.num_halo),
        "send_rows": int(part.plan.num_send),
        "edges": edges,
    }


def _callback_class():
    import lightning.pytorch as pl
    import torch

    class BenchCallback(pl.Callback):
        """Per-rank timing, traffic and memory; writes ``rank<r>.json`` at the end of training."""

        def __init__(self, out_dir: str, threads: int = 1) -> None:
            self.out_dir = Path(out_dir)
            self.threads = threads
            self.epochs: list[dict[str, Any]] = []
            self._t: dict[str, float] = {}

        # -- setup ---------------------------------------------------------------------
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            torch.set_num_threads(self.threads)

        def on_train_start(self, trainer, pl_module) -> None:
            # what this rank actually runs (a bound must run its own mode's path)
            s = trainer.strategy
            ex = getattr(s, "exchanger", None)
            self.strategy_record = {
                "class": type(s).__name__,
                "mode": getattr(s, "mode", None),
                "compute_only": getattr(s, "compute_only", None),
                "overlap": getattr(s, "overlap", None),
                "bits": getattr(s, "bits", None),
                "staleness": getattr(s, "staleness", None) if getattr(s, "mode", None) == "sylvie" else None,
                "skip_transfers": getattr(ex, "skip_transfers", None),
                "pipeline": ex is not None and ex.policy.halo_ages() is not None,
            }

        # -- timestamps ----------------------------------------------------------------
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self._cpu0 = (resource.getrusage(resource.RUSAGE_SELF), time.thread_time())
            self._t = {"epoch_start": time.perf_counter()}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._t["batch_start"] = time.perf_counter()

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self._t["before_backward"] = time.perf_counter()

        def on_after_backward(self, trainer, pl_module) -> None:
            self._t["after_backward"] = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self._t["before_optimizer"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._t["batch_end"] = time.perf_counter()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            t = self._t
            t["epoch_end"] = time.perf_counter()
            ru1, thread1 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
            ru0, thread0 = self._cpu0
            rec: dict[str, Any] = {"epoch": trainer.current_epoch}
            # CPU seconds of the whole rank process (all threads: the main thread plus gloo's
            # transport threads, whose loopback TCP copies show up as sys time)
            rec["cpu_user"] = ru1.ru_utime - ru0.ru_utime
            rec["cpu_sys"] = ru1.ru_stime - ru0.ru_stime
            rec["cpu_main_thread"] = thread1 - thread0
            rec["cpu_other_threads"] = rec["cpu_user"] + rec["cpu_sys"] - rec["cpu_main_thread"]
            rec["minor_faults"] = ru1.ru_minflt - ru0.ru_minflt
            if all(k in t for k in ("batch_start", "before_backward", "after_backward", "before_optimizer", "batch_end")):
                rec["epoch_time"] = t["epoch_end"] - t["epoch_start"]
                rec["step_time"] = t["batch_end"] - t["batch_start"]
                rec["forward"] = t["before_backward"] - t["batch_start"]
                rec["backward"] = t["after_backward"] - t["before_backward"]
                rec["allreduce"] = t["before_optimizer"] - t["after_backward"]
                rec["optimizer"] = t["batch_end"] - t["before_optimizer"]
            else:  # a skipped step: only the epoch wall time is meaningful
                rec["epoch_time"] = t["epoch_end"] - t.get("epoch_start", t["epoch_end"])
            # the policy's assignment runs inside the training step, before forward
            figures = getattr(trainer.strategy, "step_figures", {})
            rec["assign"] = float(figures.get("comm/assign_time", 0.0))
            rec["assigned"] = "comm/assign_time" in figures
            ex = getattr(trainer.strategy, "exchanger", None)
            if ex is not None:
                s = ex.stats  # reset by the strategy at every batch start: this epoch's step
                rec.update(
                    bytes_sent=int(sum(s.bytes_sent.values())),
                    bytes_recv=int(sum(s.bytes_recv.values())),
                    onetime_bytes=int(s.bytes_sent["onetime"]),
                    exchanges=int(s.exchanges),
                    forward_exchanges=int(s.forward_exchanges),
                    backward_exchanges=int(s.backward_exchanges),
                    cache_hits=int(s.cache_hits),
                    wait=float(s.wait_time),
                    quant=float(s.quant_time),
                    # per-epoch messages, forward and backward, payload bits (no metadata)
                    bits_sent=int(sum(s.payload_bits.values())),
                    values_sent=int(sum(s.values.values())),
                )
                ages = ex.policy.halo_ages()
                if ages is not None:
                    rec["staleness_max"] = max(ages, default=0)
                    rec["staleness_mean"] = sum(ages) / len(ages) if ages else 0.0
                    rec["sync"] = bool(ex.policy.synchronous)
            if "forward" in rec:
                rec["compute"] = rec["forward"] + rec["backward"] - rec.get("wait", 0.0) - rec.get("quant", 0.0) - rec["assign"]
                rec["other"] = rec["epoch_time"] - (rec["forward"] + rec["backward"] + rec["allreduce"] + rec["optimizer"])
            self.epochs.append(rec)

        def on_train_end(self, trainer, pl_module) -> None:
            rank = trainer.global_rank
            dm = trainer.datamodule
            part = getattr(dm, "local_partition", None)
            mem_end = proc_memory()
            before = getattr(dm, "mem_before_load", None) or {}
            after = getattr(dm, "mem_after_load", None) or {}
            peak = max(mem_end.get("VmHWM", 0.0), mem_end.get("ru_maxrss", 0.0))
            record: dict[str, Any] = {
                "rank": rank,
                "world_size": trainer.world_size,
                "pid": os.getpid(),
                "threads": torch.get_num_threads(),
                "memory": {
                    "rss_baseline": before.get("VmRSS"),
                    "rss_after_load": after.get("VmRSS"),
                    "rss_end": mem_end.get("VmRSS"),
                    "peak_rss": peak,
                    "vm_hwm": mem_end.get("VmHWM"),
                    "ru_maxrss": mem_end.get("ru_maxrss"),
                    "peak_above_baseline": (peak - before["VmRSS"]) if before.get("VmRSS") is not None else None,
                    "cuda_max_allocated": (
                        torch.cuda.max_memory_allocated() / MiB
                        if torch.cuda.is_available() and pl_module.device.type == "cuda"
                        else None
                    ),
                },
                "partition": None if part is None else _partition_record(part),
                "strategy": getattr(self, "strategy_record", None),
                "epochs": self.epochs,
            }
            from lightning_fullgraph._os import write_atomic

            write_atomic(self.out_dir / f"rank{rank}.json", json.dumps(record))

    return BenchCallback


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs one configuration (this process launches and waits for the forked ranks)."""
    import torch

    torch.set_num_threads(int(spec.get("threads", 1)))
    import lightning.pytorch as pl
    from bench_modes import is_bound, strategy_settings

    from lightning_fullgraph import FullGraphStrategy
    from lightning_fullgraph.models import GNNNodeClassifier

    out_dir = Path(spec["run_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("rank*.json"):
        stale.unlink()
    mem_parent = proc_memory()
    pl.seed_everything(int(spec.get("seed", 0)), verbose=False)
    model = GNNNodeClassifier(
        conv=spec["conv"],
        in_channels=int(spec["in_channels"]),
        num_classes=int(spec["num_classes"]),
        hidden_channels=int(spec["hidden"]),
        num_layers=int(spec["layers"]),
        dropout=float(spec.get("dropout", 0.5)),
        lr=float(spec.get("lr", 0.01)),
    )
    dm = _datamodule_class()(spec["partition_folder"])
    mode = spec["mode"]
    kwargs: dict[str, Any] = dict(spec.get("strategy_kwargs") or {})
    # exact/adaqp/sylvie, their diagnostic variants, and every one's bound (the same settings
    # plus compute_only=True: the mode's own compute path, halo collectives skipped)
    kwargs.update(strategy_settings(mode))
    strategy = FullGraphStrategy(
        start_method="fork", timeout=timedelta(seconds=float(spec.get("pg_timeout", 300))), **kwargs
    )
    callback = _callback_class()(str(out_dir), threads=int(spec.get("threads", 1)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(spec["ranks"]),
        strategy=strategy,
        max_epochs=int(spec["epochs"]),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[callback],
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    fit_wall = time.perf_counter() - t0
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    test_acc = None
    test_wall = None
    if spec.get("test") and not is_bound(mode):
        t0 = time.perf_counter()
        (res,) = trainer.test(model, datamodule=dm, verbose=False)
        test_wall = time.perf_counter() - t0
        test_acc = float(res["test_acc"])
    ranks = []
    for r in range(int(spec["ranks"])):
        path = out_dir / f"rank{r}.json"
        if not path.is_file():
            raise RuntimeError(f"rank {r} wrote no {path.name}: it did not finish training")
        ranks.append(json.loads(path.read_text()))
    return {
        "spec": spec,
        "fit_wall": fit_wall,
        "test_wall": test_wall,
        "test_acc": test_acc,
        "logged_last_epoch": logged,
        "parent_memory": mem_parent,
        "ranks": ranks,
    }


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = run_worker(spec)
    from lightning_fullgraph._os import write_atomic

    write_atomic(Path(spec["result_path"]), json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1]))
