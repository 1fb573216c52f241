"""Halo communication: transport, codec, the exchanger's autograd, and the compression policies."""

from lightning_fullgraph.comm.exchange import HaloExchanger
from lightning_fullgraph.comm.policies import (
    MODES,
    AdaQPPolicy,
    CompressionPolicy,
    ExactPolicy,
    PolicyEnv,
    SylviePolicy,
    make_policy,
)
from lightning_fullgraph.comm.transport import CommStats

__all__ = [
    "MODES",
    "AdaQPPolicy",
    "CommStats",
    "CompressionPolicy",
    "ExactPolicy",
    "HaloExchanger",
    "PolicyEnv",
    "SylviePolicy",
    "make_policy",
]
