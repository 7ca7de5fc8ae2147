"""Run under torchrun on a CUDA machine: a torch FSDP1 script with only the wrapper's import changed
trains like torch FSDP1 itself, side by side on NCCL.

    torchrun --standalone --nproc_per_node=1 tests/gpu/cuda_torch_style.py

Both wrap the same CPU-built model with torch's option objects (bf16 parameters, fp32 reduction,
``device_id``, ``sync_module_states``, a transformer policy) and train five AdamW steps on the same
batches. Prints one JSON line: the losses of both, where the parameters and gradients live, and
the largest difference of the full state dicts after training.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fsdp import FullyShardedDataParallel as FSDP


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.relu(self.fc(x)))


def _net(width: int = 256) -> nn.Module:
    return nn.Sequential(nn.Linear(32, width), *[Block(width) for _ in range(4)], nn.Linear(width, 8))


def _wrap(cls: type, module: nn.Module, device: int) -> nn.Module:
    return cls(
        module,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        sharding_strategy=torch_fsdp.ShardingStrategy.FULL_SHARD,
        backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_PRE,
        device_id=device,
        sync_module_states=True,
    )


def _train(model: nn.Module, device: torch.device) -> tuple[list[float], list[str]]:
    """Five AdamW steps with clipping; the losses, and the gradients' dtypes before the last step."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grad_dtypes = [], []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(64, 32, generator=g).to(device), torch.randn(64, 8, generator=g).to(device)
        loss = (model(x).float() - y).pow(2).mean()
        loss.backward()
        model.clip_grad_norm_(1.0)  # type: ignore[operator]
        grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, grad_dtypes


def _full_state(cls: type, model: nn.Module) -> dict[str, torch.Tensor]:
    config = torch_fsdp.FullStateDictConfig(offload_to_cpu=True)
    with cls.state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT, config):  # type: ignore[attr-defined]
        return {k: v.float().cpu() for k, v in model.state_dict().items()}


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    net = _net()
    ours = _wrap(FSDP, copy.deepcopy(net), local_rank)
    theirs = _wrap(torch_fsdp.FullyShardedDataParallel, copy.deepcopy(net), local_rank)
    (our_losses, our_grads), (their_losses, _) = _train(ours, device), _train(theirs, device)
    a, b = _full_state(FSDP, ours), _full_state(torch_fsdp.FullyShardedDataParallel, theirs)
    report = {
        "ours": our_losses,
        "theirs": their_losses,
        "param_devices": sorted({str(p.device) for p in ours.parameters()}),
        "grad_dtypes": our_grads,
        "same_keys": sorted(a) == sorted(b),
        "state_max_diff": max((a[k] - b[k]).abs().max().item() for k in a if k in b),
        "loss_max_rel_diff": max(
            abs(x - y) / max(abs(y), 1e-6) for x, y in zip(our_losses, their_losses, strict=True)
        ),
    }
    if dist.get_rank() == 0:
        print(json.dumps(report))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
