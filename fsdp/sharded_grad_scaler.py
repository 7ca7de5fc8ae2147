"""ShardedGradScaler: loss scaling for sharded gradients, with every rank agreeing on each step.

``torch.amp.GradScaler`` decides from *local* gradients whether a step had an inf/nan. With FSDP
every rank holds only a shard of each gradient, so an overflow may be visible on one rank only;
if that rank skipped the step while the others took it, the ranks' parameters (and scales) would
drift apart. This scaler all-reduces the finding over the process group before anyone reads it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp._device import default_compute_device
from fsdp.collectives import all_reduce

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan check is agreed over ``process_group``.

    Same interface (``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``,
    ``load_state_dict``). ``device`` defaults to CUDA when available, else CPU; gradients may live
    on any device (e.g. on the CPU with offload). fp16 gradients are accepted (pure fp16 mode).

    Postcondition of ``unscale_(optimizer)`` (and so of ``step``): every rank of the group holds the
    same ``found_inf``, so all ranks skip the same steps and ``update()`` leaves the same scale.
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if device is None:
            device = default_compute_device(set()).type  # CUDA when available, else CPU
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.process_group = process_group  # None: the default (world) group

    def _unscale_grads_(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # Pure fp16 training has fp16 gradients; the check and unscale work on them as well.
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        super().unscale_(optimizer)
        state: dict[str, Any] = self._per_optimizer_states[id(optimizer)]
        found: dict[torch.device, torch.Tensor] = state["found_inf_per_device"]
        scale = self._scale
        assert scale is not None
        # One tensor per rank whatever devices its gradients are on, so every rank joins one all-reduce.
        total = torch.zeros((), dtype=torch.float32, device=scale.device)
        for value in found.values():
            total += value.to(total.device)
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group is not None and dist.get_world_size(group) > 1:
            all_reduce(total, group, op=dist.ReduceOp.MAX).wait()  # read only after the wait
        for device, value in found.items():
            value.copy_(total.to(device))
        if not found:
            found[total.device] = total
