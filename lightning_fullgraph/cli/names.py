"""The command's names (``lightning-fullgraph``, ``python -m lightning_fullgraph``) and its debug variable."""

from __future__ import annotations

PROG = "lightning-fullgraph"
#: ``python -m lightning_fullgraph``: how the command is named when run that way.
MODULE_PROG = "python -m lightning_fullgraph"
#: Set to 1 for the full traceback of a configuration error instead of its two-line summary.
DEBUG_ENV = "LIGHTNING_FULLGRAPH_DEBUG"
