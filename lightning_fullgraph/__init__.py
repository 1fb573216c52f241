"""lightning-fullgraph: distributed full-graph GNN training for PyTorch Lightning.

Importing the package registers the strategy names ``"fullgraph_exact"`` (fp32,
synchronous), ``"fullgraph_adaqp"`` (AdaQP: quantized halo messages, adaptive bit-widths,
overlap), ``"fullgraph_sylvie"`` (Sylvie: one-bit messages, bounded-staleness pipeline) and
``"fullgraph_quant"`` (AdaQP unless ``mode=`` says otherwise) with Lightning's strategy
registry, so that ``Trainer(strategy="fullgraph_quant")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fullgraph.comm.exchange import HaloExchanger
from lightning_fullgraph.comm.plan import HaloPlan, LocalPartition
from lightning_fullgraph.comm.policies import MODES, AdaQPPolicy, CompressionPolicy, ExactPolicy, SylviePolicy
from lightning_fullgraph.comm.transport import CommStats
from lightning_fullgraph.data.datamodule import FullGraphDataModule
from lightning_fullgraph.nn.errors import UnsupportedConvError
from lightning_fullgraph.nn.registry import register_conv_adapter, supported_convs
from lightning_fullgraph.strategy import FullGraphStrategy

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "AdaQPPolicy",
    "CommStats",
    "CompressionPolicy",
    "ExactPolicy",
    "FullGraphDataModule",
    "FullGraphStrategy",
    "HaloExchanger",
    "HaloPlan",
    "LocalPartition",
    "SylviePolicy",
    "UnsupportedConvError",
    "__version__",
    "register_conv_adapter",
    "supported_convs",
]


def _register() -> None:
    # Lightning resolves strategy names through its registry; only our own names are added,
    # every one from the one mode table: ``fullgraph_<mode>`` for every mode, and the table's
    # aliases (``fullgraph_quant``: AdaQP unless mode= says otherwise).
    from lightning_fullgraph.comm.policies.modes import strategy_names

    prefix = "Full-graph training over graph partitions, "
    for name, (description, mode) in strategy_names().items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, FullGraphStrategy, description=prefix + description, mode=mode)


_register()
