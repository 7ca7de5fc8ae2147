"""The only module that names ``torch.cuda``.

Streams and events are real on CUDA and no-ops on CPU, so the wrapper's code reads the same on
both: ``with handle.stream(s)``, ``handle.wait_stream(a, b)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["DeviceHandle", "default_compute_device", "is_accelerator"]


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


def is_accelerator(device: torch.device) -> bool:
    return device.type == "cuda"


def default_compute_device(param_devices: set[torch.device]) -> torch.device:
    """The compute device when the user names none: where the parameters already live.

    A module with no parameters computes on the current CUDA device if there is one, else CPU.
    """
    if param_devices:
        (device,) = param_devices
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
