"""A warnings filter that lives between two hooks, not for the whole process.

Lightning emits some warnings at epoch end from its own loop, so no ``with
warnings.catch_warnings()`` block of ours can enclose them; the filter is installed in a
``setup`` hook and removed again in the matching ``teardown``, leaving the process's filters
as they were (importing this package changes nothing).
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["ScopedWarningFilter", "leafspec_filter"]


class ScopedWarningFilter:
    """``ignore`` for warnings whose message matches ``message``, between :meth:`install` and
    :meth:`remove` (both idempotent).

    Args:
        message: Regular expression matched against the start of the warning message.
        category: Warning class the filter applies to.
    """

    def __init__(self, message: str, category: type[Warning] = Warning) -> None:
        self.message = message
        self.category = category
        self._entry: tuple[Any, ...] | None = None

    def install(self) -> None:
        if self._entry is None:
            warnings.filterwarnings("ignore", message=self.message, category=self.category)
            self._entry = warnings.filters[0]  # filterwarnings inserts at the front

    def remove(self) -> None:
        if self._entry is None:
            return
        try:
            warnings.filters.remove(self._entry)
        except ValueError:  # someone reset the filters meanwhile: nothing of ours is left
            pass
        self._entry = None
        mutated = getattr(warnings, "_filters_mutated", None)  # invalidates cached decisions
        if mutated is not None:
            mutated()

    @property
    def installed(self) -> bool:
        return self._entry is not None


def leafspec_filter() -> ScopedWarningFilter:
    """Lightning 2.6 builds every loop's ``CombinedLoader`` with torch's ``LeafSpec()``, which
    torch >= 2.13 deprecates with a ``FutureWarning`` the user cannot act on (every step)."""
    return ScopedWarningFilter(r".*`?isinstance\(treespec, LeafSpec\)`? is deprecated", FutureWarning)
