"""Projected messages: a layer that narrows the rows sends ``X W``, not ``X``, where that is
fewer values (``HaloContext.sends_projection``), and trains to the same weights.

The widths are read off the tensors handed to ``torch.distributed.all_to_all_single`` (a spy
installed before the ranks fork), not from the package's own counters.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_fullgraph import FullGraphDataModule
from tests.helpers import NodeClassifier, cpu_trainer, directed_graph, reference_training

STEPS = 3
IN_DIM, HIDDEN, CLASSES = 40, 16, 3


def _spy(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Appends ``(call, width)`` of every all-to-all's send rows to ``folder/rank<r>.jsonl``."""
    real = dist.all_to_all_single

    def spy(output, input, *args, **kwargs):
        width = int(input.shape[1]) if input.dim() > 1 else 1
        with open(folder / f"rank{dist.get_rank()}.jsonl", "a") as f:
            f.write(json.dumps([str(input.dtype), width]) + "\n")
        return real(output, input, *args, **kwargs)

    monkeypatch.setattr(dist, "all_to_all_single", spy)


def _widths(folder: Path) -> Counter:
    """The float32 send widths of rank 0's all-to-alls, counted."""
    calls = [json.loads(line) for line in (folder / "rank0.jsonl").read_text().splitlines()]
    return Counter(width for dtype, width in calls if dtype == "torch.float32")


def _train(conv: str, project: bool, folder: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    folder.mkdir()
    _spy(monkeypatch, folder)
    data = directed_graph(num_features=IN_DIM, seed=5)
    torch.manual_seed(0)
    model = NodeClassifier(conv=conv, in_dim=IN_DIM, hidden=HIDDEN, num_classes=CLASSES, num_layers=3)
    trainer = cpu_trainer(2, max_epochs=STEPS, strategy_kwargs={"project_messages": project})
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=folder / "parts"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("conv", ["gcn", "sage"])
def test_the_output_layer_sends_its_projected_rows(conv: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``40 -> 16 -> 16 -> 3`` model on 2 ranks: per step the hidden layer sends 16-wide rows
    and the output layer 3-wide rows (``X W``), each forward and back; the first layer's input
    is the batch's features, which travel once, as themselves (40 wide), never projected.  With
    ``project_messages=False`` the output layer sends its 16-wide input instead.  Both train to
    the single-process weights.

    Negative controls (run): ``sends_projection`` returning ``False`` fails the first
    assertion (no 3-wide rows); without its static-input clause the features' layer sends
    16-wide projected rows every step (twelve 16-wide sends, not six)."""
    data = directed_graph(num_features=IN_DIM, seed=5)
    torch.manual_seed(0)
    reference = NodeClassifier(conv=conv, in_dim=IN_DIM, hidden=HIDDEN, num_classes=CLASSES, num_layers=3)
    expected = reference_training(copy.deepcopy(reference), data, STEPS)

    projected = _train(conv, True, tmp_path / "projected", monkeypatch)
    widths = _widths(tmp_path / "projected")
    assert widths[CLASSES] == 2 * STEPS, widths  # output layer: forward + backward, every step
    assert widths[HIDDEN] == 2 * STEPS, widths  # hidden layer: forward + backward, every step
    assert widths[IN_DIM] == 1, widths  # the features: once, as themselves

    inputs = _train(conv, False, tmp_path / "inputs", monkeypatch)
    widths = _widths(tmp_path / "inputs")
    assert widths[CLASSES] == 0 and widths[HIDDEN] == 4 * STEPS and widths[IN_DIM] == 1, widths

    for key in expected:
        torch.testing.assert_close(projected[key], expected[key], msg=lambda m, k=key: f"projected {k}: {m}")
        torch.testing.assert_close(inputs[key], expected[key], msg=lambda m, k=key: f"inputs {k}: {m}")
