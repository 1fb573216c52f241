"""How standard PyG convs are made partition-aware.

Modules, each importing only those listed before it: ``errors`` (:class:`UnsupportedConvError`),
``sparse`` (CSR blocks), ``scores`` (the halo rows' aggregation scores), ``context``
(:class:`HaloContext`, incl. GCN's global degrees), ``gcn`` and ``families`` (the adapters),
``registry`` (which conv type gets which adapter, and the refusals), ``patch``
(:func:`install_adapters`, :func:`uninstall_adapters`).
"""

from lightning_fullgraph.nn.context import HaloContext
from lightning_fullgraph.nn.errors import UnsupportedConvError
from lightning_fullgraph.nn.patch import AdapterHandle, install_adapters, uninstall_adapters
from lightning_fullgraph.nn.registry import register_conv_adapter, supported_convs

__all__ = [
    "AdapterHandle",
    "HaloContext",
    "UnsupportedConvError",
    "install_adapters",
    "register_conv_adapter",
    "supported_convs",
    "uninstall_adapters",
]
