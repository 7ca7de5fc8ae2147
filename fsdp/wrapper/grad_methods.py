"""The wrapper's gradient methods, mixed into it: ``no_sync()`` and ``clip_grad_norm_()``.

Both act on the whole tree through the root's context: ``no_sync()`` turns its reductions off while
gradients accumulate locally (See [Note: no_sync] in fsdp/core/handle_grads.py), ``clip_grad_norm_()`` scales
every gradient shard by one factor from their global norm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import torch

from fsdp.api import TrainingState
from fsdp.comm.consistency import collective
from fsdp.common.guards import unsynced
from fsdp.core.wrapper_protocol import WrapperMixin
from fsdp.wrapper.clip_grad import clip_grad_norm_

__all__ = ["GradientMethods"]


class GradientMethods(WrapperMixin):
    """``no_sync()`` and ``clip_grad_norm_()``, called on the root."""

    @contextlib.contextmanager
    def no_sync(self, keep_full_params: bool = False) -> Generator[None, None, None]:
        """Accumulate gradients over several backward passes without reducing them (on the root).

        The first backward after the context reduces the sum once: k micro-batches equal one
        k-times larger batch. Full parameters follow ``reshard_after_forward`` as outside (as in
        fairscale); ``keep_full_params=True`` keeps every unit's, so nothing is communicated after
        the first micro-batch. See [Note: no_sync].
        """
        if not isinstance(keep_full_params, bool):
            raise TypeError(
                f"FullyShardedDataParallel.no_sync: keep_full_params must be a bool, got {keep_full_params!r}"
            )
        self._require_root("no_sync()")
        ctx = self._ctx
        assert ctx is not None
        for w in ctx.wrappers:
            w.assert_state(TrainingState.IDLE)
        previous = ctx.sync, ctx.keep_full
        ctx.sync, ctx.keep_full = False, keep_full_params
        try:
            with unsynced(self, (h.flat_param for w in ctx.wrappers for h in w.handles)):
                yield
        finally:
            ctx.sync, ctx.keep_full = previous

    @collective("clip_grad_norm_()", agreed=("max_norm", "norm_type"))
    def clip_grad_norm_(self, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model by their global norm; return that norm.

        Call it on the root after backward, on every rank. The norm is computed over every rank's
        gradient shards (one all-reduce over the data-parallel group; replicas counted once, expert
        units on smaller groups once per rank that holds them), so it is identical on all ranks and
        equal to ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. Ignored parameters count
        once, with this rank's gradients (they are not reduced).
        """
        self._require_root("clip_grad_norm_()")
        ctx = self._ctx
        assert ctx is not None
        self.assert_state(TrainingState.IDLE)
        if not ctx.sync:
            raise RuntimeError(
                "FullyShardedDataParallel: clip_grad_norm_() inside no_sync(): the accumulated gradients are not "
                "reduced yet, so there is nothing to clip; call it after the backward outside no_sync()"
            )
        handles = [h for w in ctx.wrappers for h in w.handles if h.requires_grad]
        if any(h.on_reduced is not None for h in handles):
            raise RuntimeError(
                "FullyShardedDataParallel: clip_grad_norm_() with an optimizer in backward (fsdp.optimizer_in_backward "
                "or torch's _apply_optimizer_in_backward): each unit's shard "
                "was already updated in backward, before the last gradient (and so the global norm) existed. "
                "Clip with a usual optimizer (backward(); clip_grad_norm_(); optimizer.step())"
            )
        ignored = {id(p): p for w in ctx.wrappers for p in w._ignored.tensors() if p.requires_grad}
        group, device = self.fsdp_config.comm.dp_group, self.compute_device
        return clip_grad_norm_(
            handles, float(max_norm), float(norm_type), device, ctx.stats, [*ignored.values()], group
        )

    def _require_root(self, what: str) -> None:
        if self._is_root is None and not self._inside_another:
            self._lazy_init()
        if not self._is_root:
            raise RuntimeError(
                f"FullyShardedDataParallel: {what} should only be called on the root FSDP instance (the outermost "
                "wrapper), not on an inner one: it acts on the whole model"
            )
