"""Configuration errors as a user meets them: found before any rank starts, reported once, last.

Each test runs what a user runs, in a subprocess with the default ``popen`` launcher: a
script (``python train.py``, Python API) or ``python -m lightning_fullgraph fit``.  A
``sitecustomize.py`` on the subprocesses' path records every Python process started with
its ``LOCAL_RANK``: a rank started by the launcher has one (``1``, ``2``...), so "no rank was
started" is read from the processes themselves, not from what they print.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX processes")

PROBE = textwrap.dedent(
    """
    import os
    _path = os.environ.get("PREFLIGHT_PROBE")
    if _path:
        with open(_path, "a") as f:
            f.write(f"{os.getpid()} {os.environ.get('LOCAL_RANK', '-')}\\n")
    """
)

CHEB_MODEL = textwrap.dedent(
    """
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch_geometric.nn import ChebConv

    from lightning_fullgraph.models import GNNNodeClassifier


    class ChebModel(pl.LightningModule):
        # a module as a user writes it, with a multi-hop conv no adapter can make exact
        def __init__(self, in_channels: int = 64, num_classes: int = 5) -> None:
            super().__init__()
            self.conv = ChebConv(in_channels, num_classes, K=2)

        def training_step(self, batch, batch_idx):
            out = self.conv(batch.x, batch.edge_index)
            return F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    class ChebClassifier(GNNNodeClassifier):
        # the CLI's --model must subclass its default model
        def __init__(self, conv: str = "gcn") -> None:
            super().__init__(conv=conv)
            self.cheb = ChebConv(64, 5, K=2)
    """
)

SCRIPT = textwrap.dedent(
    """
    import sys

    import lightning.pytorch as pl
    import torch
    from torch_geometric.data import Data

    import lightning_fullgraph  # noqa: F401  (registers the strategy names)
    from lightning_fullgraph import FullGraphDataModule
    from lightning_fullgraph.models import GNNNodeClassifier

    CASE = sys.argv[1]
    SMALL = {"num_nodes": 400, "num_val": 100, "num_test": 100}


    class Fail(pl.Callback):
        # errors only a rank can find (after the launch)
        def setup(self, trainer, pl_module, stage):
            if CASE == "one-rank" and trainer.global_rank == 1:
                raise ValueError(f"rank {trainer.global_rank}: lr must be positive, got -0.1 (test)")
            if CASE == "every-rank":
                raise ValueError("lr must be positive, got -0.1 (every rank, test)")

        def on_train_epoch_start(self, trainer, pl_module):
            if CASE == "in-loop" and trainer.global_rank == 1 and trainer.current_epoch == 1:
                raise FloatingPointError("rank 1: the loss is nan at epoch 1 (test)")


    if __name__ == "__main__":
        devices, model = 2, GNNNodeClassifier()
        datamodule = FullGraphDataModule("community", dataset_kwargs=SMALL)
        if CASE == "parts":
            devices, datamodule = 3, FullGraphDataModule("community", num_parts=2)
        elif CASE == "masks":
            g = torch.Generator().manual_seed(0)
            graph = Data(x=torch.randn(40, 8, generator=g), y=torch.randint(0, 3, (40,), generator=g),
                         edge_index=torch.randint(0, 40, (2, 160), generator=g))  # no train_mask
            datamodule = FullGraphDataModule(graph)
        elif CASE == "conv":
            from chebmodel import ChebModel

            model = ChebModel()
        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="fullgraph_quant",
                             max_epochs=3 if CASE == "in-loop" else 1, callbacks=[Fail()], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, datamodule=datamodule)
    """
)

#: (error, fix) of each configuration error, as the run must end with them.
EXPECTED = {
    "parts": (
        "ValueError: FullGraphDataModule(num_parts=2) but the trainer runs 3 rank(s)",
        "set num_parts=None (or 3), or run with 2 devices",
    ),
    "masks": (
        "GraphValidationError: data.train_mask is missing, so no node is marked for training",
        "add a bool mask data.train_mask of shape [num_nodes]",
    ),
    "no-train": (
        "GraphValidationError: data.train_mask has no True entry",
        "mark the training nodes in data.train_mask",
    ),
    "conv": ("UnsupportedConvError: ChebConv cannot be made exact by FullGraphStrategy", "Supported: "),
}

CLI_ARGS = {
    "parts": ["--trainer.devices=3", "--data.num_parts=2"],
    # a generated graph whose split has no training node (no train_mask is not expressible here)
    "no-train": ["--data.dataset_kwargs", json.dumps({"train_per_class": 0, "num_nodes": 400})],
    "conv": [
        "--model.class_path=chebmodel.ChebClassifier",
        "--data.dataset_kwargs",
        json.dumps({"num_nodes": 400}),
    ],
}

#: Texts of failures that are consequences, not the cause: none may reach the user.
CONSEQUENCES = (
    "stopped taking part in the halo exchange",
    "Timed out",
    "timed out",
    "Connection closed",
    "Connection reset",
)


def _run(tmp_path: Path, args: list[str], timeout: float = 150) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "sitecustomize.py").write_text(PROBE)
    (tmp_path / "chebmodel.py").write_text(CHEB_MODEL)
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    for name in ("PL_GLOBAL_SEED", "LIGHTNING_FULLGRAPH_LAUNCHER_PID", "LIGHTNING_FULLGRAPH_RUN_DIR"):
        env.pop(name, None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        LIGHTNING_FULLGRAPH_CACHE=str(tmp_path / "partitions"),
        PREFLIGHT_PROBE=str(tmp_path / "processes.txt"),
        CI="true",
    )
    start = time.monotonic()
    proc = subprocess.run(
        args,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


def _ranks_started(tmp_path: Path) -> list[str]:
    """``LOCAL_RANK`` of every process the launcher started (it has none itself)."""
    path = tmp_path / "processes.txt"
    lines = path.read_text().split("\n") if path.exists() else []
    return [rank for _, rank in (line.split() for line in lines if line.strip()) if rank != "-"]


def _last_paragraph(output: str) -> str:
    return [p for p in re.split(r"\n\s*\n", output) if p.strip()][-1]


def _check_reported_once_last(proc: subprocess.CompletedProcess, error: str, fix: str) -> None:
    output = proc.stdout
    tail = output[-4000:]
    assert proc.returncode != 0, tail
    last = _last_paragraph(output)
    assert error in last and fix in last, f"the output does not end with the error and its fix:\n{tail}"
    assert output.count(error) == 1, f"{error!r} printed {output.count(error)} times:\n{output[-8000:]}"
    for text in CONSEQUENCES:
        assert text not in output, f"{text!r} reached the user:\n{tail}"


def _check_refused_before_launch(
    tmp_path: Path, proc: subprocess.CompletedProcess, elapsed: float, case: str
) -> None:
    error, fix = EXPECTED[case]
    _check_reported_once_last(proc, error, fix)
    # the launcher found it: no rank was started, no process group was made
    assert _ranks_started(tmp_path) == [], (
        f"ranks {_ranks_started(tmp_path)} were started:\n{proc.stdout[-3000:]}"
    )
    assert "Initializing distributed" not in proc.stdout, proc.stdout[-3000:]
    # (imports take most of it; the process-group timeout is 30 min)
    assert elapsed < 90, f"the run took {elapsed:.0f} s to fail"
    print(f"{case}: refused in {elapsed:.1f} s, {len(proc.stdout.splitlines())} lines of output")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["parts", "masks", "conv"])
def test_a_script_with_a_configuration_error_fails_before_any_rank_starts(tmp_path, case: str) -> None:
    """``python train.py`` (Python API, popen launcher) with parts != ranks, a graph without
    ``train_mask``, or a ChebConv module: exit status 1, the error and its fix are the last
    paragraph, printed once, no lost-peer or timeout text, and no rank process was started.

    Negative control (run: the ``_preflight`` call of the popen launcher in ``launch/launchers.py``
    commented out): parts starts ranks 1 and 2, masks rank 1, so the ``_ranks_started`` check
    fails (the error is still last and once: rank 0 finds it and reports it, its peers stay
    quiet; with ``claim_report`` disabled too, i.e. before this change, the output ends with a
    rank's ``Connection closed by peer`` error)."""
    proc, elapsed = _run(tmp_path, [sys.executable, str(tmp_path / "train.py"), case])
    _check_refused_before_launch(tmp_path, proc, elapsed, case)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["parts", "no-train", "conv"])
def test_the_cli_with_a_configuration_error_fails_before_any_rank_starts(tmp_path, case: str) -> None:
    """``python -m lightning_fullgraph fit`` with ``--data.num_parts=2 --trainer.devices=3``,
    a graph without training nodes, or a ChebConv model: as for the script.

    Negative control (run: the popen launcher's ``_preflight`` call commented out): the parts
    case starts ranks 1 and 2 and fails the ``_ranks_started`` check.  Before this change it
    printed 128 lines ending with rank 2's ``Connection closed by peer``."""
    args = [sys.executable, "-m", "lightning_fullgraph", "fit", "--trainer.max_epochs=1", *CLI_ARGS[case]]
    proc, elapsed = _run(tmp_path, args)
    _check_refused_before_launch(tmp_path, proc, elapsed, case)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("case", "error", "fix"),
    [
        ("one-rank", "ValueError: rank 1: lr must be positive, got -0.1 (test)", "(test)"),
        ("every-rank", "ValueError: lr must be positive, got -0.1 (every rank, test)", "(every rank, test)"),
        ("in-loop", "FloatingPointError: rank 1: the loss is nan at epoch 1 (test)", "(test)"),
    ],
    ids=["one-rank", "every-rank", "in-loop"],
)
@pytest.mark.slow
def test_an_error_found_inside_a_rank_is_the_last_thing_printed_once(
    tmp_path, case: str, error: str, fix: str
) -> None:
    """An error only a rank can find (in setup on rank 1, in setup on every rank alike, in
    training on rank 1): the output ends with it, once; the peers that lose the failed rank
    (closed connection) or raised the same error say nothing; no halo-exchange paragraph.

    Negative control (run: the ``claim_report`` test in ``FullGraphStrategy.on_exception``
    disabled): ``one-rank`` prints rank 0's ``Connection closed by peer`` last; ``every-rank``
    prints the error twice; ``in-loop`` ends with the halo-exchange paragraph."""
    proc, _ = _run(tmp_path, [sys.executable, str(tmp_path / "train.py"), case])
    assert _ranks_started(tmp_path) == ["1"], proc.stdout[-3000:]  # found inside a rank indeed
    _check_reported_once_last(proc, error, fix)
