"""The wrapper's statistics methods, mixed into it: collectives counted and unshard memory.

The counters live in the root's context (``fsdp.comm.collectives.CommStats`` and
``fsdp.core.handle.MemoryStats``), shared by every wrapper of the tree; these methods read and reset them.
"""

from __future__ import annotations

from typing import Any

from fsdp.comm.collectives import CommStats
from fsdp.core.handle import FlatParamHandle
from fsdp.core.wrapper_protocol import WrapperMixin

__all__ = ["StatsMethods"]


class StatsMethods(WrapperMixin):
    """``comm_stats()``, ``memory_stats()`` and their resets."""

    def comm_stats(self) -> dict[str, dict[str, Any]]:
        """Collective calls, elements and bytes of the whole tree since the last reset."""
        return (self._ctx.stats if self._ctx is not None else CommStats()).as_dict()

    def reset_comm_stats(self) -> None:
        if self._ctx is not None:
            self._ctx.stats.reset()

    def memory_stats(self) -> dict[str, int]:
        """This rank's bytes in the whole tree: shards and their gradients, the full parameters,
        and the buffers allocated to unshard, now and at the peak since the last reset (before the
        root's first forward nothing is counted: both are the bytes held now)."""
        handles = self._tree_handles()
        full = [h.spec.padded_numel * h.compute_dtype.itemsize for h in handles]
        shards = [h.sharded_data() for h in handles]
        grads = [h.flat_param.grad for h in handles if h.flat_param.grad is not None]
        memory = self._ctx.memory if self._ctx is not None else None
        held = sum(h.unshard_bytes() for h in handles)
        return {
            "sharded_params": sum(t.numel() * t.element_size() for t in shards),
            "sharded_grads": sum(g.numel() * g.element_size() for g in grads),
            "full_params": sum(full),
            "largest_unit": max(full, default=0),
            "unsharded": memory.current if memory is not None else held,
            "unsharded_peak": memory.peak if memory is not None else held,
        }

    def reset_memory_stats(self) -> None:
        """Start the peak of ``memory_stats()["unsharded_peak"]`` over from the current value."""
        if self._ctx is not None:
            self._ctx.memory.reset()

    def _tree_handles(self) -> list[FlatParamHandle]:
        wrappers = self._ctx.wrappers if self._ctx is not None else self._wrappers()
        return [h for w in wrappers for h in w.handles]
