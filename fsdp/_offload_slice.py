"""One slice of an :class:`~fsdp.offload_model.OffloadModel`: its layers, the names of its master
tensors, and their device copies. The engine (``fsdp/_offload_engine.py``) decides when a slice is
reloaded and freed; this module says what that means for its tensors.

[Note: offload residency]
Each slice owns one *device copy* per master parameter and buffer, allocated at first use. A slice
is OFFLOADED when the storage of its device copies is resized to zero and ON_DEVICE when it holds
(or a queued copy will hold) the master values. The layers never run with the masters: each
micro-batch runs ``torch.func.functional_call`` with *aliases* of the device copies (same storage,
own version counter, made with ``Tensor.set_``), so that

- the aliases saved by autograd (without checkpointing, e.g. a Linear saves its weight) stay
  valid across a free and a reload: freeing resizes the shared storage to zero, reloading resizes
  it back and copies the masters into it. See [Note: storage resize] in ``handle.py``.
- reload writes through the device copy, never through an alias, so autograd's saved-tensor
  version checks do not fire.

Forward leaves every slice OFFLOADED. Buffers that a forward updates in place (BatchNorm running
statistics; in-place updates need not bump the version counter, so every buffer is written back)
are copied back to their masters before the slice is freed.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["Residency"]


class Residency(enum.Enum):
    """Where a slice's working copy is. See [Note: offload residency]."""

    OFFLOADED = enum.auto()  # device copies hold no storage
    ON_DEVICE = enum.auto()  # device copies hold (or a queued copy will hold) the master values


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s storage with the same geometry but its own version counter."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return out


class _Slice:
    """One contiguous slice of layers: names of its master tensors and their device copies."""

    index: int
    start: int  # first layer, index into the user's Sequential
    stop: int  # one past the last layer
    model: nn.Sequential  # the user's model (registered on the OffloadModel, not here)
    layers: nn.Sequential  # container over model[start:stop]'s layer objects; not registered anywhere
    param_names: list[str]  # names in `layers`, tied parameters once
    buffer_names: list[str]
    numel: int  # parameter elements (the size used to balance slices)
    residency: Residency
    loaded_event: Any  # recorded on copy_stream after the reload; None on CPU
    generation: int  # bumped whenever a device copy is re-allocated with a new storage
    device_params: list[torch.Tensor | None]  # per param_names; storage size 0 while OFFLOADED
    device_buffers: list[torch.Tensor | None]  # per buffer_names; same

    def __init__(self, index: int, start: int, stop: int, model: nn.Sequential) -> None:
        self.index = index
        self.start = start
        self.stop = stop
        self.model = model
        self.layers = nn.Sequential(*[model[i] for i in range(start, stop)])
        self.param_names = [name for name, _ in self.layers.named_parameters()]
        self.buffer_names = [name for name, _ in self.layers.named_buffers()]
        self.numel = sum(p.numel() for p in self.layers.parameters())
        self.residency = Residency.OFFLOADED
        self.loaded_event = None
        self.generation = 0
        self.device_params = [None] * len(self.param_names)
        self.device_buffers = [None] * len(self.buffer_names)

    def describe(self) -> str:
        return f"slice {self.index} (layers {self.start}..{self.stop - 1})"

    def master_params(self) -> list[nn.Parameter]:
        """The master parameters, per ``param_names``. Pre: the layers are those of construction."""
        if len(self.model) < self.stop or any(
            self.layers[i] is not self.model[self.start + i] for i in range(self.stop - self.start)
        ):
            raise RuntimeError(
                f"OffloadModel: a layer of {self.describe()} was replaced after construction; build a new "
                "OffloadModel around the changed nn.Sequential"
            )
        params = dict(self.layers.named_parameters())
        if list(params) != self.param_names:
            raise RuntimeError(
                f"OffloadModel: the parameters of {self.describe()} changed after construction "
                f"(had {self.param_names}, now {list(params)}); build a new OffloadModel instead"
            )
        return list(params.values())

    def master_buffers(self) -> list[torch.Tensor]:
        buffers = dict(self.layers.named_buffers())
        if list(buffers) != self.buffer_names:
            raise RuntimeError(
                f"OffloadModel: the buffers of {self.describe()} changed after construction "
                f"(had {self.buffer_names}, now {list(buffers)}); build a new OffloadModel instead"
            )
        return list(buffers.values())

    def device_tensors(self) -> list[torch.Tensor]:
        """The device copies, params then buffers. Pre: the slice has been loaded once."""
        out = [t for t in self.device_params + self.device_buffers if t is not None]
        assert len(out) == len(self.device_params) + len(self.device_buffers), "slice never loaded"
        return out

    def aliases(
        self, params_requiring_grad: Sequence[bool], buffers: Sequence[torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Fresh aliases of the device copies to run the layers with. See [Note: offload residency].

        ``params_requiring_grad[i]`` makes alias i a leaf that requires grad. ``buffers`` (device
        tensors, per ``buffer_names``) replace the buffer copies, e.g. a snapshot for recompute.
        Pre: ON_DEVICE.
        """
        assert self.residency is Residency.ON_DEVICE, f"{self.describe()} is not on the device"
        out: dict[str, torch.Tensor] = {}
        for name, t, needs in zip(self.param_names, self.device_params, params_requiring_grad):
            assert t is not None
            out[name] = _alias(t).requires_grad_(needs)
        for i, name in enumerate(self.buffer_names):
            if buffers is not None:
                out[name] = buffers[i]
            else:
                t = self.device_buffers[i]
                assert t is not None
                out[name] = _alias(t)
        return out

    def run(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The slice's layers applied to ``x`` with ``tensors`` in place of the masters."""
        out = torch.func.functional_call(self.layers, tensors, (x,), strict=True)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"OffloadModel: {self.describe()} returned {type(out).__name__}; OffloadModel passes one "
                "tensor from slice to slice, so the last layer of every slice (and of the model) must "
                "return a tensor (choose num_slices so that layers returning tuples are not at a "
                "boundary, or wrap them)"
            )
        return out
