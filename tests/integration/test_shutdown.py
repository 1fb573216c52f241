"""How runs end: SIGTERM/SIGINT, a stalled rank, an error before the halo exchange.

Real processes and real signals, as a user runs them: ``python train.py`` (a script with the
default ``popen`` launcher, 2 ranks, a tiny generated graph, 20 s process-group timeout) or
``python -m lightning_fullgraph fit``.  Every test checks the launcher's exit status and that
no process it started (ranks, and anything they started) is alive afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_fullgraph._os import proc_start
from lightning_fullgraph.launch.guard import GRACE
from tests.conftest import REPO, free_port
from tests.processes import descendants

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and POSIX signals")

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from datetime import timedelta
    import lightning.pytorch as pl
    from lightning_fullgraph import FullGraphDataModule, FullGraphStrategy
    from tests.helpers import NodeClassifier, directed_graph

    CFG = json.loads(sys.argv[1])
    OUT = CFG["out"]

    def mark(name):
        open(os.path.join(OUT, name), "w").close()

    class Probe(pl.Callback):
        # records each rank's pid; marks training; slows, stalls or breaks a rank
        def setup(self, trainer, pl_module, stage):
            with open(os.path.join(OUT, f"rank{trainer.global_rank}"), "w") as f:
                f.write(str(os.getpid()))
            if trainer.global_rank == CFG.get("bad_rank"):
                raise ValueError(f"rank {trainer.global_rank}: lr must be positive, got -0.1 (test)")

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 2 and trainer.global_rank == 0:
                mark("training")
            if trainer.current_epoch == 3 and trainer.global_rank == CFG.get("stall_rank"):
                mark("stalled")
                time.sleep(CFG["stall"])

        def on_before_backward(self, trainer, pl_module, loss):
            # rank 0 slow between its forward and its backward: the other rank waits for it
            # inside the backward halo exchange
            if trainer.current_epoch == 3 and trainer.global_rank == CFG.get("slow_rank"):
                mark("slow")
                time.sleep(CFG["slow"])

    if __name__ == "__main__":
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, max_epochs=100000, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            strategy=FullGraphStrategy(mode=CFG["mode"], timeout=timedelta(seconds=CFG.get("timeout", 20))),
            callbacks=[Probe()],
        )
        trainer.fit(NodeClassifier(conv="gcn"), datamodule=FullGraphDataModule(directed_graph(), cache_dir=OUT))
    """
)

HALO_PARAGRAPH = "another rank stopped taking part in the halo exchange"
#: The brief's bound: every rank gone this many seconds after SIGTERM/SIGINT.
STOP_WITHIN = 10.0


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.pop("PL_GLOBAL_SEED", None)
    env.pop("LIGHTNING_FULLGRAPH_LAUNCHER_PID", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(free_port())
    env["LIGHTNING_FULLGRAPH_CACHE"] = str(tmp_path / "partitions")
    return env


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not)."""
    return bool(proc_start(pid))


def _wait_for(path: Path, run: Run, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if run.proc.poll() is not None:
            pytest.fail(f"the run ended ({run.proc.returncode}) before {path.name}:\n{run.stderr[-6000:]}")
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.05)


class Run:
    """One 2-rank run in its own session (like a job), with its stdout/stderr in files."""

    def __init__(self, tmp_path: Path, args: list[str]) -> None:
        self.tmp_path = tmp_path
        self.out_file = open(tmp_path / "stdout.txt", "w")
        self.err_file = open(tmp_path / "stderr.txt", "w")
        self.proc = subprocess.Popen(
            args, cwd=tmp_path, env=_env(tmp_path), stdout=self.out_file, stderr=self.err_file,
            start_new_session=True,
        )
        self.processes: set[int] = set()

    def record_processes(self) -> None:
        """Every process of the run so far: the launcher, its ranks and what they started."""
        self.processes |= {self.proc.pid, *descendants(self.proc.pid)}
        self.processes |= {int(p.read_text()) for p in self.tmp_path.glob("rank[0-9]") if p.read_text()}

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def survivors(self, within: float) -> set[int]:
        """Processes of the run still alive ``within`` seconds from now."""
        deadline = time.monotonic() + within
        while True:
            left = {p for p in self.processes if p != self.proc.pid and _alive(p)}
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)

    @property
    def stderr(self) -> str:
        self.err_file.flush()
        return (self.tmp_path / "stderr.txt").read_text()

    def close(self) -> None:
        self.record_processes()
        for pid in self.processes:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out_file.close()
        self.err_file.close()


@pytest.fixture
def run_script(tmp_path):
    runs: list[Run] = []
    (tmp_path / "train.py").write_text(SCRIPT)

    def start(**cfg) -> Run:
        cfg["out"] = str(tmp_path)
        run = Run(tmp_path, [sys.executable, str(tmp_path / "train.py"), json.dumps(cfg)])
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.close()


def _signal_run(run: Run, marker: str, signum: int, to_group: bool = False, delay: float = 0.3) -> float:
    _wait_for(run.tmp_path / marker, run)
    time.sleep(delay)
    run.record_processes()
    assert len(run.processes) >= 2, run.processes
    sent = time.monotonic()
    if to_group:
        os.killpg(run.proc.pid, signum)  # Ctrl+C in a terminal: every process of the job
    else:
        os.kill(run.proc.pid, signum)  # `kill PID`, a scheduler preempting the job
    return sent


def _check_stopped(run: Run, sent: float, signum: int) -> None:
    code = run.wait(timeout=60)
    elapsed = time.monotonic() - sent
    left = run.survivors(within=max(0.0, sent + STOP_WITHIN - time.monotonic()))
    stopped_in = time.monotonic() - sent
    print(f"{signal.Signals(signum).name}: launcher exit {code} after {elapsed:.1f} s; survivors {left}")
    assert code is not None, f"the launcher still runs 60 s after {signal.Signals(signum).name}:\n{run.stderr[-3000:]}"
    assert code == 128 + signum, f"exit status {code}, not {128 + signum}:\n{run.stderr[-3000:]}"
    assert elapsed < STOP_WITHIN, f"the launcher took {elapsed:.1f} s to stop"
    assert not left, f"processes {left} of the run are alive {stopped_in:.1f} s after the signal"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "slow"),
    [("exact", True), ("sylvie", True), ("exact", False), ("adaqp", False)],
    ids=["exact-rank0-slow", "sylvie-rank0-slow", "exact", "adaqp"],
)
@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank(run_script, mode: str, slow: bool) -> None:
    """SIGTERM to the launcher mid-training: every rank gone within 10 s, status 143.

    Negative control (the strategy's launchers, hooks, ``teardown`` and ``on_exception``
    reverted to before the change; run): with rank 0 slowed (the signal lands while rank 0
    sleeps before its backward and rank 1 waits for it in the backward halo exchange),
    Lightning's handler broadcasts on the default group against rank 1's halo wait: the run
    hangs until the 20 s process-group timeout (20.7 s) and exits 1, blaming the halo
    exchange; at equal speed it stops in ~1 s, but with status 0.
    """
    run = run_script(mode=mode, slow_rank=0 if slow else None, slow=5.0)
    sent = _signal_run(run, "slow" if slow else "training", signal.SIGTERM)
    _check_stopped(run, sent, signal.SIGTERM)
    assert "FullGraphStrategy: received SIGTERM" in run.stderr
    # Lightning's handler (it logs this, then broadcasts from wherever the rank is) did not run
    assert "Received SIGTERM: 15" not in run.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_rank(run_script) -> None:
    """SIGINT to every process of the job (Ctrl+C in a terminal) while rank 0 is slow: all gone
    within 10 s, status 130.

    Negative control (run): Lightning's KeyboardInterrupt path SIGKILLs the ranks and exits 1
    (in ~1 s): the status does not say the job was interrupted."""
    run = run_script(mode="sylvie", slow_rank=0, slow=5.0)
    sent = _signal_run(run, "slow", signal.SIGINT, to_group=True)
    _check_stopped(run, sent, signal.SIGINT)


CLI_CALLBACK = textwrap.dedent(
    """
    import os
    import lightning.pytorch as pl

    class MarkTraining(pl.Callback):
        def __init__(self, out: str) -> None:
            self.out = out

        def setup(self, trainer, pl_module, stage):
            with open(os.path.join(self.out, f"rank{trainer.global_rank}"), "w") as f:
                f.write(str(os.getpid()))

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 2 and trainer.global_rank == 0:
                open(os.path.join(self.out, "training"), "w").close()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigint_to_the_cli_launcher_stops_every_rank(tmp_path) -> None:
    """`python -m lightning_fullgraph fit`, SIGINT to the launcher only: status 130, no rank left.

    Negative control (run): Lightning's KeyboardInterrupt path SIGKILLs the ranks and exits 1."""
    (tmp_path / "mark_training.py").write_text(CLI_CALLBACK)
    callback = {"class_path": "mark_training.MarkTraining", "init_args": {"out": str(tmp_path)}}
    args = [
        sys.executable, "-m", "lightning_fullgraph", "fit",
        "--data.dataset_kwargs", json.dumps({"num_nodes": 400, "num_val": 100, "num_test": 100}),
        "--trainer.strategy=lightning_fullgraph.FullGraphStrategy", "--trainer.strategy.mode=sylvie",
        "--trainer.strategy.timeout=0:00:20", "--trainer.max_epochs=100000", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.callbacks+=" + json.dumps(callback),
    ]
    run = Run(tmp_path, args)
    try:
        sent = _signal_run(run, "training", signal.SIGINT)
        _check_stopped(run, sent, signal.SIGINT)
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_stalled_past_the_timeout_leaves_no_orphan(run_script) -> None:
    """Sylvie, rank 1 sleeps 100 s (timeout 20 s): rank 0 fails with the timeout, and rank 1 is
    gone a few seconds after the launcher exits, not when its sleep ends.

    The timeout is the other tests' 20 s: it bounds every collective of the run (the ranks'
    start is bounded by ``rendezvous_timeout`` instead, which a loaded CI machine can stretch
    past 20 s: :mod:`lightning_fullgraph.launch.rendezvous`).

    Negative control (run): rank 1 is still alive after the launcher has exited; it lives until
    its sleep ends, ~80 s later."""
    run = run_script(mode="sylvie", stall_rank=1, stall=100.0, timeout=20)
    _wait_for(run.tmp_path / "stalled", run)
    run.record_processes()
    code = run.wait(timeout=60)
    assert code is not None and code != 0, f"exit status {code}:\n{run.stderr[-3000:]}"
    ended = time.monotonic()
    left = run.survivors(within=GRACE + 6.0)
    print(f"stalled rank: launcher exit {code}; rank 1 gone after {time.monotonic() - ended:.1f} s")
    assert not left, f"processes {left} outlived the launcher by {GRACE + 6.0:.0f} s:\n{run.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_configuration_error_is_not_blamed_on_the_halo_exchange(run_script) -> None:
    """Rank 1 raises a configuration error in setup; rank 0 then loses its peer in a barrier.
    The output names the error and does not end with (or contain) the lost-peer paragraph,
    which is about ranks that stop during the halo exchange.

    Negative control (run): ``on_exception`` appended the paragraph to rank 0's "Connection
    closed by peer" error, the last lines of the output."""
    run = run_script(mode="exact", bad_rank=1)
    code = run.wait(timeout=90)
    run.record_processes()
    assert code is not None and code != 0
    stderr = run.stderr
    assert "lr must be positive, got -0.1" in stderr, stderr[-3000:]
    assert HALO_PARAGRAPH not in stderr, stderr[-3000:]
    assert not run.survivors(within=GRACE + 2.0)


@pytest.mark.timeout(120)
def test_handlers_are_restored_after_a_run(tmp_path) -> None:
    """The guard exists only while the strategy runs: a 2-rank fit (forked ranks, in this
    process) leaves SIGTERM/SIGINT handlers and the wakeup fd as they were.

    Negative control: a guard that is not uninstalled leaves its handler on both signals."""
    from lightning_fullgraph import FullGraphDataModule
    from lightning_fullgraph.launch.guard import active_guard
    from tests.helpers import NodeClassifier, cpu_trainer, directed_graph

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    cpu_trainer(2, max_epochs=2).fit(NodeClassifier(), datamodule=FullGraphDataModule(directed_graph(), cache_dir=tmp_path))
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(wakeup) == wakeup
    assert active_guard() is None
