"""The default caches never shadow the package (issue 29, item 8).

The partition cache used to default to ``<tmp>/lightning_fullgraph/partitions``: after the
first run, ``<tmp>/lightning_fullgraph/`` existed, and Python started from the temporary
folder (or a script stored there) imported that folder as a namespace package, so
``from lightning_fullgraph import FullGraphDataModule`` failed.  The defaults are now under
``$XDG_CACHE_HOME/lightning-fullgraph`` (``~/.cache/lightning-fullgraph``): a name with a
hyphen is never imported.

Real processes: a fresh interpreter partitions with the default cache (``HOME``,
``XDG_CACHE_HOME`` and ``TMPDIR`` point into the test's folder, so the real home and
temporary folder are untouched), then another one imports the package from the temporary
folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(180)

_PARTITION = (
    "from lightning_fullgraph import FullGraphDataModule\n"
    "from tests.helpers import directed_graph\n"
    "dm = FullGraphDataModule(directed_graph())\n"
    "dm.setup()\n"
    "print(dm.partition_result.folder)\n"
)
_IMPORT = "from lightning_fullgraph import FullGraphDataModule; print(FullGraphDataModule.__module__)"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("LIGHTNING_FULLGRAPH_CACHE", "LIGHTNING_FULLGRAPH_DATA_CACHE", "XDG_CACHE_HOME", "PYTHONPATH")
    }
    for name in ("home", "tmp"):
        (tmp_path / name).mkdir(exist_ok=True)
    env.update(HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"), **extra)
    return env


def _run(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=150
    )


@pytest.mark.slow
def test_python_started_from_the_temporary_folder_imports_the_package_after_a_run(tmp_path) -> None:
    """After a partitioning with the default cache, ``python -c "from lightning_fullgraph
    import FullGraphDataModule"`` started from ``$TMPDIR`` succeeds, and the partitions are
    under ``~/.cache/lightning-fullgraph/partitions``.

    Negative control: the former default ``<tmp>/lightning_fullgraph/partitions`` -> the
    import fails with "ImportError: cannot import name 'FullGraphDataModule' from
    'lightning_fullgraph' (unknown location)" and this test fails."""
    env = _env(tmp_path)
    tmp = tmp_path / "tmp"
    run = _run(_PARTITION, REPO, env)
    assert run.returncode == 0, run.stderr[-3000:]
    imported = _run(_IMPORT, tmp, env)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert imported.stdout.strip() == "lightning_fullgraph.data.datamodule"
    folder = Path(run.stdout.strip().splitlines()[-1])
    assert folder.parent == tmp_path / "home" / ".cache" / "lightning-fullgraph" / "partitions", folder
    assert (folder / "manifest.json").is_file()
    assert not (tmp / "lightning_fullgraph").exists(), sorted(p.name for p in tmp.iterdir())


@pytest.mark.slow
def test_xdg_cache_home_and_the_overrides_are_honoured(tmp_path) -> None:
    """``$XDG_CACHE_HOME`` moves the default; ``LIGHTNING_FULLGRAPH_CACHE`` overrides it."""
    xdg = tmp_path / "xdg"
    run = _run(_PARTITION, REPO, _env(tmp_path, XDG_CACHE_HOME=str(xdg)))
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.split()[-1]).parent == xdg / "lightning-fullgraph" / "partitions"
    chosen = tmp_path / "chosen"
    run = _run(
        _PARTITION, REPO, _env(tmp_path, XDG_CACHE_HOME=str(xdg), LIGHTNING_FULLGRAPH_CACHE=str(chosen))
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.split()[-1]).parent == chosen


@pytest.mark.slow
def test_an_old_default_cache_is_named_once_with_how_to_remove_it(tmp_path) -> None:
    """An earlier version's ``<tmp>/lightning_fullgraph/partitions`` is not used (its
    partitions are of an older format); one warning line names it, why it matters and the
    command that removes it.  Negative control: the former default reuses that folder and
    prints nothing -> this test fails."""
    old = tmp_path / "tmp" / "lightning_fullgraph" / "partitions"
    (old / "metis-edges-p1-s0-0123456789abcdef").mkdir(parents=True)
    run = _run(
        _PARTITION + "dm2 = FullGraphDataModule(directed_graph(seed=1)); dm2.setup()\n", REPO, _env(tmp_path)
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (
        Path(run.stdout.split()[-1]).parent
        == tmp_path / "home" / ".cache" / "lightning-fullgraph" / "partitions"
    )
    lines = [line for line in run.stderr.splitlines() if str(old) in line]
    assert len(lines) == 1, run.stderr[-3000:]
    assert f"rm -rf {old}" in lines[0] and "import lightning_fullgraph" in lines[0], lines[0]
    assert not any((old.parent / "partitions").glob("*-p1-s0-[!0]*")), "nothing new is written there"


def test_an_unwritable_home_falls_back_to_a_hyphenated_temporary_folder(
    tmp_path, monkeypatch, caplog
) -> None:
    """Where the home cache cannot be created, partitions go to
    ``<tmp>/lightning-fullgraph-<uid>/partitions`` (still not importable), with one warning
    naming both folders, instead of failing every run of a user with a read-only home.
    Negative control: the former default (``<tmp>/lightning_fullgraph/partitions``) -> the
    path assert fails."""
    import tempfile

    from lightning_fullgraph.partition.cache import roots as cache_mod

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.delenv("LIGHTNING_FULLGRAPH_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(blocker / "home"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(cache_mod, "_WARNED", set(), raising=False)
    (tmp_path / "tmp").mkdir()
    with caplog.at_level("WARNING", logger=cache_mod.__name__):
        root = cache_mod.default_cache_root()
        assert cache_mod.default_cache_root() == root
    assert root == tmp_path / "tmp" / f"lightning-fullgraph-{os.getuid()}" / "partitions"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and str(blocker / "home" / ".cache" / "lightning-fullgraph") in warned[0], warned
    assert str(root) in warned[0] and "LIGHTNING_FULLGRAPH_CACHE" in warned[0]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_mod.default_cache_root() == tmp_path / "xdg" / "lightning-fullgraph" / "partitions"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # ignored, as the XDG specification says
    assert cache_mod.default_cache_root() == root


def test_the_dataset_cache_is_hyphenated_and_an_old_one_is_kept_with_a_warning(
    tmp_path, monkeypatch, caplog
) -> None:
    """The dataset cache defaults to ``~/.cache/lightning-fullgraph/datasets``; an earlier
    version's ``~/.cache/lightning_fullgraph/datasets`` (its downloads) is used while the new
    one does not exist, with one warning giving the command that moves it.  Negative control:
    the former ``_default_cache_dir`` returns the underscore folder -> the first assert fails."""
    from lightning_fullgraph.data.datasets import public as datasets

    home = tmp_path / "home"
    monkeypatch.delenv(datasets.CACHE_ENV_VAR, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(datasets, "_LEGACY_NAMED", set(), raising=False)
    new, old = (
        home / ".cache" / "lightning-fullgraph" / "datasets",
        home / ".cache" / "lightning_fullgraph" / "datasets",
    )
    assert datasets._default_cache_dir() == new
    old.mkdir(parents=True)
    with caplog.at_level("WARNING", logger=datasets.__name__):
        assert datasets._default_cache_dir() == old
        assert datasets._default_cache_dir() == old
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"mv {old} {new}" in warned[0], warned
    new.mkdir(parents=True)
    assert datasets._default_cache_dir() == new
    monkeypatch.setenv(datasets.CACHE_ENV_VAR, str(tmp_path / "chosen"))
    assert datasets._default_cache_dir() == tmp_path / "chosen"
