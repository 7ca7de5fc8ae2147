"""Checkpoints cross with torch FSDP2 (``fully_shard``) through ``torch.distributed.checkpoint``.

Model and optimizer (Adam), both ways, mid-training: one library trains two steps and saves, the
other loads into a model built from other weights and trains two more. The four losses and the
final parameters equal those of the first library training all four steps, bit for bit (at world
size 2 both libraries sum two halves, and Adam is elementwise).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from tests.rank_pool import RankPool


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(10)
        self.mlp = nn.Sequential(nn.Linear(10, 13), nn.GELU(), nn.Linear(13, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """Odd sizes, so that both libraries pad their shards."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(7, 10)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _ours(seed: int) -> nn.Module:
    net = Net(seed)
    for i, block in enumerate(net.blocks):
        net.blocks[i] = FSDP(block)
    return FSDP(net)


def _fsdp2(seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    net = Net(seed)
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    return net


def _save_ours(model: Any, optim: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"model": model.sharded_state_dict(), "optim": model.sharded_optim_state_dict(optim)},
        checkpoint_id=path,
    )


def _load_ours(model: Any, optim: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    # a DCP target needs every key it fills: one step gives the optimizer its state (all overwritten)
    _step(model, optim, -1)
    state = {"model": model.sharded_state_dict(), "optim": model.sharded_optim_state_dict(optim)}
    dcp.load(state, checkpoint_id=path)
    model.load_sharded_state_dict(state["model"])
    model.load_sharded_optim_state_dict(optim, state["optim"])


def _save_fsdp2(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _load_fsdp2(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optim)  # (torch initializes the optimizer state)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, FSDP):
        return dict(model.state_dict())
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


LIBRARIES: dict[str, tuple[Callable[[int], nn.Module], Callable[..., None], Callable[..., None]]] = {
    "ours": (_ours, _save_ours, _load_ours),
    "fsdp2": (_fsdp2, _save_fsdp2, _load_fsdp2),
}


def _cross(tmp: str, first: str, second: str) -> dict[str, Any]:
    build_a, save_a, _ = LIBRARIES[first]
    build_b, _, load_b = LIBRARIES[second]
    ref = build_a(0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    expected = [_step(ref, ref_opt, s) for s in range(4)]

    a = build_a(0)
    a_opt = torch.optim.Adam(a.parameters(), lr=1e-2)
    losses = [_step(a, a_opt, s) for s in range(2)]
    save_a(a, a_opt, f"{tmp}/{first}")
    b = build_b(seed=7)  # other weights: everything comes from the checkpoint
    b_opt = torch.optim.Adam(b.parameters(), lr=1e-2)
    load_b(b, b_opt, f"{tmp}/{first}")
    losses += [_step(b, b_opt, s) for s in (2, 3)]
    got, want = _full(b), _full(ref)
    return {
        "losses": (losses, expected),
        "keys_equal": sorted(got) == sorted(want),
        "differ": [k for k in want if not torch.equal(got[k].cpu(), want[k].cpu())],
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    "first,second", [("ours", "fsdp2"), ("fsdp2", "ours")], ids=["ours_to_fsdp2", "fsdp2_to_ours"]
)
def test_training_continues_identically_across_the_libraries(
    pool: RankPool, tmp_path: Path, first: str, second: str
) -> None:
    for r in pool.run(_cross, str(tmp_path), first, second, timeout=120):
        losses, expected = r["losses"]
        assert losses == expected, r
        assert r["keys_equal"] and r["differ"] == [], r
