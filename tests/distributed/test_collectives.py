"""The CPU forms of the collectives: results, completion reporting, and both all-gather paths."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import fsdp.collectives
from tests.rank_pool import RankPool


def _cpu_reduce_scatter_completes() -> bool:
    """A CPU reduce-scatter reports completion without a wait, and wait() returns this rank's sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(4.0 * world) + rank
    expected = torch.stack([torch.arange(4.0 * world) + r for r in range(world)]).sum(0).view(world, 4)[rank]
    group = dist.group.WORLD
    assert group is not None
    pending = fsdp.collectives.reduce_scatter(None, full, group)
    deadline = time.monotonic() + 30
    while not pending.done():  # gloo's own reduce-scatter never reports completion
        assert time.monotonic() < deadline, "the reduce-scatter never reported completion"
        time.sleep(0.005)
    return bool(torch.equal(pending.wait(), expected))


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_cpu_reduce_scatter_reports_completion(pool: RankPool) -> None:
    assert all(pool.run(_cpu_reduce_scatter_completes))


def _gathered(max_ranks: int) -> tuple[bool, int]:
    """all_gather through in-place broadcasts (few ranks) or gloo's all-gather: the same result.
    Returns (correct, broadcasts issued)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    saved, real_broadcast = fsdp.collectives._BROADCAST_GATHER_MAX_RANKS, dist.broadcast
    broadcasts = 0

    def counted_broadcast(*args: object, **kwargs: object) -> object:
        nonlocal broadcasts
        broadcasts += 1
        return real_broadcast(*args, **kwargs)  # type: ignore[arg-type]

    fsdp.collectives._BROADCAST_GATHER_MAX_RANKS = max_ranks
    dist.broadcast = counted_broadcast  # type: ignore[assignment]
    try:
        shard = torch.arange(5.0) + 10 * rank
        out = torch.full((5 * world,), float("nan"))
        stats = fsdp.collectives.CommStats()
        group = dist.group.WORLD
        assert group is not None
        fsdp.collectives.all_gather(out, shard, group, stats).wait()
    finally:
        fsdp.collectives._BROADCAST_GATHER_MAX_RANKS = saved
        dist.broadcast = real_broadcast
    expected = torch.cat([torch.arange(5.0) + 10 * r for r in range(world)])
    counted = stats.as_dict()["all_gather"]
    correct = bool(torch.equal(out, expected)) and counted["calls"] == 1 and counted["numel"] == 5 * world
    return correct, broadcasts


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("max_ranks", [0, 4])
def test_all_gather_paths_agree(pool: RankPool, max_ranks: int) -> None:
    # up to the limit: one in-place broadcast per rank; above it (limit 0 here): gloo's all-gather
    for correct, broadcasts in pool.run(_gathered, max_ranks):
        assert correct
        assert broadcasts == (pool.world_size if pool.world_size <= max_ranks else 0)
