"""fsdp: fully sharded data parallel training for PyTorch, in the fairscale style.

Public names only; see ``docs/`` for the guide and ``docs/design.md`` for the design.
"""

from fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    ProcessGroupName,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
    TrainingState,
)
from fsdp.checkpoint import checkpoint_wrapper, disable_checkpointing
from fsdp.checkpoint_io import latest_checkpoint, load_checkpoint, save_checkpoint
from fsdp.data_parallel import DistributedDataParallel
from fsdp.fully_sharded import FSDP, FullyShardedDataParallel, get_fsdp_instances
from fsdp.norm_wrap import auto_wrap_bn
from fsdp.offload_model import OffloadModel
from fsdp.sharded_grad_scaler import ShardedGradScaler
from fsdp.wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    no_split_modules_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "FSDP",
    "BackwardPrefetch",
    "CPUOffload",
    "DistributedDataParallel",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OffloadModel",
    "OptimStateKeyType",
    "ProcessGroupName",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictSettings",
    "StateDictType",
    "TrainingState",
    "auto_wrap",
    "auto_wrap_bn",
    "checkpoint_wrapper",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "disable_checkpointing",
    "enable_wrap",
    "get_fsdp_instances",
    "lambda_auto_wrap_policy",
    "latest_checkpoint",
    "load_checkpoint",
    "no_split_modules_auto_wrap_policy",
    "save_checkpoint",
    "transformer_auto_wrap_policy",
    "wrap",
]

__version__ = "0.1.0"
