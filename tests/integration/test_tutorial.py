"""``docs/tutorial.md`` and ``docs/make_tutorial.py``: the page shows what the script runs.

* ``python docs/make_tutorial.py --help`` and ``--print-commands`` work (nothing is trained).
* Every command the script runs (the three ``fit`` commands and ``tensorboard --logdir``)
  appears verbatim on the page, and every ``fit`` command parses with the CLI
  (``--print_config``: strategy names, logger arguments, config path).
* The page's figures exist, are the script's outputs and stay below 300 KB.

The figures and numbers themselves come from running the script (a minute or more); that run
is not repeated here.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from lightning_fullgraph.cli import main
from tests.conftest import REPO

DOCS = REPO / "docs"
TUTORIAL = DOCS / "tutorial.md"
SCRIPT = DOCS / "make_tutorial.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_tutorial", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_and_print_commands_run_without_training():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--logdir" in proc.stdout and "--skip-fit" in proc.stdout
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--print-commands"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    script = _script()
    assert proc.stdout.splitlines() == [*script.commands(), script.tensorboard_command()]


def test_tutorial_shows_the_commands_the_script_runs():
    """Negative control: changing a flag in ``make_tutorial.commands()`` (say
    ``--trainer.logger.name``) without changing the page, or the page without the script,
    fails here."""
    page = TUTORIAL.read_text()
    script = _script()
    lines = script.commands()
    assert [re.search(r"fullgraph_(\w+)", line).group(1) for line in lines] == ["exact", "adaqp", "sylvie"]
    for line in [*lines, script.tensorboard_command()]:
        assert line in page, f"docs/tutorial.md does not show the command make_tutorial.py runs:\n{line}"


@pytest.mark.parametrize("index", range(3), ids=("exact", "adaqp", "sylvie"))
def test_each_fit_command_parses(index, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the page runs them from the repository root
    monkeypatch.setattr(sys, "argv", ["lightning-fullgraph"])
    argv = shlex.split(_script().commands()[index])
    assert argv[:4] == ["python", "-m", "lightning_fullgraph", "fit"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv[3:], "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    mode = ("exact", "adaqp", "sylvie")[index]
    assert config["trainer"]["strategy"] == f"fullgraph_{mode}"
    assert config["trainer"]["logger"]["init_args"]["name"] == mode
    assert (config["trainer"]["devices"], config["data"]["data"]) == (2, "Cora")


def test_the_page_shows_the_scripts_figures():
    page = TUTORIAL.read_text()
    for name in ("tutorial_scalars.png", "accuracy_vs_bytes.png"):
        assert f"img/{name}" in page, name
        path = DOCS / "img" / name
        assert path.is_file(), f"{path} missing: run python docs/make_tutorial.py"
        assert path.stat().st_size < 300_000, f"{path} is {path.stat().st_size} bytes"
        assert name in SCRIPT.read_text()
