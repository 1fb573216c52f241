"""Warning filters: none installed at import, scoped ones removed again."""

from __future__ import annotations

import subprocess
import sys
import warnings

from lightning_fullgraph._warnings import ScopedWarningFilter


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
