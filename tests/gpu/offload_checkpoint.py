"""Run under torchrun on a CUDA machine: sharded checkpoints of a CPU-offloaded model stay on the host.

    torchrun --standalone --nproc_per_node=1 tests/gpu/offload_checkpoint.py

With ``move_params_to_cpu=True`` the parameter shards and the optimizer state live on the host.
``sharded_state_dict()`` and ``sharded_optim_state_dict()`` must return their rows there, and
``save_checkpoint``/``load_checkpoint`` may use the device only for one flat parameter's gathered
values at a time, never for the rank's whole optimizer state. A model loaded from the checkpoint
must then train exactly like the one that saved it.

Prints one JSON line; exits non-zero when a check fails.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import load_checkpoint, save_checkpoint

WIDTH = 2048
LAYERS = 6  # 6 units of 16 MiB of fp32 parameters; Adam's state: 192 MiB, the largest unit's: 32 MiB


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = [FSDP(nn.Linear(WIDTH, WIDTH), move_params_to_cpu=True) for _ in range(LAYERS)]
    model = FSDP(nn.Sequential(*layers), move_params_to_cpu=True)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int, device: torch.device) -> float:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, WIDTH, generator=g).to(device)
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.item()


def local_devices(state: object) -> set[str]:
    """Device types of every tensor in a nested state dict (a DTensor counts by its local rows)."""
    found: set[str] = set()
    if isinstance(state, dict):
        for v in state.values():
            found |= local_devices(v)
    elif isinstance(state, list | tuple):
        for v in state:
            found |= local_devices(v)
    elif isinstance(state, DTensor):
        found.add(state.to_local().device.type)
    elif isinstance(state, torch.Tensor):
        found.add(state.device.type)
    return found


def growth(fn, device: torch.device) -> int:  # type: ignore[no-untyped-def]
    """Peak device memory above what was allocated before ``fn`` ran, in bytes."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def main() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    report: dict[str, object] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    unit_bytes = (WIDTH * WIDTH + WIDTH) * 4
    whole_optim_bytes = 2 * LAYERS * unit_bytes
    # loading stages one state value of one unit three times (the rows sent, the rows received and the
    # full values); saving less. 16 MiB more for the allocator's rounding (more with a roundup setting
    # in PYTORCH_CUDA_ALLOC_CONF). The whole optimizer state is 192 MiB.
    bound = 3 * unit_bytes + (16 << 20)
    report["bound_bytes"] = bound
    report["whole_optimizer_state_bytes"] = whole_optim_bytes

    model, optim = build()
    for step in range(2):
        train_step(model, optim, step, device)
    devices = local_devices(model.sharded_state_dict()) | local_devices(model.sharded_optim_state_dict(optim))
    report["sharded_state_devices"] = sorted(devices)
    ok = devices == {"cpu"}

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        report["save_growth_bytes"] = growth(lambda: save_checkpoint(path, model, optim), device)
        restored, restored_optim = build()
        report["load_growth_bytes"] = growth(lambda: load_checkpoint(path, restored, restored_optim), device)
    ok = ok and report["save_growth_bytes"] <= bound and report["load_growth_bytes"] <= bound  # type: ignore[operator]

    on_host = all(p.device.type == "cpu" for p in restored.parameters()) and all(
        t.device.type == "cpu" or t.dim() == 0
        for s in restored_optim.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    report["restored_on_host"] = on_host
    losses = [train_step(m, o, 7, device) for m, o in ((model, optim), (restored, restored_optim))]
    diff = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), restored.parameters(), strict=True)
    )
    report["losses"] = losses
    report["max_param_diff_after_step"] = diff
    ok = ok and on_host and losses[0] == losses[1] and diff == 0.0
    report["ok"] = ok
    print(json.dumps(report))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
