"""fairscale 0.4.13's state-dict, optimizer-state, shared-parameter and expert (MoE) scenarios,
run on CPU ranks with our wrapper: the scenarios of fairscale's ``test_fsdp_state_dict.py``,
``test_fsdp_optimizer_utils.py``, ``test_fsdp_shared_weights*.py`` and its MoE users (an expert
unit per rank on a one-rank process group inside a root over every rank), each checked against a
plain model or against fairscale's own functions."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy
from fsdp.collectives import hybrid_groups
from tests.rank_pool import RankPool


# ---------------------------------------------------------------------- experts (MoE)
class MoE(nn.Module):
    """Shared input and output layers around one expert per rank (fairscale's MoE layout): rank r
    holds expert r alone, drawn from seed ``100 + r``; the shared layers are the same everywhere."""

    def __init__(self, expert_seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.out = nn.Linear(8, 3)
        torch.manual_seed(expert_seed)
        self.expert = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.expert(self.inp(x))))


def _per_rank_groups() -> list[dist.ProcessGroup]:
    """One process group per rank (every rank takes part in creating each)."""
    return [dist.new_group([r]) for r in range(dist.get_world_size())]


def _moe(groups: list[dist.ProcessGroup], **kwargs: Any) -> FSDP:
    rank = dist.get_rank()
    net = MoE(100 + rank)
    net.expert = FSDP(net.expert, process_group=groups[rank], **kwargs)
    return FSDP(net, **kwargs)


def _batch(rank: int) -> torch.Tensor:
    """Larger inputs on later ranks, so that the last rank's expert holds the largest gradients."""
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(7 + rank)) * (1 + 2 * rank)


def _plain_moe_grads(world: int) -> tuple[nn.Module, list[nn.Linear]]:
    """The plain model of every rank's expert, with the gradients the wrapped model holds: the
    shared layers' averaged over the ranks, each expert's its own rank's (a one-rank group)."""
    shared = MoE(0)
    experts = [MoE(100 + r).expert for r in range(world)]
    for p in shared.parameters():
        p.grad = torch.zeros_like(p)
    for r, expert in enumerate(experts):
        shared.expert = expert
        loss = shared(_batch(r)).pow(2).sum()
        grads = torch.autograd.grad(loss, [*shared.inp.parameters(), *shared.out.parameters(), *expert.parameters()])
        n_shared = len([*shared.inp.parameters(), *shared.out.parameters()])
        for p, g in zip([*shared.inp.parameters(), *shared.out.parameters()], grads[:n_shared]):
            p.grad += g / world
        for p, g in zip(expert.parameters(), grads[n_shared:]):
            p.grad = g.clone()
    return shared, experts


def _clip_experts(norm_type: float, strategy: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs: dict[str, Any] = {}
    if strategy == "HYBRID_SHARD":  # the shared layers 2 x 2; the experts on their own groups
        kwargs = {"sharding_strategy": ShardingStrategy.HYBRID_SHARD, "process_group": hybrid_groups(2)}
    groups = _per_rank_groups()
    net = MoE(100 + rank)
    net.expert = FSDP(net.expert, process_group=groups[rank])
    model = FSDP(net, **kwargs)
    model(_batch(rank)).pow(2).sum().backward()
    shared, experts = _plain_moe_grads(world)
    params = [*shared.inp.parameters(), *shared.out.parameters(), *(p for e in experts for p in e.parameters())]
    max_norm = 0.5
    ref_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type).item()
    norm = model.clip_grad_norm_(max_norm, norm_type).item()
    errors = []
    with model.summon_full_params(with_grads=True):
        ours = dict(model.named_parameters())
        theirs = {**dict(shared.named_parameters()), **{f"expert.{n}": p for n, p in experts[rank].named_parameters()}}
        for name, p in ours.items():
            errors.append((p.grad - theirs[name].grad).abs().max().item())
    return {"norm": norm, "ref_norm": ref_norm, "grad_error": max(errors), "names": sorted(ours)}


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_with_an_expert_per_rank_is_the_plain_models_norm(pool: RankPool, norm_type: float) -> None:
    results = pool.run(_clip_experts, norm_type, "FULL_SHARD")
    for r in results:
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), r
        assert r["norm"] > 0.5, "the test must actually clip"
        assert r["grad_error"] <= 1e-6, "every rank scales its shards and its expert by the same factor"
    assert len({r["norm"] for r in results}) == 1


@pytest.mark.parametrize("pool", [4], indirect=True)
def test_clip_grad_norm_with_experts_beside_hybrid_sharding(pool: RankPool) -> None:
    for r in pool.run(_clip_experts, 2.0, "HYBRID_SHARD"):
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), r
        assert r["grad_error"] <= 1e-6
