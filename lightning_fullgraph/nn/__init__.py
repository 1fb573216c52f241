"""How standard PyG convs are made partition-aware."""

from lightning_fullgraph.nn.adapters import (
    AdapterHandle,
    HaloContext,
    UnsupportedConvError,
    install_adapters,
    register_conv_adapter,
    supported_convs,
    uninstall_adapters,
)

__all__ = [
    "AdapterHandle",
    "HaloContext",
    "UnsupportedConvError",
    "install_adapters",
    "register_conv_adapter",
    "supported_convs",
    "uninstall_adapters",
]
