"""Halo communication: transport + autograd (``exchange``)."""

from lightning_fullgraph.comm.exchange import CommStats, HaloExchanger

__all__ = ["CommStats", "HaloExchanger"]
