"""Launching and stopping the ranks of a run: Lightning's launchers with this package's rules.

* :mod:`~lightning_fullgraph.launch.guard`: signals and exit status (``ShutdownGuard``);
* :mod:`~lightning_fullgraph.launch.report`: each error reported once, by the rank that found it;
* :mod:`~lightning_fullgraph.launch.launchers`: the ``popen`` and ``fork``/``spawn`` launchers,
  the launcher's checks before any rank starts, child supervision;
* :mod:`~lightning_fullgraph.launch.rendezvous`: joining the process group, the ranks' start
  bounded apart from the collectives' timeout;
* :mod:`~lightning_fullgraph.launch.preflight`: those checks, on the datamodule's public API
  (imported where used, not here: it imports the datamodule).
"""

from lightning_fullgraph.launch.guard import GRACE, KILL_AFTER, ShutdownGuard, active_guard
from lightning_fullgraph.launch.launchers import FullGraphMultiprocessingLauncher, FullGraphSubprocessLauncher
from lightning_fullgraph.launch.report import claim_report, is_lost_peer

__all__ = [
    "GRACE",
    "KILL_AFTER",
    "FullGraphMultiprocessingLauncher",
    "FullGraphSubprocessLauncher",
    "ShutdownGuard",
    "active_guard",
    "claim_report",
    "is_lost_peer",
]
