"""How standard PyG convs are made partition-aware."""

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
