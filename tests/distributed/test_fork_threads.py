"""Forked ranks run one thread each, and say so, instead of hanging (GNU OpenMP's thread pool
does not survive ``fork``): where the launching process runs torch on several threads, and
where it ran several before and has set one since.

Each case runs as a user's script in its own Python process, so that the OpenMP pool it starts
(or does not) is that script's alone, and the test reads its terminal output.
"""

from __future__ import annotations

import os
import sys

import pytest

from lightning_fullgraph.launch.launchers import rank_threads
from tests.conftest import REPO, free_port
from tests.processes import run_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

_SCRIPT = """
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_fullgraph import FullGraphDataModule
from tests.helpers import NodeClassifier, cpu_trainer, directed_graph


class RecordThreads(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        Path(sys.argv[1], f"threads-rank{trainer.global_rank}").write_text(str(torch.get_num_threads()))


if __name__ == "__main__":
    threads, threads_after, ranks = map(int, sys.argv[2:5])
    torch.set_num_threads(threads)
    print("sum", float((torch.ones(4_000_000) * 2).sum()))  # multi-threaded here when threads > 1
    torch.set_num_threads(threads_after)
    data = directed_graph(num_nodes=400, num_edges=4000, seed=1)
    trainer = cpu_trainer(ranks, max_epochs=1, callbacks=[RecordThreads()])
    model = NodeClassifier(in_dim=data.num_features, num_layers=2)
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=Path(sys.argv[1]) / "parts"))
"""


@pytest.mark.parametrize("omp_num_threads", ["2", None])
def test_forked_ranks_of_a_multithreaded_process_run_one_thread_and_say_so(tmp_path, omp_num_threads) -> None:
    """A script whose torch ran a two-thread op before ``trainer.fit`` forks two ranks.  With
    ``OMP_NUM_THREADS=2`` (two threads per rank asked for) they run one thread each, the fit
    finishes, and rank 0 warns once, naming the fix.  Without it the ranks' share of a 2-core
    machine is one thread anyway: the same single thread and no warning (with more cores the
    share is held to one, and rank 0 warns).

    Negative controls (run): without :func:`one_thread_after_fork` in the launcher the first
    case hangs in the ranks' first multi-threaded op (the planner's indexing, in
    ``prepare_data``) until the timeout; warning whenever the parent ran several threads
    (not only when the ranks asked for several) fails the second case."""
    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(free_port())}
    env.pop("OMP_NUM_THREADS", None)
    if omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = omp_num_threads
    proc = run_process([sys.executable, str(script), str(tmp_path), "2", "2", "2"], cwd=tmp_path, env=env, timeout=150)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert [int((tmp_path / f"threads-rank{r}").read_text()) for r in range(2)] == [1, 1]
    warned = proc.stdout.count("each rank runs torch on 1 thread, not 2")
    if omp_num_threads is not None:
        assert warned == 1, proc.stdout[-4000:]
        assert "start_method='popen'" in proc.stdout
    elif rank_threads(2) == 1:
        assert warned == 0 and "OpenMP" not in proc.stdout, proc.stdout[-4000:]
    else:  # more than 2 cores: the ranks' share is more than one thread, held to one
        assert proc.stdout.count("each rank runs torch on 1 thread, not") == 1, proc.stdout[-4000:]


@pytest.mark.skipif(rank_threads(1) < 2, reason="the rank's share of one core is one thread already")
def test_forked_rank_of_a_process_back_on_one_thread_runs_one_thread(tmp_path) -> None:
    """A script ran a two-thread op, set torch back to one thread, then forks one rank, whose
    share of the cores is two threads (this 2-core machine) or more.  The rank runs one thread, the fit
    finishes, and rank 0 says so in an info line (no warning: the script runs one thread, as
    its rank now does).

    Negative control (run): applying the rule only where the launching process runs several
    threads at launch (the rule before this test) leaves the rank on two threads, and it hangs
    in its first multi-threaded op until the timeout (the idle pool stays in the script)."""
    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(free_port())}
    env.pop("OMP_NUM_THREADS", None)
    proc = run_process([sys.executable, str(script), str(tmp_path), "2", "1", "1"], cwd=tmp_path, env=env, timeout=150)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert int((tmp_path / "threads-rank0").read_text()) == 1
    said = f"each rank runs torch on 1 thread, not {rank_threads(1)}: this process may have run"
    assert proc.stdout.count(said) == 1, proc.stdout[-4000:]
    assert "UserWarning" not in proc.stdout, proc.stdout[-4000:]
