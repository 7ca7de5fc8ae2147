"""Run under torchrun on a CUDA machine: the training utilities on CUDA at world size 1.

    torchrun --standalone --nproc_per_node=1 tests/gpu/cuda_training.py

- ``fsdp.DistributedDataParallel`` (side streams for its all-reduces, fp16 all-reduce buffers)
  trains like the plain model on the GPU;
- ``clip_grad_norm_`` of a wrapped model returns torch's norm of the plain model's gradients and
  clips them the same way;
- ``checkpoint_wrapper`` recomputes dropout with the forward's CUDA RNG state (also for a tensor
  passed by keyword) and offloads the saved activations to pinned host memory;
- ``.cuda()`` on a model wrapped with CPU offload is refused with a clear error;
- fp16 mixed precision with ``ShardedGradScaler`` (CUDA kernels, with and without CPU offload): a
  step whose loss overflowed is skipped everywhere and halves the scale, the next one trains.

Prints one JSON line; exits non-zero when a check fails.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fsdp import DistributedDataParallel, ShardedGradScaler, checkpoint_wrapper
from fsdp import FullyShardedDataParallel as FSDP


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 16))


def batches(device: torch.device, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(32, 256, generator=g).to(device), torch.randn(32, 16, generator=g).to(device))
        for _ in range(n)
    ]


def largest_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (p - q.to(p.device)).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def ddp_parity(device: torch.device, **kwargs: object) -> float:
    ref = mlp().to(device)
    model = DistributedDataParallel(copy.deepcopy(ref), **kwargs)  # type: ignore[arg-type]
    optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    for x, y in batches(device, 3):
        for m, opt in zip((ref, model), optims):
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return largest_param_diff(ref, model.module)


def clip_norms(device: torch.device) -> tuple[float, float, float]:
    ref = mlp().to(device)
    model = FSDP(nn.Sequential(*[FSDP(m) if isinstance(m, nn.Linear) else m for m in copy.deepcopy(ref)]))
    ((x, y),) = batches(device, 1)
    for m in (ref, model):
        nn.functional.mse_loss(m(x), y * 100).backward()  # large gradients: the clip bites
    theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
    ours = model.clip_grad_norm_(1.0).item()
    clipped = sum(p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None) ** 0.5
    return ours, theirs, float(clipped)


def scaler_skips_overflow(device: torch.device, offload: bool) -> dict[str, object]:
    kwargs = {"mixed_precision": True, "move_params_to_cpu": offload}
    model = FSDP(
        nn.Sequential(*[FSDP(m, **kwargs) if isinstance(m, nn.Linear) else m for m in mlp()]), **kwargs
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=2.0**10)
    ((x, y),) = batches(device, 1)
    before = [p.detach().clone() for p in model.parameters()]
    loss = nn.functional.mse_loss(model(x).float(), y) * float("inf")  # overflows
    scaler.scale(loss).backward()
    scaler.step(optim)
    scaler.update()
    optim.zero_grad(set_to_none=True)
    skipped = all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    scale_after_overflow = scaler.get_scale()
    loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    grads_home = {p.grad.device.type for p in model.parameters() if p.grad is not None}
    scaler.step(optim)
    scaler.update()
    trained = any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    finite = all(torch.isfinite(p).all().item() for p in model.parameters())
    return {
        "skipped_overflow": skipped,
        "scale_after_overflow": scale_after_overflow,
        "trained_after": trained and finite,
        "grad_devices": sorted(grads_home),
    }


def moving_an_offloaded_model_is_refused(device: torch.device) -> str:
    """.cuda() on a model wrapped with move_params_to_cpu would take the shards off the host."""
    layers = [FSDP(m, move_params_to_cpu=True) if isinstance(m, nn.Linear) else m for m in mlp()]
    model = FSDP(nn.Sequential(*layers), move_params_to_cpu=True)
    ((x, _),) = batches(device, 1)
    try:
        model.cuda()  # refused at the call, before anything moves
        model(x)
    except RuntimeError as e:
        return str(e)
    return ""


class _DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:  # keyword-only: the case that broke
        return nn.functional.dropout(self.lin(x), p=0.5, training=True)


def checkpointed_dropout_grads_differ(device: torch.device) -> float:
    """checkpoint_wrapper recomputes dropout with the masks of the forward (CUDA RNG restored)."""
    grads = []
    for wrapped in (False, True):
        torch.manual_seed(0)
        block = _DropoutBlock().to(device)
        if wrapped:
            block = checkpoint_wrapper(block, offload_to_cpu=True)
        torch.manual_seed(1)
        x = torch.randn(16, 64, device=device, requires_grad=True)
        block(x=x).square().sum().backward()
        assert x.grad is not None
        grads.append(x.grad.clone())
    return (grads[0] - grads[1]).abs().max().item()


def main() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    report: dict[str, object] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    report["ddp_max_diff"] = ddp_parity(device)
    report["ddp_two_streams_max_diff"] = ddp_parity(device, num_allreduce_streams=2, message_size=100_000)
    ours, theirs, clipped = clip_norms(device)
    report["clip_norm_ours_theirs_after"] = [ours, theirs, clipped]
    ok = report["ddp_max_diff"] <= 1e-6 and report["ddp_two_streams_max_diff"] <= 1e-6  # type: ignore[operator]
    ok = ok and abs(ours - theirs) <= 1e-4 * theirs and theirs > 1.0 and abs(clipped - 1.0) <= 1e-3
    for offload in (False, True):
        r = scaler_skips_overflow(device, offload)
        report["scaler" + ("_offload" if offload else "")] = r
        home = "cpu" if offload else "cuda"
        ok = ok and bool(r["skipped_overflow"]) and r["scale_after_overflow"] == 2.0**9
        ok = ok and bool(r["trained_after"]) and r["grad_devices"] == [home]
    report["checkpoint_dropout_max_diff"] = checkpointed_dropout_grads_differ(device)
    ok = ok and report["checkpoint_dropout_max_diff"] == 0.0
    refused = moving_an_offloaded_model_is_refused(device)
    report["move_refused"] = refused[:200]
    ok = ok and "after wrapping would make the flat parameters" in refused
    report["ok"] = ok
    print(json.dumps(report))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
