"""One slice of an :class:`~fsdp.offload.model.OffloadModel`: its layers, the names of its master
tensors, and their device copies. The engine (``fsdp/offload/engine.py``) decides when a slice is
reloaded and freed; this module says what that means for its tensors.

[Note: offload residency]
Each slice owns one *device copy* per master parameter and buffer, allocated at first use. A slice
is OFFLOADED when the storage of its device copies is resized to zero and ON_DEVICE when it holds
(or a queued copy will hold) the master values. The layers never run with the masters: for each
call, ``_Slice.run`` puts other tensors into the slice's *slots* (every ``module._parameters[attr]``
and ``module._buffers[attr]`` that holds one of the slice's masters, each (module object,
attribute) once, so a module used twice in the slice and tied parameters are swapped once) and
puts the masters back, in reverse order, when the call returns or raises. The parameters it puts
there are *aliases* of the device copies (same storage, own version counter, made with
``Tensor.set_``), so that

- the aliases saved by autograd (without checkpointing, e.g. a Linear saves its weight) stay
  valid across a free and a reload: freeing resizes the shared storage to zero, reloading resizes
  it back and copies the masters into it. See [Note: storage resize] in ``core/handle.py``.
- reload writes through the device copy, never through an alias, so autograd's saved-tensor
  version checks do not fire.

Forward leaves every slice OFFLOADED, and so does the end of every backward (see [Note: offload
schedule] in ``fsdp/offload/engine.py``).

Buffers are state, not weights: a slice's forward runs with one list of buffer values, passed
from one micro-batch to the next. A layer may update a buffer in place (BatchNorm running
statistics; in-place updates need not bump the version counter, so every buffer is written back)
or assign a new tensor to it (``self.avg = 0.9 * self.avg + m``): ``run`` reads every buffer slot
back after the call and keeps the new tensor (detached) as that buffer's value for the following
micro-batches. At the end of the slice's forward the final values are copied back to the masters,
before the slice is freed. Without checkpointing the forward runs with its own clones of the
buffers rather than aliases, so that a buffer the graph saved keeps its forward-time value after
the write-back changes the master and a reload copies the master into the device copies. A
recompute runs with fresh copies of the snapshot taken before forward, passed on the same way,
and writes nothing back.

Pickling a slice (``torch.save`` of the model) drops its device copies: the pickled slice is
OFFLOADED with no copies, and they are allocated again at its first use.
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


# (module object, attribute, index into the slice's param_names or buffer_names): one place where a
# layer looks a master up, ``module._parameters[attribute]`` or ``module._buffers[attribute]``.
_Slot = tuple[nn.Module, str, int]


def _slots(layers: nn.Module, tensors: Sequence[torch.Tensor], buffers: bool) -> list[_Slot]:
    """Every (module, attribute) under ``layers`` that holds one of ``tensors``, each once.

    ``layers.modules()`` yields a module used twice once, so ``nn.Sequential(*[layer] * 4)`` has one
    slot per tensor of ``layer``; a parameter tied across two modules has two slots, one index.
    Post: every index of ``tensors`` has at least one slot.
    """
    index = {id(t): i for i, t in enumerate(tensors)}
    out: list[_Slot] = []
    for module in layers.modules():
        table = module._buffers if buffers else module._parameters
        for attr, t in table.items():
            if t is not None:
                out.append((module, attr, index[id(t)]))
    assert {i for _, _, i in out} == set(range(len(tensors))), "a tensor without a slot"
    return out


class _Slice:
    """One contiguous slice of layers: its master tensors' names and slots, and their device copies."""

    index: int
    start: int  # first layer, index into the user's Sequential
    stop: int  # one past the last layer
    model: nn.Sequential  # the user's model (registered on the OffloadModel, not here)
    layers: nn.Sequential  # container over model[start:stop]'s layer objects; not registered anywhere
    param_names: list[str]  # names in `layers`, tied parameters once
    buffer_names: list[str]
    param_slots: list[_Slot]  # where the layers look each parameter up; see [Note: offload residency]
    buffer_slots: list[_Slot]
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
        params = dict(self.layers.named_parameters())
        buffers = dict(self.layers.named_buffers())
        self.param_names = list(params)
        self.buffer_names = list(buffers)
        self.param_slots = _slots(self.layers, list(params.values()), buffers=False)
        self.buffer_slots = _slots(self.layers, list(buffers.values()), buffers=True)
        self.numel = sum(p.numel() for p in params.values())
        self.residency = Residency.OFFLOADED
        self.loaded_event = None
        self.generation = 0
        self.device_params = [None] * len(self.param_names)
        self.device_buffers = [None] * len(self.buffer_names)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the device copies (zero-size storage while OFFLOADED, which ``torch.load``
        cannot restore); they are allocated again at first use. See [Note: offload residency]."""
        state = self.__dict__.copy()
        state["residency"] = Residency.OFFLOADED
        state["loaded_event"] = None
        state["device_params"] = [None] * len(self.param_names)
        state["device_buffers"] = [None] * len(self.buffer_names)
        return state

    def describe(self) -> str:
        return f"slice {self.index} (layers {self.start}..{self.stop - 1})"

    def model_name(self, name: str) -> str:
        """``name`` (relative to ``layers``) as it is named in the user's model: "1.avg" -> "5.avg"."""
        head, _, rest = name.partition(".")
        return f"{self.start + int(head)}.{rest}"

    def master_params(self) -> list[nn.Parameter]:
        """The master parameters, per ``param_names``. Pre: the layers are those of construction."""
        if len(self.model) < self.stop or any(
            self.layers[i] is not self.model[self.start + i] for i in range(self.stop - self.start)
        ):
            raise RuntimeError(
                f"OffloadModel: a layer of {self.describe()} was replaced after construction; build a new "
                "OffloadModel around the changed nn.Sequential"
            )
        return self._masters("parameters", self.param_names, self.param_slots)  # type: ignore[return-value]

    def master_buffers(self) -> list[torch.Tensor]:
        """The master buffers, per ``buffer_names``."""
        return self._masters("buffers", self.buffer_names, self.buffer_slots)

    def _masters(self, kind: str, names: list[str], slots: list[_Slot]) -> list[torch.Tensor]:
        """The masters, after the strict check: the same names in the same slots as at construction,
        so that ``run`` replaces every one of them (a master in a slot that ``run`` does not swap,
        e.g. a submodule added later with a tied parameter, would be computed with)."""
        buffers = kind == "buffers"
        found = dict(self.layers.named_buffers() if buffers else self.layers.named_parameters())
        masters = list(found.values())
        if list(found) != names or _slots(self.layers, masters, buffers) != slots:
            raise RuntimeError(
                f"OffloadModel: the {kind} of {self.describe()} changed after construction (had {names}, "
                f"now {list(found)}, or they moved between the modules that hold them); build a new "
                "OffloadModel instead"
            )
        return masters

    def device_tensors(self) -> list[torch.Tensor]:
        """The device copies, params then buffers. Pre: the slice has been loaded once."""
        out = [t for t in self.device_params + self.device_buffers if t is not None]
        assert len(out) == len(self.device_params) + len(self.device_buffers), "slice never loaded"
        return out

    def param_aliases(self, requires_grad: Sequence[bool]) -> list[torch.Tensor]:
        """Fresh aliases of the parameters' device copies, per ``param_names``; alias i is a leaf
        that requires grad when ``requires_grad[i]``. See [Note: offload residency]. Pre: ON_DEVICE.
        """
        assert self.residency is Residency.ON_DEVICE, f"{self.describe()} is not on the device"
        out = []
        for t, needs in zip(self.device_params, requires_grad, strict=True):
            assert t is not None
            out.append(_alias(t).requires_grad_(needs))
        return out

    def buffer_aliases(self) -> list[torch.Tensor]:
        """Aliases of the buffers' device copies, per ``buffer_names``. Pre: ON_DEVICE."""
        assert self.residency is Residency.ON_DEVICE, f"{self.describe()} is not on the device"
        out = []
        for t in self.device_buffers:
            assert t is not None
            out.append(_alias(t))
        return out

    def run(
        self, x: torch.Tensor, params: Sequence[torch.Tensor], buffers: list[torch.Tensor]
    ) -> torch.Tensor:
        """The slice's layers applied to ``x`` with ``params`` and ``buffers`` in place of the masters.

        Every slot gets its tensor for the call and its master back afterwards, also when a layer
        raises. ``buffers`` is updated in place: entry i is the value of buffer i after the call,
        which is the tensor passed in (perhaps updated in place) unless a layer assigned a new one
        to the buffer; that one is kept, detached.

        Example: a layer doing ``self.avg = 0.9 * self.avg + x.mean()`` with ``buffers == [a]``
        leaves ``buffers == [(0.9 * a + x.mean()).detach()]`` and its ``avg`` back at the master.
        Pre: one tensor per name in ``param_names`` / ``buffer_names``.
        """
        assert len(params) == len(self.param_names) and len(buffers) == len(self.buffer_names)
        given = list(buffers)
        swapped: list[tuple[dict[str, Any], str, Any]] = []  # (table, attribute, master), in swap order
        try:
            for slots, values, kind in (
                (self.param_slots, params, "_parameters"),
                (self.buffer_slots, given, "_buffers"),
            ):
                for module, attr, i in slots:
                    table: dict[str, Any] = getattr(module, kind)
                    swapped.append((table, attr, table[attr]))
                    table[attr] = values[i]
            out = self.layers(x)
            for module, attr, i in self.buffer_slots:
                now = module._buffers.get(attr)
                if now is not given[i]:
                    buffers[i] = self._reassigned(i, now, given[i])
        finally:
            for table, attr, master in reversed(swapped):
                table[attr] = master
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"OffloadModel: {self.describe()} returned {type(out).__name__}; OffloadModel passes one "
                "tensor from slice to slice, so the last layer of every slice (and of the model) must "
                "return a tensor (choose num_slices so that layers returning tuples are not at a "
                "boundary, or wrap them)"
            )
        return out

    def _reassigned(self, i: int, now: Any, before: torch.Tensor) -> torch.Tensor:
        """The new value a layer assigned to buffer ``i``, checked: it is written back into the master."""
        if not isinstance(now, torch.Tensor) or now.shape != before.shape or now.dtype != before.dtype:
            what = (
                f"shape {tuple(now.shape)} and dtype {now.dtype}"
                if isinstance(now, torch.Tensor)
                else repr(now)
            )
            raise RuntimeError(
                f"OffloadModel: a layer of {self.describe()} set buffer "
                f"{self.model_name(self.buffer_names[i])!r} to {what} in forward, but it had shape "
                f"{tuple(before.shape)} and dtype {before.dtype}; OffloadModel copies each buffer's new "
                "value into its master, so assign a tensor of the same shape and dtype"
            )
        return now.detach()
