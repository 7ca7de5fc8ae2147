"""Building a wrapper, in the order its constructor runs.

1. :func:`build_config`: every constructor option checked, agreed by the ranks and resolved into one
   :class:`~fsdp.api.FSDPConfig`, before the module is touched.
2. :func:`prepare_module`: torch's ``auto_wrap_policy`` wraps the children, a unit built on the meta
   device is materialized (``param_init_fn`` / ``reset_parameters``), and the parameters the new
   wrapper owns are found, with its compute device.
3. The wrapper flattens them (grouped by requires_grad and dtype) and shards each group: one
   :class:`~fsdp.core.handle.FlatParamHandle` per flat parameter (``FullyShardedDataParallel._flatten_and_shard``).

A constructor that raises leaves the module as it was: step 1 changes nothing, and step 2 wraps and
materializes only once every option (of the children's wrappers too) passed step 1's checks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import (
    CommConfig,
    FSDPConfig,
    OffloadConfig,
    ScheduleConfig,
    ShardingConfig,
    ShardingStrategy,
    StateDictConfig,
    default_gradient_predivide_factor,
)
from fsdp.comm.consistency import agree_on_construction
from fsdp.comm.topology import (
    ProcessGroups,
    checked_device,
    choose_compute_device,
    group_rank,
    group_size,
    is_stand_in,
    materialize_device,
    reduce_scatter_group,
    resolve_groups,
    resolve_strategy,
)
from fsdp.core.flat_param import IgnoredStates, collect_owned, own_parameters
from fsdp.core.wrapper_protocol import Wrapper
from fsdp.wrapper.mixed_precision import resolve_precision
from fsdp.wrapper.torch_compat import (
    resolve_ignored,
    torch_fsdp_options,
    without_own_precision,
    wrap_children_with_policy,
)

__all__ = ["Plan", "Prepared", "build_config", "prepare_module"]

Params = list[tuple[str, nn.Parameter]]  # (name under the wrapped module, parameter)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What :func:`build_config` resolved, before the module is touched."""

    config: FSDPConfig  # every option; compute_device: where meta parameters materialize
    groups: ProcessGroups  # the shard / replicate / data-parallel groups
    ignored: IgnoredStates  # ignored_modules / ignored_states. See [Note: ignored modules]
    compute_device: torch.device | None  # as given (None: where the parameters are)
    inner: list[tuple[str, Wrapper]]  # the outermost wrappers already inside the module, by name


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """What :func:`prepare_module` found: the parameters a new wrapper owns, ready to be flattened."""

    owned: Params  # the parameters it flattens
    module_of: dict[str, nn.Module]  # its modules by name (ignored ones and inner wrappers' left out)
    inner: list[tuple[str, Any]]  # the outermost wrappers inside it, by name (collect_owned)
    nested: list[Wrapper]  # every wrapper inside it
    replaced: Params  # the meta parameters that materialization replaced (empty if none)
    tied: Params  # names in its modules of parameters another wrapper owns, with the owner's parameter
    param_order: dict[nn.Module, list[str]]  # parameter order of the modules holding owned or tied ones
    device: torch.device  # the compute device


def build_config(module: nn.Module, options: dict[str, Any], is_wrapper: Callable[[nn.Module], bool]) -> Plan:
    """Check the constructor's ``options`` (its keyword arguments by name) for wrapping ``module``,
    agree on them with the other ranks, and resolve them into one config. Collective (the handshake);
    changes nothing: a mistake raises ``TypeError`` / ``ValueError`` before anything is wrapped or
    materialized."""
    _check_can_wrap(module, options)
    (
        sharding_strategy,
        mixed_precision,
        cpu_offload,
        (prefetch_pre, prefetch_post),
        compute_device,
        flatten_parameters,
    ) = torch_fsdp_options(
        options["sharding_strategy"],
        options["mixed_precision"],
        options["cpu_offload"],
        options["backward_prefetch"],
        options["device_id"],
        options["use_orig_params"],
        options["compute_device"],
        options["flatten_parameters"],
    )
    # See [Note: ignored modules]
    ignored = resolve_ignored(module, options["ignored_modules"], options["ignored_states"], is_wrapper)
    offload = OffloadConfig.from_flags(
        options["move_params_to_cpu"], cpu_offload, options["move_grads_to_cpu"]
    )
    compute_device = checked_device(compute_device, "compute_device")
    state_dict_device = checked_device(options["state_dict_device"], "state_dict_device", allow_meta=True)
    strategy, reshard_after_forward = resolve_strategy(sharding_strategy, options["reshard_after_forward"])
    agree_on_construction(module, {  # before any group is made. See [Note: agreement before communication]
        **options, "sharding_strategy": strategy, "reshard_after_forward": reshard_after_forward,
        "mixed_precision": mixed_precision, "flatten_parameters": flatten_parameters,
        "compute_device": compute_device, "move_params_to_cpu": offload.params_to_cpu,
        "backward_prefetch": (prefetch_pre, prefetch_post),
    })  # fmt: skip
    groups = resolve_groups(strategy, options["process_group"])
    rs_group, dp_size, pre = _reduction(groups, strategy, options)
    strategy = _one_rank_strategy(strategy, options["process_group"])  # (the same groups at one rank)
    target = materialize_device(compute_device, offload.params_to_cpu, groups.dp)
    collected, _, inner = collect_owned(module, is_wrapper, ignored)
    if options["auto_wrap_policy"] is not None:
        collected = without_own_precision(
            collected, module, options["auto_wrap_policy"], mixed_precision, ignored
        )
    # every option is validated before a meta unit is materialized (dtypes are known on meta)
    config = FSDPConfig(
        sharding=ShardingConfig(
            reshard_after_forward=reshard_after_forward,
            disable_reshard_on_root=options["disable_reshard_on_root"],
            flatten_parameters=flatten_parameters,
            strategy=strategy,
        ),
        precision=resolve_precision(
            mixed_precision,
            options["compute_dtype"],
            options["buffer_dtype"],
            options["fp32_reduce_scatter"],
            options["force_input_to_fp32"],
            options["clear_autocast_cache"],
            collected,
        ),
        comm=CommConfig(
            process_group=groups.shard,
            process_group_reduce_scatter=rs_group,
            world_size=groups.shard_size,
            rank=groups.shard_rank,
            bucket_cap_mb=float(options["bucket_cap_mb"]),
            gradient_predivide_factor=pre,
            gradient_postdivide_factor=dp_size / pre,
            replicate_group=groups.replicate,
            dp_group=groups.dp,
            dp_world_size=dp_size,
            dp_rank=group_rank(groups.dp),
        ),
        state_dict=StateDictConfig(
            state_dict_device=state_dict_device,
            state_dict_on_rank_0_only=options["state_dict_on_rank_0_only"],
        ),
        compute_device=target,
        offload=offload,
        schedule=ScheduleConfig(
            backward_prefetch=prefetch_pre,
            forward_prefetch=options["forward_prefetch"],
            limit_all_gathers=options["limit_all_gathers"],
            backward_prefetch_post=prefetch_post,
        ),
        no_broadcast_optim_state=bool(options["no_broadcast_optim_state"]),
        allow_reset_parameters=options["allow_reset_parameters"],
        verbose=options["verbose"],
    )
    return Plan(config=config, groups=groups, ignored=ignored, compute_device=compute_device, inner=inner)


def prepare_module(
    module: nn.Module,
    plan: Plan,
    wrapper_cls: type,
    live: Iterable[Wrapper],
    options: dict[str, Any],
) -> Prepared:
    """Make ``module`` ready to be flattened by a new ``wrapper_cls``: torch's ``auto_wrap_policy``
    (in ``options``) wraps its children, a unit built on the meta device is materialized on the
    config's device, and the parameters the new wrapper owns are found (those of ``live`` wrappers,
    or of wrappers inside it, are not), with the compute device it takes from them."""
    is_wrapper: Callable[[nn.Module], bool] = lambda m: isinstance(m, wrapper_cls)  # noqa: E731
    ignored, inner, policy = plan.ignored, plan.inner, options["auto_wrap_policy"]
    if policy is not None:  # torch FSDP's form: the same options for every wrapper built
        # Only now, once every option and every parameter's dtype passed the checks of build_config (those
        # of any child wrapper too): a call that fails leaves the module as it was, not partly wrapped.
        wrap_children_with_policy(module, policy, wrapper_cls, options, ignored)  # (not a subclass's)
        _, _, inner = collect_owned(module, is_wrapper, ignored)
    nested = [w for _, top in inner for w in top._wrappers()]
    for w in nested:  # a param_init_fn calling to_empty(recurse=True) must not wipe inner shards
        w._frozen = True
    # the original parameters other wrappers own, inside this one or alive elsewhere (a tie across wrappers)
    taken = {id(p) for w in [*nested, *live] for p in w._original_params.values()}
    config = plan.config
    try:
        owned, module_of, inner, replaced, tied = own_parameters(
            module, is_wrapper, taken, config.compute_device, options["param_init_fn"], ignored
        )
    finally:
        for w in nested:
            w._frozen = False
    # original parameter order of the modules holding owned or tied parameters (before the ties move)
    owning = {fqn.rpartition(".")[0] for fqn, _ in [*owned, *tied]}
    param_order = {m: list(m._parameters) for name, m in module_of.items() if name in owning}
    device = choose_compute_device(
        plan.compute_device,
        module,
        {p.device for _, p in owned},
        {w.compute_device for _, w in inner},
        config.offload.params_to_cpu,
        plan.groups.dp,
    )
    return Prepared(
        owned=owned,
        module_of=module_of,
        inner=inner,
        nested=nested,
        replaced=replaced,
        tied=tied,
        param_order=param_order,
        device=device,
    )


def _check_can_wrap(module: nn.Module, options: dict[str, Any]) -> None:
    """What must hold before anything else is looked at: a module, torch.distributed, a real group
    for ``sync_module_states``."""
    process_group, sync_module_states = options["process_group"], options["sync_module_states"]
    if not isinstance(module, nn.Module):
        raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
    if not (dist.is_available() and (dist.is_initialized() or is_stand_in(process_group))):
        raise RuntimeError(
            "FullyShardedDataParallel needs torch.distributed: call "
            "torch.distributed.init_process_group() (e.g. backend='gloo' on CPU, 'nccl' on CUDA) first"
        )
    if not isinstance(sync_module_states, bool):
        raise TypeError(
            f"FullyShardedDataParallel: sync_module_states must be a bool, got {sync_module_states!r}"
        )
    if sync_module_states and is_stand_in(process_group) and group_size(process_group) > 1:
        raise ValueError(
            "FullyShardedDataParallel: sync_module_states=True broadcasts over the process group, but a "
            "stand-in with rank() and size() cannot communicate; pass the real group"
        )


def _one_rank_strategy(strategy: ShardingStrategy, process_group: Any) -> ShardingStrategy:
    """torch FSDP1's rule for a job of one rank: nothing is sharded, so the strategy is ``NO_SHARD``,
    with torch's warning (its tests match its words). At one rank the groups, shards and full
    parameters are the same under every strategy (``resolve_groups``), so only the strategy's name
    changes. A stand-in group (fairseq's one-rank experts) and a ``(shard, replicate)`` pair keep
    the strategy given."""
    if (
        strategy is ShardingStrategy.NO_SHARD
        or isinstance(process_group, tuple)
        or is_stand_in(process_group)
        or dist.get_world_size() != 1
    ):
        return strategy
    warnings.warn(
        f"FullyShardedDataParallel: FSDP is switching to use `NO_SHARD` instead of {strategy} since the world "
        "size is 1.",
        UserWarning,
        stacklevel=4,  # (the constructor's caller: through build_config and __init__)
    )
    return ShardingStrategy.NO_SHARD


def _reduction(
    groups: ProcessGroups, strategy: ShardingStrategy, options: dict[str, Any]
) -> tuple[dist.ProcessGroup, int, float]:
    """The gradient reduction's group (a second group of the same ranks, made here: see
    ``ProcessGroupName.reduce_scatter``), the data-parallel world size, and the factor gradients are
    divided by before the reduction (fairscale's default when none is given)."""
    rs_group = groups.shard
    if groups.shard_size > 1 or strategy is not ShardingStrategy.NO_SHARD:
        rs_group = reduce_scatter_group(
            groups.shard, options["process_group_reduce_scatter"], groups.shard_size
        )
    dp_size = group_size(groups.dp)
    factor = options["gradient_predivide_factor"]
    return rs_group, dp_size, float(factor) if factor else default_gradient_predivide_factor(dp_size)
