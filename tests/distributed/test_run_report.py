"""What a run says about itself: the fit-start line, the small-halo and transformed-input
warnings, the end-of-fit totals, and per-epoch metrics that never read 0 for "nothing sent".

Each case runs as a user's script in its own Python process (2 gloo ranks forked from it),
and the test reads that process's terminal output, as a user would see it (under pytest,
warnings and log records of forked ranks would go to pytest's capture instead).
"""

from __future__ import annotations

import csv
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.data import Data

from tests.conftest import free_port
from tests.helpers import NodeClassifier, cpu_trainer
from tests.processes import run_process

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, body: str) -> str:
    """Runs ``body`` (with this module's names and ``tmp`` in scope) as a script; returns its
    output (stdout and stderr interleaved, as on a terminal).  Fails with the output if the script fails."""
    script = tmp_path / "user_script.py"
    script.write_text(
        "from pathlib import Path\n"
        "from tests.distributed.test_run_report import *\n"
        "from tests.helpers import *\n"
        f"tmp = Path({str(tmp_path)!r})\n"
        "if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in body.strip().splitlines())
    )
    # a port of its own: a test runs several scripts, and one may still hold the last one's
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(free_port())}
    proc = run_process([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=170)
    output = proc.stdout
    assert proc.returncode == 0, output[-4000:]
    return output


def two_communities(bridges: int, nodes: int = 400, features: int = 32) -> Data:
    """Two dense halves joined by ``bridges`` edges: METIS cuts only the bridges."""
    g = torch.Generator().manual_seed(0)
    half = nodes // 2
    edges = []
    for offset in (0, half):
        src = torch.randint(0, half, (half * 8,), generator=g) + offset
        dst = torch.randint(0, half, (half * 8,), generator=g) + offset
        edges.append(torch.stack([src, dst]))
    a = torch.randint(0, half, (bridges,), generator=g)
    b = torch.randint(half, nodes, (bridges,), generator=g)
    edges.append(torch.stack([torch.cat([a, b]), torch.cat([b, a])]))
    edge_index = torch.cat(edges, dim=1)
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    y = torch.randint(0, 3, (nodes,), generator=g)
    mask = torch.rand(nodes, generator=g) < 0.5
    return Data(
        x=torch.randn(nodes, features, generator=g),
        y=y,
        edge_index=edge_index,
        train_mask=mask,
        val_mask=~mask,
        test_mask=~mask,
        num_nodes=nodes,
    )


def fit_two_ranks(
    data: Data, parts: Path, model: NodeClassifier | None = None, epochs: int = 2, **kwargs
) -> None:
    """What the user's script does: fit on 2 CPU ranks."""
    from lightning_fullgraph import FullGraphDataModule

    os.environ["MASTER_PORT"] = str(free_port())  # a script may fit several times
    model = model or NodeClassifier(in_dim=data.num_features, num_layers=2)
    trainer = cpu_trainer(2, max_epochs=epochs, **kwargs)
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=parts))


@pytest.mark.slow
def test_fit_start_line_says_mode_graph_parts_and_halo(tmp_path) -> None:
    """One line on rank 0: mode and settings, node and edge counts, parts, halo rows of each
    rank and their share of the aggregation inputs.

    Negative control: without ``rank_zero_info(self.describe_run())`` in setup this fails.
    """
    out = _run(
        tmp_path,
        """
data = directed_graph(seed=3)
fit_two_ranks(data, tmp / "parts", strategy_kwargs={"mode": "adaqp", "bits": 4})
""",
    )
    lines = [ln for ln in out.splitlines() if ln.startswith("FullGraphStrategy: mode")]
    assert len(lines) == 1, out[-3000:]
    line = lines[0]
    assert "mode adaqp" in line and "bits=4" in line
    assert "64 nodes, 256 edges in 2 part(s)" in line
    assert re.search(r"halo rows per rank \[\d+, \d+\]", line) and "of the aggregation inputs" in line


@pytest.mark.slow
def test_fit_start_line_states_the_overlap_decision(tmp_path) -> None:
    """The fit-start line says whether the central/marginal split runs, why, and the central
    share (min and mean over ranks): adaqp's default on two communities joined by 3 bridges
    (share ~0.95: on) and on a random graph (share ~0: off).

    Negative control (run): ``describe_run`` without its overlap argument in the strategy
    leaves "overlap on"/"overlap off" out of the line: both searches fail.
    """
    out = _run(
        tmp_path,
        """
fit_two_ranks(two_communities(bridges=3), tmp / "a", strategy_kwargs={"mode": "adaqp", "bits": 4})
fit_two_ranks(directed_graph(seed=3), tmp / "b", strategy_kwargs={"mode": "adaqp", "bits": 4})
""",
    )
    lines = [ln for ln in out.splitlines() if ln.startswith("FullGraphStrategy: mode")]
    assert len(lines) == 2, out[-3000:]
    share = r"central share of the aggregation (\d+\.\d)% min, (\d+\.\d)% mean over ranks"
    on = re.search(r"overlap on \(central share at least 50%; " + share, lines[0])
    off = re.search(r"overlap off \(central share below 50%: nothing to hide; " + share, lines[1])
    assert on and off, lines
    assert float(on.group(1)) >= 50.0 > float(off.group(1))


@pytest.mark.slow
def test_a_tiny_halo_warns_that_compression_cannot_matter(tmp_path) -> None:
    """Two communities joined by 3 bridges: a handful of halo rows.  A compressed mode warns
    that compression cannot change much; a graph with a real cut does not warn.

    Negative control: without the ``SMALL_HALO_SHARE`` warning the first half fails; with the
    threshold at 1.0 the second half fails.
    """
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    out = _run(
        tmp_path / "a",
        """
fit_two_ranks(two_communities(bridges=3), tmp / "parts", strategy_kwargs={"mode": "sylvie"})
""",
    )
    assert "compressing them cannot change much" in out, out[-3000:]
    out = _run(
        tmp_path / "b",
        """
fit_two_ranks(two_communities(bridges=300), tmp / "parts", strategy_kwargs={"mode": "sylvie"})
""",
    )
    assert "FullGraphStrategy: mode sylvie" in out
    assert "compressing them cannot change much" not in out, out[-3000:]


class InputDropout(NodeClassifier):
    """Dropout on the input features before the first conv, as users often write it."""

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return super().forward(F.dropout(x, p=0.5, training=self.training), edge_index)


@pytest.mark.slow
def test_input_dropout_warns_once_naming_the_extra_traffic(tmp_path) -> None:
    """SAGE ``64 -> 8 -> 3`` with ``dropout(batch.x)`` before the first conv: the first layer's
    message travels every epoch instead of once.  One warning (over 3 epochs) per fit names the
    factor.  With projected messages (the default) the first layer sends ``X W_l^T``, 8 values
    each way, and the output layer 3: (16 + 6) / 6 = 3.7x; with ``project_messages=False`` it
    sends the 64-wide dropped-out features and the output layer its 8-wide input:
    (64 + 16) / 16 = 5x.  The same model without input dropout does not warn, nor does GCN
    whose first message, ``lin(x)``, has the features' shape (64 hidden channels) but travels
    every epoch anyway.

    Negative controls: without ``_warn_transformed_input`` the first half fails; judging a
    projected message by itself rather than by its ``source`` (``HaloExchanger._next_layer``)
    loses the projected run's warning; without the ``not grad`` condition there the GCN run
    warns (the CLI's default model on the default graph did) and the second half fails.
    """
    out = _run(
        tmp_path,
        """
data = directed_graph(seed=3, num_features=64)
fit_two_ranks(data, tmp / "a", model=InputDropout(conv="sage", in_dim=64, hidden=8, num_layers=2), epochs=3)
fit_two_ranks(data, tmp / "a2", model=InputDropout(conv="sage", in_dim=64, hidden=8, num_layers=2), epochs=3,
              strategy_kwargs={"project_messages": False})
print("=== without input dropout")
fit_two_ranks(data, tmp / "b", model=NodeClassifier(conv="sage", in_dim=64, hidden=8, num_layers=2), epochs=3)
# GCN's first message is lin(x): as wide as the features here, but a per-epoch message anyway
fit_two_ranks(data, tmp / "c", model=NodeClassifier(conv="gcn", in_dim=64, hidden=64, num_layers=2), epochs=3)
""",
    )
    first, second = out.split("=== without input dropout")
    found = re.findall(r"halo rows \((\d+) values each\) travel every epoch.*?traffic ([\d.]+)x", first, re.S)
    assert [int(width) for width, _ in found] == [8, 64], out[-3000:]
    assert float(found[0][1]) == pytest.approx(22 / 6, rel=0.01)
    assert float(found[1][1]) == pytest.approx(5.0, rel=0.01)
    assert "travel every epoch" not in second


class Validating(NodeClassifier):
    """Has a validation step: Lightning's sanity check runs it before the first epoch."""

    def validation_step(self, batch: Data, batch_idx: int) -> None:
        self(batch.x, batch.edge_index)


def _metrics(path: Path) -> list[dict[str, str]]:
    (csv_file,) = list(path.rglob("metrics.csv"))
    with open(csv_file) as f:
        return [row for row in csv.DictReader(f) if row.get("epoch") not in (None, "")]


@pytest.mark.slow
def test_sylvie_epochs_that_send_nothing_log_no_bits_and_the_totals_are_reported(tmp_path) -> None:
    """staleness=3, 6 epochs: epoch 2 (before the synchronous epoch 3) and epoch 5 (the last)
    send nothing.  Those epochs log ``comm/bytes_sent`` 0 and no ``comm/bits`` (it used to
    read 0 bits); the others log 1 bit.  GCN's one-time transfer (the degrees), done in the
    sanity check, is logged in epoch 0 (it used to read 0 in every epoch).  The end-of-fit
    line gives the totals: epochs that sent, mean bits, fp32 bytes.

    Negative controls: logging ``comm/bits`` when nothing was sent fails the first part;
    without the carried one-time bytes ``comm/onetime_bytes`` is 0 in epoch 0; without the
    totals line the last part fails.
    """
    out = _run(
        tmp_path,
        """
from lightning.pytorch.loggers import CSVLogger
data = directed_graph(seed=3, num_features=16)
model = Validating(conv="gcn", in_dim=16, num_layers=3)
fit_two_ranks(data, tmp / "parts", model=model, epochs=6, logger=CSVLogger(tmp / "logs"), num_sanity_val_steps=1,
     limit_val_batches=1, strategy_kwargs={"mode": "sylvie", **PIPELINED, "staleness": 3})
""",
    )
    rows = {int(r["epoch"]): r for r in _metrics(tmp_path / "logs") if r.get("comm/bytes_sent")}
    assert sorted(rows) == list(range(6)), rows.keys()
    for epoch in (2, 5):
        assert float(rows[epoch]["comm/bytes_sent"]) == 0 and rows[epoch]["comm/bits"] == "", rows[epoch]
    for epoch in (0, 1, 3, 4):
        assert float(rows[epoch]["comm/bits"]) == 1.0, rows[epoch]
    assert float(rows[0]["comm/onetime_bytes"]) > 0
    assert all(float(rows[e]["comm/onetime_bytes"]) == 0 for e in range(1, 6))
    totals = re.search(
        r"FullGraphStrategy \[sylvie\]: 6 training epoch\(s\), halo messages [\d.]+ MB \(all ranks\) in "
        r"(\d) epoch\(s\) that sent, ([\d.]+) bits per value on average; fp32 messages every epoch: [\d.]+ MB "
        r"\(([\d.]+)x\)",
        out,
    )
    assert totals, out[-3000:]
    assert totals.group(1) == "4" and float(totals.group(2)) == 1.0 and float(totals.group(3)) > 10
