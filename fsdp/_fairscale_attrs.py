"""The attributes a fairscale ``FullyShardedDataParallel`` exposes, read from the wrapper's config.

fairscale stores its constructor arguments, resolved, as plain attributes (``model.compute_dtype``,
``model.gradient_postdivide_factor``, ...), and code written for it reads them. Here they are
read-only properties over :class:`~fsdp.api.FSDPConfig`, mixed into the wrapper. Where the
wrapped module has an attribute of the same name (``nn.LSTM.flatten_parameters``, a model's own
``verbose``), that attribute wins, as it did when lookups fell through to the module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import FSDPConfig, ShardingStrategy

__all__ = ["FairscaleAttributes"]


def _option(read: Callable[[Any], Any]) -> property:
    """A read-only fairscale attribute, unless the wrapped module has one of that name."""
    name = read.__name__

    def get(self: Any) -> Any:
        module = self.__dict__.get("_modules", {}).get("_fsdp_wrapped_module")
        if module is not None and hasattr(module, name):
            return getattr(module, name)
        return read(self)

    return property(get, doc=read.__doc__)


class FairscaleAttributes:
    fsdp_config: FSDPConfig
    handles: list[Any]
    _reshard_after_forward: bool

    @property
    def world_size(self) -> int:
        """Ranks that train this model together (all of them, whatever the sharding strategy)."""
        return self.fsdp_config.comm.dp_world_size

    @property
    def rank(self) -> int:
        """This rank's index among :attr:`world_size`."""
        return self.fsdp_config.comm.dp_rank

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.fsdp_config.comm.process_group

    @_option
    def process_group_reduce_scatter(self) -> dist.ProcessGroup:
        return self.fsdp_config.comm.process_group_reduce_scatter

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self.fsdp_config.sharding.strategy

    @property
    def compute_device(self) -> torch.device:
        return self.fsdp_config.compute_device

    @property
    def move_params_to_cpu(self) -> bool:
        return self.fsdp_config.offload.params_to_cpu

    @property
    def move_grads_to_cpu(self) -> bool:
        return self.fsdp_config.offload.grads_to_cpu

    cpu_offload = move_params_to_cpu  # fairscale's older name

    @_option
    def mixed_precision(self) -> bool:
        """Whether parameters are cast for the all-gather and compute."""
        return self.fsdp_config.precision.mixed

    @_option
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward run in (the parameters' own dtype without casting)."""
        dtype = self.fsdp_config.precision.param_dtype
        if dtype is None:
            dtype = self.handles[0].meta.dtype if self.handles else torch.get_default_dtype()
        return dtype

    @_option
    def buffer_dtype(self) -> torch.dtype:
        return self.fsdp_config.precision.buffer_dtype or self.compute_dtype

    @_option
    def fp32_reduce_scatter(self) -> bool:
        precision = self.fsdp_config.precision
        return precision.mixed and precision.reduce_dtype == torch.float32

    @_option
    def force_input_to_fp32(self) -> bool:
        return self.fsdp_config.precision.force_input_to_fp32

    @_option
    def clear_autocast_cache(self) -> bool:
        return self.fsdp_config.precision.clear_autocast_cache

    @_option
    def flatten_parameters(self) -> bool:
        return self.fsdp_config.sharding.flatten_parameters

    @_option
    def reshard_after_forward(self) -> bool:
        """Whether full parameters are freed after forward (the root's decision once it is known)."""
        return self._reshard_after_forward

    @_option
    def disable_reshard_on_root(self) -> bool:
        return self.fsdp_config.sharding.disable_reshard_on_root

    @_option
    def bucket_cap_mb(self) -> float:
        return self.fsdp_config.comm.bucket_cap_mb

    @_option
    def gradient_predivide_factor(self) -> float:
        return self.fsdp_config.comm.gradient_predivide_factor

    @_option
    def gradient_postdivide_factor(self) -> float:
        return self.fsdp_config.comm.gradient_postdivide_factor

    @_option
    def state_dict_device(self) -> torch.device:
        """Where ``state_dict()`` puts its values: the one given, else the CPU under
        ``move_params_to_cpu`` (as fairscale), else the compute device."""
        return self._state_dict_device()

    def _state_dict_device(self) -> torch.device:
        given = self.fsdp_config.state_dict.state_dict_device
        if given is not None:
            return given
        return torch.device("cpu") if self.move_params_to_cpu else self.compute_device

    @_option
    def state_dict_on_rank_0_only(self) -> bool:
        return self.fsdp_config.state_dict.state_dict_on_rank_0_only

    @_option
    def no_broadcast_optim_state(self) -> bool:
        return self.fsdp_config.no_broadcast_optim_state

    @_option
    def allow_reset_parameters(self) -> bool:
        return self.fsdp_config.allow_reset_parameters

    @_option
    def verbose(self) -> bool:
        return self.fsdp_config.verbose

    @property
    def params(self) -> list[nn.Parameter]:
        """This wrapper's own flat parameters (fairscale name)."""
        return [h.flat_param for h in self.handles]

    def non_shared_params(self) -> list[nn.Parameter]:
        """fairscale: the parameters not shared with another wrapper; here every one of ``params``
        (a parameter tied across wrappers is refused at construction)."""
        return self.params

    @_option
    def numel_padded_per_param(self) -> list[int]:
        """Padding elements in this rank's shard of each flat parameter (fairscale name)."""
        return [h.spec.chunk - h.spec.valid for h in self.handles]

    @_option
    def params_with_grad(self) -> list[nn.Parameter]:
        """``[p for p in self.parameters() if p.grad is not None]``"""
        assert isinstance(self, nn.Module)
        return [p for p in self.parameters() if p.grad is not None]
