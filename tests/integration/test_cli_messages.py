"""What the command line prints when something is off, read as a user reads a terminal.

Every check runs ``python -m lightning_fullgraph`` in a subprocess (stdout and stderr are
pipes, as when the output goes to a file) and reads what it printed:

* a configuration error (a mistyped strategy name, a strategy setting of another mode, a
  value the parser refuses, parts that do not match the devices) ends after a few lines, with
  exit status 2, on one line that says what to change as command-line flags;
* ``fit --help`` names the command the user typed, not ``__main__.py``;
* ``fit`` whose output goes to a file prints a line every few epochs, not a progress bar
  redrawn line by line; a resumed ``fit`` prints Lightning's checkpoint-folder warning once,
  not once per rank.

(issue 29, items 12-14)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fullgraph.cli import errors
from lightning_fullgraph.cli.train import FullGraphCLI
from tests.conftest import REPO, free_port
from tests.processes import run_process

SMALL_GRAPH = json.dumps({"num_nodes": 1000, "num_val": 300, "num_test": 300})
SYLVIE_CONFIG = REPO / "examples" / "configs" / "community_sage_sylvie.yaml"
#: A configuration error prints at most this many lines on stderr (Lightning's own info
#: lines such as "Seed set to 0" included).
SHORT = 10


def _env(cwd: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    for name in ("PL_GLOBAL_SEED", "LIGHTNING_FULLGRAPH_LAUNCHER_PID", "LIGHTNING_FULLGRAPH_RUN_DIR"):
        env.pop(name, None)
    env.pop("LIGHTNING_FULLGRAPH_DEBUG", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(free_port())
    env["LIGHTNING_FULLGRAPH_CACHE"] = str(cwd / "partitions")
    return env


def _cli(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_process(
        [sys.executable, "-m", "lightning_fullgraph", *args],
        cwd=cwd,
        env=_env(cwd),
        merge_stderr=False,
        timeout=timeout,
    )


def _check_short_error(proc: subprocess.CompletedProcess, *expected_in_last_line: str) -> str:
    """Exit status 2, no traceback, at most :data:`SHORT` lines on stderr, and the last line
    names everything in ``expected_in_last_line``.  Returns the last line."""
    shown = f"exit status {proc.returncode}\n--- stderr ---\n{proc.stderr[-5000:]}"
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, shown
    assert "Traceback" not in proc.stderr, shown
    assert len(lines) < SHORT, f"{len(lines)} lines on stderr\n{shown}"
    last = lines[-1]
    for text in expected_in_last_line:
        assert text in last, f"{text!r} is not in the last line {last!r}\n{shown}"
    return last


# ---------------------------------------------------------------------- item 12: names
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_mistyped_strategy_name_suggests_the_nearest_registered_one(tmp_path):
    """``fit --trainer.strategy=fullgraph_sylvia`` ends on a line suggesting
    ``--trainer.strategy=fullgraph_sylvie``; the registered ``fullgraph_*`` names are listed.

    Negative control: on the old code Lightning's ``ValueError`` ("invalid strategy name ...
    Example choices: auto, ddp, ddp_spawn, deepspeed, ...") is the last line of a 36-line
    traceback, exit status 1 -> fails on the exit status / the traceback."""
    proc = _cli(["fit", "--trainer.strategy=fullgraph_sylvia", "--trainer.max_epochs=1"], tmp_path)
    _check_short_error(proc, "--trainer.strategy=fullgraph_sylvie")
    for name in ("fullgraph_quant", "fullgraph_exact", "fullgraph_adaqp", "fullgraph_sylvie"):
        assert name in proc.stderr, proc.stderr
    assert not (tmp_path / "lightning_logs").exists()


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_cli_class_mistyped_strategy_name_raises_configuration_error():
    """In Python, :class:`~lightning_fullgraph.cli.FullGraphCLI` raises a
    :class:`~lightning_fullgraph.cli.ConfigurationError` (a ``ValueError``) whose message ends
    on the suggestion.

    Negative control: on the old code Lightning's ``ValueError`` without any ``fullgraph_*``
    name -> fails."""
    with pytest.raises(ValueError) as info:
        FullGraphCLI(args=["--trainer.strategy=fullgraph_sylvia"], run=False)
    assert type(info.value).__name__ == "ConfigurationError", repr(info.value)
    assert str(info.value).splitlines()[-1] == "fix: did you mean --trainer.strategy=fullgraph_sylvie?"


# ------------------------------------------------------------- item 13: configuration errors
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_setting_of_another_mode_says_which_flags_to_change(tmp_path):
    """The Sylvie example config with ``--trainer.strategy.mode=adaqp``: its ``staleness``,
    ``smoothing``, ... are Sylvie's; the last line names the flags to drop, or the mode that
    takes them.

    Negative control: on the old code a 60-line jsonargparse traceback, exit status 1, whose
    last line is ``Given value: Namespace(class_path=...)`` -> fails on the exit status."""
    proc = _cli(
        ["fit", "--config", str(SYLVIE_CONFIG), "--trainer.strategy.mode=adaqp", "--trainer.max_epochs=1"],
        tmp_path,
    )
    last = _check_short_error(proc, "--trainer.strategy.staleness", "--trainer.strategy.mode=sylvie")
    assert "--trainer.strategy.smoothing" in last
    assert "mode='adaqp' does not take" in proc.stderr  # the strategy's own words are kept


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.conv=cheb"], ["--model.conv", "gcn, sage, gat, gin, graph"]),
        (["--trainer.max_epochs=abc"], ["--trainer.max_epochs", "an int"]),
        (["--trainer.maxepochs=3"], ["--trainer.maxepochs=3", "did you mean --trainer.max_epochs"]),
        (["--model.hiden_channels=8"], ["--model.hiden_channels", "did you mean --model.hidden_channels"]),
    ],
    ids=["conv-choice", "not-an-int", "unknown-flag", "unknown-model-argument"],
)
@pytest.mark.slow
def test_cli_parse_error_ends_on_the_flag_to_change(args, expected, tmp_path):
    """A value or flag the parser refuses: a few lines, the last naming the flag and what it
    takes (or the flag meant).

    Negative control: on the old code jsonargparse printed the whole usage (60+ lines) and
    its nested union dump; the last line was ``Given value: NestedArg(key='conv', val='cheb')``
    (conv), ``Given value: abc`` (int) or ``error: unrecognized arguments: ...`` -> fails on
    the line count."""
    proc = _cli(["fit", *args], tmp_path)
    _check_short_error(proc, *expected)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_parts_that_do_not_match_the_devices_in_flags(tmp_path):
    """``--trainer.devices=3 --data.num_parts=2``: the strategy's error (found before any rank
    starts) is kept, and the last line says what to change as flags.

    Negative control: on the old code a 28-line traceback ending on the Python phrasing
    ``set num_parts=None (or 3), or run with 2 devices``, exit status 1 -> fails."""
    proc = _cli(["fit", "--trainer.devices=3", "--data.num_parts=2", "--trainer.max_epochs=1"], tmp_path)
    last = _check_short_error(proc, "--data.num_parts", "--trainer.devices=2")
    assert "num_parts=None" not in last
    assert "ValueError: FullGraphDataModule(num_parts=2) but the trainer runs 3 rank(s)" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_debug_variable_shows_the_traceback(tmp_path):
    """``LIGHTNING_FULLGRAPH_DEBUG=1`` gives the full traceback of a configuration error.

    Negative control: on the old code the traceback is Lightning's, without the suggested
    ``fullgraph_sylvie`` -> fails on the last assertion."""
    env = _env(tmp_path)
    env["LIGHTNING_FULLGRAPH_DEBUG"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_fullgraph", "fit", "--trainer.strategy=fullgraph_sylvia"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr, proc.stderr[-3000:]
    assert "fullgraph_sylvie" in proc.stderr


# ------------------------------------------------------------------ item 14: small things
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fit_help_names_the_command(tmp_path):
    """``python -m lightning_fullgraph fit --help`` starts with
    ``usage: python -m lightning_fullgraph [options] fit``.

    Negative control: on the old code ``usage: __main__.py [options] fit`` -> fails."""
    proc = _cli(["fit", "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: python -m lightning_fullgraph [options] fit"), proc.stdout[:300]
    assert "__main__.py" not in proc.stdout


@pytest.fixture(scope="module")
def fitted_to_a_file(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``fit`` for 4 epochs, 2 ranks, progress bar not configured, output to pipes."""
    cwd = tmp_path_factory.mktemp("to_a_file")
    proc = _cli(["fit", "--trainer.max_epochs=4", f"--data.dataset_kwargs={SMALL_GRAPH}"], cwd, timeout=150)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return cwd, proc


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fit_to_a_file_prints_epoch_lines_not_a_progress_bar(fitted_to_a_file):
    """stdout not a terminal and no progress bar configured: no carriage returns, no tqdm
    rates, one line per epoch (4 here), and the whole stdout stays short.

    Negative control: on the old code TQDM redraws the bar: 4 epochs print ~80 ``\\r``/``\\n``
    separated segments (100 epochs: 760 lines) -> fails on the carriage returns."""
    _, proc = fitted_to_a_file
    out = proc.stdout
    assert "\r" not in out and "it/s" not in out, out[:2000]
    epoch_lines = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epoch_lines] == [f"epoch {e}/4" for e in (1, 2, 3, 4)], out
    assert "train_loss" in epoch_lines[-1] and "val_acc" in epoch_lines[-1], epoch_lines
    assert len(out.splitlines()) < 50, out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fit_with_the_progress_bar_asked_for_keeps_it(tmp_path):
    """``--trainer.enable_progress_bar=true`` given explicitly: the bar is drawn even into a
    file (the user asked), and no epoch lines are added.

    Negative control: disabling the bar whenever stdout is not a terminal -> fails."""
    proc = _cli(
        [
            "fit",
            "--trainer.max_epochs=1",
            "--trainer.enable_progress_bar=true",
            "--test_after_fit=false",
            f"--data.dataset_kwargs={SMALL_GRAPH}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "it/s" in proc.stdout
    assert not [line for line in proc.stdout.splitlines() if line.startswith("epoch 1/1")]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_resume_prints_the_checkpoint_folder_warning_once(fitted_to_a_file):
    """``fit --ckpt_path .../last.ckpt`` on 2 ranks logs into a new ``version_N/``; Lightning's
    ``ModelCheckpoint`` warns "The dirpath has changed ..." when it loads its state, on every
    rank. The CLI keeps it on rank 0 only.

    Negative control: on the old code rank 1 prints it too (2 copies on stderr) -> fails."""
    cwd, _ = fitted_to_a_file
    proc = _cli(
        [
            "fit",
            "--ckpt_path=lightning_logs/version_0/checkpoints/last.ckpt",
            "--trainer.max_epochs=5",
            "--test_after_fit=false",
            f"--data.dataset_kwargs={SMALL_GRAPH}",
        ],
        cwd,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "final metrics after 5 epoch(s)" in proc.stdout
    assert proc.stderr.count("The dirpath has changed") == 1, proc.stderr


# ------------------------------------------------------------ the explanations, in-process
CONV_MESSAGE = """Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'lightning_fullgraph.models.GNNNodeClassifier':
        Parser key "conv":
          Expected a typing.Literal['gcn', 'sage', 'gat', 'gin', 'graph']. Got value: cheb
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='conv', val='cheb')"""

MODE_MESSAGE = """Parser key "trainer.strategy":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'str'>, <class 'lightning.pytorch.strategies.strategy.Strategy'>]
  Errors:
    - Expected a <class 'str'>
    - Problem with given class_path 'lightning_fullgraph.FullGraphStrategy':
        Parser key "mode":
          Does not validate against any of the Union subtypes
          Subtypes: [typing.Literal['exact', 'adaqp', 'sylvie'], <class 'NoneType'>]
          Errors:
            - Expected a typing.Literal['exact', 'adaqp', 'sylvie']
            - Expected a <class 'NoneType'>
          Given value type: <class 'str'>
          Given value: sylvia
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='mode', val='sylvia')"""


@pytest.mark.parametrize(
    ("message", "problem", "fix"),
    [
        (
            CONV_MESSAGE,
            "--model.conv=cheb: not one of gcn, sage, gat, gin, graph",
            "set --model.conv to one of: gcn, sage, gat, gin, graph",
        ),
        (
            MODE_MESSAGE,
            "--trainer.strategy.mode=sylvia: not one of exact, adaqp, sylvie",
            "set --trainer.strategy.mode to one of: exact, adaqp, sylvie",
        ),
    ],
    ids=["model-conv", "strategy-mode"],
)
def test_explain_parse_error_reads_the_innermost_key(message, problem, fix):
    """jsonargparse's nested union message becomes the innermost flag, its value and its
    choices (the same messages as the subprocess tests, without a process).

    Negative control: on the old code there is no ``explain_parse_error`` -> fails."""
    assert errors.explain_parse_error(message) == (problem, fix)


def test_unknown_strategy_suggests_among_fullgraph_names_first():
    """``fullgraph-quant`` and ``FULLGRAPH_SYLVIA`` get the nearest ``fullgraph_*`` name; a name
    far from every registered one gets the list instead of a guess.

    Negative control: on the old code there is no ``unknown_strategy`` -> fails."""
    assert errors.unknown_strategy("fullgraph-quant")[1] == "did you mean --trainer.strategy=fullgraph_quant?"
    assert errors.unknown_strategy("FULLGRAPH_SYLVIA")[1] == "did you mean --trainer.strategy=fullgraph_sylvie?"
    problem, fix = errors.unknown_strategy("zzzz")
    assert "did you mean" not in fix and "fullgraph_exact" in fix and "fullgraph_adaqp" in problem


def test_python_arguments_become_flags():
    """``name=`` and `` `name` `` of a message become the one flag of that name, with the
    command line's literals; a name two groups share (``seed``) is left alone.

    Negative control: on the old code there is no ``_as_flags`` -> fails."""
    flags = {
        "--data.num_parts": 2,
        "--data.require_train": True,
        "--data.seed": 0,
        "--trainer.strategy.seed": 0,
    }
    text = "set num_parts=None (or 3), pass require_train=False or `num_parts`; seed=1"
    assert errors.as_flags(text, flags) == (
        "set --data.num_parts=null (or 3), pass --data.require_train=false or --data.num_parts; seed=1"
    )
