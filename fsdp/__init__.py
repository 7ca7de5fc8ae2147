"""fsdp: fully sharded data parallel training for PyTorch, in the fairscale style.

Public names only; see ``docs/`` for the guide and ``docs/design.md`` for the design.
"""

from fsdp.api import MixedPrecision, ProcessGroupName, ShardingStrategy, TrainingState
from fsdp.checkpoint import checkpoint_wrapper
from fsdp.fully_sharded import FSDP, FullyShardedDataParallel, get_fsdp_instances
from fsdp.sharded_grad_scaler import ShardedGradScaler

__all__ = [
    "FSDP",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ProcessGroupName",
    "ShardedGradScaler",
    "ShardingStrategy",
    "TrainingState",
    "checkpoint_wrapper",
    "get_fsdp_instances",
]

__version__ = "0.1.0"
