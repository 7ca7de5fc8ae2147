"""Simulated steps: the wrapper run on the meta device under torch's fake process group.

See [Note: simulated steps] below; :func:`fsdp.estimate_memory` is the user of this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["device_type", "is_simulating", "simulating"]


# [Note: simulated steps]
# fsdp.estimate_memory runs a real training step of the real wrapper on the meta device under torch's
# fake process group (collectives that move no data), so that torch's memory tracker sees every
# tensor the step would hold on one rank of N, at no memory and in seconds. Two things cannot run
# there: reading values (meta tensors have none) and agreeing with peers (there are none). While
# simulating(), the cross-rank handshakes and checks return at once, sync_module_states broadcasts
# nothing, and deferred initialization keeps meta units on the meta device.
# Where the choice of an implementation depends on the device (gloo's CPU collectives, forward
# prefetch), a meta tensor stands for the device simulated (device_type), so the estimate follows
# the path the job will take.
_simulation: list[str] = [""]  # the device type simulated; "" when not simulating


@contextlib.contextmanager
def simulating(device_type: str = "cpu") -> Iterator[None]:
    """Within: a simulated step on ``device_type`` (See [Note: simulated steps])."""
    _simulation[0] = device_type
    try:
        yield
    finally:
        _simulation[0] = ""


def is_simulating() -> bool:
    return bool(_simulation[0])


def device_type(device: torch.device) -> str:
    """``device``'s type, or the simulated one for the meta device while simulating."""
    return _simulation[0] if device.type == "meta" and _simulation[0] else device.type
