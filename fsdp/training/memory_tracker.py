"""A rank's live tensors over a step by what they are for, in the categories of torch's FSDP2 tracker.

[Note: memory categories]
torch's ``MemTracker`` follows every tensor storage a step allocates (a dispatch mode, plus
``resize_``), but knows only parameters, gradients, optimizer state, and, for anything else,
whether it appeared in forward (activation) or backward (temporary). Our gathered parameters would
count as activations, full gradients and reduction buffers as temporaries. :class:`WrapperMemTracker`
is torch's ``FSDPMemTracker`` (whose categories are those of FSDP2's units) told about our tensors:

- ``Sharded Param``: each handle's shard; ``Unsharded Param``: its full buffers (the compute-dtype
  one and, under mixed precision, the full-precision one a summon fills; their storage is freed and
  re-allocated in place, and the tracker follows ``resize_``); ``All Gather``: the compute-dtype copy
  of the shard sent by the all-gather (mixed precision, offload);
- ``Unsharded Grad``: a unit's full gradient from the moment the post-backward hook sees it;
  ``Reduce Scatter``: the gradient handed to the reduction (a cast or contiguous copy of it) and what
  the reduction allocates; ``Sharded Grad``: the reduced shard set on the flat parameter (and the
  gradients on the shards when the step begins);
- ``Optstate``: the optimizer's state and what its step allocates, also a step inside backward
  (``optimizer_in_backward``); ``Buffer``, ``Activation``, ``Temp`` (other tensors of backward:
  gradients of activations), ``Inputs`` as torch counts them.

The wrapper tells the tracker through ``fsdp.common.memory_tags`` (one attribute check per call
when no tracker is installed). Tensors made before the tracker is entered and not named above (a
user's own tensors) are not counted, as with torch's trackers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _FSDPState
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.weak import WeakIdKeyDictionary

from fsdp.common import memory_tags
from fsdp.core.handle import FlatParamHandle

__all__ = ["WrapperMemTracker"]

_KINDS = {
    memory_tags.UNSHARDED_GRAD: _FSDPRefType.UNSHARDED_GRAD,
    memory_tags.REDUCE_SCATTER: _FSDPRefType.REDUCE_SCATTER,
    memory_tags.SHARDED_GRAD: _FSDPRefType.SHARDED_GRAD,
}


class WrapperMemTracker(FSDPMemTracker):  # type: ignore[no-untyped-call]
    """torch's ``FSDPMemTracker`` for a model wrapped by this library. See [Note: memory categories].

    Use it as torch's: ``with WrapperMemTracker(model, optimizer) as t: step()``, then
    ``t.get_tracker_snapshot("peak")`` (per device, categories to bytes, with ``"Total"``)."""

    def __init__(self, mod: nn.Module, optm: torch.optim.Optimizer | None = None) -> None:
        MemTracker.__init__(self)  # (not FSDPMemTracker's: it accepts FSDP2 modules only)
        self._root_mod = mod  # type: ignore[assignment]  # (any module here)
        self._optm = optm
        self._fsdp_mod_to_saved_methods = WeakIdKeyDictionary()
        # never a state in which torch's tracker reclassifies collective buffers by FSDP2's phases
        self._fsdp_state = _FSDPState.FW
        self._ref_class = _FSDPRefType
        self._observing: Any = None

    def _handles(self) -> list[FlatParamHandle]:
        from fsdp.wrapper.base import get_fsdp_instances

        return [h for w in get_fsdp_instances(self._root_mod) for h in w.handles]

    def _mark(self, t: torch.Tensor | None, reftype: _FSDPRefType) -> None:
        if t is not None:
            self._update_and_maybe_create_winfos(t, reftype, update_existing=False)

    def _observe(self, t: torch.Tensor | None, kind: str, begins: bool) -> None:
        if kind == memory_tags.OPTIMIZER_STEP:
            self._in_opt = begins
        elif t is not None:
            self._mark(t, _KINDS[kind])

    def _register_module_and_optimizer_hooks(self) -> None:
        flat = set()
        for h in self._handles():
            flat.add(id(h.flat_param))
            self._mark(h._shard, _FSDPRefType.SHARDED_PARAM)
            if not h.aliased:
                self._mark(h._full, _FSDPRefType.UNSHARDED_PARAM)
            self._mark(h._full_precision, _FSDPRefType.UNSHARDED_PARAM)
            self._mark(h._lp_shard, _FSDPRefType.ALL_GATHER)
            self._mark(h.flat_param.grad, _FSDPRefType.SHARDED_GRAD)
        for p in self._root_mod.parameters():  # (parameters no wrapper manages: whole on every rank)
            if id(p) not in flat:
                self._mark(p, _FSDPRefType.UNSHARDED_PARAM)
                self._mark(p.grad, _FSDPRefType.UNSHARDED_GRAD)
        for b in self._root_mod.buffers():
            self._mark(b, _FSDPRefType.BUFFER)
        self._instrument_optimizer()
        self._observing = memory_tags.observing(self._observe)
        self._observing.__enter__()

    def _deregister_module_and_optimizer_hooks(self) -> None:
        if self._observing is not None:
            self._observing.__exit__(None, None, None)
            self._observing = None
        super()._deregister_module_and_optimizer_hooks()
