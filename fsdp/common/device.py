"""The only module that names ``torch.cuda``.

Streams and events are real on CUDA and no-ops on CPU, so the wrapper's code reads the same on
both: ``with handle.stream(s)``, ``handle.wait_stream(a, b)``.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "DeviceHandle",
    "SideCopies",
    "allocated_bytes",
    "default_compute_device",
    "device_available",
    "is_accelerator",
    "with_index",
]


class _NullStream:
    """Stands in for a stream on devices that execute in program order (CPU)."""

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class DeviceHandle:
    """Streams, events and synchronization for one compute device."""

    device: torch.device

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.is_cuda else _NullStream()

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device) if self.is_cuda else _NullStream()  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        if self.is_cuda:
            with torch.cuda.stream(stream):
                yield
        else:
            yield

    def wait_stream(self, waiter: Any, producer: Any) -> None:
        """Make ``waiter`` wait for the work queued so far on ``producer``."""
        if self.is_cuda:
            waiter.wait_stream(producer)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    # Events, pinned memory and RNG state (added for OffloadModel). Every method is a no-op or an
    # identity on CPU, so callers need no device checks of their own.

    def record_event(self, stream: Any) -> Any:
        """An event marking the work queued so far on ``stream``; ``None`` on CPU."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)  # type: ignore[no-untyped-call]
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait (on the device, not the host) for ``event``; no-op for ``None``."""
        if self.is_cuda and event is not None:
            stream.wait_event(event)

    def synchronize_event(self, event: Any) -> None:
        """Block the host until ``event`` has completed; no-op for ``None``."""
        if self.is_cuda and event is not None:
            event.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` still reads ``tensor`` (CUDA tensors only)."""
        if self.is_cuda and tensor.is_cuda:
            tensor.record_stream(stream)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in page-locked memory when it is on the CPU and this handle is CUDA; else itself.

        Pinned host memory is what lets host<->device copies run asynchronously on a side stream.
        """
        if self.is_cuda and tensor.device.type == "cpu" and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def should_pin(self, host_device: torch.device) -> bool:
        """Whether host buffers on ``host_device`` that feed this device should be pinned."""
        return self.is_cuda and host_device.type == "cpu"

    def get_rng_state(self) -> torch.Tensor | None:
        """The device's RNG state (CUDA), or ``None`` where the CPU generator is the only one."""
        return torch.cuda.get_rng_state(self.device) if self.is_cuda else None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """Restore a state from :meth:`get_rng_state`; no-op for ``None``."""
        if self.is_cuda and state is not None:
            torch.cuda.set_rng_state(state, self.device)


class _EventWork:
    """A work object for ``Pending``: ``wait()`` orders the current stream after an event."""

    def __init__(self, device: DeviceHandle, event: Any) -> None:
        self.device, self.event = device, event

    def wait(self) -> None:
        self.device.wait_event(self.device.current_stream(), self.event)


class SideCopies:
    """Host<->device copies of offloaded shards and their gradients on one side stream (CUDA).

    Copies are queued asynchronously (pinned host memory) so that they overlap compute queued on the
    current stream, and the host never waits for them until their results are needed. Memory
    safety comes from ordering and from holding tensors, not from ``record_stream``:

    - the side stream first waits for the work queued so far on the current stream, where the
      tensors it reads or writes were produced or allocated (a buffer allocated on the current
      stream may reuse memory that queued compute still uses);
    - the current stream waits for a copy through ``wait()`` of what :meth:`to_device` returns;
    - a device tensor copied to the host is held until the copy's event has completed.

    One instance per CUDA device (:meth:`for_device`); FSDP uses none on CPU, where the offloaded
    shard already lives on the compute device. On CPU every stream and event call is a no-op and the
    copies happen at once, which is how the tests drive this bookkeeping without a GPU.
    """

    _instances: dict[torch.device, SideCopies] = {}

    def __init__(self, device: DeviceHandle) -> None:
        self.device = device
        self.stream = device.new_stream()
        self._held: collections.deque[tuple[Any, tuple[torch.Tensor, ...]]] = collections.deque()

    @classmethod
    def for_device(cls, device: torch.device) -> SideCopies:
        if device not in cls._instances:
            cls._instances[device] = cls(DeviceHandle(device))
        return cls._instances[device]

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run the body on the side stream, after the work queued so far on the current stream.

        A collective launched inside (NCCL) orders itself after the side stream's copies."""
        self.device.wait_stream(self.stream, self.device.current_stream())
        with self.device.stream(self.stream):
            yield

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> _EventWork:
        """Queue ``dst.copy_(src)`` (host -> device, with any cast on the device) on the side stream."""
        with self.side():
            dst.copy_(src, non_blocking=True)
        return _EventWork(self.device, self.device.record_event(self.stream))

    def to_host(self, src: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """Queue a copy of the device tensor ``src`` (cast to ``dtype`` on the device) into new pinned
        host memory. Returns ``(host tensor, event)``: read the host tensor only after
        ``DeviceHandle.synchronize_event(event)``."""
        self.release_finished()
        with self.side():
            cast = src.to(dtype)
            host = torch.empty(src.shape, dtype=dtype, pin_memory=self.device.is_cuda)
            host.copy_(cast, non_blocking=True)
        event = self.device.record_event(self.stream)
        self._held.append((event, (src, cast)))
        return host, event

    @classmethod
    def synchronize_all(cls) -> None:
        for copies in cls._instances.values():
            copies.synchronize()

    def synchronize(self) -> None:
        """Block the host until every copy queued so far has finished; drop what they held."""
        self.device.synchronize_event(self.device.record_event(self.stream))
        self._held.clear()

    def release_finished(self) -> None:
        """Drop the device sources of the host copies that have finished (never blocks)."""
        while self._held and (self._held[0][0] is None or self._held[0][0].query()):
            self._held.popleft()


def is_accelerator(device: torch.device) -> bool:
    return device.type == "cuda"


def default_compute_device(
    param_devices: set[torch.device], fallback: set[torch.device] | None = None, prefer_cuda: bool = False
) -> torch.device:
    """The compute device when the user names none: where the parameters already live.

    A module with no parameters of its own uses ``fallback`` (e.g. the devices of its inner
    wrappers) when that names one device. With ``prefer_cuda`` and parameters on the CPU, the current
    CUDA device if there is one: FSDP sets it for offload (``move_params_to_cpu``: offloading is for
    computing elsewhere, fairscale's default) and for a process group that sends only CUDA tensors
    (NCCL). Otherwise the current CUDA device if there is one, else the CPU.
    """
    devices = param_devices or fallback or set()
    if len(devices) == 1:
        (device,) = devices
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if not (prefer_cuda and device.type == "cpu" and torch.cuda.is_available()):
            return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allocated_bytes(device: torch.device) -> tuple[int, int] | None:
    """``(now, peak)`` bytes of the caching allocator of a CUDA ``device``; ``None`` elsewhere (the CPU
    keeps no such count)."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def with_index(device: torch.device) -> torch.device:
    """``cuda`` as the current CUDA device (``cuda:N``), the name tensors on it report; else ``device``."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_available(device: torch.device) -> bool:
    """Whether tensors can be placed on ``device`` in this process (CUDA: built, present, in range).

    Devices other than CUDA are left to torch to refuse at first use.
    """
    if device.type != "cuda":
        return True
    if not torch.cuda.is_available():
        return False
    return device.index is None or device.index < torch.cuda.device_count()
