"""The exact method's policy: fp32 messages, every epoch synchronous."""

from __future__ import annotations

from lightning_fullgraph.comm.policies.base import CompressionPolicy

__all__ = ["ExactPolicy"]


class ExactPolicy(CompressionPolicy):
    """fp32 messages, synchronous: the distributed run equals single-process training.

    Args:
        seed: Unused (nothing is random); accepted so that one configuration can switch modes.
    """

    name = "exact"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed
