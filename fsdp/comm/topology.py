"""Who communicates with whom, and where: sharding strategy, shard / replicate / data-parallel
groups, and the compute device a wrapper picks when none is given.

Resolves fairscale's ``reshard_after_forward`` and torch's ``sharding_strategy`` into one
:class:`~fsdp.api.ShardingStrategy`, and the ``process_group`` argument (a group, a
``(shard, replicate)`` pair for HYBRID_SHARD, or nothing) into the groups a wrapper uses.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import ProcessGroupName, ShardingStrategy
from fsdp.comm.collectives import get_process_group_cached, hybrid_groups
from fsdp.comm.simulation import is_simulating
from fsdp.common.device import default_compute_device, device_available, with_index

__all__ = [
    "ProcessGroups",
    "backend_has_cuda",
    "backend_is_cuda_only",
    "check_hybrid_pair",
    "checked_device",
    "choose_compute_device",
    "group_rank",
    "group_size",
    "is_stand_in",
    "materialize_device",
    "reduce_scatter_group",
    "resolve_groups",
    "resolve_strategy",
]


def resolve_strategy(strategy: Any, reshard_after_forward: bool) -> tuple[ShardingStrategy, bool]:
    """fairscale's ``reshard_after_forward`` and torch's ``sharding_strategy`` as one decision."""
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"FullyShardedDataParallel: `reshard_after_forward` must be a bool, got {reshard_after_forward!r}"
        )
    if strategy is None:
        return (ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP), (
            reshard_after_forward
        )
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(
            f"FullyShardedDataParallel: `sharding_strategy` must be a fsdp.ShardingStrategy, got {strategy!r}"
        )
    if strategy is ShardingStrategy._HYBRID_SHARD_ZERO2:  # HYBRID_SHARD, full parameters kept for backward
        return ShardingStrategy.HYBRID_SHARD, False
    if strategy is ShardingStrategy.FULL_SHARD and not reshard_after_forward:
        raise ValueError(
            "FullyShardedDataParallel: sharding_strategy=FULL_SHARD frees parameters after forward, but "
            "reshard_after_forward=False keeps them: use ShardingStrategy.SHARD_GRAD_OP instead"
        )
    return strategy, reshard_after_forward and strategy is not ShardingStrategy.SHARD_GRAD_OP


class ProcessGroups(NamedTuple):
    """The groups one wrapper communicates over (see CommConfig)."""

    shard: dist.ProcessGroup  # parameters are sharded over it (NO_SHARD: unused)
    shard_size: int
    shard_rank: int
    replicate: dist.ProcessGroup | None  # gradient shards are all-reduced over it
    dp: dist.ProcessGroup  # every rank training the model


def is_stand_in(group: Any) -> bool:
    """Whether ``group`` stands for a process group without being one: an object with ``rank()`` and
    ``size()``, such as fairscale's ``DummyProcessGroup`` (fairseq builds one-rank wrappers with
    ``DummyProcessGroup(rank=0, size=1)``, without ``init_process_group()``)."""
    return (
        group is not None
        and not isinstance(group, (dist.ProcessGroup, tuple, ProcessGroupName))
        and callable(getattr(group, "rank", None))
        and callable(getattr(group, "size", None))
    )


def group_size(group: Any) -> int:
    return int(group.size()) if is_stand_in(group) else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    return int(group.rank()) if is_stand_in(group) else dist.get_rank(group)


def backend_is_cuda_only(group: Any) -> bool:
    """Whether ``group`` can send CUDA tensors only (NCCL alone, with no CPU backend beside it)."""
    return not is_stand_in(group) and str(dist.get_backend(group)).lower() in ("nccl", "cuda:nccl")


def backend_has_cuda(group: Any) -> bool:
    """Whether ``group`` has a CUDA backend (NCCL), alone or beside a CPU one."""
    return not is_stand_in(group) and "nccl" in str(dist.get_backend(group)).lower()


def checked_device(value: Any, name: str, allow_meta: bool = False) -> torch.device | None:
    """``value`` (a device, a string such as ``"cuda:1"``, or None) as a device this process can use
    (the meta device only with ``allow_meta``)."""
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise TypeError(
            f"FullyShardedDataParallel: `{name}` must be a torch.device or a string, got {value!r}"
        ) from e
    if device.type == "meta" and not allow_meta:
        raise ValueError(
            f"FullyShardedDataParallel: `{name}` cannot be the meta device (it holds no values); give a real one, "
            "or leave it unset. A model built on the meta device is materialized on the compute device"
        )
    if not device_available(device):
        raise ValueError(
            f"FullyShardedDataParallel: `{name}`={device} is not available in this process (torch built without "
            "CUDA, no GPU, or an index out of range); leave it unset on a CPU machine"
        )
    return with_index(device)  # (one name per device: tensors on it say cuda:N, never cuda)


def materialize_device(compute_device: Any, params_to_cpu: bool, group: Any) -> torch.device:
    """Where meta parameters materialize: ``compute_device``, else where a CPU-built model would
    compute (:func:`choose_compute_device`), except that NCCL in the group also means CUDA."""
    if is_simulating():  # See [Note: simulated steps]
        return torch.device("meta")
    if compute_device is not None:
        return torch.device(compute_device)
    return default_compute_device({torch.device("cpu")}, prefer_cuda=params_to_cpu or backend_has_cuda(group))


def choose_compute_device(
    compute_device: Any,
    module: nn.Module,
    devices: set[torch.device],
    inner_devices: set[torch.device],
    params_to_cpu: bool,
    group: Any,
) -> torch.device:
    """The wrapper's compute device: ``compute_device``, else where its parameters (or its inner
    wrappers) are; CUDA for CPU parameters under offload or a CUDA-only group (``default_compute_device``)."""
    if len(devices) > 1:
        raise ValueError(
            f"FullyShardedDataParallel: the parameters of {type(module).__name__} are on several devices "
            f"({', '.join(sorted(str(d) for d in devices))}); move the module to one device before wrapping"
        )
    if is_simulating():  # See [Note: simulated steps]
        return torch.device("meta")
    if compute_device is not None:
        return torch.device(compute_device)
    return default_compute_device(devices, inner_devices, params_to_cpu or backend_is_cuda_only(group))


def resolve_groups(strategy: ShardingStrategy, process_group: Any) -> ProcessGroups:
    if is_stand_in(process_group):
        return _stand_in_groups(strategy, process_group)
    world = dist.group.WORLD
    assert world is not None
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if isinstance(process_group, tuple):
            if len(process_group) != 2 or not all(isinstance(g, dist.ProcessGroup) for g in process_group):
                raise TypeError(
                    "FullyShardedDataParallel: HYBRID_SHARD takes process_group=(shard_group, replicate_group)"
                )
            shard, replicate = process_group
            check_hybrid_pair(shard, replicate)
        elif process_group is None:
            local = os.environ.get("LOCAL_WORLD_SIZE")
            if local is None:
                raise ValueError(
                    "FullyShardedDataParallel: HYBRID_SHARD needs process_group=(shard_group, replicate_group), "
                    "or LOCAL_WORLD_SIZE in the environment (set by torchrun) to shard within each node"
                )
            shard, replicate = hybrid_groups(int(local))
        else:
            raise TypeError(
                "FullyShardedDataParallel: HYBRID_SHARD takes process_group=(shard_group, replicate_group)"
            )
        size = dist.get_world_size(shard)
        return ProcessGroups(
            shard,
            size,
            dist.get_rank(shard),
            replicate if dist.get_world_size(replicate) > 1 else None,
            world,
        )
    if isinstance(process_group, tuple):
        raise TypeError(
            "FullyShardedDataParallel: a (shard_group, replicate_group) pair needs sharding_strategy=HYBRID_SHARD"
        )
    group = process_group if process_group is not None else world
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"FullyShardedDataParallel: this rank ({dist.get_rank()}) is not a member of process_group; give "
            "every rank a group it belongs to (dist.new_group on every rank, then each rank passes its own)"
        )
    if strategy is ShardingStrategy.NO_SHARD:
        return ProcessGroups(group, 1, 0, group if dist.get_world_size(group) > 1 else None, group)
    return ProcessGroups(group, dist.get_world_size(group), dist.get_rank(group), None, group)


def _stand_in_groups(strategy: ShardingStrategy, group: Any) -> ProcessGroups:
    """The groups of a wrapper built with a stand-in (see :func:`is_stand_in`): its ``rank()`` and
    ``size()`` say which shard this rank keeps. Of one rank, the wrapper never communicates; of more,
    it is built (sharded) for that rank and must be given the real group (``model.process_group =
    group`` on every wrapper, as fairscale's tests do) before anything communicates."""
    size, rank = group_size(group), group_rank(group)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(
            f"FullyShardedDataParallel: the stand-in process group says rank {rank} of {size}; give a rank in "
            "[0, size) and a size of at least 1"
        )
    if strategy is ShardingStrategy.HYBRID_SHARD:
        raise TypeError(
            "FullyShardedDataParallel: HYBRID_SHARD takes process_group=(shard_group, replicate_group) of real "
            "torch.distributed groups, not a stand-in with rank() and size()"
        )
    if strategy is ShardingStrategy.NO_SHARD:
        return ProcessGroups(group, 1, 0, group if size > 1 else None, group)
    return ProcessGroups(group, size, rank, None, group)


def check_hybrid_pair(shard: dist.ProcessGroup, replicate: dist.ProcessGroup) -> None:
    """Refuse a ``(shard, replicate)`` pair that cannot be a grid over the world, from what this
    rank sees alone; :func:`~fsdp.comm.consistency.check_hybrid_grids` completes the check across ranks."""
    me, world = dist.get_rank(), dist.get_world_size()
    if dist.get_rank(shard) < 0 or dist.get_rank(replicate) < 0:
        raise ValueError(
            f"FullyShardedDataParallel: this rank ({me}) is not a member of both groups of process_group="
            "(shard_group, replicate_group); give each rank the pair of groups it belongs to"
        )
    shard_ranks, replicate_ranks = (
        dist.get_process_group_ranks(shard),
        dist.get_process_group_ranks(replicate),
    )
    if set(shard_ranks) & set(replicate_ranks) != {me}:
        raise ValueError(
            f"FullyShardedDataParallel: the shard group {shard_ranks} and the replicate group {replicate_ranks} "
            f"of rank {me} must have only this rank in common (the replicate group holds one rank of each shard "
            "group: the ranks that keep the same shard)"
        )
    if len(shard_ranks) * len(replicate_ranks) != world:
        raise ValueError(
            f"FullyShardedDataParallel: HYBRID_SHARD groups of {len(shard_ranks)} (shard) x {len(replicate_ranks)} "
            f"(replicate) ranks must cover the world of {world} ranks; hybrid sharding over part of the world is "
            "not supported (give every rank a pair, or use FULL_SHARD with process_group=<your ranks>)"
        )


def reduce_scatter_group(group: dist.ProcessGroup, option: Any, world_size: int) -> dist.ProcessGroup:
    if option is None or option == ProcessGroupName.default or is_stand_in(group):
        return group  # (a stand-in's reductions go over whatever group replaces it)
    if option == ProcessGroupName.reduce_scatter:
        return get_process_group_cached(group, "reduce_scatter")
    if isinstance(option, dist.ProcessGroup):
        if dist.get_world_size(option) != world_size:
            raise ValueError(
                f"FullyShardedDataParallel: process_group_reduce_scatter has {dist.get_world_size(option)} ranks but "
                f"process_group has {world_size}; pass a group with the same ranks"
            )
        return option
    raise TypeError(
        "FullyShardedDataParallel: process_group_reduce_scatter must be a ProcessGroup or a ProcessGroupName, "
        f"got {option!r}"
    )
