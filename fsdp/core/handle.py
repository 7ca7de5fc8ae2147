"""FlatParamHandle: one flat parameter's tensors and the verbs that move it between states.

[Note: flat parameter data]
A handle owns three tensors for its flat parameter ``flat_param`` (an ``nn.Parameter``, the object
the optimizer holds):

- ``_shard``: this rank's chunk of the padded flat tensor, shape ``(chunk,)``, fp32 master data.
- ``_full``: the padded full flat tensor, shape ``(padded_numel,)``. Its storage is freed
  (``untyped_storage().resize_(0)``) while the handle is SHARDED and re-allocated in place before
  every all-gather. See [Note: storage resize].
- ``flat_param.data`` is ``_shard`` while SHARDED or FULL_KEPT and ``_active`` (normally ``_full``)
  while UNSHARDED. FULL_KEPT is SHARDED with ``_full`` still holding the full parameter gathered for
  the shard (kept by ``reshard(free_full=False)``), valid while ``flat_param._version`` is the
  ``_full_version`` recorded then: an in-place update of the shard (an optimizer step) makes the
  next unshard gather again. Between training steps every handle is SHARDED or FULL_KEPT, so the
  optimizer sees and updates only the local shard.

Under mixed precision ``_full`` is in the compute dtype (fp16/bf16) and is gathered from
``_lp_shard``, a compute-dtype copy of the shard made just before the all-gather, so the wire
carries half the bytes of fp32; ``summon_full_params`` and ``state_dict`` instead gather the fp32
shards into ``_full_precision`` (``_active`` then points there). Both extra buffers are freed
like ``_full``. At world size 1 without casting, ``_full`` *is* ``_shard`` (no copy, nothing freed).

[Note: storage resize]
Autograd saves views of the full parameter for backward (e.g. a Linear saves its weight). When
``reshard_after_forward`` frees the full parameter, those saved views must become valid again
before backward runs. Freeing by resizing the *storage* to zero and re-gathering into the *same*
storage achieves that: the saved views point at that storage, so the pre-backward all-gather
refills exactly the memory they read. Writes go to ``_full`` (its own version counter), never
through ``flat_param``, so autograd's saved-tensor version checks stay quiet. Reading a view while
its storage is freed would crash, so whenever the handle reshards the module attributes are set to
placeholders on the meta device: same shape and dtype, no memory, no data to read by mistake.

"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fsdp.api import MEMORY_TRANSITIONS, CommConfig, MemoryState, check_transition
from fsdp.comm.collectives import CommStats, Pending, all_gather
from fsdp.comm.rs_buckets import ReduceScatterBucketer
from fsdp.common.device import DeviceHandle, SideCopies
from fsdp.core.flat_param import (
    FlatParamMeta,
    _Entry,
    make_meta,
    make_placeholders,
    set_module_tensor,
    unflatten_views,
)
from fsdp.core.grad_hooks import AccumulatorHooks
from fsdp.core.handle_grads import GRAD_TRANSITIONS, GradState, HandleGradients, _same_bits
from fsdp.core.param_attrs import (
    carry_attributes,
    linked_indices,
    linked_version,
    publish_torch_attributes,
    record_places,
)
from fsdp.core.placeholders import is_placeholder
from fsdp.core.saved_views import SavedViews
from fsdp.core.sharding import ShardSpec, shard_spec

__all__ = ["GRAD_TRANSITIONS", "FlatParamHandle", "GradState", "MemoryStats", "free_unused_prefetches"]


def _free_storage(t: torch.Tensor) -> int:
    """Free ``t``'s memory (its storage keeps existing, with size 0); return the bytes freed."""
    size = t.untyped_storage().size()
    if size != 0:
        t.untyped_storage().resize_(0)
    return size


def _alloc_storage(t: torch.Tensor) -> int:
    """Give ``t``'s storage its memory back; return the bytes allocated."""
    nbytes = t.numel() * t.element_size()
    size = t.untyped_storage().size()
    if size != nbytes:
        t.untyped_storage().resize_(nbytes)
    return nbytes - size


class MemoryStats:
    """Bytes of the buffers the handles of one tree allocate to unshard (full parameters in the
    compute and the master dtype, a shard cast or copied for the all-gather), now and at the peak
    since the last :meth:`reset`. Updated where the buffers are allocated and freed."""

    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current

    def reset(self) -> None:
        self.peak = self.current


class _Uncounted(MemoryStats):
    """The count of a handle no root holds (before the first forward, or after its root's context
    was released): nothing is counted. Each root's context owns the one count of its tree."""

    __slots__ = ()

    def add(self, nbytes: int) -> None:
        pass


UNCOUNTED: MemoryStats = _Uncounted()


class FlatParamHandle(HandleGradients):
    """Owns one flat parameter: shard, full buffers, gradient stash, pending reduction.

    The gradient's attributes and verbs are :class:`~fsdp.core.handle_grads.HandleGradients`'."""

    meta: FlatParamMeta  # layout of the original parameters in the flat tensor
    spec: ShardSpec  # this rank's chunk of the padded flat tensor
    modules: list[nn.Module]  # owning module of each meta.params[i]
    shared_modules: list[nn.Module]  # owning module of each meta.shared[i]
    flat_param: nn.Parameter  # .data: _shard (SHARDED) or _active (UNSHARDED)
    # stats, memory, rs_bucketer: the root's, handed over at its lazy init (join_root)
    stats: CommStats | None  # collective calls and bytes of the tree (None: no root, not counted)
    memory: MemoryStats  # unshard buffers of the tree (the root's, from its lazy init)
    state: MemoryState  # changed only by _set_memory_state (MEMORY_TRANSITIONS)
    compute_dtype: torch.dtype  # dtype of the all-gather and of compute
    reduce_dtype: torch.dtype | None  # dtype of the gradient reduce-scatter (None: the gradient's)
    _shard: torch.Tensor  # (chunk,) local master shard, meta.dtype (fp32 under mixed precision)
    _lp_shard: torch.Tensor | None  # (chunk,) compute-dtype device copy of the shard to all-gather; freed
    offloaded: bool  # the master shard (and its gradient) lives on the CPU, compute on another device
    copies: SideCopies | None  # CUDA with offload: the side stream of host<->device copies
    _full: torch.Tensor  # (padded_numel,) compute-dtype full buffer; storage freed while SHARDED
    _full_precision: torch.Tensor | None  # (padded_numel,) master-dtype full buffer for summon; freed
    _active: torch.Tensor  # the full buffer flat_param.data points at while UNSHARDED
    _full_version: int  # FULL_KEPT: flat_param._version when _full was kept (valid while unchanged)
    _gathering: tuple[torch.Tensor, Pending] | None  # (target buffer, in-flight all-gather) after prefetch()
    rs_bucketer: ReduceScatterBucketer | None  # the root's reduce-scatter buckets (None: one collective each)
    _placeholders: list[torch.Tensor]  # meta-device stand-ins for the module attributes while sharded
    _placeholders_set: bool  # the modules' attributes are the stand-ins now
    accumulators: AccumulatorHooks  # the post-backward's hooks: see [Note: gradient accumulators]
    saved_views: SavedViews  # views of ``_full`` autograd holds: see [Note: releasing kept full parameters]
    _released: bool  # UNSHARDED, with ``_full`` freed in backward by release_full_early()
    finish_soon: bool  # see _post_backward in fsdp/wrapper/base.py
    # the views set in forward of the parameters some link points at, by index in meta.params (see
    # [Note: linked parameters] in fsdp/core/param_attrs.py); empty for nearly every handle
    linked_views: list[tuple[int, torch.Tensor]]
    _linked: tuple[int, tuple[int, ...]]  # (linked_version() when computed, the linked indices)

    def __init__(
        self,
        entries: Sequence[_Entry],
        shared: Sequence[tuple[_Entry, int]],
        module_of: dict[str, nn.Module],
        comm: CommConfig,
        device: torch.device,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        offload: bool = False,
    ) -> None:
        record_places((e.param, module_of[e.module_name], e.param_name) for e in entries)
        self.meta = make_meta(entries, shared)
        self.comm = comm
        self.leave_root()  # (until the first forward's root hands over its objects)
        self.spec = shard_spec(self.meta.numel, comm.world_size, comm.rank)
        self.modules = [module_of[p.module_name] for p in self.meta.params]
        self.shared_modules = [module_of[s.module_name] for s in self.meta.shared]
        self.compute_dtype = param_dtype if param_dtype is not None else self.meta.dtype
        self.reduce_dtype = reduce_dtype
        self.low_grad_dtype = None  # (the wrapper sets it: keep_low_precision_grads)
        with torch.no_grad():  # straight into the padded buffer: one unit's copy beside the parameters
            padded = torch.empty(self.spec.padded_numel, dtype=self.meta.dtype, device=device)
            for e, info in zip(entries, self.meta.params):
                padded[info.offset : info.offset + info.numel].view(info.shape).copy_(e.param)
            padded[self.meta.numel :].zero_()
        # With CPU offload the master shard lives in (pinned) host memory; on a CPU compute device
        # that is where it is anyway, and nothing changes.
        self.compute_device = device  # where the full parameter and the collectives live
        self.offloaded = offload and device.type != "cpu"
        if comm.world_size == 1 and not self.mixed and not self.offloaded:
            self._shard = padded
        else:
            self._shard = padded[self.spec.start : self.spec.end].clone()
            if self.offloaded:
                self._shard = DeviceHandle(device).pin_memory(self._shard.cpu())
        self.flat_param = nn.Parameter(self._shard, requires_grad=self.meta.requires_grad)
        self._start_sharded(padded)

    def _start_sharded(self, padded: torch.Tensor | None = None) -> None:
        """The state of a handle between steps, around its shard (``flat_param.data``): full
        buffers made and freed, no gradient in flight, hooks and stand-ins installed."""
        cuda = self.offloaded and self.compute_device.type == "cuda"
        self.copies = SideCopies.for_device(self.compute_device) if cuda else None
        self._grad_copy = None
        self._make_full_buffers(padded)
        self.state = MemoryState.SHARDED
        self._saved_grad_shard = self._pending = self._gathering = self.rs_bucketer = None
        self._grad_acc = self._full_grad = self._acc_shown = None
        self._acc_hidden = False
        self.grad_state = GradState.IDLE
        self.on_reduced = None  # (an optimizer in backward sets it on the handles it steps)
        self.saved_views = SavedViews(self)
        self._released = False
        self.finish_soon = False  # released early: its reduction is finished at the next pre-backward
        self.linked_views = []
        self._linked = (-1, ())
        self.accumulators = AccumulatorHooks(self.flat_param)
        self._placeholders = make_placeholders(self)
        self.remove_module_tensors()

    def _make_full_buffers(self, padded: torch.Tensor | None = None) -> None:
        """The buffers derived from the shard, for its dtype and the compute dtype and device, all
        freed: ``_full`` (``_shard`` itself when aliased), ``_full_precision`` and ``_lp_shard`` under
        mixed precision, ``_lp_shard`` under offload. ``padded`` (the full master-dtype values at
        construction) lends its storage to a full buffer of its dtype."""
        device, numel = self.compute_device, self.spec.padded_numel
        if self.spec.world_size == 1 and not self.mixed and not self.offloaded:
            self._full = self._shard
        elif self.mixed or padded is None:
            self._full = torch.empty(numel, dtype=self.compute_dtype, device=device)
            _free_storage(self._full)
        else:
            self._full = padded
            _free_storage(self._full)
        self._full_precision = self._lp_shard = None
        if self.mixed:  # the master-dtype full buffer (summon, state dict)
            self._full_precision = (
                padded if padded is not None else torch.empty(numel, dtype=self.meta.dtype, device=device)
            )
            _free_storage(self._full_precision)
        if self.mixed or self.offloaded:
            self._lp_shard = torch.empty(self.spec.chunk, dtype=self.compute_dtype, device=device)
            _free_storage(self._lp_shard)
        self._active = self._full
        self._full_version = -1
        self._publish_torch_attributes()

    def _publish_torch_attributes(self) -> None:
        """torch's names for the shard and buffers, on the flat parameter, after any of them changed.
        See [Note: torch's flat parameter attributes] in fsdp/core/param_attrs.py."""
        lp_shard = self._lp_shard if self.mixed else None
        publish_torch_attributes(self.flat_param, self._shard, lp_shard, self._full)

    def follow_conversion(self, param_dtype: torch.dtype | None, device: torch.device) -> None:
        """``module.half()`` / ``.to()`` / ``.cuda()`` replaced ``flat_param.data`` between steps: the
        new tensor is the shard, the master dtype is its dtype, the compute dtype ``param_dtype`` (its
        own without mixed precision) and the compute ``device``; every buffer derived from the shard
        is made again (freed), and the stand-ins of the original parameters take the new dtype."""
        assert self.state is not MemoryState.UNSHARDED and self._gathering is None, (
            "converted while unsharded"
        )
        self._free_full()  # (a compute buffer kept from a forward holds the old values)
        data = self.flat_param.data
        self.compute_device = device
        if self.offloaded:  # (the device stays the host: a conversion moving it is refused before)
            data = DeviceHandle(device).pin_memory(data)
            self.flat_param.data = data
        self._shard = data
        self.meta = dataclasses.replace(self.meta, dtype=data.dtype)
        self.compute_dtype = param_dtype if param_dtype is not None else data.dtype
        if self.chunk_shown_on_grad():
            self.flat_param.grad = None  # (the chunk shown of the accumulator, which is converted below)
        grad_acc = self._grad_acc  # (accumulated in no_sync and not reduced yet: converted alike)
        unsynced = self.grad_state is GradState.UNSYNCED
        self._start_sharded()
        if grad_acc is not None:
            self._grad_acc = grad_acc.to(device=device, dtype=data.dtype)
        if unsynced:
            self._set_grad_state(GradState.UNSYNCED)

    # ------------------------------------------------------------------ copies
    # What a copy or a pickle of the handle keeps: its layout, its flat parameter (the shard, its data)
    # and its modules; the rest is made anew (freed full buffers, hooks) or dropped (the process
    # groups: the wrapper gives them back; gradients, as a copied nn.Parameter has none).
    # See [Note: copies of a wrapped model] in fsdp/wrapper/module_ops.py.
    _COPIED = (
        "meta", "spec", "modules", "shared_modules", "flat_param", "compute_dtype", "reduce_dtype",
        "compute_device", "offloaded", "low_grad_dtype",
    )  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        assert self.state is not MemoryState.UNSHARDED and self._gathering is None, "copied while unsharded"
        return {name: getattr(self, name) for name in self._COPIED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.comm = None  # type: ignore[assignment]  # (set by the wrapper right after)
        self.leave_root()
        self._shard = self.flat_param.data
        if self.offloaded:
            self._shard = self.flat_param.data = DeviceHandle(self.compute_device).pin_memory(self._shard)
        self.flat_param.grad = None
        self._start_sharded()

    # ------------------------------------------------------------------ the root's objects
    def join_root(
        self, stats: CommStats, memory: MemoryStats, rs_bucketer: ReduceScatterBucketer | None
    ) -> None:
        """Count in the root's ``stats`` and ``memory`` and send small gradients through its
        ``rs_bucketer`` (its context hands them over at its lazy init); the bytes held now join ``memory``."""
        self.stats, self.memory, self.rs_bucketer = stats, memory, rs_bucketer
        memory.add(self.unshard_bytes())

    def leave_root(self) -> None:
        """Drop the root's objects (no root yet, or its context was released) until the next lazy init."""
        self.stats, self.memory, self.rs_bucketer = None, UNCOUNTED, None

    # ------------------------------------------------------------------ properties
    @property
    def aliased(self) -> bool:
        """World size 1 without casting: the full parameter is the shard itself."""
        return self._full is self._shard

    @property
    def holds_full(self) -> bool:
        """Whether the full flat parameter's values for the current shard are in memory: unsharded, or
        the compute buffer kept since a forward and the shard unchanged since (always when aliased)."""
        if self.state is MemoryState.UNSHARDED:
            return not self._released
        return self.aliased or self.kept_full_valid

    @property
    def kept_full_valid(self) -> bool:
        """FULL_KEPT, and the shard unchanged since: the kept full parameter is its all-gather."""
        return self.state is MemoryState.FULL_KEPT and self._full_version == self.flat_param._version

    @property
    def gathers(self) -> bool:
        """Its unshard is an all-gather across ranks (not a copy, a cast or nothing)."""
        return self.spec.world_size > 1

    # torch FSDP1's handle names, for code that inspects handles (``model._handle``)
    @property
    def uses_sharded_strategy(self) -> bool:
        """torch's: the parameter is sharded (every strategy but NO_SHARD at more than one rank)."""
        return self.gathers

    @property
    def sharded_grad(self) -> torch.Tensor | None:
        """torch's: the shard's gradient (None once consumed by an optimizer in backward, or zeroed)."""
        return self.flat_param.grad

    @property
    def prefetched(self) -> bool:
        """An all-gather was launched by :meth:`prefetch` and not yet used by :meth:`unshard`."""
        return self._gathering is not None

    @property
    def shard_device(self) -> torch.device:
        """Where the master shard, its gradient and its optimizer state live: the host when offloaded."""
        return self._shard.device

    @property
    def mixed(self) -> bool:
        """Compute runs in a lower precision than the master shard."""
        return self.compute_dtype != self.meta.dtype

    @property
    def requires_grad(self) -> bool:
        """Whether the flat parameter trains now: set at construction by the originals' flag, and
        changed since by ``requires_grad_()`` on it (``use_orig_params=True``: one per parameter)."""
        return self.flat_param.requires_grad

    def sharded_data(self) -> torch.Tensor:
        """This rank's shard (what ``flat_param.data`` is between steps)."""
        return self._shard

    def unshard_bytes(self) -> int:
        """The bytes this handle's unshard buffers hold now (what :class:`MemoryStats` counts)."""
        held = [] if self.aliased else [self._full]
        held += [t for t in (self._full_precision, self._lp_shard) if t is not None]
        return sum(t.untyped_storage().size() for t in held)

    # ------------------------------------------------------------------ verbs
    def unshard(self, full_precision: bool = False) -> None:
        """All-gather the full flat parameter and make it ``flat_param.data``. Collective.

        In compute precision (forward, backward) the shard is first cast to the compute dtype, so
        the all-gather moves compute-dtype bytes; the gather is skipped when the full buffer still
        holds the current shard's values (kept after a forward with ``reshard_after_forward=False``
        and not invalidated by an in-place update since). With ``full_precision`` (summon, state
        dict) the master shards are gathered instead. Finishes a gather started by :meth:`prefetch`.
        """
        if self.state is MemoryState.UNSHARDED and self._released:
            self.reshard()  # (its full buffer was freed in this backward: gathered again below)
        if self.state is MemoryState.UNSHARDED:
            assert not (full_precision and self.mixed and self._active is self._full), (
                "unsharded in compute dtype"
            )
            return
        if full_precision and self._full_precision is not None and self._gathering is not None:
            if self._gathering[0] is not self._full_precision:  # a compute-dtype prefetch never used
                self.reshard(free_full=False)  # (lets it land), then gather the fp32 masters below
        self.prefetch(full_precision)
        assert self._gathering is not None
        buf, pending = self._gathering
        self._gathering = None
        pending.wait()
        if self._lp_shard is not None:
            self.memory.add(-_free_storage(self._lp_shard))
        self._active = buf
        self.flat_param.data = buf
        self._set_memory_state(MemoryState.UNSHARDED)

    def prefetch(self, full_precision: bool = False) -> None:
        """Launch the all-gather of :meth:`unshard` without waiting for it. Collective.

        The full buffer is allocated now; the gather runs in the background (gloo's worker thread,
        NCCL's stream) while the caller computes, and :meth:`unshard` waits for it.
        """
        if self.state is MemoryState.UNSHARDED or self._gathering is not None:
            return
        self._adopt_user_data()
        if full_precision and self._full_precision is not None:
            buf = self._full_precision
            self.memory.add(_alloc_storage(buf))
            if self.spec.world_size == 1:
                buf.copy_(self._shard)
                pending = Pending(None, buf)
            else:
                source = self._shard.to(buf.device)  # a device copy when the shard is offloaded
                pending = all_gather(buf, source, self.comm.process_group, self.stats)
        else:
            buf = self._full
            if self.aliased or self.kept_full_valid:
                pending = Pending(None, buf)
            else:
                self.memory.add(_alloc_storage(buf))
                pending = self._gather_compute_(buf)
        self._gathering = (buf, pending)

    def _gather_compute_(self, buf: torch.Tensor) -> Pending:
        if self._lp_shard is None:
            return all_gather(buf, self._shard, self.comm.process_group, self.stats)
        if self.spec.world_size == 1:  # cast and/or host-to-device copy
            if self.copies is not None:
                return Pending(self.copies.to_device(buf, self._shard), buf, (self._shard,))
            buf.copy_(self._shard)
            return Pending(None, buf)
        self.memory.add(_alloc_storage(self._lp_shard))
        # cast before the all-gather (half the bytes on the wire), and/or copy the offloaded shard in
        if self.copies is None:
            self._lp_shard.copy_(self._shard)
            return all_gather(buf, self._lp_shard, self.comm.process_group, self.stats)
        with self.copies.side():  # the copy overlaps compute; the all-gather follows the copy
            self._lp_shard.copy_(self._shard, non_blocking=True)
            return all_gather(buf, self._lp_shard, self.comm.process_group, self.stats)

    def reshard(self, free_full: bool = True) -> None:
        """Point ``flat_param.data`` back at the shard; free the full buffer, or keep it (FULL_KEPT)
        with ``free_full=False`` when it holds the compute-dtype gather (a master-dtype one, shown by a
        summon, is always freed)."""
        if self._gathering is not None:  # prefetched but never used: let the gather land first
            self.unshard()
        if self.state is not MemoryState.UNSHARDED:
            if free_full:
                self._free_full()
            return
        self.flat_param.data = self._shard
        self.remove_module_tensors()
        if self._full_precision is not None:
            self.memory.add(-_free_storage(self._full_precision))
        keep = not free_full and self._active is self._full and not self.aliased and not self._released
        self._released = False
        self._active = self._full
        if keep:
            self._full_version = self.flat_param._version
            self._set_memory_state(MemoryState.FULL_KEPT)
        else:
            self._set_memory_state(MemoryState.SHARDED)
            self._free_full()

    @property
    def full_precision_compute(self) -> bool:
        """Unsharded in the master dtype under mixed precision (a forward and backward in full
        precision: ``FSDP_USE_FULL_PREC_IN_EVAL``; or a summon)."""
        return self._full_precision is not None and self._active is self._full_precision

    @property
    def released(self) -> bool:
        """UNSHARDED with the full buffer freed in this backward by :meth:`release_full_early`."""
        return self._released

    def release_full_early(self) -> None:
        """Free the full buffer kept from forward while still UNSHARDED in backward: autograd reads it no
        more. The flat parameter keeps its full shape (gradients still flow into it); the module
        attributes become placeholders; :meth:`unshard` gathers again if asked. See [Note: releasing kept
        full parameters] in fsdp/core/saved_views.py."""
        if self.state is not MemoryState.UNSHARDED or self._active is not self._full or self.aliased:
            return
        if self.linked_views:  # (a gradient set by hand sits on a view: see [Note: linked parameters])
            return
        self.memory.add(-_free_storage(self._full))
        self._released = True
        self.remove_module_tensors()

    def _free_full(self) -> None:
        """Free the compute-dtype full buffer (nothing when aliased): FULL_KEPT becomes SHARDED."""
        if not self.aliased:
            self.memory.add(-_free_storage(self._full))
        if self.state is MemoryState.FULL_KEPT:
            self._set_memory_state(MemoryState.SHARDED)

    def _set_memory_state(self, state: MemoryState) -> None:
        """The one way the memory state changes (after the buffers changed). See [Note: flat parameter data]."""
        check_transition("memory state", self.state, state, MEMORY_TRANSITIONS)
        assert state is not MemoryState.FULL_KEPT or not self.aliased, "an aliased full parameter kept"
        self.state = state

    def _adopt_user_data(self) -> None:
        """Follow a user who replaced ``flat_param.data`` between steps (e.g. ``p.data = t``)."""
        data = self.flat_param.data
        if data.data_ptr() == self._shard.data_ptr() and data.shape == self._shard.shape:
            return
        if data.device != self._shard.device:
            raise RuntimeError(
                f"FullyShardedDataParallel: a flat parameter was moved to {data.device}, but its shard lives on "
                f"{self._shard.device} (the host under CPU offload; else the compute device). Do not call "
                ".to()/.cuda()/.cpu() on a wrapped model: move the module before wrapping it, or pass "
                "compute_device / move_params_to_cpu"
            )
        if data.shape != self._shard.shape or data.dtype != self._shard.dtype:
            raise RuntimeError(
                "FullyShardedDataParallel: a flat parameter's data was replaced by a tensor of shape "
                f"{tuple(data.shape)} and dtype {data.dtype}; it must keep its local shard's shape "
                f"{tuple(self._shard.shape)} and dtype {self._shard.dtype}"
            )
        self._free_full()  # (a full parameter kept for the old shard)
        if self.aliased:
            self._full = data
        self._shard = data
        self._publish_torch_attributes()

    def write_back_(self) -> None:
        """Copy this rank's chunk of the (possibly user-modified) full tensor into the shard."""
        assert self.state is MemoryState.UNSHARDED
        if not self.aliased:
            chunk = self._active[self.spec.start : self.spec.end]
            with torch.no_grad():
                # an unchanged chunk is not written: the write would bump the flat parameter's version,
                # which a pending backward (a summon between forward and backward) refuses
                if _same_bits(chunk.to(self._shard.device), self._shard):
                    return
                self._shard.copy_(chunk)
            # (the full buffer holds what was written: a summon that keeps it, kept from a forward, may)

    # ------------------------------------------------------------------ module attributes
    def use_full_views(self, as_parameters: bool, before_concat: Callable[[], None] | None = None) -> None:
        """Set the modules' attributes to views of the full parameter.

        In forward the views come from ``flat_param`` so autograd routes their gradients into
        ``flat_param.grad``; as parameters (summon / state dict) they are plain views of ``_full``.
        ``before_concat`` runs in backward just before the views' gradients are concatenated into
        the flat gradient (see [Note: finishing reductions early]).
        """
        assert self.state is MemoryState.UNSHARDED
        if self._placeholders_set:
            self._check_placeholders()
            self._placeholders_set = False
        source = self._active if as_parameters else self.flat_param
        views = unflatten_views(source, self.meta, before_concat)
        for info, module, view in zip(self.meta.params, self.modules, views, strict=True):
            if as_parameters:
                view = nn.Parameter(view, requires_grad=self.flat_param.requires_grad)
            set_module_tensor(module, info.param_name, view, as_parameters)
        for sinfo, module in zip(self.meta.shared, self.shared_modules, strict=True):
            primary = self.modules[sinfo.primary]
            set_module_tensor(
                module,
                sinfo.param_name,
                getattr(primary, self.meta.params[sinfo.primary].param_name),
                as_parameters,
            )
        if not as_parameters:  # what modules compute with: the originals' attributes, the linked views
            for i in self.meta.attributed:  # (after every view is set: a link may point into this handle)
                carry_attributes(views[i], self.meta.params[i])
            self.linked_views = [(i, views[i]) for i in self.linked_indices()]

    def linked_indices(self) -> tuple[int, ...]:
        """The indices in ``meta.params`` of the parameters some link points at (by any of their
        names). See [Note: linked parameters] in fsdp/core/param_attrs.py."""
        version = linked_version()
        if self._linked[0] != version:
            places = [(m, p.param_name) for p, m in zip(self.meta.params, self.modules, strict=True)]
            found = set(linked_indices(places))
            shared = [(m, s.param_name) for s, m in zip(self.meta.shared, self.shared_modules, strict=True)]
            found.update(self.meta.shared[j].primary for j in linked_indices(shared))
            self._linked = (version, tuple(sorted(found)))
        return self._linked[1]

    def _check_placeholders(self) -> None:
        """Refuse a module attribute replaced while sharded (``layer.weight = nn.Parameter(...)``): the
        flat parameter holds the values, and the replacement would be dropped silently."""
        pairs = [
            (info.fqn, info.param_name, m) for info, m in zip(self.meta.params, self.modules, strict=True)
        ]
        pairs += [
            (s.fqn, s.param_name, m) for s, m in zip(self.meta.shared, self.shared_modules, strict=True)
        ]
        for fqn, name, module in pairs:
            if not is_placeholder(module.__dict__.get(name)) or name in module._parameters:
                raise RuntimeError(
                    f"FullyShardedDataParallel: {fqn!r} was replaced after wrapping; the wrapper's flat parameter "
                    "holds its values and would ignore the new one. Change the model before wrapping it, or write "
                    "new values inside `with model.summon_full_params():`"
                )

    def remove_module_tensors(self) -> None:
        """Replace the modules' attributes by meta-device placeholders. See [Note: storage resize]."""
        self._placeholders_set = True
        if self._placeholders and self._placeholders[0].requires_grad != self.flat_param.requires_grad:
            # (``root.requires_grad_(False)`` reached the flat parameter): the stand-ins follow
            self._placeholders = make_placeholders(self)
        for info, module, placeholder in zip(self.meta.params, self.modules, self._placeholders, strict=True):
            set_module_tensor(module, info.param_name, placeholder, as_parameter=False)
        for sinfo, module in zip(self.meta.shared, self.shared_modules, strict=True):
            set_module_tensor(module, sinfo.param_name, self._placeholders[sinfo.primary], as_parameter=False)


def free_unused_prefetches(handles: Sequence[FlatParamHandle]) -> None:
    """Free the full parameters of units prefetched but not run (a forward that skipped them)."""
    for h in handles:
        if h.prefetched:
            h.reshard(free_full=True)
