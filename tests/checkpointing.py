"""Helpers for the checkpoint and optimizer-state tests: training at any world size beside a reference.

The global batch has a fixed size (12 rows, divisible by 1, 2, 3 and 4), drawn from a seed per
step, so a run that changes world size in the middle sees exactly the batches of an uninterrupted
run; rank r of N feeds rows ``[r * 12 / N, (r + 1) * 12 / N)`` while the reference sees all 12.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.models import CASES, build, wrap

GLOBAL_BATCH = 12


def make(
    case: str, seed: int = 0, paths: tuple[str, ...] | None = None, **fsdp_kwargs: Any
) -> tuple[nn.Module, Any]:
    """(plain reference, FSDP-wrapped copy) of a named case, wrapped with its plan or ``paths``."""
    ref = build(case, seed)
    model = wrap(copy.deepcopy(ref), CASES[case].wrap if paths is None else paths, **fsdp_kwargs)
    return ref, model


def batch(case: str, step: int) -> Any:
    return CASES[case].make_input(torch.Generator().manual_seed(1000 + step), GLOBAL_BATCH)


def train(model: nn.Module, opt: torch.optim.Optimizer, case: str, steps: range) -> list[float]:
    """Train the wrapped model on this rank's rows of each step's batch; return the global mean losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    losses = []
    for step in steps:
        loss = CASES[case].loss(model(batch(case, step)[rank * per : (rank + 1) * per]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def train_ref(ref: nn.Module, opt: torch.optim.Optimizer, case: str, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = CASES[case].loss(ref(batch(case, step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def state_diff(sd: Mapping[str, torch.Tensor], ref_sd: Mapping[str, torch.Tensor]) -> float:
    """Largest difference between two state dicts with the same keys in the same order (inf otherwise)."""
    if list(sd) != list(ref_sd):
        return float("inf")
    return max(
        ((sd[k].double() - v.double()).abs().max().item() if v.numel() else 0.0) for k, v in ref_sd.items()
    )


def optim_diff(full: Mapping[str, Any], ref: Mapping[str, Any]) -> float:
    """Largest difference between a gathered optimizer state dict and a plain optimizer's (inf if shaped otherwise)."""
    if set(full["state"]) != set(ref["state"]):
        return float("inf")
    worst = 0.0
    for i, entry in ref["state"].items():
        mine = full["state"][i]
        if set(mine) != set(entry):
            return float("inf")
        for key, value in entry.items():
            if key == "step" and isinstance(value, torch.Tensor) and not isinstance(mine[key], torch.Tensor):
                if value.dim() != 0 or float(mine[key]) != value.item():  # fairscale's form: a number
                    return float("inf")
            elif isinstance(value, torch.Tensor):
                if mine[key].shape != value.shape:
                    return float("inf")
                worst = max(
                    worst, (mine[key].double() - value.double()).abs().max().item() if value.numel() else 0
                )
            elif mine[key] != value:
                return float("inf")
    for group, ref_group in zip(full["param_groups"], ref["param_groups"], strict=True):
        if {k: v for k, v in group.items() if k != "param_names"} != ref_group:
            return float("inf")
    return worst


def scramble_(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    """Change in place every parameter (flat shards and ignored parameters), every persistent buffer and
    every optimizer-state tensor, before a load: a load that skipped any of them leaves a difference
    for the comparison after it to find. Adds 1 (floating and integer tensors) or flips (booleans);
    raises if a non-empty tensor kept its value (e.g. a large bf16 value that adding 1 cannot move)."""
    tensors = list(model.parameters())
    for m in model.modules():
        skip = m._non_persistent_buffers_set  # not in a state dict: no load restores them
        tensors += [b for n, b in m.named_buffers(recurse=False) if n not in skip]
    if opt is not None:
        for group in opt.param_groups:
            for p in group["params"]:
                tensors += [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    seen: set[int] = set()
    with torch.no_grad():
        for t in tensors:
            if id(t) in seen or t.numel() == 0:
                continue
            seen.add(id(t))
            before = t.detach().clone()
            if t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(1)
            assert not torch.equal(before, t), (
                f"scramble_ left a {t.dtype} tensor of {tuple(t.shape)} unchanged"
            )


def flat_snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """Copies of every flat shard, buffer and optimizer state tensor of this rank (to check nothing changed)."""
    out = [p.detach().clone() for p in model.parameters()] + [b.detach().clone() for b in model.buffers()]
    if opt is not None:
        for p in model.parameters():
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    out.append(v.detach().clone())
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def expect_error(exc_type: type[BaseException], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Run ``fn`` and return the message of the expected exception (raise if none or another)."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return str(e)
    raise AssertionError(f"{exc_type.__name__} was not raised")
