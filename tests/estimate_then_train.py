"""Run under torchrun with two ranks: estimate a model's memory, then start the job in the same
process and train it (the simulated world's cached groups must not be found by the real one)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import fsdp


def build() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    net[0] = fsdp.FullyShardedDataParallel(net[0])
    return fsdp.FullyShardedDataParallel(net)


def step(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(4, 8)).sum()  # type: ignore[no-any-return]


if __name__ == "__main__":
    estimate = fsdp.estimate_memory(build, step, world_size=2, device="cpu")
    dist.init_process_group("gloo")
    model = build()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        step(model).backward()
        optim.step()
        optim.zero_grad()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            f.write(str(estimate.peak_bytes))
    dist.barrier()
    dist.destroy_process_group()
