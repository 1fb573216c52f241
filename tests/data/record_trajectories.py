"""Records the trajectories ``tests/distributed/test_recorded_trajectories.py`` compares against.

``python tests/data/record_trajectories.py`` (from the repository root) writes, per mode,
``trajectories/<mode>.pt`` (weights after :data:`EPOCHS` epochs on 3 ranks) and
``trajectories/<mode>-epoch4.ckpt`` (the checkpoint after epoch 4, written by the stopped run);
``python tests/data/record_trajectories.py adaqp`` re-records the modes named only.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

if __name__ == "__main__":  # run as a script: make ``tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_fullgraph import FullGraphDataModule  # noqa: E402
from tests.helpers import PIPELINED, NodeClassifier, cpu_trainer, directed_graph  # noqa: E402

RECORDS = Path(__file__).resolve().parent / "trajectories"
EPOCHS = 7
STOP_AFTER = 4
MODES = {
    "exact": {"mode": "exact"},
    "adaqp": {"mode": "adaqp", "first_assign": 2, "assign_every": 2, "group_size": 4, "link_costs": "uniform"},
    "adaqp-4bit": {"mode": "adaqp", "bits": 4},
    "sylvie": {"mode": "sylvie"},
    "sylvie-pipelined": {"mode": "sylvie", **PIPELINED, "staleness": 3, "smoothing": 0.5},
    "sylvie-adaptive": {"mode": "sylvie", **PIPELINED, "staleness": 3, "smoothing": 0.5, "epoch_adaptive": True,
                        "adaptive_window": 2},
}


class _StopAfter(pl.Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


def fit(tmp_path: Path, mode: str, *, resume: Path | None = None, checkpoint_dir: Path | None = None,
        stop_after: int | None = None) -> dict[str, torch.Tensor]:
    """Trains ``mode`` (3 ranks, GraphSAGE 3 layers, Adam) and returns the final weights."""
    torch.manual_seed(0)
    model = NodeClassifier(conv="sage", num_layers=3, optimizer="adam", lr=0.01)
    callbacks: list = []
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_last=True, save_top_k=0))
    if stop_after is not None:
        callbacks.append(_StopAfter(stop_after))
    trainer = cpu_trainer(3, max_epochs=EPOCHS, callbacks=callbacks, enable_checkpointing=checkpoint_dir is not None,
                          strategy_kwargs=MODES[mode])
    trainer.fit(model, datamodule=FullGraphDataModule(directed_graph(seed=31), cache_dir=tmp_path / "parts"),
                ckpt_path=None if resume is None else str(resume))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(modes: list[str]) -> None:
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; recorded modes: {list(MODES)}")
    RECORDS.mkdir(exist_ok=True)
    for mode in modes or MODES:
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            torch.save(fit(tmp_path / "full", mode), RECORDS / f"{mode}.pt")
            fit(tmp_path / "part", mode, checkpoint_dir=tmp_path / "ckpt", stop_after=STOP_AFTER)
            shutil.copy(tmp_path / "ckpt" / "last.ckpt", RECORDS / f"{mode}-epoch4.ckpt")
        print(f"recorded {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
