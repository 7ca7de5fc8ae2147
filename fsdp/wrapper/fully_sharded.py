"""FullyShardedDataParallel: the public wrapper class and its construction.

One wrapper owns the flat parameters (:class:`~fsdp.core.handle.FlatParamHandle`) of the parameters of
its module that no inner wrapper owns. This module builds it (options, flattening, sharding, handles)
and forwards attributes to the wrapped module; what runs in a training step (the state machine, lazy
init, forward and the backward hooks) is :class:`~fsdp.wrapper.base.WrapperBase`, which it derives
from, with the lifecycle of one step in its module docstring.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import (
    MixedPrecision,
    ProcessGroupName,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
    TrainingState,
)
from fsdp.comm.collectives import broadcast_from_first_rank
from fsdp.comm.consistency import (
    WRAPPED,
)
from fsdp.common.guards import claim_modules, mark_flattened
from fsdp.common.torch_compile import run_eagerly_under_compile
from fsdp.core.flat_param import (
    group_params,
)
from fsdp.core.handle import FlatParamHandle
from fsdp.core.layout import UnitSpec, describe
from fsdp.wrap.policies import AutoWrapPolicy
from fsdp.wrapper.base import _LIVE, WrapperBase, _is_wrapper, get_fsdp_instances
from fsdp.wrapper.construct import Prepared, build_config, prepare_module
from fsdp.wrapper.fairscale_attrs import FlattenParamsLevel, is_expert
from fsdp.wrapper.mixed_precision import move_owned_buffers
from fsdp.wrapper.shared_params import adopt_tied
from fsdp.wrapper.state_methods import StateDictMethods
from fsdp.wrapper.summon_methods import SummonMethods
from fsdp.wrapper.torch_compat import (
    torch_options_of,
)
from fsdp.wrapper.torch_methods import InstanceOrStatic, TorchFSDPMethods

__all__ = ["FSDP", "FullyShardedDataParallel", "get_fsdp_instances"]

log = logging.getLogger(__name__)


class FullyShardedDataParallel(WrapperBase):
    """Shard a module's parameters over a process group; gather them just in time for compute.

    Drop-in for ``fairscale.nn.FullyShardedDataParallel``: the constructor takes the same keyword
    arguments with the same defaults, then torch-FSDP's ``sharding_strategy``. Invalid combinations
    raise ``ValueError`` / ``TypeError`` that say what to change.

    Args:
        module: the module to wrap. Inner wrappers may sit anywhere inside it.
        process_group: the group to shard over (default: the world).
        process_group_reduce_scatter: ``ProcessGroupName.reduce_scatter`` (default) gives
            gradient reductions their own group with the same ranks; ``ProcessGroupName.default``
            reuses ``process_group``; or pass a group of the same size.
        reshard_after_forward: free full parameters after forward and re-gather them in backward.
        disable_reshard_on_root: the root keeps its full parameters from forward to backward.
        flatten_parameters: one flat parameter per (requires_grad, dtype) group; False shards every
            parameter on its own.
        compute_device: where compute runs; default: where the parameters are (CPU parameters with
            ``move_params_to_cpu`` or an NCCL-only group: the current CUDA device if any).
        state_dict_device: where ``state_dict()`` values go; default: the CPU under
            ``move_params_to_cpu``, else the compute device.
        state_dict_on_rank_0_only: rank 0 receives the full state dict, other ranks an empty one.
        gradient_predivide_factor: divide gradients by this before the reduction and by
            ``world_size / factor`` after it (default: fairscale's choice, see
            :func:`fsdp.api.default_gradient_predivide_factor`).
        allow_reset_parameters: let ``reset_parameters()`` reach the wrapped module.
        ignored_modules, ignored_states: torch FSDP1's; modules (and their descendants) or parameters
            left unmanaged: regular parameters under their names, never sharded, reduced or cast.
        verbose: a more detailed ``repr``.
    """

    # torch FSDP1's static functions where fairscale has methods of the same names: the class's are
    # torch's (any model), an instance's fairscale's (see fsdp/wrapper/torch_methods.py)
    summon_full_params = InstanceOrStatic(SummonMethods.summon_full_params, TorchFSDPMethods._summon_any)
    sharded_optim_state_dict = InstanceOrStatic(
        StateDictMethods.sharded_optim_state_dict, TorchFSDPMethods._sharded_optim_state_dict_any
    )

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        process_group_reduce_scatter: Any = ProcessGroupName.reduce_scatter,
        reshard_after_forward: bool = True,
        disable_reshard_on_root: bool = True,
        mixed_precision: bool | MixedPrecision = False,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
        compute_dtype: torch.dtype | None = None,
        buffer_dtype: torch.dtype | None = None,
        move_grads_to_cpu: bool | None = None,
        bucket_cap_mb: int = 25,
        compute_device: torch.device | None = None,
        no_broadcast_optim_state: bool | None = False,
        state_dict_device: torch.device | None = None,
        clear_autocast_cache: bool = False,
        force_input_to_fp32: bool = False,
        verbose: bool = False,
        cpu_offload: bool = False,
        state_dict_on_rank_0_only: bool = False,
        gradient_predivide_factor: float | None = None,
        allow_reset_parameters: bool = False,
        sharding_strategy: ShardingStrategy | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        backward_prefetch: bool = True,
        forward_prefetch: bool | None = None,
        limit_all_gathers: bool = True,
        auto_wrap_policy: AutoWrapPolicy | None = None,
        sync_module_states: bool = False,
        device_id: int | torch.device | None = None,
        use_orig_params: bool = False,
        ignored_modules: Iterable[nn.Module] | None = None,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
    ) -> None:
        options = {k: v for k, v in locals().items() if k not in ("self", "module", "__class__")}
        super().__init__()
        self._tstart = time.time()  # fairscale's clock of _print_r0
        run_eagerly_under_compile()  # See [Note: torch.compile]
        self._frozen = False
        # Every option is checked and agreed by the ranks before anything is wrapped or materialized.
        plan = build_config(module, options, _is_wrapper)
        prepared = prepare_module(module, plan, FullyShardedDataParallel, _LIVE, options)
        self.fsdp_config = config = dataclasses.replace(plan.config, compute_device=prepared.device)
        dp_group, device = plan.groups.dp, prepared.device
        if sync_module_states:  # rank 0's values, before sharding (after a deferred init)
            broadcast_from_first_rank([p for _, p in prepared.owned], dp_group, device, "parameters")
        self._fsdp_wrapped_module = module
        self._outer = None
        self._flatten_and_shard(prepared)
        self._ignored = plan.ignored
        self._paths_at_wrap = frozenset(prepared.module_of)
        self._torch_options = torch_options_of(options)
        # Original dtypes of the owned buffers: the state dict restores them (fp32 under mixed precision).
        self._buffer_dtypes = move_owned_buffers(
            module,
            device,
            config.precision.buffer_dtype,
            lambda m: _is_wrapper(m) or plan.ignored.has_module(m),
        )
        if sync_module_states:
            buffers = [module.get_buffer(name) for name in self._buffer_dtypes]
            broadcast_from_first_rank(buffers, dp_group, device, "buffers")
        self.training_state = TrainingState.IDLE
        self._own_ctx = self._ctx_ref = None
        self._state_dict_settings = StateDictSettings(StateDictType.FULL_STATE_DICT)
        self._is_root = None
        self._reshard_after_forward = config.sharding.reshard_after_forward
        self._pre_backward_done = False
        self._hook_direct_calls(
            _is_wrapper
        )  # See [Note: calls past the wrapper] in fsdp/wrapper/direct_call.py
        for _, w in prepared.inner:  # last: a constructor that raised leaves its inner wrappers free
            w._outer = weakref.ref(self)  # (before any forward: checkpoints refuse an inner wrapper)
        _LIVE.add(self)

    def _flatten_and_shard(self, prepared: Prepared) -> None:
        """Flatten and shard the parameters this wrapper owns (and those it adopts from ties across
        wrappers) into its handles, and record the originals."""
        # See [Note: parameters shared across wrappers] in fsdp/wrapper/shared_params.py (last before flattening:
        # it rebuilds inner wrappers, so every check that can refuse this wrapper has passed)
        module, module_of, inner = self._fsdp_wrapped_module, prepared.module_of, prepared.nested
        self._module_param_order = prepared.param_order
        adopted, originals, orders = adopt_tied(
            self, module, prepared.tied, module_of, inner, _LIVE, _is_wrapper
        )
        owned = [*prepared.owned, *adopted]
        self.handles = []
        self._build_handles(owned, module_of)
        mark_flattened([*prepared.replaced, *owned])
        claim_modules(self, self._module_param_order)
        self._module_param_order.update(orders)  # (modules of inner wrappers showing adopted parameters)
        originals = [*prepared.replaced, *owned, *originals]
        self._original_params = weakref.WeakValueDictionary({id(p): p for _, p in originals})
        self._original_names = {id(p): fqn for fqn, p in reversed(originals)}  # (meta ones: ties found later)

    def _build_handles(self, owned: list[tuple[str, nn.Parameter]], module_of: dict[str, nn.Module]) -> None:
        """Flatten and shard ``owned`` into this wrapper's flat parameters, replacing those it had."""
        for i in range(len(self.handles)):
            del self._parameters[f"flat_param_{i}"]
        config = self.fsdp_config
        self.handles = []
        for entries, shared in group_params(owned, config.sharding.flatten_parameters):
            handle = FlatParamHandle(
                entries,
                shared,
                module_of,
                config.comm,
                config.compute_device,
                config.precision.param_dtype,
                config.precision.reduce_dtype,
                config.offload.params_to_cpu,
            )
            low = config.precision.low_grad_dtype
            handle.low_grad_dtype = (
                low if low not in (None, handle.meta.dtype) and not handle.aliased else None
            )
            self.register_parameter(f"flat_param_{len(self.handles)}", handle.flat_param)
            self.handles.append(handle)
            # See [Note: gradient accumulators] in fsdp/core/grad_hooks.py (every one: a frozen flat parameter
            # may be unfrozen between steps, and hooks nothing until then)
            handle.accumulators.on_accumulated = self._make_post_backward_hook(handle)

    # ------------------------------------------------------------------ module forwarding
    @property
    def module(self) -> nn.Module:
        """The wrapped module (built torch's way), or fairscale's level above it (``FlattenParamsLevel``)."""
        if self._torch_options.torch_style:
            return self._fsdp_wrapped_module
        return cast(nn.Module, FlattenParamsLevel(self._fsdp_wrapped_module))

    def __getattr__(self, name: str) -> Any:
        """Forward missing attributes to the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        """Forward indexing to the wrapped module (e.g. an ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def _register_live(self) -> None:
        _LIVE.add(self)

    @property
    def is_root(self) -> bool | None:
        """True for the wrapper that ran the first forward; None before any forward."""
        return self._is_root

    # ------------------------------------------------------------------ full parameters
    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Divide gradients by ``pre`` before and ``post`` after the reduction (their product: world size)."""
        self.assert_state(TrainingState.IDLE)
        wrappers = self._wrappers() if recursive else [self]
        for w in wrappers:
            comm = dataclasses.replace(
                w.fsdp_config.comm,
                gradient_predivide_factor=float(pre),
                gradient_postdivide_factor=float(post),
            )
            w.fsdp_config = dataclasses.replace(w.fsdp_config, comm=comm)
            for h in w.handles:
                h.comm = comm
        ctx = self._ctx
        if ctx is not None:  # the NO_SHARD bucket engine was built with the old factors
            ctx.make_bucketer(ctx.wrappers[0])

    # ------------------------------------------------------------------ gradient accumulation
    # no_sync() and clip_grad_norm_() are in fsdp/wrapper/grad_methods.py.
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; also drops what ``no_sync()`` accumulated in this subtree."""
        super().zero_grad(set_to_none)
        for w in self._wrappers():
            for h in w.handles:
                h.discard_accumulated_grad()

    # ------------------------------------------------------------------ state dicts
    # The methods are in fsdp/wrapper/state_methods.py; their bodies in fsdp/state/state_dict.py and fsdp/state/optim_state.py.
    def _state_layout(self, root: nn.Module | None = None) -> Any:
        """Where every original parameter and buffer of this wrapper tree lives (a ``fsdp.state.state_dict.Layout``);
        of ``root`` instead, a plain module holding this wrapper, when given (torch's whole-model functions).

        Used by the state-dict and optimizer-state methods (``StateDictMethods``) and by ``fsdp.checkpoints.save_load``.
        Every wrapper must be IDLE.
        """
        root = self if root is None else root
        wrappers = [m for m in root.modules() if isinstance(m, FullyShardedDataParallel)]
        for w in wrappers:
            w.assert_state(TrainingState.IDLE)
            w._adopt_attached(w._fsdp_wrapped_module.__class__.__name__)
        self._require_groups("a state dict or optimizer state")
        units = {
            id(w): UnitSpec(
                w._fsdp_wrapped_module,
                tuple(w.handles),
                w._module_param_order,
                w._buffer_dtypes,
                w.fsdp_config.no_broadcast_optim_state or is_expert(w, self),
                w._ignored,
                w.fsdp_config.sharding.flatten_parameters,
            )
            for w in wrappers
        }
        comm = self.fsdp_config.comm
        assert comm.dp_group is not None
        return describe(root, units, comm.dp_group, comm.dp_world_size, comm.dp_rank, self.compute_device)


FSDP = FullyShardedDataParallel
