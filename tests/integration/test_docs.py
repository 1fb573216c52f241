"""The documentation is checked like code: README's example runs as written, and every test a
document names as evidence exists.

* README's ``## Using it`` example runs as a user runs it (a script in a subprocess, Lightning's
  popen launcher), with only the dataset root, ``devices`` and ``max_epochs`` substituted.
* Every ``tests/<path>.py::<name>`` mentioned in README.md, ``docs/*.md`` and
  ``benchmarks/*.md`` names a test function that exists in that file (a parametrisation in
  brackets is checked by its function name).
* ``.ci/run`` runs README's test command (the same pytest arguments).
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.conftest import REPO
from tests.processes import run_process

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").glob("*.md"))]
TEST_REF = re.compile(r"(tests/[\w/]+\.py)((?:::\w+)?)")


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Using it", 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_example_runs_as_written(shared_datasets, tmp_path) -> None:
    """Negative control: a renamed public name (e.g. ``FullGraphDataModule``) or a changed
    datamodule argument makes the script fail and this test with it."""
    code = readme_example()
    assert 'root="path/to/Planetoid"' in code and "devices=4" in code and "max_epochs=200" in code
    code = (code.replace('root="path/to/Planetoid"', f'root="{shared_datasets / "Planetoid"}", cache_dir="parts"')
            .replace("devices=4", "devices=2").replace("max_epochs=200", "max_epochs=2, logger=False, "
                                                        "enable_checkpointing=False"))
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = run_process([sys.executable, str(script)], cwd=tmp_path, env=env, merge_stderr=False, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_epochs=2` reached" in proc.stderr + proc.stdout


def _references() -> list[tuple[str, str, str]]:
    refs = []
    for doc in DOCS:
        for path, name in TEST_REF.findall(doc.read_text()):
            refs.append((doc.relative_to(REPO).as_posix(), path, name.lstrip(":")))
    return refs


def test_every_test_the_documents_name_exists() -> None:
    """Negative control: renaming ``tests/distributed/test_checkpoint.py`` (or a test in it)
    without updating docs/reliability.md fails this with the document and the reference."""
    refs = _references()
    assert len(refs) > 50, "the documents should name their evidence"
    missing = []
    for doc, path, name in refs:
        file = REPO / path
        if not file.is_file():
            missing.append(f"{doc}: {path} does not exist")
        elif name and not re.search(rf"^\s*(?:async\s+)?def {name}\(", file.read_text(), re.M):
            missing.append(f"{doc}: {path}::{name} does not exist")
    assert not missing, "\n".join(sorted(set(missing)))


LINKED_DOCS = [*DOCS, REPO / "examples" / "README.md", REPO / "CHANGELOG.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path) -> set[str]:
    """GitHub's heading anchors of a markdown file, plus explicit ``<a id="...">``."""
    text = path.read_text()
    text_wo_code = re.sub(r"```.*?```", "", text, flags=re.S)
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#{1,6} (.*)$", text_wo_code, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_every_relative_link_of_the_documents_resolves() -> None:
    """Files and ``#anchors`` of every relative link in the documents exist.

    Negative control: moving README's Convergence section to docs/ without rewriting
    ``docs/tutorial.md``'s ``../README.md#convergence-where-the-halo-matters`` fails this."""
    broken = []
    for doc in LINKED_DOCS:
        for target in LINK.findall(re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = doc if not path else (doc.parent / path).resolve()
            if not file.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such anchor)")
    assert not broken, "\n".join(broken)


def _pytest_args(command: str) -> list[str]:
    """The arguments after ``python -m pytest`` in a shell command line."""
    words = command.split()
    at = next(i for i in range(len(words) - 2) if words[i].endswith("python") and words[i + 1:i + 3] == ["-m", "pytest"])
    return [w for w in words[at + 3:] if w not in ("&&", "\\")]


def test_ci_runs_the_readme_test_command() -> None:
    """CI (``.ci/run``) runs the README Quickstart's test command with the same pytest
    arguments (``-p no:cacheprovider`` aside: a clean clone has no cache to keep), so the
    suite CI passes is the one a user runs.

    Negative control (run): ``-n 2`` dropped from ``.ci/run`` only -> the lists differ."""
    quickstart = (REPO / "README.md").read_text().split("```bash", 3)[2].split("```", 1)[0]
    assert 'pip install -e ".[test]"' in quickstart, quickstart
    readme = _pytest_args(quickstart)
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if "-m pytest" in line and not line.lstrip().startswith("#")]
    assert len(ci) == 1, ci
    ci_args = _pytest_args(ci[0])
    at = ci_args.index("-p")
    assert ci_args[at : at + 2] == ["-p", "no:cacheprovider"], ci_args
    del ci_args[at : at + 2]
    assert sorted(ci_args) == sorted(readme), (ci_args, readme)
