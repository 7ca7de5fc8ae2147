"""fsdp: fully sharded data parallel training for PyTorch, in the fairscale style.

Public names only; see ``docs/`` for the guide and ``docs/design.md`` for the design.
"""

from fsdp import _legacy_paths
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
from fsdp.checkpoints.save_load import latest_checkpoint, load_checkpoint, save_checkpoint
from fsdp.ddp.data_parallel import DistributedDataParallel
from fsdp.offload.model import OffloadModel
from fsdp.training.activation_checkpoint import checkpoint_wrapper, disable_checkpointing
from fsdp.training.memory_estimate import MemoryEstimate, estimate_memory, measure_memory
from fsdp.training.optim_in_backward import optimizer_in_backward
from fsdp.training.sharded_grad_scaler import ShardedGradScaler
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
from fsdp.wrapper.fully_sharded import FSDP, FullyShardedDataParallel, get_fsdp_instances
from fsdp.wrapper.norm_wrap import auto_wrap_bn

__all__ = [
    "FSDP",
    "BackwardPrefetch",
    "CPUOffload",
    "DistributedDataParallel",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalStateDictConfig",
    "MemoryEstimate",
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
    "estimate_memory",
    "get_fsdp_instances",
    "lambda_auto_wrap_policy",
    "latest_checkpoint",
    "load_checkpoint",
    "measure_memory",
    "no_split_modules_auto_wrap_policy",
    "optimizer_in_backward",
    "save_checkpoint",
    "transformer_auto_wrap_policy",
    "wrap",
]

__version__ = "0.1.0"

_legacy_paths.install()  # See [Note: legacy module paths]
