"""The root's context: what a root shares with every wrapper of its tree, made once at its lazy init.

It is the one owner of the tree's shared objects, as FSDP2's root owns its ``FSDPCommContext``: the
device handle, the collective and memory statistics, the bucketers, the schedule, the reductions in
flight and the step's flags. Each handle gets the objects it uses at the lazy init
(``FlatParamHandle.join_root``) and drops them when the context is released.
"""

from __future__ import annotations

import collections
import os
import warnings
import weakref
from typing import Any, Generic, TypeVar

from torch import nn

from fsdp.api import TrainingState
from fsdp.comm.buckets import GradBucketer
from fsdp.comm.collectives import CommStats
from fsdp.comm.consistency import wrapper_path
from fsdp.comm.rs_buckets import ReduceScatterBucketer
from fsdp.comm.schedule import Scheduler
from fsdp.common.device import DeviceHandle
from fsdp.core.handle import FlatParamHandle, MemoryStats
from fsdp.core.no_shard_buckets import make_no_shard_bucketer
from fsdp.core.wrapper_protocol import Wrapper

__all__ = ["CHECK_UNITS", "RootContext", "clear_aborted_backward", "end_backward_states"]

CHECK_UNITS = "FSDP_CHECK_UNITS"  # the environment variable read at a root's lazy init


W = TypeVar("W", bound=Wrapper)


class RootContext(Generic[W]):
    """State shared by every wrapper (``W``) under one root, created once at the root's lazy init."""

    device: DeviceHandle
    stats: CommStats  # collective calls and bytes of every wrapper in the tree
    memory: MemoryStats  # unshard buffers of every wrapper in the tree, now and at the peak
    rs_bucketer: ReduceScatterBucketer | None  # small gradients' reduce-scatters (None: bucket_cap_mb=0)
    callback_queued: bool  # the end-of-backward callback of the current backward is queued
    sync: bool  # False inside no_sync(): gradients accumulate locally, nothing is reduced
    keep_full: bool  # inside no_sync(keep_full_params=True): every unit keeps its full parameters
    bucketer: GradBucketer | None  # reduces NO_SHARD flat parameters in learned buckets
    bucket_index: dict[int, int]  # id(handle) -> its index in the bucketer
    scheduler: Scheduler  # unit order, prefetching, all-gather limiter (the root's schedule config)
    in_flight: collections.deque[FlatParamHandle]  # handles whose reduction was sent, oldest first
    registrations: int  # the process's registration count at the root's last look at its modules
    fingerprint: int  # digest of the wrapper tree, agreed at lazy init; every step's handshake carries it
    check_units: bool  # each unit's forward and the end of the root's forward agree too (FSDP_CHECK_UNITS)

    def __init__(self, device: DeviceHandle, wrappers: list[W]) -> None:
        self.device = device
        self.stats = CommStats()
        self.memory = MemoryStats()
        root = wrappers[0].fsdp_config
        cap = int(root.comm.bucket_cap_mb * 2**20)
        self.rs_bucketer = ReduceScatterBucketer(cap, self.stats) if cap > 0 else None
        # weakly: the root holds this context, so holding the root here would be a reference cycle
        # (a deleted model would then wait for the cyclic garbage collector to free its memory)
        self._wrappers = [weakref.ref(w) for w in wrappers]
        self.callback_queued = False
        self.sync = True
        self.keep_full = False
        self.bucketer = None
        self.bucket_index = {}
        self.scheduler = Scheduler(root.schedule, device)
        self.in_flight = collections.deque()
        self.registrations = -1
        self.fingerprint = 0
        # See [Note: agreement before communication]; "0" turns the per-unit handshakes off
        self.check_units = os.environ.get(CHECK_UNITS, "1") != "0"

    @property
    def wrappers(self) -> list[W]:
        """Root first, then the nested wrappers in module order (those still alive)."""
        return [w for w in self.wrappers_as_built() if w is not None]

    def wrappers_as_built(self) -> list[W | None]:
        """The wrappers at the root's lazy init; None for one that was removed and freed since."""
        return [w() for w in self._wrappers]

    def share_with(self, handle: FlatParamHandle) -> None:
        """Hand ``handle`` the statistics and the reduce-scatter bucketer this context owns."""
        handle.join_root(self.stats, self.memory, self.rs_bucketer)

    def make_bucketer(self, root: nn.Module) -> None:
        """The bucket engine for the tree's NO_SHARD flat parameters (shared with DistributedDataParallel),
        made again when the gradient divide factors change. ``root``: the root wrapper (names)."""
        items = [
            (f"{wrapper_path(root, w)}:{'+'.join(h.meta.fqns)}", h) for w in self.wrappers for h in w.handles
        ]
        cap = self.wrappers[0].fsdp_config.comm.bucket_cap_mb
        self.bucketer, self.bucket_index = make_no_shard_bucketer(items, cap, self.device, self.stats)

    def finish_reductions(self) -> None:
        """Runs before a unit's flat gradient is built. See [Note: finishing reductions early]."""
        for h in [h for h in self.in_flight if h.reduction_finishable]:  # (a queued bucket holds up none)
            self.in_flight.remove(h)
            h.finalize_gradient(asynchronous=True)


def end_backward_states(ctx: RootContext[Any]) -> None:
    """The last part of every end of backward, also of one that raised: buckets and reductions in
    flight forgotten, each handle's backward ended, every wrapper in a backward state back to IDLE
    (not one in a forward or summon of its own)."""
    if ctx.bucketer is not None and ctx.bucketer._active:
        ctx.bucketer.abort()
    ctx.in_flight.clear()
    for w in ctx.wrappers:
        for h in w.handles:
            h.end_backward()
            h.accumulators.end_backward()
        w._pre_backward_done = False
        if w._views_tracked:
            w._views_tracked = False
            for h in w.handles:
                h.saved_views.armed = h.saved_views.unsure = False
        if w.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
            w.training_state = TrainingState.IDLE


def clear_aborted_backward(ctx: RootContext[Any]) -> None:
    """A backward that raised (a tensor hook, an out-of-memory error the program caught) never ran its
    end-of-backward callback: clear what it left, at the root's next forward, outside any backward.
    What it had reduced into ``.grad`` stays, as a plain model keeps what its stopped backward
    accumulated; reductions in flight are waited for and dropped (``abandon_backward``); every
    wrapper and handle returns to IDLE. See the decision in docs/design.md."""
    warnings.warn(
        "FullyShardedDataParallel: the previous backward did not finish (it raised); what it left is "
        "cleared now. Gradients it had reduced before it stopped are in .grad, as on a plain model: call "
        "zero_grad() to drop them",
        stacklevel=4,
    )
    ctx.callback_queued = False
    if ctx.bucketer is not None and ctx.bucketer._active:
        ctx.bucketer.abort()  # (waits for its launched all-reduces first)
    handles = [h for w in ctx.wrappers for h in w.handles]
    # inside no_sync(): the stopped backward took some units' accumulations off .grad, so a zero_grad()
    # since could not reach them; it did reach the others', and then drops theirs too (See [Note: no_sync])
    if any(h.accumulation_dropped() for h in handles if not h._acc_hidden):
        for h in handles:
            if h._acc_hidden:
                h.discard_accumulated_grad()
    for w in ctx.wrappers:
        for h in w.handles:
            h.reshard(free_full=True)
            h.abandon_backward()
    end_backward_states(ctx)
