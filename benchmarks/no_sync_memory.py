"""Tensor bytes held during a gradient-accumulation window, by way of accumulating.

    torchrun --standalone --nproc_per_node=2 benchmarks/no_sync_memory.py [--out no_sync_memory.json]

The model is ``--blocks`` units of Linear(width, width) + Tanh, each its own wrapper (FULL_SHARD),
under a root that owns a Linear(width, 8) head. Each variant accumulates ``--micro`` micro-batches
(the last one outside ``no_sync()``, as a training loop does) and reports, per rank, the peak of
the live tensor bytes inside the window: every storage that the window's operations create or read
(shards, full parameters, gradients, accumulators, activations), sampled at every operation by a
``TorchDispatchMode`` with the storages' current sizes (a freed full parameter counts 0). The
variants:

- ``no_sync``: ``model.no_sync()``, full parameters follow ``reshard_after_forward`` (fairscale's
  behaviour, the default);
- ``no_sync_keep``: ``model.no_sync(keep_full_params=True)``, every unit keeps its full parameters;
- ``synced``: no ``no_sync()``, every micro-batch reduce-scatters its gradients into the shards.

Also reported: the fp32 bytes of the full model and of this rank's shards. Tensor bytes, not RSS
(see BENCHMARKING.md); the figures are the same on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fsdp import FSDP


class LiveBytes(TorchDispatchMode):
    """The peak, over the operations run inside, of the bytes of every storage seen so far and alive."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}
        self.peak = 0
        for t in tensors:
            self._see(t)

    def _see(self, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            self.refs.setdefault(storage._cdata, StorageWeakRef(storage))

    def now(self) -> int:
        total = 0
        for key, ref in list(self.refs.items()):
            if ref.expired():
                del self.refs[key]
            else:
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for t in tree_flatten((args, kwargs))[0]:
            self._see(t)
        self.peak = max(self.peak, self.now())
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._see(t)
        self.peak = max(self.peak, self.now())
        return out


def build(blocks: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [FSDP(nn.Sequential(nn.Linear(width, width), nn.Tanh())) for _ in range(blocks)]
    return FSDP(nn.Sequential(*layers, nn.Linear(width, 8)))


def window(model: nn.Module, variant: str, micro: int, batch: int, width: int) -> int:
    """Peak live tensor bytes over one accumulation window of ``micro`` micro-batches."""
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(batch, width, generator=g) for _ in range(micro)]
    state = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    for w in model.modules():  # the buffers the handles gather into, allocated and freed in place
        if isinstance(w, FSDP):
            state += [
                t for h in w.handles for t in (h._full, h._full_precision, h._lp_shard) if t is not None
            ]
    tracker = LiveBytes(state)
    context: Any = contextlib.nullcontext()
    if variant == "no_sync":
        context = model.no_sync()
    elif variant == "no_sync_keep":
        context = model.no_sync(keep_full_params=True)
    with tracker:
        with context:
            for x in xs[:-1]:
                model(x).pow(2).mean().backward()
        model(xs[-1]).pow(2).mean().backward()
    model.zero_grad()
    return tracker.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model = build(args.blocks, args.width)
    window(model, "synced", 1, args.batch, args.width)  # lazy init and the first step behind us
    full = 4 * (args.blocks * (args.width + 1) * args.width + (args.width + 1) * 8)
    report: dict[str, Any] = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "full_model_bytes": full,
        "shard_bytes": sum(4 * p.numel() for p in model.parameters()),
    }
    for variant in ("no_sync", "no_sync_keep", "synced"):
        report[f"{variant}_peak_bytes"] = window(model, variant, args.micro, args.batch, args.width)
    line = json.dumps(report)
    if dist.get_rank() == 0:
        sys.stdout.write(line + "\n")
        if args.out is not None:
            args.out.write_text(line + "\n")
    dist.barrier()
    time.sleep(0.1)  # See "Exit under gloo" in docs/design.md
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
