"""Where the partition cache lives by default, and the earlier default that is no longer used."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

__all__ = ["default_cache_root", "legacy_cache_root", "user_cache_dir"]

log = logging.getLogger(__name__)


def user_cache_dir() -> Path:
    """This package's folder in the user's cache: ``$XDG_CACHE_HOME/lightning-fullgraph``,
    else ``~/.cache/lightning-fullgraph`` (``<tmp>/lightning-fullgraph-<uid>`` where no home
    folder is known).

    The hyphen matters: a folder named like the package (``lightning_fullgraph``) in the
    folder Python starts from, or beside a script, is imported as an empty namespace package
    instead of this one (the former default ``<tmp>/lightning_fullgraph/partitions`` broke
    ``from lightning_fullgraph import ...`` for Python started from the temporary folder)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # (the XDG specification ignores a relative path)
        return Path(xdg) / "lightning-fullgraph"
    try:
        return Path.home() / ".cache" / "lightning-fullgraph"
    except (RuntimeError, KeyError):  # no $HOME and no password-database entry
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        return Path(tempfile.gettempdir()) / f"lightning-fullgraph-{uid}"


def legacy_cache_root() -> Path:
    """Where earlier versions kept partitions by default: ``<tmp>/lightning_fullgraph/partitions``
    (never used now: it shadows the package, and its partitions are of an older format)."""
    return Path(tempfile.gettempdir()) / "lightning_fullgraph" / "partitions"


_WARNED: set[Path] = set()


def _name_legacy_cache(new: Path) -> None:
    """One warning per process if an earlier version's default partition cache exists."""
    old = legacy_cache_root()
    if old in _WARNED or not old.is_dir():
        return
    _WARNED.add(old)
    log.warning(
        "the partition cache of an earlier version, %s, is not used any more (partitions are now "
        "cached in %s and rebuilt there when needed); as long as %s exists, Python started from %s "
        "cannot `import lightning_fullgraph`. Remove it: rm -rf %s && rmdir %s",
        old,
        new,
        old.parent,
        old.parent.parent,
        old,
        old.parent,
    )


def default_cache_root() -> Path:
    """``$LIGHTNING_FULLGRAPH_CACHE``, else ``partitions`` in :func:`user_cache_dir`
    (``$XDG_CACHE_HOME/lightning-fullgraph/partitions`` or
    ``~/.cache/lightning-fullgraph/partitions``), created if missing; where that cannot be
    created or written (a read-only home), ``<tmp>/lightning-fullgraph-<uid>/partitions``, with
    one warning line naming both.

    Where an earlier version's default (:func:`legacy_cache_root`) exists, one warning line
    per process says how to remove it (its partitions are not used)."""
    env = os.environ.get("LIGHTNING_FULLGRAPH_CACHE")
    if env:
        return Path(env)
    root = user_cache_dir() / "partitions"
    problem = _not_writable(root)
    if problem is not None:
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        fallback = Path(tempfile.gettempdir()) / f"lightning-fullgraph-{uid}" / "partitions"
        if root not in _WARNED:
            _WARNED.add(root)
            log.warning(
                "cannot use the default partition cache %s (%s); caching partitions in %s instead "
                "(choose a folder with LIGHTNING_FULLGRAPH_CACHE or cache_dir=)",
                root,
                problem,
                fallback,
            )
        root = fallback
    _name_legacy_cache(root)
    return root


def _not_writable(folder: Path) -> str | None:
    """Why ``folder`` cannot be created or written by this user, or ``None``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "not writable for this user"
    return None
