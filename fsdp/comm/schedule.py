"""When all-gathers are launched: the order units run in, prefetching, and the all-gather limiter.

[Note: prefetch]
Each iteration starts at the root's forward; every unit's forward is appended to ``order``.

- Backward prefetch: when unit U's backward starts (its pre-backward hook), the unit whose backward
  comes next is the most recent unit in this iteration's forward order that has not started its
  backward yet (the root's hook fires first; then units run backward in reverse forward order). Its
  all-gather is launched right away and overlaps U's gradient computation. It uses this
  iteration's own order, so it can never be stale. With ``backward_prefetch_post`` (torch's
  ``BACKWARD_POST``) the same unit is gathered later, at the end of U's post-backward hook, once
  U's gradients are reduced and its full parameters freed.
- Forward prefetch: when unit U's forward starts, the unit after it in the order recorded in the
  first iteration is gathered. If a later iteration runs units in another order, forward prefetch
  stops, with one warning when the user asked for it. By default (``forward_prefetch=None``) it is
  on where the host itself computes (CPU) and off on CUDA. On CUDA the host queues work ahead of
  the device, so the next unit's all-gather is launched while the device still computes this one:
  the overlap comes for free, and prefetching would only hold one more full unit. On the CPU the
  host waits for each computation, so without prefetch every forward all-gather is waited for as
  soon as it is launched (35 to 45 ms of a 1.5 s step at 35M on two cores; ``docs/performance.md``).
  The default stops silently, as it was never asked for.

Prefetch decisions depend only on the order units run in, which is the same on every rank, so
every rank launches the same all-gathers in the same order. A prefetched unit whose backward never
comes is waited for and freed at the end of backward. At most one unit is prefetched ahead.
"""

from __future__ import annotations

import collections
import logging
import warnings
import weakref
from typing import Any

from fsdp.api import ScheduleConfig
from fsdp.comm.simulation import device_type
from fsdp.common.device import DeviceHandle

__all__ = ["Scheduler"]

log = logging.getLogger(__name__)


class Scheduler:
    """Owned by the root context; the units are wrappers (anything with ``handles`` and
    ``_pre_backward_done``), held weakly: the root holds this scheduler (through its context), and a
    cycle through it would leave a deleted model to the cyclic garbage collector."""

    config: ScheduleConfig
    device: DeviceHandle
    order: list[weakref.ref[Any]]  # units in the order their forward ran in this iteration
    recorded: list[weakref.ref[Any]] | None  # the first iteration's order (forward prefetch follows it)
    forward: bool  # forward prefetch is on (the config's value, or the device's default)
    forward_ok: bool  # forward prefetch still follows the recorded order
    _free_events: collections.deque[Any]  # CUDA events recorded when units were freed (limiter)

    def __init__(self, config: ScheduleConfig, device: DeviceHandle) -> None:
        self.config = config
        self.device = device
        self.order = []
        self.recorded = None
        requested = config.forward_prefetch
        cuda = device.is_cuda or device_type(device.device) == "cuda"  # (a simulated CUDA step too)
        self.forward = not cuda if requested is None else requested
        self.forward_ok = True
        self._free_events = collections.deque()

    def start_iteration(self) -> None:
        """The root's forward begins: check and reset the order."""
        if self.order and self.recorded is None:
            self.recorded = list(self.order)
        elif self.order and self.forward and self.forward_ok and self.order != self.recorded:
            self.forward_ok = False
            if self.config.forward_prefetch is None:  # the default: nobody asked for it
                log.info("forward prefetch stops: this iteration ran the wrapped units in another order")
            else:
                warnings.warn(
                    "FullyShardedDataParallel: this iteration ran the wrapped units in a different order than "
                    "the first one, so forward prefetch is disabled from now on (results are not affected)",
                    stacklevel=3,
                )
        self.order = []

    def on_forward(self, unit: Any) -> None:
        """``unit``'s forward begins (its own parameters are being gathered): record it, and with
        forward prefetch launch the gather of the unit recorded after it."""
        position = len(self.order)
        self.order.append(weakref.ref(unit))
        if not (self.forward and self.forward_ok and self.recorded is not None):
            return
        if position >= len(self.recorded) or self.recorded[position]() is not unit:
            return  # the mismatch is reported once at the start of the next iteration
        if position + 1 < len(self.recorded):
            nxt = self.recorded[position + 1]()
            if nxt is not None and nxt is not unit:
                self.prefetch(nxt)

    def on_backward(self, unit: Any) -> None:
        """``unit``'s backward begins: launch the gather of the unit whose backward comes next."""
        if self.config.backward_prefetch and not self.config.backward_prefetch_post:
            self._prefetch_next_backward(unit)

    def after_backward(self, unit: Any) -> None:
        """``unit``'s gradients are reduced and its full parameters freed: with
        ``backward_prefetch_post``, launch the gather of the unit whose backward comes next."""
        if self.config.backward_prefetch and self.config.backward_prefetch_post:
            self._prefetch_next_backward(unit)

    def _prefetch_next_backward(self, unit: Any) -> None:
        for ref in reversed(self.order):
            candidate = ref()
            if candidate is not None and candidate is not unit and not candidate._pre_backward_done:
                self.prefetch(candidate)
                return

    def prefetch(self, unit: Any) -> None:
        self.throttle()
        for h in unit.handles:
            h.prefetch()

    # [Note: limit_all_gathers]
    # The host may run ahead of the GPU, issuing all-gathers (each allocating a full unit) for units
    # whose compute is far in the future. With the limiter on, a gather first waits until the GPU
    # has reached the second-to-last free of a gathered unit, so at most two units' gathers run
    # ahead of compute. Only units gathered across ranks record frees: at world size 1 (or
    # NO_SHARD) the "unshard" is a cast or copy ordered after the compute stream's earlier work (on
    # it, or on the offload side stream, which waits for it first), so the caching allocator's
    # stream-ordered reuse bounds its memory, and a host wait there would only stall the host. On the CPU
    # no events are recorded: compute and the host are the same.
    def throttle(self) -> None:
        """Before a gather: with the limiter on, wait until the compute before the second-to-last free
        has finished (CUDA; nothing to wait for on CPU, where no events are recorded)."""
        if self.config.limit_all_gathers and len(self._free_events) >= 2:
            self.device.synchronize_event(self._free_events.popleft())

    def freed(self) -> None:
        """A gathered unit's full parameters were just freed (in stream order); the last two frees are kept."""
        if self.config.limit_all_gathers:
            event = self.device.record_event(self.device.current_stream())
            if event is not None:
                self._free_events.append(event)
                while len(self._free_events) > 2:
                    self._free_events.popleft()
