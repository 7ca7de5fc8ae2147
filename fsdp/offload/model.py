"""OffloadModel: train an ``nn.Sequential`` larger than the device, one slice of layers at a time.

The model is cut into ``num_slices`` contiguous slices of about equal parameter count. Every
parameter and buffer (the *master* tensors, what ``parameters()`` returns and the optimizer steps)
stays on ``offload_device``. Forward and backward bring one slice at a time to ``device``, run it
over every micro-batch, and drop it again. Gradients are returned to the masters on
``offload_device``.

The slices' residency, the schedule of copies and compute, and the streams live in
``fsdp/offload/layer_slice.py`` and ``fsdp/offload/engine.py``, with their design notes
([Note: offload residency], [Note: offload schedule], [Note: offload streams],
[Note: offload activations]).
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fsdp.common.device import DeviceHandle, default_compute_device, device_available
from fsdp.common.torch_compile import run_eagerly_under_compile
from fsdp.offload.engine import OffloadModelConfig, _Engine, _SliceFunction
from fsdp.offload.layer_slice import Residency, _Slice

__all__ = ["OffloadModel", "OffloadModelConfig", "Residency", "split_layers"]

logger = logging.getLogger(__name__)


def split_layers(sizes: Sequence[int], num_slices: int) -> list[tuple[int, int]]:
    """Cut layers into ``num_slices`` contiguous, non-empty ``[start, stop)`` ranges of about equal size.

    Cut k is placed where the running total of ``sizes`` is closest to ``k * total / num_slices``
    (ties go to the later layer, so parameter-free layers stay with the layer before them). When
    every size is zero, layers are counted instead.

    Example: ``split_layers([10, 0, 10, 0, 10, 0], 3) == [(0, 2), (2, 4), (4, 6)]`` (three
    Linear+ReLU pairs).

    Pre: ``1 <= num_slices <= len(sizes)``, sizes >= 0.
    Post: the ranges cover ``range(len(sizes))`` in order, each non-empty.
    """
    n = len(sizes)
    if not 1 <= num_slices <= n:
        raise ValueError(f"num_slices must be between 1 and the number of layers ({n}), got {num_slices}")
    weights = list(sizes) if sum(sizes) > 0 else [1] * n
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    total = prefix[-1]
    cuts = [0]
    for k in range(1, num_slices):
        target = total * k / num_slices
        # Leave at least one layer for this slice and for each slice after it.
        candidates = range(cuts[-1] + 1, n - (num_slices - k) + 1)
        cuts.append(min(candidates, key=lambda b: (abs(prefix[b] - target), -b)))
    cuts.append(n)
    return list(itertools.pairwise(cuts))


def _as_device(value: Any, name: str) -> torch.device:
    if isinstance(value, str):
        value = torch.device(value)
    if not isinstance(value, torch.device):
        raise TypeError(
            f"OffloadModel: `{name}` must be a torch.device or a string such as 'cuda', got {value!r}"
        )
    if value.type == "meta":
        raise ValueError(
            f"OffloadModel: `{name}`=meta holds no values, but OffloadModel copies parameter values between "
            "offload_device and device; pass real devices (e.g. device='cuda', offload_device='cpu')"
        )
    if not device_available(value):
        raise ValueError(
            f"OffloadModel: `{name}`={value} is not available in this process; "
            "pass device=torch.device('cpu') on a machine without CUDA"
        )
    return default_compute_device({value})  # "cuda" -> "cuda:<current>", so device comparisons hold


def _check_no_buffer_in_two_slices(model: nn.Sequential, slices: Sequence[_Slice]) -> None:
    """Refuse a buffer that layers in two slices use. See [Note: offload schedule]."""
    names = {id(b): name for name, b in model.named_buffers()}
    where: dict[int, list[int]] = {}
    for sl in slices:
        for b in sl.layers.buffers():
            where.setdefault(id(b), []).append(sl.index)
    for key, indices in where.items():
        if len(indices) > 1:
            layers = [i for i, layer in enumerate(model) if any(id(b) == key for b in layer.buffers())]
            raise ValueError(
                f"OffloadModel: buffer {names[key]!r} is used by layers {layers}, which fall in slices "
                f"{indices} ({[slices[i].describe() for i in indices]}); a slice's buffers are written back "
                "only after the next slice was copied in, so that slice would see a stale value. Choose "
                "num_slices so that these layers share one slice, or do not share the module (or buffer) "
                "across the model"
            )


class OffloadModel(nn.Module):
    """Train an ``nn.Sequential`` whose parameters live on ``offload_device``, computing on ``device``.

    A drop-in for fairscale's experimental ``OffloadModel`` (same constructor)::

        model = OffloadModel(nn.Sequential(...), device=torch.device("cuda"), num_slices=4,
                             checkpoint_activation=True, num_microbatches=2)
        optim = torch.optim.Adam(model.parameters())  # master params, on offload_device
        loss = loss_fn(model(x), target)             # output on `device`
        loss.backward()                              # grads land in param.grad on offload_device
        optim.step()

    The layers are cut into ``num_slices`` contiguous slices of about equal parameter count
    (``slice_bounds``). Forward brings each slice to ``device`` in turn (the next one is copied in
    while the current one computes), runs it over every micro-batch and frees it; backward does
    the same in reverse order. At most two slices are on the device at a time. See
    ``docs/offload-model.md`` and the notes in this module.

    Args:
        model: the ``nn.Sequential`` to train. Its parameters and buffers are moved to
            ``offload_device`` in place (same ``Parameter`` objects; pinned when ``device`` is CUDA
            and ``offload_device`` the CPU).
        device: where the layers compute.
        offload_device: where parameters, buffers, gradients and the optimizer live.
        num_slices: how many slices; ``1 <= num_slices <= len(model)`` (fairscale clamps a larger
            value; here it is a ``ValueError``).
        checkpoint_activation: keep only each slice's input (on ``offload_device``) and recompute
            the slice in backward, instead of keeping its autograd graph on ``device``.
        num_microbatches: split dim 0 of the input into this many micro-batches (sizes differ
            by at most one; a batch of fewer rows gets one micro-batch per row) and run each slice
            over all of them before moving on.

    The options are readable as fairscale's attributes: ``device``, ``offload_device``,
    ``num_slices``, ``num_microbatches``, ``checkpoint_activation`` (read-only).

    Pre (forward): ``x`` is one tensor, with at least one dimension when ``num_microbatches > 1``,
    and every layer keeps the batch in dim 0. Post: the output is on ``device``; the parameters
    and buffers are still on ``offload_device``.

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential``; an option has the wrong type.
        ValueError: ``model`` is empty; ``num_slices`` or ``num_microbatches`` out of range; a
            device that is not available or is ``meta``; a parameter or buffer on ``meta``; a buffer
            used by layers in two slices.
    """

    module: nn.Sequential  # the user's model, its tensors on offload_device
    config: OffloadModelConfig
    _engine: _Engine

    def __init__(
        self,
        model: nn.Sequential,
        device: torch.device,
        offload_device: torch.device = torch.device("cpu"),  # noqa: B008 (fairscale's signature)
        num_slices: int = 3,
        checkpoint_activation: bool = False,
        num_microbatches: int = 1,
    ) -> None:
        super().__init__()
        run_eagerly_under_compile()  # See [Note: torch.compile]
        if not isinstance(model, nn.Sequential):
            raise TypeError(
                f"OffloadModel needs an nn.Sequential, got {type(model).__name__}; express the model as "
                "nn.Sequential(layer, layer, ...) whose layers each take and return one tensor"
            )
        if len(model) == 0:
            raise ValueError("OffloadModel got an empty nn.Sequential; give it at least one layer")
        config = OffloadModelConfig(
            device=_as_device(device, "device"),
            offload_device=_as_device(offload_device, "offload_device"),
            num_slices=num_slices,
            checkpoint_activation=checkpoint_activation,
            num_microbatches=num_microbatches,
        )
        if num_slices > len(model):
            raise ValueError(
                f"OffloadModel: num_slices={num_slices} but the nn.Sequential has only {len(model)} "
                f"layers; use 1 <= num_slices <= {len(model)}"
            )
        meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if meta:
            raise ValueError(
                f"OffloadModel: {meta[0]!r}{f' (and {len(meta) - 1} more)' if len(meta) > 1 else ''} is on "
                "the meta device and holds no values; materialize the model first "
                "(model.to_empty(device='cpu'), then initialize it)"
            )
        if config.device == config.offload_device and config.device.type != "cpu":
            warnings.warn(
                f"OffloadModel: device and offload_device are both {config.device}; nothing is offloaded",
                stacklevel=2,
            )
        if num_microbatches > 1 and any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()
        ):
            warnings.warn(
                "OffloadModel: with num_microbatches > 1, batch-norm layers compute their statistics per "
                "micro-batch, so results differ from running the whole batch at once",
                stacklevel=2,
            )
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in model]
        slices = [_Slice(i, a, b, model) for i, (a, b) in enumerate(split_layers(sizes, num_slices))]
        _check_no_buffer_in_two_slices(model, slices)
        self.module = model
        self.config = config
        self._place_masters(move=True)
        self._engine = _Engine(config, slices)
        total = sum(sizes)
        logger.info(
            "OffloadModel: %d layers, %.2fM parameters in %d slices of %s parameters; device %s, offload %s",
            len(model),
            total / 1e6,
            len(slices),
            [sl.numel for sl in slices],
            config.device,
            config.offload_device,
        )

    def _place_masters(self, move: bool) -> None:
        """Masters on offload_device (``move``), pinned when they feed a CUDA device from the CPU."""
        handle = DeviceHandle(self.config.device)
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                data = t.data.to(self.config.offload_device) if move else t.data
                t.data = handle.pin_memory(data)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """After unpickling (``torch.load``): pin the masters again where this process can."""
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        if device_available(self.config.device):
            self._place_masters(move=False)

    @property
    def slice_bounds(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` layer range of each slice, in order."""
        return [(sl.start, sl.stop) for sl in self._engine.slices]

    # fairscale's attributes, read-only (they are fixed at construction)
    @property
    def device(self) -> torch.device:
        """Where the layers compute."""
        return self.config.device

    @property
    def offload_device(self) -> torch.device:
        """Where parameters, buffers, gradients and the optimizer live."""
        return self.config.offload_device

    @property
    def num_slices(self) -> int:
        return self.config.num_slices

    @property
    def num_microbatches(self) -> int:
        """The most micro-batches a forward uses (``min(num_microbatches, rows)`` for a batch)."""
        return self.config.num_microbatches

    @property
    def checkpoint_activation(self) -> bool:
        return self.config.checkpoint_activation

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"device={c.device}, offload_device={c.offload_device}, slices={self.slice_bounds}, "
            f"checkpoint_activation={c.checkpoint_activation}, num_microbatches={c.num_microbatches}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"OffloadModel.forward takes one tensor (what the first layer takes), got {type(x).__name__}"
            )
        m = self.config.num_microbatches
        if m > 1 and x.dim() == 0:
            raise ValueError(
                f"OffloadModel: cannot split a 0-dim tensor into num_microbatches={m}; give a batch in "
                "dim 0, or use num_microbatches=1"
            )
        engine = self._engine
        if not torch.is_grad_enabled():
            return engine.infer(x)
        engine.begin_forward()
        h = x
        try:
            for sl in engine.slices:
                h = _SliceFunction.apply(engine, sl.index, h, *sl.master_params())  # type: ignore[no-untyped-call]
        except BaseException:
            engine.end_forward(failed=True)
            raise
        engine.end_forward()
        return h
