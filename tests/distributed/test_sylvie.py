"""Sylvie mode: bounded staleness is respected, eps=1 at 32 bits is exact, clean shutdowns."""

from __future__ import annotations

import copy
import json
import math
import threading
import time

import lightning.pytorch as pl
import pytest
import torch

from lightning_fullgraph import FullGraphDataModule
from tests.helpers import (
    PIPELINED,
    NodeClassifier,
    cpu_trainer,
    directed_graph,
    reference_training,
    without_training_nodes_on_last_rank,
)

pytestmark = pytest.mark.timeout(120)


class _RecordSchedule(pl.Callback):
    """Runs inside every rank: per epoch, message bytes this rank sent and the schedule."""

    def __init__(self) -> None:
        self.epochs: list[tuple[int, bool, int]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        ex = trainer.strategy.exchanger
        self.epochs.append((trainer.current_epoch, ex.policy.synchronous, ex.stats.bytes_sent["message"]))

    def on_train_end(self, trainer, pl_module) -> None:
        eps = trainer.strategy.staleness
        last = trainer.max_epochs - 1
        for epoch, sync, sent in self.epochs:
            assert sync == (epoch % eps == 0), (epoch, sync)
            next_sync = (epoch + 1) % eps == 0 or epoch == last
            if sync or not next_sync:
                assert sent > 0, f"epoch {epoch} sent nothing"
            else:
                # its payload would be replaced by the synchronous epoch's fresh rows
                assert sent == 0, f"epoch {epoch} sent {sent} bytes that nothing consumes"


@pytest.mark.parametrize("eps", [1, 2, 3])
def test_no_transfer_is_thrown_away(eps: int, tmp_path) -> None:
    """Asynchronous epochs followed by a synchronous (or no) epoch send nothing, all others
    send; the weights this produces are checked value by value against a single-process
    simulation in test_sylvie_reference.py.

    Negative control: launching sends in every asynchronous epoch (the 0.1 behaviour, whose
    last sends before a synchronous epoch were drained and discarded) fails the ``sent == 0``
    assertion for eps >= 2."""
    data = directed_graph(seed=21)
    trainer = cpu_trainer(3, max_epochs=7, callbacks=[_RecordSchedule()],
                          strategy_kwargs={"mode": "sylvie", **PIPELINED, "staleness": eps})
    trainer.fit(NodeClassifier(conv="sage", num_layers=3), datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
    assert float(trainer.callback_metrics["comm/bits"]) == 1.0


@pytest.mark.parametrize("conv", ["gcn", "sage"])
def test_eps_one_with_32_bit_messages_equals_exact(conv: str, tmp_path) -> None:
    data = directed_graph(seed=22)
    torch.manual_seed(0)
    model = NodeClassifier(conv=conv, num_layers=3)
    expected = reference_training(copy.deepcopy(model), data, 4)
    trainer = cpu_trainer(3, max_epochs=4, strategy_kwargs={"mode": "sylvie", **PIPELINED, "staleness": 1, "bits": 32})
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
    for key in expected:
        torch.testing.assert_close(model.state_dict()[key], expected[key])


def test_async_epochs_actually_differ_from_exact(tmp_path) -> None:
    """Sanity check of the test above: with staleness the weights do move differently."""
    data = directed_graph(seed=22)
    torch.manual_seed(0)
    model = NodeClassifier(conv="sage", num_layers=3)
    expected = reference_training(copy.deepcopy(model), data, 4)
    trainer = cpu_trainer(3, max_epochs=4, strategy_kwargs={"mode": "sylvie", **PIPELINED, "staleness": 4, "bits": 32})
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
    assert any(not torch.allclose(model.state_dict()[k], expected[k]) for k in expected)


class _ThreadCheck(pl.Callback):
    def setup(self, trainer, pl_module, stage) -> None:
        self.before = {t.ident for t in threading.enumerate()}

    def teardown(self, trainer, pl_module, stage) -> None:
        leaked = [t.name for t in threading.enumerate() if t.ident not in self.before and t.is_alive()]
        assert not leaked, f"threads left behind: {leaked}"


class _StopEarly(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 2:
            trainer.should_stop = True


def test_early_stop_ends_cleanly(tmp_path) -> None:
    start = time.monotonic()
    trainer = cpu_trainer(2, max_epochs=50, callbacks=[_StopEarly(), _ThreadCheck()],
                          strategy_kwargs={"mode": "sylvie", **PIPELINED, "staleness": 5})
    trainer.fit(NodeClassifier(conv="gcn"), datamodule=FullGraphDataModule(directed_graph(), cache_dir=tmp_path))
    assert time.monotonic() - start < 60


class _Explodes(NodeClassifier):
    def training_step(self, batch, batch_idx):
        if self.current_epoch == 3 and self.global_rank == 0:
            raise RuntimeError("boom in an asynchronous epoch")
        return super().training_step(batch, batch_idx)


def test_exception_in_an_async_epoch_fails_fast(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(Exception, match="boom in an asynchronous epoch|another rank stopped taking part in the halo exchange"):
        cpu_trainer(2, max_epochs=6, strategy_kwargs={"mode": "sylvie", **PIPELINED, "staleness": 5}).fit(
            _Explodes(), datamodule=FullGraphDataModule(directed_graph(), cache_dir=tmp_path)
        )
    assert time.monotonic() - start < 60


class _RecordAdaptive(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        m = trainer.callback_metrics
        self.seen.append((float(m["comm/global_loss"]), float(m["comm/bits"])))

    def on_train_end(self, trainer, pl_module) -> None:
        losses = [loss for loss, _ in self.seen]
        assert all(math.isfinite(loss) for loss in losses), losses
        # a 50 % relative-improvement bar counts most epochs as stalled: bits climb above 1
        assert max(bits for _, bits in self.seen) > 1.0, self.seen


def test_epoch_adaptive_rule_with_a_rank_without_training_nodes(tmp_path) -> None:
    """A rank that owns no training node contributes exactly 0 to the global loss the rule
    reads, so the rule sees a finite loss and raises the bits when it stalls.

    Negative control: contributing ``loss * 0`` (NaN for a mean over no node) makes the global
    loss NaN; the adaptor skips a non-finite loss, so the bits never rise above 1 and
    ``comm/global_loss`` is never logged (non-finite figures are skipped)."""
    data = without_training_nodes_on_last_rank(directed_graph(seed=5), 3)
    # (the adaptor reads rates from epoch 9 on; a window of 2 reacts to one slower epoch.
    # Epochs whose time doubles by design make the loss's rate per second fall whatever the
    # machine's timing noise: with free-running epochs the rule saw no slowdown in 1 run of 6,
    # and with 20 ms more per epoch (about 10 % at epoch 9) it saw none in 1 CI run: the
    # smoothed loss's decrease itself grows by about 6 % per epoch there)
    trainer = cpu_trainer(3, max_epochs=14, callbacks=[_RecordAdaptive()], strategy_kwargs={
        "mode": "sylvie", **PIPELINED, "staleness": 3, "smoothing": 0.9, "epoch_adaptive": True,
        "adaptive_window": 2})
    trainer.fit(_SlowingMeanLoss(conv="sage"), datamodule=FullGraphDataModule(data, cache_dir=tmp_path))


class _MeanLoss(NodeClassifier):
    """Cross-entropy mean over the rank's training nodes: NaN on a rank that owns none."""

    def training_step(self, batch, batch_idx):
        out = self(batch.x, batch.edge_index)
        return torch.nn.functional.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])


class _SlowingMeanLoss(_MeanLoss):
    """:class:`_MeanLoss` whose training step from epoch 8 on sleeps twice as long as the
    epoch before (50 ms at epoch 8, 1.6 s at epoch 13; inside the forward + backward time the
    adaptor divides by), so each rate it reads is well under the one before."""

    def training_step(self, batch, batch_idx):
        if self.current_epoch >= 8:
            time.sleep(0.05 * 2 ** (self.current_epoch - 8))
        return super().training_step(batch, batch_idx)


class _RecordBits(pl.Callback):
    """Rank 0 writes ``comm/bits`` and ``comm/sync_epoch`` of every epoch to ``path``."""

    def __init__(self, path) -> None:
        self.path = path
        self.seen: list[tuple[float, float]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        m = trainer.callback_metrics
        self.seen.append((float(m["comm/bits"]), float(m["comm/sync_epoch"])))

    def on_train_end(self, trainer, pl_module) -> None:
        assert trainer.strategy.halo_share >= 0.2, trainer.strategy.halo_share  # above max_halo_share
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(self.seen))


class _SlowingClassifier(NodeClassifier):
    """:class:`NodeClassifier` whose training step from epoch 8 on sleeps twice as long as the
    epoch before (the loss's decrease per second then falls whatever the loss does)."""

    def training_step(self, batch, batch_idx):
        if self.current_epoch >= 8:
            time.sleep(0.05 * 2 ** (self.current_epoch - 8))
        return super().training_step(batch, batch_idx)


def _fit_default_sylvie(tmp_path, name: str, model_class, **settings) -> tuple[list, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    # (lr 0.05: the loss flattens from epoch 12 on this graph, and the adaptor raises the bits)
    model = model_class(conv="sage", num_layers=3, optimizer="adam", lr=0.05)
    record = tmp_path / f"{name}.txt"
    trainer = cpu_trainer(3, max_epochs=16, callbacks=[_RecordBits(record)],
                          strategy_kwargs={"mode": "sylvie", "adaptive_window": 2, **settings})
    trainer.fit(model, datamodule=FullGraphDataModule(directed_graph(seed=5), cache_dir=tmp_path / "parts"))
    return [tuple(e) for e in json.loads(record.read_text())], {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(240)
def test_default_adaptor_above_the_halo_share_limit_is_reproducible(tmp_path) -> None:
    """With the defaults (``epoch_adaptive="auto"``) above ``max_halo_share`` the adaptor
    reads the loss's decrease per epoch: it raises the bits when the loss flattens, every epoch
    stays synchronous, and a run whose epochs take longer and longer decides the same epochs
    and reaches bit for bit the same weights.

    Negative controls: resolving ``"auto"`` to off above the share keeps the bits at 1 (the
    first assertion fails); reading the decrease per second (``epoch_adaptive=True``) makes the
    slowed run raise its bits at other epochs than the free one (the third assertion fails:
    run ``test_seed_rule_reads_wall_clock_time`` below)."""
    free, free_weights = _fit_default_sylvie(tmp_path, "free", NodeClassifier)
    slowed, slowed_weights = _fit_default_sylvie(tmp_path, "slowed", _SlowingClassifier)
    assert max(bits for bits, _ in free) > 1.0, free
    assert all(sync == 1.0 for _, sync in free), free
    assert slowed == free
    for key in free_weights:
        torch.testing.assert_close(slowed_weights[key], free_weights[key], rtol=0, atol=0)


class _StepClock:
    """Stands in for ``lightning_fullgraph.strategy.time``, the clock the strategy times each
    training step with: it moves only when a model's step advances it, so the seconds the
    seed's rule divides by are the same in every run and whatever else the machine runs (with
    the real clock, on a loaded machine the free run's own timing noise can look like the
    slowed run's slowdown)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


_CLOCK = _StepClock()


class _ClockedClassifier(NodeClassifier):
    """Every training step takes 0.125 s on :data:`_CLOCK` (a binary fraction: the sums and
    differences of the clock's readings are exact, so every step reads exactly the same)."""

    def training_step(self, batch, batch_idx):
        _CLOCK.now += 0.125
        return super().training_step(batch, batch_idx)


class _SlowingClockedClassifier(_ClockedClassifier):
    """Like :class:`_SlowingClassifier`, on :data:`_CLOCK`: a :class:`_ClockedClassifier`'s
    step plus 0.0625 s doubling every epoch from epoch 8 on."""

    def training_step(self, batch, batch_idx):
        if self.current_epoch >= 8:
            _CLOCK.now += 0.0625 * 2 ** (self.current_epoch - 8)
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(240)
def test_seed_rule_reads_wall_clock_time(tmp_path, monkeypatch) -> None:
    """The negative control of the test above, kept as a test: the seed's rule
    (``epoch_adaptive=True``, the decrease per second) sees the slowed run's doubling epochs as
    a slowdown and raises its bits at other epochs than the free run's.  The step times come
    from :class:`_StepClock` (the ranks are forked, so they inherit it).

    Both runs exchange every layer's input (``project_messages=False``): with the output
    layer's projected rows this model's loss flattens by epoch 10 in the free run too, and the
    loss alone then raises the bits at the very epochs the slowed run raises them (1, 2, 4, 8
    from epoch 11 in both, measured); the rule, not the message, is what this test is about.

    Negative control (run): passing ``seconds=1`` to the seed's rule (as ``"epoch"`` does)
    makes the two schedules equal."""
    import lightning_fullgraph.strategy as strategy_module

    monkeypatch.setattr(strategy_module, "time", _CLOCK)
    settings = {"epoch_adaptive": True, "project_messages": False}
    free, _ = _fit_default_sylvie(tmp_path, "free", _ClockedClassifier, **settings)
    slowed, _ = _fit_default_sylvie(tmp_path, "slowed", _SlowingClockedClassifier, **settings)
    assert [bits for bits, _ in slowed] != [bits for bits, _ in free], (free, slowed)


@pytest.mark.timeout(180)
def test_sylvie_with_adaptive_bits_assigns_inside_the_pipeline(tmp_path) -> None:
    """``mode="sylvie", bits="adaptive"``: AdaQP's assignment (2/4/8 bits per row group,
    forward and backward separately) runs inside Sylvie's pipeline; asynchronous epochs still
    consume one-epoch-old values.

    Negative control: ignoring ``bits="adaptive"`` in the sylvie policy (uniform 8 bits) keeps
    ``comm/bits`` at 8 after the assignment and fails the first assertion."""
    data = directed_graph(num_nodes=300, num_edges=2400, num_features=8, seed=3)
    trainer = cpu_trainer(2, max_epochs=5, callbacks=[_RecordAdaptiveBits()], strategy_kwargs={
        "mode": "sylvie", **PIPELINED, "bits": "adaptive", "staleness": 5, "first_assign": 1, "assign_every": 2,
        "link_costs": "uniform", "group_size": 10})
    trainer.fit(NodeClassifier(conv="gcn", num_layers=3, hidden=32), datamodule=FullGraphDataModule(data, cache_dir=tmp_path))


class _RecordAdaptiveBits(pl.Callback):
    """Runs inside every rank (the assertions too)."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        m = trainer.callback_metrics
        self.seen.append((float(m["comm/bits"]), float(m["comm/staleness_max"])))

    def on_train_end(self, trainer, pl_module) -> None:
        seen = self.seen
        assert seen[0][0] == 8.0 and all(bits < 8.0 for bits, _ in seen[1:4]), seen
        # the last epoch consumes what epoch 3 sent and sends nothing itself
        assert [age for _, age in seen] == [0.0, 1.0, 1.0, 1.0, 1.0], seen


class _WithValidation(NodeClassifier):
    def validation_step(self, batch, batch_idx):
        out = self(batch.x, batch.edge_index)
        self.log("val_out", out.abs().mean(), batch_size=1, sync_dist=True)


def test_evaluation_never_disturbs_the_pipeline(tmp_path) -> None:
    """Validation between epochs (fresh fp32 exchanges) leaves training bit-for-bit unchanged."""
    data = directed_graph(seed=23)
    results = []
    for val_batches in (0, 1):
        torch.manual_seed(0)
        model = _WithValidation(conv="sage", num_layers=3)
        trainer = cpu_trainer(3, max_epochs=6, limit_val_batches=val_batches,
                              strategy_kwargs={"mode": "sylvie", **PIPELINED, "staleness": 3})
        trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key


class _RecordKeptBytes(pl.Callback):
    """Runs inside every rank: after every step, the bytes the pipeline's kept blocks hold
    and what the same rows would take as float32."""

    def __init__(self) -> None:
        self.kept: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        from lightning_fullgraph.comm.codec import ReceivedRows

        held = as_float = 0
        for pipe in trainer.strategy.exchanger.policy.pipeline.layers.values():
            for block in (pipe.halo, pipe.grad):
                if block is None:
                    continue
                rows, cols = block.shape
                as_float += rows * cols * 4
                held += block.buffer.numel() if isinstance(block, ReceivedRows) else block.numel() * 4
        self.kept.append((held, as_float))

    def on_train_end(self, trainer, pl_module) -> None:
        assert any(f > 0 for _, f in self.kept)
        for held, as_float in self.kept:
            assert held * 4 <= as_float, (held, as_float)


def test_stale_blocks_are_kept_encoded(tmp_path) -> None:
    """The halo rows and gradients kept for the next asynchronous epoch stay as the 1-bit
    bytes that arrived (decoded when used; ``test_sylvie_reference`` checks the values), so
    they hold well under a quarter of their float32 size (here hidden 16: ~1/10).

    Negative control: keeping the decoded float32 rows (``EncodedTransfer.received``
    returning ``wait()``'s decoded rows, as before) holds exactly their float32 size and fails."""
    data = directed_graph(seed=23)
    trainer = cpu_trainer(3, max_epochs=5, callbacks=[_RecordKeptBytes()],
                          strategy_kwargs={"mode": "sylvie", **PIPELINED, "staleness": 3})
    trainer.fit(NodeClassifier(conv="sage", num_layers=3), datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
