"""Halo communication: transport + autograd (``exchange``)."""

from lightning_fullgraph.comm.exchange import HaloExchanger
from lightning_fullgraph.comm.transport import CommStats

__all__ = ["CommStats", "HaloExchanger"]
