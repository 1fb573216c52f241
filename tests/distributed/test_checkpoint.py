"""Checkpoint and resume: observation leaves the trajectory unchanged, and a run stopped
mid-way and resumed reaches the weights of an uninterrupted run that never wrote a checkpoint,
in every mode (stale buffers in flight, smoothing averages, bit-widths and rounding RNG)."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.checkpoint import CHECKPOINT_KEY
from lightning_fullgraph.partition.cache import FORMAT_VERSION
from tests.helpers import PIPELINED, NodeClassifier, cpu_trainer, directed_graph

MODES = {
    "exact": {"mode": "exact"},
    # measured link costs differ between two runs; resume restores them, but "full" and "part"
    # are two runs, so they share nominal links here
    "adaqp": {"mode": "adaqp", "first_assign": 2, "assign_every": 2, "group_size": 4, "link_costs": "uniform"},
    "adaqp-4bit": {"mode": "adaqp", "bits": 4},
    "sylvie": {"mode": "sylvie", **PIPELINED, "staleness": 3, "smoothing": 0.5},
    "sylvie-adaptive": {"mode": "sylvie", **PIPELINED, "staleness": 3, "smoothing": 0.5, "epoch_adaptive": True,
                        "adaptive_window": 2},
}
EPOCHS = 7


class _StopAfter(pl.Callback):
    """Ends training after ``epoch`` the way a preemption would between two epochs."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


def _fit(tmp_path, name: str, *, checkpoints: bool, stop_after: int | None = None,
         resume: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = NodeClassifier(conv="sage", num_layers=3, optimizer="adam", lr=0.01)
    callbacks: list = []
    if checkpoints:
        # a checkpoint after EVERY epoch: each one drains the pipeline
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / name, save_last=True, save_top_k=-1,
                                         every_n_epochs=1))
    if stop_after is not None:
        callbacks.append(_StopAfter(stop_after))
    trainer = cpu_trainer(3, max_epochs=EPOCHS, callbacks=callbacks, enable_checkpointing=checkpoints,
                          strategy_kwargs=MODES[name.split("/")[0]])
    trainer.fit(model, datamodule=FullGraphDataModule(directed_graph(seed=31), cache_dir=tmp_path / "parts"),
                ckpt_path=resume)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", list(MODES))
def test_resume_reaches_the_uninterrupted_weights(mode: str, tmp_path) -> None:
    """The reference run writes no checkpoint at all; the other writes one every epoch, stops
    after epoch 4 (an asynchronous sylvie epoch whose sends are in flight) and resumes.

    Negative control: freezing the smoothing average while the pipeline is drained for a
    checkpoint (the 0.1 behaviour) makes the sylvie cases differ; see also the test below."""
    full = _fit(tmp_path, f"{mode}/full", checkpoints=False)
    _fit(tmp_path, f"{mode}/part", checkpoints=True, stop_after=4)
    resumed = _fit(tmp_path, f"{mode}/part", checkpoints=True, resume=str(tmp_path / mode / "part" / "last.ckpt"))
    for key in full:
        torch.testing.assert_close(resumed[key], full[key], rtol=0, atol=0, msg=lambda m, k=key: f"{mode} {k}: {m}")


@pytest.mark.timeout(180)
def test_checkpointing_every_epoch_leaves_sylvie_unchanged(tmp_path) -> None:
    """Writing a checkpoint after every epoch (smoothing on) gives bit-for-bit the weights of a
    run that writes none.

    Negative control: updating the smoothing average only when a block lands inside the
    training step (the 0.1 rule, ``fresh = pending is not None``) skips the update for blocks
    drained by a checkpoint and fails this comparison."""
    plain = _fit(tmp_path, "sylvie/plain", checkpoints=False)
    observed = _fit(tmp_path, "sylvie/observed", checkpoints=True)
    for key in plain:
        assert torch.equal(plain[key], observed[key]), key


@pytest.mark.timeout(180)
def test_resume_without_pipeline_state_differs(tmp_path) -> None:
    """The sylvie check above is not vacuous: dropping the policy state changes the result."""
    full = _fit(tmp_path, "sylvie/full", checkpoints=False)
    _fit(tmp_path, "sylvie/part", checkpoints=True, stop_after=4)
    path = tmp_path / "sylvie" / "part" / "last.ckpt"
    ckpt = torch.load(path, weights_only=False)
    # the state rides in the checkpoint under the strategy's key, not as a callback's state
    assert CHECKPOINT_KEY in ckpt and not any("Comm" in key for key in ckpt.get("callbacks", {}))
    del ckpt[CHECKPOINT_KEY]
    torch.save(ckpt, path)
    resumed = _fit(tmp_path, "sylvie/part", checkpoints=True, resume=str(path))
    assert any(not torch.equal(resumed[k], full[k]) for k in full)


class _ExpectPolicyState(pl.Callback):
    """Runs inside every rank: records warnings from setup on, then checks at train start
    whether the checkpoint's Sylvie buffers were restored or reset."""

    def __init__(self, restored: bool, written_by: int | None = None, reason: str | None = None) -> None:
        self.restored, self.written_by, self.reason = restored, written_by, reason

    def setup(self, trainer, pl_module, stage) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self.caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer, pl_module) -> None:
        self._catcher.__exit__(None, None, None)
        said = [str(w.message) for w in self.caught if "Resuming:" in str(w.message)]
        layers = trainer.strategy.policy.pipeline.layers
        if self.restored:
            assert layers and not said, said
        else:
            assert layers == {}
            if trainer.global_rank == 0:
                reason = self.reason or f"written by {self.written_by} ranks and this run has {trainer.world_size}"
                assert said and reason in said[0], said
                assert "compression state" in said[0] and "reset" in said[0]


_SYLVIE = {"mode": "sylvie", **PIPELINED, "staleness": 3}


def _sylvie_checkpoint_on_two_ranks(tmp_path) -> Path:
    """Trains sylvie on 2 ranks and stops after epoch 1 (an asynchronous epoch follows, so
    the checkpoint holds stale halo buffers); returns ``last.ckpt``."""
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    cpu_trainer(2, max_epochs=5, callbacks=[ckpt, _StopAfter(1)], enable_checkpointing=True,
                strategy_kwargs=_SYLVIE).fit(
        NodeClassifier(conv="sage", num_layers=3),
        datamodule=FullGraphDataModule(directed_graph(seed=31), cache_dir=tmp_path / "p"))
    return tmp_path / "ckpt" / "last.ckpt"


def _resume_sylvie(world: int, check: pl.Callback, path: Path, tmp_path) -> None:
    """Resumes ``path`` on ``world`` ranks; ``check`` asserts inside the ranks (a failing rank
    fails the fit)."""
    trainer = cpu_trainer(world, max_epochs=5, callbacks=[check], strategy_kwargs=_SYLVIE)
    trainer.fit(NodeClassifier(conv="sage", num_layers=3),
                datamodule=FullGraphDataModule(directed_graph(seed=31), cache_dir=tmp_path / "p"), ckpt_path=str(path))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_resume_on_another_world_size_resets_the_compression_state(world: int, tmp_path) -> None:
    """A sylvie checkpoint written by 2 ranks resumes on 3: model and optimizer state are
    restored, the per-rank compression state is reset and the warning says so; on 2 ranks it
    is restored as usual.

    Negative control: loading the 2-rank buffers into 3 ranks (no world-size check) fails
    deep inside the exchange with a size mismatch (the issue's report)."""
    path = _sylvie_checkpoint_on_two_ranks(tmp_path)
    _resume_sylvie(world, _ExpectPolicyState(world == 2, written_by=2), path, tmp_path)


@pytest.mark.timeout(240)
def test_resume_on_another_partition_layout_resets_the_compression_state(tmp_path) -> None:
    """A sylvie checkpoint whose partition record names another on-disk format version (an
    older layout orders a rank's owned and halo rows differently, e.g. by global id instead
    of locality) resumes with the compression state reset and a warning naming
    ``format_version``; the model and optimizer state are restored.

    Negative control: without ``format_version`` among ``checkpoint.PARTITION_KEYS`` the
    stale halo buffers are restored (rows in the wrong order) and the callback's check fails."""
    path = _sylvie_checkpoint_on_two_ranks(tmp_path)
    saved = torch.load(path, weights_only=False)
    assert saved[CHECKPOINT_KEY]["partition"]["format_version"] == FORMAT_VERSION
    saved[CHECKPOINT_KEY]["partition"]["format_version"] = FORMAT_VERSION - 1
    torch.save(saved, path)
    _resume_sylvie(2, _ExpectPolicyState(False, reason="(format_version)"), path, tmp_path)


class _RecordAges(pl.Callback):
    """Appends (epoch, synchronous, ages of the halo blocks consumed) of every epoch (rank 0)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_rank == 0:
            policy = trainer.strategy.policy
            ages = [age for _, _, age in policy.pipeline.ages]
            with open(self.path, "a") as f:
                f.write(f"{trainer.current_epoch} {int(policy.synchronous)} {' '.join(map(str, ages))}\n")


def _sylvie_run(tmp_path, epochs: int, log: Path, *, resume: Path | None = None) -> None:
    torch.manual_seed(0)
    model = NodeClassifier(conv="sage", num_layers=3, optimizer="adam", lr=0.01)
    callbacks = [_RecordAges(log), ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)]
    trainer = cpu_trainer(2, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=True,
                          strategy_kwargs={"mode": "sylvie", **PIPELINED, "staleness": 5})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=FullGraphDataModule(directed_graph(seed=31), cache_dir=tmp_path / "parts"),
                    ckpt_path=resume)


def _read_ages(log: Path) -> dict[int, tuple[bool, list[int]]]:
    rows = {}
    for line in log.read_text().splitlines():
        epoch, sync, *ages = line.split()
        rows[int(epoch)] = (sync == "1", [int(a) for a in ages])
    return rows


@pytest.mark.timeout(180)
def test_resuming_to_train_more_epochs_keeps_the_staleness_bound(tmp_path) -> None:
    """``staleness=5, max_epochs=8``, then resume from ``last.ckpt`` with ``max_epochs=12``.
    The checkpoint's last epoch (7) sent nothing, so the pipeline holds epoch 6's blocks:
    epoch 8 must not consume them (rows two epochs old, epoch 6's gradient block added a
    second time).  It runs synchronous instead, and the bound (<= 1 epoch) holds in every
    epoch; epochs 9 on pipeline again.

    Negative control: without the block-age check in ``SylviePolicy.on_train_epoch_start``
    epoch 8 consumes epoch 6's rows -- the defensive check in the stale path stops the run
    with "beyond the one-epoch staleness bound"; with that check removed too, epoch 8 records
    age 2.  Either way this test fails.
    """
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    _sylvie_run(tmp_path, 8, first)
    _sylvie_run(tmp_path, 12, second, resume=tmp_path / "ckpt" / "last.ckpt")
    before, after = _read_ages(first), _read_ages(second)
    assert sorted(before) == list(range(8)) and sorted(after) == list(range(8, 12))
    # (layers 2 and 3 exchange per epoch; layer 1's input features travel once)
    assert before[7] == (False, [1, 1])  # epoch 7 consumed epoch 6's blocks and sent nothing
    assert after[8] == (True, [0, 0]), after
    assert all(a <= 1 for _, ages in after.values() for a in ages), after
    assert after[9] == (False, [1, 1]) and after[11] == (False, [1, 1]), after
