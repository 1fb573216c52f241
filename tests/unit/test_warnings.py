"""Warning filters: none installed at import, scoped ones removed again."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from lightning_fullgraph._warnings import ScopedWarningFilter


@pytest.mark.slow
def test_import_leaves_the_process_warning_filters_alone() -> None:
    """Importing the package (strategy, models, CLI) adds no warnings filter.

    Negative control: a module-level ``warnings.filterwarnings`` (as strategy.py and
    models.py had) makes the filter lists differ and fails."""
    code = (
        "import warnings, torch, lightning.pytorch, torch_geometric, torchmetrics\n"
        "before = list(warnings.filters)\n"
        "import lightning_fullgraph, lightning_fullgraph.models, lightning_fullgraph.cli\n"
        "added = [f for f in warnings.filters if f not in before]\n"
        "print(added)\n"
        "raise SystemExit(1 if added else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scoped_filter_ignores_only_its_message_and_only_while_installed() -> None:
    """Negative control: a ``remove`` that leaves the entry behind keeps ignoring the message
    after it and fails the last check."""
    before = list(warnings.filters)
    scoped = ScopedWarningFilter(r"noisy thing")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        scoped.install()
        scoped.install()  # idempotent
        warnings.warn("noisy thing happened", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["something else"]
        scoped.remove()
        scoped.remove()  # idempotent
        warnings.warn("noisy thing happened", UserWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["something else", "noisy thing happened"]
    assert warnings.filters == before


_LEAFSPEC_RUN = """
import warnings
import lightning.pytorch as pl
from lightning.pytorch.utilities._pytree import _tree_flatten
import lightning_fullgraph
from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.models import GNNNodeClassifier

before = list(warnings.filters)
pl.seed_everything(0)
dm = FullGraphDataModule("community", dataset_kwargs={"num_nodes": 300, "num_val": 100, "num_test": 100})
model = GNNNodeClassifier(conv="gcn", hidden_channels=8)
trainer = pl.Trainer(
    strategy="fullgraph_exact", accelerator="cpu", devices=1, max_epochs=1, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model, datamodule=dm)
trainer.test(model, datamodule=dm, verbose=False)
assert warnings.filters == before, "the strategy left a warnings filter behind"
# Control: the Lightning call that warns inside fit/test still warns outside them.
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    _tree_flatten(1)
print("CONTROL", any("LeafSpec" in str(w.message) for w in seen))
"""


@pytest.mark.slow
def test_lightning_leafspec_warning_does_not_reach_the_user() -> None:
    """Lightning 2.6 on torch >= 2.13 warns ``isinstance(treespec, LeafSpec) is deprecated``
    from every loop's ``setup_data`` (its ``CombinedLoader``); the strategy ignores exactly that
    message between ``setup`` and ``teardown``.  A fit and a test from the Python API, with
    Python's default warning filters (a subprocess: pytest's own configuration ignores the
    message), print no such line and leave the filters as they were.

    Negative control: without ``self._leafspec_warning.install()`` in
    ``FullGraphStrategy.setup`` the warning is printed (three times here: the sanity check, the
    training loop and the test) and this fails.
    Skips where the installed torch / Lightning no longer emit it (the control is False)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run(
        [sys.executable, "-c", _LEAFSPEC_RUN], capture_output=True, text=True, timeout=240, env=env
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    if "CONTROL True" not in proc.stdout:
        pytest.skip("this torch / Lightning pair does not emit the LeafSpec FutureWarning")
    leaked = [line for line in output.splitlines() if "LeafSpec" in line]
    assert not leaked, "\n".join(leaked)
