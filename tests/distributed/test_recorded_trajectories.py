"""Recorded trajectories: a restructuring of the package moves code, never behaviour.

``tests/data/trajectories/`` holds, per mode, the weights after 7 epochs on 3 ranks and a
checkpoint written after epoch 4 (stale Sylvie blocks in flight, AdaQP's bit assignment and
rounding RNG, smoothing averages), both recorded by ``tests/data/record_trajectories.py`` with
the package as it was before the layout of 0.6 (commit 051cc58). A fresh run must reproduce the
weights bit for bit, and resuming the old checkpoint must reach them too: checkpoints written by
an earlier version load.

Re-record (``python tests/data/record_trajectories.py``) only for a change that is MEANT to
alter training, and say so in CHANGELOG; a torch or PyG upgrade that changes kernels also
shows here first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.data.record_trajectories import MODES, RECORDS, fit


def _recorded(mode: str) -> dict[str, torch.Tensor]:
    path = RECORDS / f"{mode}.pt"
    assert path.is_file(), f"{path} missing: run python tests/data/record_trajectories.py"
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_fresh_run_reproduces_the_recorded_weights(mode: str, tmp_path: Path) -> None:
    """Every mode trains to the recorded weights, bit for bit.

    Negative control (run): seeding the rounding stream with ``seed + rank + 1`` instead of
    ``seed + rank`` (``SylviePolicy``/``AdaQPPolicy.setup``) fails the five compressed modes;
    exact passes, as it rounds nothing."""
    weights = fit(tmp_path, mode)
    recorded = _recorded(mode)
    assert weights.keys() == recorded.keys()
    for key in recorded:
        torch.testing.assert_close(weights[key], recorded[key], rtol=0, atol=0,
                                   msg=lambda m, k=key: f"{mode} {k}: {m}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_checkpoint_from_before_the_move_resumes_to_the_recorded_weights(mode: str, tmp_path: Path) -> None:
    """The epoch-4 checkpoint recorded by the old layout resumes to epoch 7's recorded weights.

    With the rounding seed changed as in the test above, these still pass: the stream's state
    comes from the checkpoint, so the old checkpoint's policy state is what is restored.
    Negative control: without that state (the checkpoint's ``CHECKPOINT_KEY`` entry dropped)
    a sylvie resume ends on other weights (``test_checkpoint.py::
    test_resume_without_pipeline_state_differs``)."""
    ckpt = RECORDS / f"{mode}-epoch4.ckpt"
    assert ckpt.is_file(), f"{ckpt} missing: run python tests/data/record_trajectories.py"
    weights = fit(tmp_path, mode, resume=ckpt)
    recorded = _recorded(mode)
    for key in recorded:
        torch.testing.assert_close(weights[key], recorded[key], rtol=0, atol=0,
                                   msg=lambda m, k=key: f"{mode} {k}: {m}")
