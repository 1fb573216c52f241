"""What a sequence of command-line runs leaves on disk, run as a user runs them.

``python -m lightning_fullgraph`` in a subprocess (2 CPU ranks, ``popen`` launcher, a 1000-node
community graph, 1-3 epochs), checked through ``lightning_logs/``:

* ``fit`` keeps ``version_0/checkpoints/last.ckpt`` (a plain file) and one events file (the
  test after fit goes into it);
* ``test`` / ``predict --ckpt_path .../last.ckpt`` leave fit's folder byte-for-byte alone;
  ``predict`` creates no run folder at all; ``fit --ckpt_path last.ckpt`` resumes;
* a run that fails before its first batch leaves no ``version_N/``; one that fails mid-training
  keeps its folder; a ``ModelCheckpoint`` from YAML replaces the default one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from tests.conftest import REPO, free_port
from tests.processes import run_process

SMALL_GRAPH = json.dumps({"num_nodes": 1000, "num_val": 300, "num_test": 300})
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
LAST = "lightning_logs/version_0/checkpoints/last.ckpt"


class FailAtEpoch(Callback):
    """Raises at the end of training epoch ``epoch`` on every rank (after epoch 0 was logged)."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            raise RuntimeError(f"FailAtEpoch: deliberate failure at epoch {self.epoch}")


def _cli(args: list[str], cwd: Path, ok: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.pop("PL_GLOBAL_SEED", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(free_port())
    env["LIGHTNING_FULLGRAPH_CACHE"] = str(cwd / "partitions")
    command = [sys.executable, "-m", "lightning_fullgraph", *args]
    if args and args[0] in ("fit", "validate", "test", "predict"):
        command += [f"--data.dataset_kwargs={SMALL_GRAPH}", *QUIET]
    proc = run_process(command, cwd=cwd, env=env, merge_stderr=False, timeout=timeout)
    assert (proc.returncode == 0) == ok, (
        f"`lightning_fullgraph {' '.join(args)}` exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )
    return proc


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``: relative path -> (size, mtime in ns)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _versions(cwd: Path) -> set[str]:
    logs = cwd / "lightning_logs"
    return {p.name for p in logs.iterdir()} if logs.is_dir() else set()


def _scalars(folder: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One ``fit`` of 2 epochs (then its test after fit) in a fresh working directory."""
    cwd = tmp_path_factory.mktemp("fitted")
    proc = _cli(["fit", "--trainer.max_epochs=2"], cwd)
    return cwd, proc


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fit_keeps_last_ckpt_and_one_events_file(fitted):
    """``fit`` writes ``checkpoints/last.ckpt`` as a plain file (it survives copying the file
    alone) holding the last epoch, and its test after fit logs into fit's events file.

    Negative controls: without the CLI's default ``ModelCheckpoint(save_last=True)`` only
    ``epoch=1-step=2.ckpt`` exists; without deferring the loggers' ``finalize`` until after the
    test, TensorBoard reopens its writer and ``version_0`` holds two events files."""
    cwd, proc = fitted
    version = cwd / "lightning_logs" / "version_0"
    last = cwd / LAST
    assert last.is_file() and not last.is_symlink(), sorted(_listing(version))
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (1, 2)
    assert f"last checkpoint: {last}" in proc.stdout

    events = list(version.glob("events.out.tfevents.*"))
    assert len(events) == 1, sorted(_listing(version))
    scalars = _scalars(version)
    assert len(scalars["train_loss"]) == 2 and "test_acc" in scalars, sorted(scalars)
    assert _versions(cwd) == {"version_0"}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_test_and_predict_from_last_ckpt_leave_the_fit_folder_alone(fitted):
    """``test --ckpt_path .../last.ckpt`` logs into a new ``version_N/`` (Lightning's rule) and
    ``predict`` creates no run folder and no ``config.yaml`` (a second predict would refuse
    to overwrite it); the fit's folder keeps the same files, sizes and mtimes.

    Negative control: without ``predict``'s ``trainer.logger=false`` default, predict adds a
    ``version_N/`` folder (events, hparams.yaml, config.yaml)."""
    cwd, _ = fitted
    version = cwd / "lightning_logs" / "version_0"
    before, versions = _listing(version), _versions(cwd)

    proc = _cli(["test", f"--ckpt_path={LAST}"], cwd)
    assert "test_acc" in proc.stdout
    assert "dirpath has changed" not in proc.stderr
    assert _listing(version) == before
    (new,) = _versions(cwd) - versions
    assert list((cwd / "lightning_logs" / new).glob("events.out.tfevents.*")), "test logged nothing"
    versions = _versions(cwd)

    _cli(["predict", f"--ckpt_path={LAST}", "--predictions_path=preds.pt"], cwd)
    assert torch.load(cwd / "preds.pt").shape == (1000, 5)
    assert _versions(cwd) == versions
    assert not (cwd / "config.yaml").exists() and not (cwd / "checkpoints").exists()
    assert _listing(version) == before


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_fit_resumes_from_last_ckpt(fitted):
    """``fit --ckpt_path .../last.ckpt --trainer.max_epochs=3`` continues at epoch 2: one more
    epoch is trained and logged (into a new ``version_N/``), and its own ``last.ckpt`` holds
    epoch 2, step 3.

    Negative control: a run restarted from scratch logs 3 ``train_loss`` values; without
    ``save_last`` the given path does not exist and the run fails."""
    cwd, _ = fitted
    versions = _versions(cwd)
    before = _listing(cwd / "lightning_logs" / "version_0")
    proc = _cli(["fit", f"--ckpt_path={LAST}", "--trainer.max_epochs=3", "--test_after_fit=false"], cwd)
    assert "final metrics after 3 epoch(s)" in proc.stdout
    (new,) = _versions(cwd) - versions
    folder = cwd / "lightning_logs" / new
    assert len(_scalars(folder)["train_loss"]) == 1
    checkpoint = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (2, 3)
    assert _listing(cwd / "lightning_logs" / "version_0") == before


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_failed_run_leaves_no_version_folder(tmp_path):
    """A run that fails after its logger created ``version_N/`` (a missing ``--ckpt_path``)
    removes that folder, and ``lightning_logs/`` too when it created it; an existing folder of
    another run, even one holding only ``config.yaml``, is never touched.

    Negative control: without :class:`~lightning_fullgraph.cli.RemoveEmptyRunFolder` the
    failed ``test`` leaves ``lightning_logs/version_0/`` (``config.yaml`` and an empty events
    file) and the failed ``fit`` leaves ``version_1/``."""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    proc = _cli(["test", "--ckpt_path=missing.ckpt"], fresh, ok=False)
    assert not (fresh / "lightning_logs").exists(), _listing(fresh / "lightning_logs")
    assert "Checkpoint file not found" in proc.stderr
    assert "the run failed before its first batch" in proc.stdout + proc.stderr

    other = tmp_path / "other"
    (other / "lightning_logs" / "version_0").mkdir(parents=True)
    (other / "lightning_logs" / "version_0" / "config.yaml").write_text("trainer: {}\n")
    before = _listing(other / "lightning_logs")
    _cli(["fit", "--ckpt_path=missing.ckpt"], other, ok=False)
    assert _listing(other / "lightning_logs") == before
    assert _versions(other) == {"version_0"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args",
    [["--trainer.devices=3", "--data.num_parts=2"], ["--data.data=NoSuchDataset"]],
    ids=["devices-vs-num_parts", "unknown-dataset"],
)
@pytest.mark.slow
def test_configuration_error_leaves_no_version_folder(args, tmp_path):
    """The configuration errors of the first-hour report fail before anything is written.

    Negative control: a check that moved after the loggers start (into ``setup``) would leave
    ``version_0/`` if :class:`~lightning_fullgraph.cli.RemoveEmptyRunFolder` were missing."""
    proc = _cli(["fit", "--trainer.max_epochs=1", *args], tmp_path, ok=False)
    assert "ValueError" in proc.stderr
    assert not (tmp_path / "lightning_logs").exists(), _listing(tmp_path / "lightning_logs")
    assert not (tmp_path / "config.yaml").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_failing_mid_training_keeps_its_folder(tmp_path):
    """A run that logged an epoch before failing keeps its folder and events (no checkpoint
    here, so only the "a batch finished" rule keeps it).

    Negative control: dropping the ``progressed`` check of ``RemoveEmptyRunFolder`` deletes
    the folder (it then holds only config.yaml, hparams.yaml and this process's events)."""
    config = tmp_path / "fail.yaml"
    config.write_text(
        yaml.safe_dump(
            {"trainer": {"callbacks": [{"class_path": f"{__name__}.FailAtEpoch", "init_args": {"epoch": 1}}]}}
        )
    )
    proc = _cli(
        ["fit", "--config", str(config), "--trainer.max_epochs=3", "--trainer.enable_checkpointing=false"],
        tmp_path,
        ok=False,
    )
    assert "FailAtEpoch: deliberate failure" in proc.stderr
    version = tmp_path / "lightning_logs" / "version_0"
    assert version.is_dir(), proc.stdout[-2000:]
    assert len(_scalars(version)["train_loss"]) >= 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_user_model_checkpoint_from_yaml_replaces_the_default(tmp_path):
    """A ``ModelCheckpoint`` given in YAML is the only one: its files and nothing else (no
    ``last.ckpt``, no ``epoch=...`` file of a second, default callback).

    Negative control: adding ``ModelCheckpoint(save_last=True)`` regardless of the
    configuration writes ``last.ckpt`` and ``epoch=1-step=2.ckpt`` beside ``best.ckpt``."""
    config = tmp_path / "ckpt.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "callbacks": [
                        {
                            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                            "init_args": {"monitor": "val_acc", "mode": "max", "filename": "best"},
                        }
                    ]
                }
            }
        )
    )
    proc = _cli(["fit", "--config", str(config), "--trainer.max_epochs=2"], tmp_path)
    assert "test_acc" in proc.stdout
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best.ckpt"]


PLAIN_MODULE = '''
import torch
import torch.nn.functional as F
import lightning.pytorch as pl
from torch_geometric.nn import GCNConv


class PlainModule(pl.LightningModule):
    """An ordinary LightningModule with PyG convs: no base class from this package."""

    def __init__(self, in_channels: int = 64, num_classes: int = 5, hidden: int = 16, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = GCNConv(in_channels, hidden)
        self.conv2 = GCNConv(hidden, num_classes)

    def forward(self, x, edge_index):
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)

    def training_step(self, batch, batch_idx):
        out = self(batch.x, batch.edge_index)
        loss = F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_any_lightning_module_by_class_path(tmp_path):
    """``--model.class_path`` takes any LightningModule (the CLI's docs promise it), with its
    own init arguments from flags.

    Negative control: with ``model_class=GNNNodeClassifier`` (subclass mode) the parser refuses
    ``plain_module.PlainModule`` ("Import path ... does not correspond to a subclass of
    GNNNodeClassifier")."""
    (tmp_path / "plain_module.py").write_text(PLAIN_MODULE)
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env_path])])
    try:
        proc = _cli(
            ["fit", "--model.class_path=plain_module.PlainModule", "--model.hidden=8", "--trainer.max_epochs=2"],
            tmp_path,
        )
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_path
    assert "not testing: PlainModule has no test_step" in proc.stdout
    assert (tmp_path / LAST).is_file()
    hparams = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert hparams["hidden"] == 8
