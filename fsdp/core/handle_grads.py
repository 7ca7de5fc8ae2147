"""The gradient half of :class:`~fsdp.core.handle.FlatParamHandle`: reduction, accumulation, summoning.

The handle's gradient verbs (``reduce_grad``, ``finalize_gradient``, ``end_backward``, the gradients
shown by ``summon_full_params(with_grads=True)``) are mixed into it from here, with the states they
move through. Every method takes the handle itself (``self``); its attributes are
listed on the class in ``handle.py``.

[Note: gradient stash]
Between steps ``flat_param.grad`` is shard-shaped. During backward autograd accumulates a
full-shaped gradient into ``flat_param.grad``, which requires it to be None or full-shaped.
``prepare_gradient_for_backward`` therefore moves an existing shard gradient to
``_saved_grad_shard``; ``finalize_gradient`` adds the new reduced shard into it, so gradient
accumulation across backward passes (without zero_grad) sums as in a plain model.

[Note: gradient state]
A handle's gradient is in one :class:`GradState` (``grad_state``), changed only by
``_set_grad_state``, which checks the change against ``GRAD_TRANSITIONS``:

    state     the gradient of this backward is                        next
    IDLE      nowhere yet (.grad: the shard gradient, or None)        UNSYNCED, REDUCING, BUCKETED
    UNSYNCED  summed in _grad_acc inside no_sync (in .grad itself     UNSYNCED, REDUCING, BUCKETED,
              when aliased), not reduced                              IDLE (zero_grad() drops it)
    REDUCING  in the reduction _pending: sent, or queued in a bucket  COPYING, REDUCED, IDLE*
    BUCKETED  on .grad (full) for the root's NO_SHARD bucket engine   REDUCED, IDLE*
    COPYING   reduced, on its way to the host (_grad_copy)            REDUCED, IDLE*
    REDUCED   reduced, added into .grad (the shard gradient)          IDLE

The post-backward (``reduce_grad``) leaves IDLE or UNSYNCED: for UNSYNCED inside ``no_sync``, else
for REDUCING, or BUCKETED where the bucket engine reduces. ``finalize_gradient`` (from a later
post-backward, the hook before a gradient concatenation, or the end of backward) goes on to REDUCED,
through COPYING when the shard is offloaded on CUDA: a call during backward leaves the copy in
flight, the end of backward collects it. The end of backward (``end_backward``) returns REDUCED to
IDLE; UNSYNCED stays until a backward outside ``no_sync`` reduces the sum. IDLE*: a backward that
raised before its end (ranks that disagree on what they reduced) drops what it left in flight. A
handle counts as reduced in this backward (``reduced_this_backward``: the end-of-backward check
compares it across ranks, and the post-backward refuses a part of the gradient that comes after
it) in REDUCING, BUCKETED, COPYING and REDUCED. The stash of [Note: gradient stash] is apart from
the state: the pre-backward makes it, and it is added to the reduced shard on the way to REDUCED,
or put back on ``.grad`` at the end of a backward that brought no reduction (IDLE, UNSYNCED).

[Note: finishing reductions early]
A launched reduction holds its full-size gradient (the reduce-scatter's input) until it is waited
for. The post-backward hook waits for the older ones once a newer one is sent, so one stays in
flight while the next unit computes its gradients, and it would stay there through that unit's
gradient peak: its parameters' gradients plus their concatenation into the flat gradient. The
forward therefore hooks the backward of the split that made the parameter views: just before the
concatenation allocates the flat gradient, the hook finishes (waits for) the reductions in flight,
oldest first, freeing their inputs. By then the unit's whole backward has run since they were
sent, so the wait rarely blocks, and the post-backward hook would have waited for them one
concatenation later anyway. On the CPU the reduce-scatter of a few ranks is a point-to-point
exchange that cannot be polled for completion (``fsdp.comm.collectives.reduce_scatter``), which is why
the hook waits rather than polls. A reduction followed by an all-reduce across replicas
(HYBRID_SHARD) is left for the post-backward hook, like a bucket not yet sent: issuing a collective
or sending a bucket from here would change the order of collectives the schedule relies on.

[Note: no_sync]
Inside ``no_sync`` the post-backward hook adds the full gradient into ``_grad_acc`` (the master
dtype) instead of reducing it. The full parameters follow ``reshard_after_forward`` as outside (as
in fairscale and torch FSDP1): a unit that frees them after forward gathers them again for its
backward and frees them after it, the root and ``reshard_after_forward=False`` keep theirs from
forward to the next forward (their validity is tracked by ``flat_param._version``). So a window of
micro-batches holds the shards, one full gradient per unit and the units being computed, and
all-gathers as a plain step does. ``no_sync(keep_full_params=True)`` keeps every unit's full
parameters instead: no collective runs after the first forward, for the memory of the unsharded
model. The first backward outside the context adds its gradient to ``_grad_acc`` and reduces
the sum once, so k micro-batches cost one reduction, exactly like one large batch. The sum is kept in
the master dtype and reduced in the dtype of the gradient it joins (the compute dtype under mixed
precision, unless a reduce dtype is set), so the reduction moves the bytes of any other step.
``zero_grad()`` on the wrapper drops the accumulator, as it drops ``.grad`` in a plain model. So
does an optimizer's ``zero_grad()`` (a window skipped after a bad loss): between backwards inside the
context ``flat_param.grad`` is this rank's chunk of the accumulator, a view (or the shard gradient
from before the context, when one was left); the next backward finds it set to None or zeroed and
drops the accumulator, and refuses any other change, which could not reach the other chunks. A
backward that raised inside the context had taken some units' chunks off ``.grad`` already (before
autograd adds into it); a ``zero_grad()`` after it reaches the others', and the root's next forward
then drops the hidden ones too (``clear_aborted_backward``). When the full
parameter is the shard itself (world size 1, NO_SHARD without casting), autograd accumulates into
``.grad`` directly and nothing needs to be kept. The price is memory: a full gradient per unit
stays allocated inside the context (with ``keep_full_params``, every unit's full parameters too).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import MemoryState, check_transition
from fsdp.comm.collectives import CommStats, Pending, all_gather, all_reduce, reduce_scatter
from fsdp.common import memory_tags
from fsdp.core.flat_param import unflatten_views
from fsdp.core.param_attrs import take_hand_set_grad

if TYPE_CHECKING:  # annotations only: the handle imports this module
    from fsdp.api import CommConfig
    from fsdp.comm.rs_buckets import ReduceScatterBucketer
    from fsdp.common.device import SideCopies
    from fsdp.core.flat_param import FlatParamMeta
    from fsdp.core.handle import MemoryStats
    from fsdp.core.sharding import ShardSpec

__all__ = ["GRAD_TRANSITIONS", "GradState", "HandleGradients"]


class GradState(enum.Enum):
    """Where a handle's gradient is in the current backward. See [Note: gradient state]."""

    IDLE = enum.auto()
    UNSYNCED = enum.auto()
    REDUCING = enum.auto()
    BUCKETED = enum.auto()
    COPYING = enum.auto()
    REDUCED = enum.auto()


_G = GradState
GRAD_TRANSITIONS: dict[GradState, frozenset[GradState]] = {
    _G.IDLE: frozenset({_G.UNSYNCED, _G.REDUCING, _G.BUCKETED}),
    _G.UNSYNCED: frozenset({_G.UNSYNCED, _G.REDUCING, _G.BUCKETED, _G.IDLE}),
    _G.REDUCING: frozenset({_G.COPYING, _G.REDUCED, _G.IDLE}),
    _G.BUCKETED: frozenset({_G.REDUCED, _G.IDLE}),
    _G.COPYING: frozenset({_G.REDUCED, _G.IDLE}),
    _G.REDUCED: frozenset({_G.IDLE}),
}
_REDUCED_THIS_BACKWARD = frozenset({_G.REDUCING, _G.BUCKETED, _G.COPYING, _G.REDUCED})
del _G


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: NaN equals itself and -0.0 differs from 0.0 (``torch.equal`` says otherwise)."""
    return a.dtype == b.dtype and torch.equal(
        a.view(_BITS[a.element_size()]), b.view(_BITS[b.element_size()])
    )


class HandleGradients:
    """The gradient verbs of :class:`~fsdp.core.handle.FlatParamHandle`. See [Note: gradient state]."""

    _grad_copy: tuple[torch.Tensor, object] | None  # COPYING: (host gradient, event) of the copy in flight
    grad_state: GradState  # the gradient's place in this backward: see [Note: gradient state]
    # keep_low_precision_grads: the dtype of .grad after backward (None: the master dtype's)
    low_grad_dtype: torch.dtype | None
    _saved_grad_shard: torch.Tensor | None  # (chunk,) gradient stashed during backward
    _pending: Pending | None  # REDUCING: the reduction of this backward, sent or queued
    _grad_acc: torch.Tensor | None  # UNSYNCED: (padded_numel,) gradients accumulated locally inside no_sync
    # UNSYNCED between backwards: what .grad was left as (this rank's chunk of _grad_acc, or the shard
    # gradient from before), its version, and whether it is the chunk. See [Note: no_sync]
    _acc_shown: tuple[torch.Tensor, int, bool] | None
    _acc_hidden: bool  # the chunk shown was taken off .grad by this backward's pre-backward (still UNSYNCED)
    # called with the handle when its gradient of this backward is REDUCED (fsdp.optimizer_in_backward);
    # the end of backward calls it again once the handle is resharded
    on_reduced: Callable[[Any], None] | None
    # summon(with_grads): (full gradient, shard gradient, the views shown); None outside
    _full_grad: tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor]] | None

    if TYPE_CHECKING:  # the handle's own, declared in handle.py (FlatParamHandle), used here
        meta: FlatParamMeta
        spec: ShardSpec
        comm: CommConfig
        modules: list[nn.Module]
        flat_param: nn.Parameter
        stats: CommStats | None
        memory: MemoryStats
        state: MemoryState
        reduce_dtype: torch.dtype | None
        compute_device: torch.device
        offloaded: bool
        copies: SideCopies | None
        rs_bucketer: ReduceScatterBucketer | None
        _shard: torch.Tensor

        @property
        def aliased(self) -> bool: ...
        @property
        def full_precision_compute(self) -> bool: ...
        @property
        def requires_grad(self) -> bool: ...
        @property
        def shard_device(self) -> torch.device: ...
        def reshard(self, free_full: bool = True) -> None: ...

        linked_views: list[tuple[int, torch.Tensor]]

    # ------------------------------------------------------------------ summon with gradients
    def gather_grad(self) -> None:
        """All-gather the shard gradients into a full flat gradient (master dtype, compute device).
        Collective: a flag first, so that no gradient anywhere shows none, a rank without one adds
        zeros. ``show_grad`` then hangs its views on the shown parameters; ``release_grad`` ends it."""
        assert self._full_grad is None, "gradients gathered twice"
        self._take_back_accumulated_grad()  # (inside no_sync: the gradient from before it is shown)
        if not self.requires_grad:
            self._full_grad = (None, None, [])
            return
        shard_grad = self.flat_param.grad
        whole = self.spec.world_size == 1  # (NO_SHARD's group is every rank: its shard is the whole)
        present = torch.tensor([int(shard_grad is not None)], device=self.compute_device)
        if not whole:
            all_reduce(present, self.comm.process_group, dist.ReduceOp.MAX, self.stats).wait()
        if not present.item():
            self._full_grad = (None, None, [])
            return
        source = self._shard.new_zeros(self._shard.shape) if shard_grad is None else shard_grad
        if whole and shard_grad is not None and shard_grad.dtype == self.meta.dtype and not self.offloaded:
            # the shard gradient is the whole one (NO_SHARD): shown as it is, so an in-place change
            # stays without writeback, as torch's (it shows the same storage)
            self._full_grad = (shard_grad, shard_grad, [])
            return
        full = torch.empty(self.spec.padded_numel, dtype=self.meta.dtype, device=self.compute_device)
        if whole:
            full.copy_(source)
        else:
            source = source.to(self.compute_device, self.meta.dtype)  # (keep_low_precision_grads: low)
            all_gather(full, source, self.comm.process_group, self.stats).wait()
        self.memory.add(full.untyped_storage().size())
        self._full_grad = (full, shard_grad, [])

    def show_grad(self) -> None:
        """Set each shown original parameter's ``.grad`` to its view of the gathered gradient."""
        assert self._full_grad is not None and self.state is MemoryState.UNSHARDED
        full, shard_grad, _ = self._full_grad
        if full is None:
            return
        views = unflatten_views(full, self.meta)
        for info, module, view in zip(self.meta.params, self.modules, views):
            getattr(module, info.param_name).grad = view
        self._full_grad = (full, shard_grad, views)

    def release_grad(self, write_back: bool) -> None:
        """Drop the full gradient; with ``write_back``, this rank's chunk of the gradients the
        parameters show now (changed in place, replaced or set to None) becomes the shard gradient."""
        if self._full_grad is None:
            return
        full, shard_grad, views = self._full_grad
        self._full_grad = None
        if write_back and self.state is MemoryState.UNSHARDED:
            shown = [getattr(m, info.param_name).grad for info, m in zip(self.meta.params, self.modules)]
            if all(g is None for g in shown):
                self.flat_param.grad = None
            elif full is None or any(g is not v for g, v in zip(shown, views, strict=True)):
                # (a gradient replaced or set to None: the chunk is built again from what is shown)
                now = torch.zeros(self.spec.padded_numel, dtype=self.meta.dtype, device=self.compute_device)
                for g, view in zip(shown, unflatten_views(now, self.meta)):
                    if g is not None:
                        view.copy_(g)
                self._write_grad_chunk(now, shard_grad)
            else:
                self._write_grad_chunk(full, shard_grad)
        if full is not None and full is not shard_grad:  # (the shard gradient itself: nothing allocated)
            self.memory.add(-full.untyped_storage().size())

    def _write_grad_chunk(self, full: torch.Tensor, shard_grad: torch.Tensor | None) -> None:
        chunk = full[self.spec.start : self.spec.end].to(self.shard_device)
        if shard_grad is None and not chunk.any():  # (the zeros this rank contributed): still none
            return
        if shard_grad is not None and _same_bits(chunk.to(shard_grad.dtype), shard_grad):
            grad = shard_grad
        elif shard_grad is not None:
            with torch.no_grad():
                grad = shard_grad.copy_(chunk)  # (in its own dtype: low with keep_low_precision_grads)
        else:
            grad = chunk.to(self.low_grad_dtype) if self.low_grad_dtype is not None else chunk.clone()
        # a shard-shaped gradient is assigned to a shard-shaped parameter (it is full-shaped now)
        data, self.flat_param.data = self.flat_param.data, self._shard
        if grad.dtype == self._shard.dtype:
            self.flat_param.grad = grad
        else:  # (keep_low_precision_grads: .data takes a dtype other than the parameter's, .grad = does not)
            self.flat_param.grad = torch.empty_like(self._shard)
            self.flat_param.grad.data = grad
        self.flat_param.data = data

    # ------------------------------------------------------------------ gradients
    def show_accumulated_grad(self) -> None:
        """End of a backward that left the gradient accumulated (UNSYNCED): remember what ``.grad`` is
        now, after setting it to this rank's chunk of the accumulator where it holds none or zeros. See
        [Note: no_sync]."""
        self._acc_hidden = False
        if self.grad_state is not GradState.UNSYNCED or self._grad_acc is None or self._acc_shown is not None:
            return
        grad = self.flat_param.grad
        chunk = self._grad_acc.device == self._shard.device and self.low_grad_dtype is None
        chunk = chunk and (grad is None or not bool(grad.count_nonzero()))  # (zeros add as none would)
        if chunk:
            grad = self.flat_param.grad = self._grad_acc[self.spec.start : self.spec.end]
        if grad is not None:
            self._acc_shown = (grad, grad._version, chunk)

    def _take_back_accumulated_grad(self) -> None:
        """Before ``.grad`` is used again: the chunk shown by :meth:`show_accumulated_grad` leaves it;
        set to None or zeroed since (``zero_grad()``), the accumulator is dropped too."""
        shown = self._acc_shown
        if shown is None:
            return
        tensor, version, chunk = shown
        if self.flat_param.grad is tensor and tensor._version == version:
            self._acc_shown = None
            if chunk:
                self.flat_param.grad = None
                self._acc_hidden = True
            return
        if not self.accumulation_dropped():
            self._acc_shown = None
            raise RuntimeError(
                "FullyShardedDataParallel: a gradient was changed inside no_sync() between two backwards. There "
                "a flat parameter's .grad is this rank's chunk of the gradients accumulated locally, so a change "
                "cannot reach the rest of them; zero_grad() (to None or to zeros) is what works. Change gradients "
                "after the backward outside no_sync(), which reduces them"
            )
        if chunk:  # (zeroed in place: none, which a gradient adds to as to zeros)
            self.flat_param.grad = None
        self.discard_accumulated_grad()

    def chunk_shown_on_grad(self) -> bool:
        """``.grad`` is the view of the accumulator :meth:`show_accumulated_grad` set."""
        shown = self._acc_shown
        return shown is not None and shown[2] and self.flat_param.grad is shown[0]

    def prepare_gradient_for_backward(self) -> None:
        """Stash a shard-shaped ``.grad`` so autograd can accumulate a full one. See [Note: gradient stash]."""
        self._take_back_accumulated_grad()
        grad = self.flat_param.grad
        param = self.flat_param
        if grad is None or (
            grad.shape == param.shape
            and grad.dtype == param.dtype
            and grad.device == param.device
            and self.low_grad_dtype is None
        ):
            return
        assert self._saved_grad_shard is None, "gradient stashed twice in one backward"
        # (left in the reduction dtype after the last backward: summed in the master dtype again)
        self._saved_grad_shard = grad if grad.dtype == self.meta.dtype else grad.to(self.meta.dtype)
        self.flat_param.grad = None

    def reduce_grad(self, sync: bool = True, bucketed: bool = False, keep_full: bool = True) -> None:
        """Launch the reduction of the full gradient; reshard. Runs in the post-backward hook.

        Example, 2 ranks, padded numel 4, full gradients g0 = [1, 2, 3, 4] on rank 0 and
        g1 = [5, 6, 7, 8] on rank 1: after reduce-scatter and division by the world size rank 0
        holds [3, 4] and rank 1 holds [5, 6] (the mean of the ranks' gradients, chunk by chunk).
        With a replicate group (NO_SHARD, HYBRID_SHARD) the shard is then all-reduced across it.

        With ``sync=False`` (inside ``no_sync``) nothing is communicated: the full gradient is added
        to a local accumulator, and the full parameter is kept for the next forward with
        ``keep_full``, else freed. See [Note: no_sync].

        With ``bucketed`` (NO_SHARD under a root that owns a bucket engine) nothing is launched here:
        the gradient is left on ``flat_param.grad`` in the master dtype, for the engine to reduce
        with its neighbours in one bucket; ``finalize_gradient`` then only accumulates.
        """
        grad = self.flat_param.grad
        assert grad is not None and grad.shape == self.flat_param.shape, (
            "post-backward without a full gradient"
        )
        memory_tags.tag(grad, memory_tags.UNSHARDED_GRAD)
        if not sync:
            if not self.aliased:  # aliased: autograd itself accumulates into .grad across backwards
                self.flat_param.grad = None
                acc = grad.to(self.meta.dtype)
                self._grad_acc = acc if self._grad_acc is None else self._grad_acc.add_(acc)
            self._set_grad_state(GradState.UNSYNCED)
            self.reshard(free_full=not keep_full)
            if self._saved_grad_shard is None:  # (shown now: a zero_grad() after a backward that raises
                self.show_accumulated_grad()  # later reaches it; with a stash, at the end of backward)
            return
        self.flat_param.grad = None
        if self._grad_acc is not None:  # the sum is reduced in the dtype a plain backward reduces in
            wire_dtype = self.reduce_dtype or grad.dtype
            grad = self._grad_acc.add_(grad)
            self._grad_acc = None
            if not bucketed:
                grad = grad.to(wire_dtype)
        if bucketed:
            full = grad.to(device=self._shard.device, dtype=self.meta.dtype)
            self.reshard(free_full=True)
            self.flat_param.grad = full  # NO_SHARD: the full gradient is shard-shaped
            self._set_grad_state(GradState.BUCKETED)
            return
        # (e.g. fp32_reduce_scatter: reduce in fp32; a backward computed in full precision, with
        # FSDP_USE_FULL_PREC_IN_EVAL, reduces in it, as torch's)
        if (
            self.reduce_dtype is not None
            and grad.dtype != self.reduce_dtype
            and not self.full_precision_compute
        ):
            grad = grad.to(self.reduce_dtype)
        grad = grad.contiguous()
        memory_tags.tag(grad, memory_tags.REDUCE_SCATTER)
        if self.comm.gradient_predivide_factor != 1:
            grad.div_(self.comm.gradient_predivide_factor)
        replicate = self.comm.replicate_group
        if self.spec.world_size > 1:  # (HYBRID_SHARD: then across replicas, when it is finished)
            group = self.comm.process_group_reduce_scatter
            # the reduced chunk is allocated when needed: on the CPU only once the sum is done
            if self.rs_bucketer is not None:  # small gradients share one collective
                self._pending = self.rs_bucketer.reduce_scatter(None, grad, group)
            else:
                self._pending = reduce_scatter(None, grad, group, self.stats)
        elif replicate is not None:  # NO_SHARD: all-reduce now, overlapped with the rest of backward
            self._pending = all_reduce(grad, replicate, stats=self.stats)
        else:
            self._pending = Pending(None, grad)
        self._set_grad_state(GradState.REDUCING)
        self.reshard(free_full=True)

    def fold_hand_set_grads(self) -> None:
        """Add the gradients set by hand on the linked views into the flat gradient (full, this
        backward's), before it is reduced. See [Note: linked parameters] in fsdp/core/param_attrs.py."""
        for i, view in self.linked_views:
            hand_set = take_hand_set_grad(view)
            if hand_set is not None:
                grad = self.flat_param.grad
                # (None: autograd ran the accumulator without a gradient, a custom function gave None)
                if grad is None:
                    grad = self.flat_param.grad = torch.zeros_like(self.flat_param)
                info = self.meta.params[i]
                grad[info.offset : info.offset + info.numel].add_(hand_set.reshape(-1))

    def check_no_hand_set_grads(self, path: str) -> None:
        """At the end of backward: a gradient set by hand on a linked view that no post-backward
        folded in (no gradient from autograd reached the flat parameter) would be lost."""
        views, self.linked_views = self.linked_views, []
        for i, view in views:
            if take_hand_set_grad(view) is not None:
                raise RuntimeError(
                    f"FullyShardedDataParallel: a gradient was set by hand on {self.meta.params[i].fqn!r} of "
                    f"{path!r} in backward, but no gradient from autograd reached the parameters it is flattened "
                    "with, so nothing reduced it. Let autograd see the parameter (return a gradient for it from "
                    "the custom function, even zeros), or wrap it with flatten_parameters=True beside one that "
                    "gets a gradient"
                )

    def reduced_onto_shard(self) -> bool:
        """A gradient is on the shard and the shard is ``flat_param.data`` again (resharded): what an
        optimizer in backward steps (``on_reduced``)."""
        p = self.flat_param
        return p.grad is not None and p.requires_grad and p.data.data_ptr() == self._shard.data_ptr()

    def accumulation_dropped(self) -> bool:
        """Its chunk shown on ``.grad`` was set to None or zeroed since (a ``zero_grad()``)."""
        shown = self._acc_shown
        if shown is None:
            return False
        grad = self.flat_param.grad
        return grad is None or (
            grad is shown[0] and grad._version != shown[1] and not bool(grad.count_nonzero())
        )

    def discard_accumulated_grad(self) -> None:
        """Forget the gradients accumulated inside ``no_sync`` (``zero_grad()`` of the wrapper)."""
        self._acc_hidden = False
        if self.chunk_shown_on_grad():  # (zeroed in place: zeros of its own, not a view of what is dropped)
            chunk = self.flat_param.grad
            assert chunk is not None
            self.flat_param.grad = torch.zeros_like(chunk) if self.flat_param.shape == chunk.shape else None
        self._acc_shown = None
        self._grad_acc = None
        if self.grad_state is GradState.UNSYNCED:
            self._set_grad_state(GradState.IDLE)

    def abandon_backward(self) -> None:
        """A backward that raised and never reached its end (see ``clear_aborted_backward`` in
        fsdp/wrapper/root_context.py): wait for the reduction it sent (every rank that stopped at the
        same place sent its part), drop what was not reduced into ``.grad`` yet, and give ``.grad``
        back the shard gradient stashed before that backward. A gradient already reduced into
        ``.grad`` stays, as a plain model keeps what its stopped backward accumulated. Call with
        ``flat_param.data`` the shard."""
        if self._pending is not None and self._pending.launched:
            self._pending.wait()
        if self._grad_copy is not None and self.copies is not None:
            self.copies.synchronize()
        self._pending = self._grad_copy = None
        if self.grad_state in (GradState.REDUCING, GradState.BUCKETED, GradState.COPYING):
            self._set_grad_state(GradState.IDLE)
        shown = self._acc_shown is not None and self.flat_param.grad is self._acc_shown[0]
        if self.grad_state is not GradState.REDUCED and not shown:  # (autograd's full sum, or nothing new)
            self.flat_param.grad = self._saved_grad_shard
        self._saved_grad_shard = None

    def end_backward(self) -> None:
        """End of backward: a reduced gradient is just the shard gradient now; what a backward that
        raised before its end left in flight is dropped. See [Note: gradient state]."""
        if self.grad_state in _REDUCED_THIS_BACKWARD:
            self._pending = self._grad_copy = None  # (set only after such a backward)
            self._set_grad_state(GradState.IDLE)
        grad = self.flat_param.grad
        if self.low_grad_dtype is not None and grad is not None and grad.dtype != self.low_grad_dtype:
            # torch's keep_low_precision_grads: through .data, which (unlike .grad =) allows a dtype other
            # than the parameter's
            grad.data = grad.to(self.low_grad_dtype)
        self.show_accumulated_grad()

    def _set_grad_state(self, state: GradState) -> None:
        """The one way the gradient state changes; checks the change and what each state holds."""
        check_transition("gradient state", self.grad_state, state, GRAD_TRANSITIONS)
        assert (self._pending is not None) == (state is GradState.REDUCING), "a reduction outside REDUCING"
        assert (self._grad_copy is not None) == (state is GradState.COPYING), "a host copy outside COPYING"
        assert self._grad_acc is None or state is GradState.UNSYNCED, (
            "an accumulated gradient outside UNSYNCED"
        )
        self.grad_state = state
        if state is GradState.REDUCED and self.on_reduced is not None:
            self.on_reduced(self)

    @property
    def reduced_this_backward(self) -> bool:
        """This backward's gradient went to a reduction (sent, queued, bucketed, or finished)."""
        return self.grad_state in _REDUCED_THIS_BACKWARD

    @property
    def _hybrid(self) -> bool:
        """The reduced shard is all-reduced across replicas once its reduce-scatter is finished."""
        return self.spec.world_size > 1 and self.comm.replicate_group is not None

    @property
    def reduction_pending(self) -> bool:
        """A reduction of this backward waits to be finished (sent or queued in a bucket)."""
        return self.grad_state is GradState.REDUCING

    @property
    def reduction_launched(self) -> bool:
        """A reduction of this backward is in flight (sent, not yet waited for)."""
        return self._pending is not None and self._pending.launched

    @property
    def reduction_finishable(self) -> bool:
        """This backward's reduction is sent, and ``finalize_gradient`` would issue no collective."""
        return self._pending is not None and self._pending.launched and not self._hybrid

    def finalize_gradient(self, asynchronous: bool = False) -> None:
        """Finish this backward's reduction and set ``flat_param.grad`` to the (accumulated) shard
        gradient: REDUCING and BUCKETED go on to REDUCED. See [Note: gradient state].

        With an offloaded shard on CUDA the gradient is copied to the host on the side stream
        (COPYING); with ``asynchronous`` (during backward) ``.grad`` is set only by a later call, which
        the end-of-backward callback makes for every handle, so the copy overlaps the rest of backward.
        """
        if self.grad_state is GradState.REDUCING:
            self._finish_reduction()
        elif self.grad_state is GradState.BUCKETED:  # reduced (and averaged) in place by the bucket engine
            if self._saved_grad_shard is not None:
                grad = self.flat_param.grad
                self.flat_param.grad = (
                    self._saved_grad_shard if grad is None else self._saved_grad_shard.add_(grad)
                )
                self._saved_grad_shard = None
            self._set_grad_state(GradState.REDUCED)
        if self.grad_state is GradState.COPYING:
            if asynchronous:
                return  # the blocking call collects it (no host wait during backward)
            assert self._grad_copy is not None and self.copies is not None
            host, event = self._grad_copy
            self._grad_copy = None
            self.copies.device.synchronize_event(event)
            self._set_grad(host)
            self._set_grad_state(GradState.REDUCED)
        # no new gradient this backward: restore the old one, once flat_param is the shard again
        if self._saved_grad_shard is not None and self.state is not MemoryState.UNSHARDED:
            self.flat_param.grad = self._saved_grad_shard
            self._saved_grad_shard = None
        if self.copies is not None and not asynchronous:
            self.copies.synchronize()  # nothing queued may still read or write host memory

    def _finish_reduction(self) -> None:
        """REDUCING -> COPYING (offloaded on CUDA) or REDUCED: wait for the reduction, finish it."""
        assert self._pending is not None
        out = self._pending.wait()
        self._pending = None
        if self._hybrid:
            assert self.comm.replicate_group is not None
            all_reduce(out, self.comm.replicate_group, stats=self.stats).wait()
        if self.comm.gradient_postdivide_factor != 1:
            out.div_(self.comm.gradient_postdivide_factor)
        # gradients always land on the master shard: its dtype, and its device (CPU when offloaded)
        if self.copies is not None:
            self._grad_copy = self.copies.to_host(out, self.meta.dtype)
            self._set_grad_state(GradState.COPYING)
        else:
            self._set_grad(out.to(device=self._shard.device, dtype=self.meta.dtype))
            self._set_grad_state(GradState.REDUCED)

    def _set_grad(self, grad: torch.Tensor) -> None:
        if self._saved_grad_shard is not None:
            grad = self._saved_grad_shard.add_(grad)
            self._saved_grad_shard = None
        memory_tags.tag(grad, memory_tags.SHARDED_GRAD)
        self.flat_param.grad = grad
