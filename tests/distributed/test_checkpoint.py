"""Checkpoint and resume: a run stopped after k epochs and resumed reaches the same weights
as an uninterrupted run, in every mode (stale buffers, bit-widths and rounding RNG included)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fullgraph import FullGraphDataModule
from tests.helpers import NodeClassifier, cpu_trainer, directed_graph

MODES = {
    "exact": {"mode": "exact"},
    # measured link costs differ between two runs; resume restores them, but "full" and "part"
    # are two runs, so they share nominal links here
    "adaqp": {"mode": "adaqp", "assign_every": 2, "group_size": 4, "link_costs": "uniform"},
    "adaqp-4bit": {"mode": "adaqp", "bits": 4},
    "sylvie": {"mode": "sylvie", "staleness": 3, "smoothing": 0.5},
}


def _fit(tmp_path, name: str, epochs: int, resume: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = NodeClassifier(conv="sage", num_layers=3, optimizer="adam", lr=0.01)
    ckpt = ModelCheckpoint(dirpath=tmp_path / name, save_last=True, save_top_k=0)
    trainer = cpu_trainer(3, max_epochs=epochs, callbacks=[ckpt], enable_checkpointing=True,
                          strategy_kwargs=MODES[name.split("/")[0]])
    trainer.fit(model, datamodule=FullGraphDataModule(directed_graph(seed=31), cache_dir=tmp_path / "parts"),
                ckpt_path=resume)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(MODES))
def test_resume_reaches_the_uninterrupted_weights(mode: str, tmp_path) -> None:
    full = _fit(tmp_path, f"{mode}/full", epochs=7)
    _fit(tmp_path, f"{mode}/part", epochs=4)
    resumed = _fit(tmp_path, f"{mode}/part", epochs=7, resume=str(tmp_path / mode / "part" / "last.ckpt"))
    for key in full:
        torch.testing.assert_close(resumed[key], full[key], rtol=0, atol=0, msg=lambda m, k=key: f"{mode} {k}: {m}")


@pytest.mark.timeout(180)
def test_resume_without_pipeline_state_differs(tmp_path) -> None:
    """The sylvie check above is not vacuous: dropping the pipeline state changes the result."""
    full = _fit(tmp_path, "sylvie/full", epochs=7)
    _fit(tmp_path, "sylvie/part", epochs=4)
    path = tmp_path / "sylvie" / "part" / "last.ckpt"
    ckpt = torch.load(path, weights_only=False)
    ckpt["callbacks"] = {}
    torch.save(ckpt, path)
    resumed = _fit(tmp_path, "sylvie/part", epochs=7, resume=str(path))
    assert any(not torch.equal(resumed[k], full[k]) for k in full)
