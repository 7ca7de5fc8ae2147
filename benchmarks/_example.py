"""Shared by the benchmark scripts that train the example's GPT (``examples.gpt.GPT``)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def add_gpt_args(p: argparse.ArgumentParser) -> None:
    """The example GPT's size and batch options, shared by the scripts that train it."""
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)


def wrap_blocks(model: torch.nn.Module, **fsdp_kwargs: Any) -> torch.nn.Module:
    """One FSDP unit per transformer block and a root around the rest."""
    from fsdp import FullyShardedDataParallel as FSDP

    for i, block in enumerate(model.blocks):  # type: ignore[arg-type]
        model.blocks[i] = FSDP(block, **fsdp_kwargs)  # type: ignore[index, operator]
    return FSDP(model, **fsdp_kwargs)


def timed_step(
    call: Callable[[torch.Tensor, torch.Tensor], Any],
    x: torch.Tensor,
    y: torch.Tensor,
    optim: torch.optim.Optimizer,
) -> float:
    """One training step of a model returning ``(logits, loss)``, between barriers: its seconds."""
    dist.barrier()
    t0 = time.perf_counter()
    _, loss = call(x, y)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - t0
