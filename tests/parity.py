"""Train FSDP beside a plain local reference and report how far apart they are.

Runs on every rank of a pool. Each step draws one global batch (same seed on every rank); rank r
feeds its slice to the FSDP model, while the reference sees the whole batch. With equal slices,
the mean of the ranks' mean losses is the global mean loss, so averaged gradients must match.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel
from fsdp.core.sharding import padded_numel
from tests.models import CASES, build, wrap


def _slice(batch: Any, rank: int, per_rank: int) -> Any:
    return batch[rank * per_rank : (rank + 1) * per_rank]


def shard_of(full_flat: torch.Tensor, handle: Any) -> torch.Tensor:
    """The slice of a reference flat tensor that ``handle`` holds on this rank."""
    padded = torch.zeros(
        padded_numel(full_flat.numel(), handle.spec.world_size),
        dtype=full_flat.dtype,
        device=full_flat.device,
    )
    padded[: full_flat.numel()] = full_flat
    return padded[handle.spec.start : handle.spec.end].to(handle.flat_param.device)


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def reference_flat(ref: nn.Module, names: list[str], what: str) -> torch.Tensor | None:
    """Concatenate the reference's parameters (or grads; a missing grad counts as zeros) in layout order.

    Returns None for gradients when none of the parameters has one.
    """
    # (names compared without torch's activation checkpoint wrappers, which one side may have)
    params = {_clean(n): p for n, p in ref.named_parameters(remove_duplicate=False)}
    names = [_clean(n) for n in names]
    tensors = [params[n] if what == "param" else params[n].grad for n in names]
    if all(t is None for t in tensors):
        return None
    return torch.cat(
        [
            (t if t is not None else torch.zeros_like(params[n])).detach().reshape(-1)
            for n, t in zip(names, tensors)
        ]
    )


def handles_with_ref_names(model: nn.Module) -> list[tuple[Any, list[str]]]:
    """Every handle in the tree with the unwrapped-model names of its parameters, in layout order."""
    out = []
    for wname, w in model.named_modules():
        if isinstance(w, FullyShardedDataParallel):
            prefix = wname.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")
            prefix = prefix.replace("_fsdp_wrapped_module", "")
            for h in w.handles:
                out.append((h, [f"{prefix}.{i.fqn}" if prefix else i.fqn for i in h.meta.params]))
    return out


def run_parity(
    case: str,
    steps: int = 3,
    per_rank: int = 4,
    lr: float = 0.1,
    check_grads: bool = True,
    **fsdp_kwargs: Any,
) -> dict[str, float]:
    """Train ``steps`` SGD-with-momentum steps of a named case; return the largest differences seen."""
    spec = CASES[case]
    ref = build(case)
    model = wrap(copy.deepcopy(ref), spec.wrap, **fsdp_kwargs)
    return compare_training(ref, model, spec.make_input, spec.loss, steps, per_rank, lr, check_grads)


def compare_training(
    ref: nn.Module,
    model: nn.Module,
    make_input: Any,
    loss_fn: Any,
    steps: int = 3,
    per_rank: int = 4,
    lr: float = 0.1,
    check_grads: bool = True,
) -> dict[str, float]:
    """Train the wrapped ``model`` and the plain ``ref`` side by side; return the largest differences."""
    rank, world = dist.get_rank(), dist.get_world_size()
    handles = handles_with_ref_names(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    diffs = {"loss": 0.0, "grad": 0.0, "param": 0.0, "state_dict": 0.0}
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        batch = make_input(g, per_rank * world)
        loss = loss_fn(model(_slice(batch, rank, per_rank)))
        loss.backward()
        ref_loss = loss_fn(ref(batch))
        ref_loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        diffs["loss"] = max(diffs["loss"], (global_loss / world - ref_loss.detach()).abs().item())
        if check_grads:
            for h, names in handles:
                expected = reference_flat(ref, names, "grad")
                assert (h.flat_param.grad is None) == (expected is None), (
                    f"gradient presence differs: {names}"
                )
                if expected is not None:
                    assert h.flat_param.grad.shape == (h.spec.chunk,), "a gradient must be shard-shaped"
                    diffs["grad"] = max(
                        diffs["grad"], (h.flat_param.grad - shard_of(expected, h)).abs().max().item()
                    )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for h, names in handles:
        expected = reference_flat(ref, names, "param")
        assert expected is not None
        assert h.flat_param.shape == (h.spec.chunk,), "between steps a flat parameter must be its shard"
        diffs["param"] = max(
            diffs["param"], (h.flat_param.detach() - shard_of(expected, h)).abs().max().item()
        )
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd), f"state dict keys differ: {list(sd)} vs {list(ref_sd)}"
    for k, v in ref_sd.items():
        diffs["state_dict"] = max(
            # (on the CPU both: state_dict() values go to the host under move_params_to_cpu)
            diffs["state_dict"],
            (sd[k].float().cpu() - v.float().cpu()).abs().max().item() if v.numel() else 0.0,
        )
    return diffs
