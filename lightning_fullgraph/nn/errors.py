"""The error for a conv the strategy cannot make exact across partitions.

Its own module because an adapter (:mod:`.gcn`) and the registry that lists the adapters
(:mod:`.registry`) both raise it, and the registry imports the adapters.
"""

from __future__ import annotations

__all__ = ["UnsupportedConvError"]


class UnsupportedConvError(TypeError):
    """A message-passing layer the strategy cannot make exact across partitions."""
