"""ShardedGradScaler: loss scaling for sharded gradients, with every rank agreeing on each step.

``torch.amp.GradScaler`` decides from *local* gradients whether a step had an inf/nan. With FSDP
every rank holds only a shard of each gradient, so an overflow may be visible on one rank only;
if that rank skipped the step while the others took it, the ranks' parameters (and scales) would
drift apart. This scaler all-reduces the finding over the process group before anyone reads it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from fsdp.comm.collectives import all_reduce
from fsdp.comm.consistency import SCALER_CHECK, agree_on_entry
from fsdp.common.device import default_compute_device
from fsdp.training.optim_in_backward import any_optimizer_in_backward

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
        if isinstance(device, (int, float)) and not isinstance(device, bool):
            raise TypeError(
                f"ShardedGradScaler: the first argument is the device (torch.amp.GradScaler's order), got "
                f"{device!r}; pass the scale by keyword, init_scale={device!r} (fairscale's first argument)"
            )
        if device is None:
            device = default_compute_device(set()).type  # CUDA when available, else CPU
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.process_group = process_group  # None: the default (world) group

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        """``torch.amp.GradScaler.scale``; refused beside an optimizer that steps in backward."""
        if self.is_enabled() and any_optimizer_in_backward():
            raise RuntimeError(
                "ShardedGradScaler with fsdp.optimizer_in_backward: the step runs inside backward, on the "
                "scaled gradients and before the check for inf/nan that would skip it. Use bf16 (no loss "
                "scaling needed) with optimizer_in_backward, or a usual optimizer with the scaler"
            )
        return super().scale(outputs)

    def _unscale_grads_(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's unscale, with two differences. fp16 gradients are accepted (pure fp16 training).
        And ``inv_scale`` and ``found_inf`` reach gradients on another device (the host, under CPU
        offload) through blocking copies: torch's copies them with ``non_blocking=True``, so from
        CUDA to the host the CPU kernel could read the scale before it arrives, and a late copy of
        ``found_inf = 0`` could overwrite the overflow the kernel found."""
        per_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    grad = p.grad
                    if grad.is_sparse:
                        if grad.dtype is torch.float16:  # fp16 sums of duplicate indices may overflow
                            p.grad = grad = grad.coalesce()
                        grad = grad._values()
                    per_device[grad.device][grad.dtype].append(grad)
            found: dict[torch.device, torch.Tensor] = {}
            for device, per_dtype in per_device.items():
                same = device == found_inf.device
                flag = found_inf if same else torch.zeros_like(found_inf, device=device)
                scale = inv_scale if device == inv_scale.device else inv_scale.to(device)  # blocking
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, scale)
                found[device] = flag
        return found

    def _agree(self, found: dict[torch.device, torch.Tensor]) -> None:
        """Make ``found`` (inf/nan flags per device) the same on every rank: the max over the group."""
        scale = self._scale
        assert scale is not None
        # One tensor per rank whatever devices its gradients are on, so every rank joins one all-reduce.
        total = torch.zeros((), dtype=torch.float32, device=scale.device)
        for value in found.values():
            total += value.to(total.device)
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group is not None and dist.get_world_size(group) > 1:
            agree_on_entry(group, SCALER_CHECK)  # See [Note: agreement before communication]
            all_reduce(total, group, op=dist.ReduceOp.MAX).wait()  # read only after the wait
        for device, value in found.items():
            value.copy_(total.to(device))
        if not found:
            found[total.device] = total

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        super().unscale_(optimizer)
        self._agree(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # the path of optimizers that unscale inside their step (fused Adam): agreed as well
        found: dict[str, Any] = super()._check_inf_per_device(optimizer)
        self._agree(found)  # type: ignore[arg-type]
        return found
