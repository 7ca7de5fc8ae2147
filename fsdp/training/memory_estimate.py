"""Before a job: one rank's peak memory over a training step, estimated at any world size.

:func:`estimate_memory` builds the model with its wrappers on the meta device, under torch's fake
process group of ``world_size`` ranks, and runs a warm-up step and one step under torch's tracker of
live tensors (``MemTracker``): the real wrapper, the real optimizer, the real activation checkpointing,
every tensor the step holds on one rank, with no memory and no peer (See [Note: simulated steps] in
``fsdp/comm/simulation.py``). A 30M-parameter GPT takes about two seconds at any world size.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp.comm.collectives import forget_world
from fsdp.comm.simulation import simulating
from fsdp.common.device import default_compute_device
from fsdp.training.optim_in_backward import optimizer_in_backward as _in_backward

__all__ = ["MemoryEstimate", "estimate_memory", "measure_memory"]


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """One rank's peak over a training step, as torch's ``MemTracker`` splits it (estimated by
    :func:`estimate_memory`, or measured by :func:`measure_memory`).

    ``breakdown`` maps categories to bytes at the peak, those of torch's FSDP2 tracker (See [Note:
    memory categories]): ``SHARDED_PARAM`` (this rank's shards), ``UNSHARDED_PARAM`` (gathered full
    parameters), ``ALL_GATHER`` (the cast shard an all-gather sends), ``SHARDED_GRAD``,
    ``UNSHARDED_GRAD`` (a unit's full gradient before its reduction), ``REDUCE_SCATTER`` (gradients
    in reduction), ``OPT`` (optimizer state and what its step allocates), ``ACT`` (activations),
    ``TEMP`` (other tensors of backward), ``BUFFER``, ``INP``."""

    world_size: int
    peak_bytes: int
    breakdown: dict[str, int]

    def fits(self, memory_bytes: int) -> bool:
        """Whether the peak stays within ``memory_bytes`` (allocator overhead not counted)."""
        return self.peak_bytes <= memory_bytes

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in self.breakdown.items() if v)
        return (
            f"peak {self.peak_bytes / 2**20:.1f} MiB per rank at world size {self.world_size} ({parts} MiB)"
        )


def estimate_memory(
    build: Callable[[], nn.Module],
    step: Callable[[nn.Module], torch.Tensor],
    world_size: int,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    optimizer_kwargs: dict[str, Any] | None = None,
    optimizer_in_backward: bool = False,
    device: str | None = None,
) -> MemoryEstimate:
    """One rank's peak memory over a training step of ``build()`` on ``world_size`` ranks.

    ``build()`` makes the model and its wrappers as the job will (it runs under
    ``torch.device("meta")``, so plain constructors need no change); ``step(model)`` runs the forward
    of one rank's batch and returns the loss (make the batch inside it: tensors made there are on
    the meta device too). The estimate then runs ``loss.backward()``, the optimizer's step (or the
    step inside backward, with ``optimizer_in_backward=True``) and ``zero_grad()``, twice (the
    first makes the optimizer state), and reports the second step's peak. ``device`` is the job's
    device type, ``"cuda"`` or ``"cpu"`` (default: CUDA when this machine has it): where this
    library's collectives and prefetching choose by device, the simulation follows that choice (pass
    ``device="cuda"`` to plan a GPU job from a laptop). The estimate counts tensors, as torch's
    tracker does: the CUDA caching allocator's fragmentation and the CUDA context come on top. Call
    it where no process group is initialized (before ``init_process_group``, or in a process of its
    own)::

        def build():
            model = GPT(cfg)
            for i, block in enumerate(model.blocks):
                model.blocks[i] = FSDP(block)
            return FSDP(model)

        def step(model):
            x = torch.randint(0, cfg.vocab, (4, 1024))
            return model(x, x)[1]

        print(fsdp.estimate_memory(build, step, world_size=64))
    """
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "estimate_memory needs no process group of its own and simulates one: call it before "
            "init_process_group(), or in a separate process (a notebook, a script run before the job)"
        )
    if world_size < 1:
        raise ValueError(f"estimate_memory: world_size must be at least 1, got {world_size}")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    target = device or default_compute_device(set()).type  # (CUDA when this machine has it)
    if target not in ("cuda", "cpu"):
        raise ValueError(f"estimate_memory: device must be 'cuda' or 'cpu', got {device!r}")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    fake_world = dist.group.WORLD
    try:
        with simulating(target), torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the tracker warns about outputs that hold no tensor)
            model = build()
            kwargs = dict(optimizer_kwargs or {})
            if optimizer_in_backward:
                optim: torch.optim.Optimizer = _in_backward(model, optimizer_class, **kwargs)
            else:
                optim = optimizer_class(model.parameters(), **kwargs)

            def train_step() -> None:
                torch.autograd.backward(step(model))
                optim.step()
                optim.zero_grad(set_to_none=True)

            train_step()
            estimate = measure_memory(model, optim, train_step, device="meta")
    finally:
        forget_world(fake_world)  # (the job's world may be given the same id)
        dist.destroy_process_group()
    return dataclasses.replace(estimate, world_size=world_size)


def measure_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    train_step: Callable[[], Any],
    device: str | torch.device | None = None,
) -> MemoryEstimate:
    """The peak of ``train_step()`` (one step of ``model``, run now) on this rank, split by what the
    tensors are for (:class:`~fsdp.training.memory_tracker.WrapperMemTracker`, torch's FSDP2 tracker
    told about this library's tensors: See [Note: memory categories]). Run a step before, so that
    the optimizer state exists. ``device``: whose memory (default: where the model's first parameter
    is). In a job, on every rank: each measures its own."""
    from fsdp.training.memory_tracker import (
        WrapperMemTracker,
    )  # (torch's trackers import sympy: not at import)

    if device is None:
        device = next(iter(model.parameters())).device
    kind = torch.device(device).type
    gc.collect()
    tracker = WrapperMemTracker(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the tracker warns about outputs that hold no tensor)
        with tracker:
            train_step()
    peak = tracker.get_tracker_snapshot("peak")
    cats = next((c for dev, c in peak.items() if torch.device(dev).type == kind), {})
    breakdown = {str(k).rsplit(".", 1)[-1]: int(v) for k, v in cats.items()}
    total = breakdown.pop("Total", 0)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return MemoryEstimate(world, total, breakdown)
