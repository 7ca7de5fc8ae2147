"""``nn.Module`` operations on a wrapped model: ``.half()`` / ``.to()`` / ``.cuda()`` after wrapping.

[Note: conversions after wrapping]
``nn.Module._apply`` (behind ``.half()``, ``.float()``, ``.double()``, ``.to()``, ``.cuda()``,
``.cpu()``) replaces every registered tensor's ``.data``: here the flat parameters, whose data is
this rank's shard between steps, their gradients, and the buffers. A wrapper lets it do so, as
torch FSDP1 does, and then follows (``FlatParamHandle.follow_conversion``): the new tensor is the
shard, its dtype the master dtype, and every buffer derived from it (the full parameter, the
compute-dtype copies) is made again for the new dtype and device. Without mixed precision the
compute dtype follows the master dtype (fairscale's rule), so ``model.half()`` trains in pure fp16
and ``model.double()`` in fp64, as the plain model cast alike; the compute device follows the
shards. The root's context is released, so the next forward sets the tree up again for the new
devices and dtypes (and checks across ranks that every rank converted alike). Buffers follow as in
a plain module; one the wrapper keeps in ``buffer_dtype`` stays in it, and its dtype in the state
dict becomes the converted one. Refused, before anything changes: a conversion during a step
(forward, backward, ``no_sync()``, ``summon_full_params()``), one that changes the master dtype
under mixed precision (masters stay fp32: change ``compute_dtype`` instead), and one that moves
shards CPU offload keeps on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp.api import FSDPConfig, TrainingState
from fsdp.consistency import wrapper_path
from fsdp.grad_hooks import AccumulatorHooks
from fsdp.handle import FlatParamHandle

__all__ = ["ModuleOps"]


def _probe(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, device: torch.device) -> Any:
    """What ``fn`` makes of a tensor of ``dtype`` on ``device``: ``(dtype, device)`` (an empty tensor
    stands in: conversions look at the dtype and device only)."""
    out = fn(torch.empty(0, dtype=dtype, device=device))
    return out.dtype, out.device


class ModuleOps:
    """The wrapper's ``_apply``: conversions after wrapping. See [Note: conversions after wrapping]."""

    # provided by the wrapper
    handles: list[FlatParamHandle]
    fsdp_config: FSDPConfig
    training_state: TrainingState
    _frozen: bool
    _buffer_dtypes: dict[str, torch.dtype]
    _fsdp_wrapped_module: nn.Module
    _parameters: dict[str, Any]
    _ctx: Any

    def _wrappers(self) -> list[Any]:
        raise NotImplementedError

    def _make_post_backward_hook(self, handle: FlatParamHandle) -> Callable[[], None]:
        raise NotImplementedError

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``.half()``, ``.to()``, ``.cuda()``, ... after wrapping. See [Note: conversions after wrapping]."""
        if self._frozen:  # an outer wrapper's deferred initialization is running
            return self
        for w in self._wrappers():  # every check first: a refused conversion changes nothing
            w._check_conversion(fn, self)
        nn.Module._apply(self, fn, recurse)  # type: ignore[arg-type, no-untyped-call]  # (inner wrappers too)
        self._follow_conversion(fn)
        return self

    def _check_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor], caller: Any) -> None:
        changes = False
        for h in self.handles:
            param = h.flat_param
            dtype, device = _probe(fn, param.dtype, param.device)
            if (dtype, device) == (param.dtype, param.device):
                continue
            changes = True
            if device != param.device and h.offloaded:
                raise RuntimeError(
                    f"FullyShardedDataParallel: .to() / .cuda() after wrapping would move the shards of {wrapper_path(caller, self)!r} to "
                    f"{device}, but CPU offload (move_params_to_cpu) keeps them on the host; compute runs on "
                    f"{h.compute_device}. Move the module before wrapping it, or pass compute_device / device_id"
                )
            if dtype != param.dtype and self.fsdp_config.precision.param_dtype is not None:
                raise RuntimeError(
                    f"FullyShardedDataParallel: .half() / .to(dtype) after wrapping would make the master weights of "
                    f"{wrapper_path(caller, self)!r} {dtype}; under mixed precision they stay {param.dtype} and compute runs in "
                    f"{self.fsdp_config.precision.param_dtype}. Change compute_dtype (or MixedPrecision.param_dtype) "
                    "instead, or wrap without mixed precision to train in one dtype"
                )
        module = self._fsdp_wrapped_module
        for name in self._buffer_dtypes:
            b = _buffer(module, name)
            if b is not None and _probe(fn, b.dtype, b.device) != (b.dtype, b.device):
                changes = True
        ctx = self._ctx
        idle = self.training_state is TrainingState.IDLE and (
            ctx is None or ctx.wrappers[0]._context_is_idle()
        )
        if changes and not idle:
            raise RuntimeError(
                f"FullyShardedDataParallel: .half() / .to() / .cuda() on {wrapper_path(caller, self)!r} during a step (its state is "
                f"{self.training_state.name}, or a forward, backward or no_sync() of its tree is not over); "
                "convert the model between steps"
            )

    def _follow_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After ``nn.Module._apply``: the handles adopt the converted shards, the compute device
        follows, buffers kept in ``buffer_dtype`` return to it."""
        config = self.fsdp_config
        device = _probe(fn, torch.float32, config.compute_device)[1]
        changed = device != config.compute_device
        if changed:
            self.fsdp_config = dataclasses.replace(config, compute_device=device)
        for i, h in enumerate(self.handles):
            registered = self._parameters.get(f"flat_param_{i}")
            if registered is not None and registered is not h.flat_param:  # (a conversion that replaces
                h.flat_param = registered  # parameters: torch.__future__'s overwrite option)
                h.accumulators = AccumulatorHooks(registered)
                h.accumulators.on_accumulated = self._make_post_backward_hook(h)
            data, shard = h.flat_param.data, h.sharded_data()
            if (data.dtype, data.device, data.data_ptr()) != (shard.dtype, shard.device, shard.data_ptr()):
                h.follow_conversion(config.precision.param_dtype, device)
                changed = True
        cast_to = config.precision.buffer_dtype
        module = self._fsdp_wrapped_module
        for name, original in self._buffer_dtypes.items():
            b = _buffer(module, name)
            if b is None:
                continue
            converted = _probe(fn, original, b.device)[0]
            if converted != original:
                self._buffer_dtypes[name] = converted
                changed = True
            if cast_to is not None and b.is_floating_point() and b.dtype != cast_to:
                owner, _, attr = name.rpartition(".")
                module.get_submodule(owner)._buffers[attr] = b.to(cast_to)
        ctx = self._ctx
        if changed and ctx is not None:  # the next forward sets the tree up for the new dtypes and devices
            ctx.wrappers[0]._release_context()


def _buffer(module: nn.Module, name: str) -> torch.Tensor | None:
    try:
        return module.get_buffer(name)
    except AttributeError:  # (removed since wrapping)
        return None
