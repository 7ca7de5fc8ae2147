"""Shared by the benchmark scripts: the example's GPT, imported from examples/train_gpt.py."""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent


def load_example() -> Any:
    """examples/train_gpt.py as a module (its ``GPT``), without running it."""
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
