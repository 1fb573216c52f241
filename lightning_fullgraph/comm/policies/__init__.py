"""Compression policies: what each method decides about halo messages, one module per method.

``base`` (the contract every policy answers), ``exact``, ``adaqp/`` (policy, MILP, distributed
assignment), ``sylvie/`` (policy, pipeline, controllers) and ``modes`` (the one mode table).
"""

from lightning_fullgraph.comm.policies.adaqp.policy import AdaQPPolicy
from lightning_fullgraph.comm.policies.base import CompressionPolicy, PolicyEnv
from lightning_fullgraph.comm.policies.exact import ExactPolicy
from lightning_fullgraph.comm.policies.modes import (
    MODE_TABLE,
    MODES,
    POLICIES,
    Mode,
    make_policy,
    policy_settings,
    resolve_policy,
)
from lightning_fullgraph.comm.policies.sylvie.policy import SylviePolicy

__all__ = [
    "MODES",
    "MODE_TABLE",
    "POLICIES",
    "AdaQPPolicy",
    "CompressionPolicy",
    "ExactPolicy",
    "Mode",
    "PolicyEnv",
    "SylviePolicy",
    "make_policy",
    "resolve_policy",
    "policy_settings",
]
