"""The CPU forms of the collectives: results of both reduce-scatter and both all-gather paths."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import fsdp.comm.collectives
from tests.rank_pool import RankPool


@contextlib.contextmanager
def _path(limit: str, max_ranks: int, counted: str) -> Iterator[list[int]]:
    """Set ``fsdp.comm.collectives.<limit>`` and count the calls of ``dist.<counted>`` (in the list)."""
    saved, real = getattr(fsdp.comm.collectives, limit), getattr(dist, counted)
    calls = [0]

    def counting(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(fsdp.comm.collectives, limit, max_ranks)
    setattr(dist, counted, counting)
    try:
        yield calls
    finally:
        setattr(fsdp.comm.collectives, limit, saved)
        setattr(dist, counted, real)


def _reduced(max_ranks: int) -> tuple[bool, int]:
    """reduce_scatter through a point-to-point exchange (few ranks) or an in-place all-reduce: the
    same sums, also with several in flight at once and waited for out of order. Returns (correct,
    point-to-point sends issued)."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def contribution(r: int, size: int, seed: int) -> torch.Tensor:
        return torch.randn(size * world, generator=torch.Generator().manual_seed(1000 * seed + r))

    group = dist.group.WORLD
    assert group is not None
    with _path("_EXCHANGE_MAX_RANKS", max_ranks, "isend") as sends:
        # equal sizes first: mixing them up would go unnoticed by gloo, not by the sums
        cases = [(6, 0, False), (6, 1, True), (3, 2, False)]
        pendings = []
        for size, seed, given in cases:
            out = torch.full((size,), float("nan")) if given else None
            pendings.append(fsdp.comm.collectives.reduce_scatter(out, contribution(rank, size, seed), group))
        results = [p.wait() for p in reversed(pendings)][::-1]
    correct = True
    for (size, seed, _), got in zip(cases, results, strict=True):
        total = contribution(0, size, seed)
        for r in range(1, world):  # the exchange sums in rank order, like this
            total = total + contribution(r, size, seed)
        want = total.view(world, size)[rank]
        # a ring all-reduce adds in another order: the same sums up to rounding
        exact = world <= max_ranks
        correct = correct and (
            torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-6, atol=1e-6)
        )
    return correct, sends[0]


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("max_ranks", [0, 4])
def test_reduce_scatter_paths_agree(pool: RankPool, max_ranks: int) -> None:
    # up to the limit: each rank sends every other rank its chunk; above it (limit 0): all-reduce
    for correct, sends in pool.run(_reduced, max_ranks):
        assert correct
        assert sends == (3 * (pool.world_size - 1) if pool.world_size <= max_ranks else 0)


def _gathered(max_ranks: int) -> tuple[bool, int]:
    """all_gather through in-place broadcasts (few ranks) or gloo's all-gather: the same result.
    Returns (correct, broadcasts issued)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    assert group is not None
    with _path("_BROADCAST_GATHER_MAX_RANKS", max_ranks, "broadcast") as broadcasts:
        shard = torch.arange(5.0) + 10 * rank
        out = torch.full((5 * world,), float("nan"))
        stats = fsdp.comm.collectives.CommStats()
        fsdp.comm.collectives.all_gather(out, shard, group, stats).wait()
    expected = torch.cat([torch.arange(5.0) + 10 * r for r in range(world)])
    counted = stats.as_dict()["all_gather"]
    correct = bool(torch.equal(out, expected)) and counted["calls"] == 1 and counted["numel"] == 5 * world
    return correct, broadcasts[0]


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("max_ranks", [0, 4])
def test_all_gather_paths_agree(pool: RankPool, max_ranks: int) -> None:
    # up to the limit: one in-place broadcast per rank; above it (limit 0 here): gloo's all-gather
    for correct, broadcasts in pool.run(_gathered, max_ranks):
        assert correct
        assert broadcasts == (pool.world_size if pool.world_size <= max_ranks else 0)


def _cached_groups() -> dict[str, object]:
    """Second groups: of the world, after a subgroup that leaves ranks out (which once hung: see
    [Note: creating groups]); of such a subgroup (itself); of a hybrid shard group (its twin)."""
    world = dist.group.WORLD
    assert world is not None
    rank = dist.get_rank()
    sub = dist.new_group([0, 1])  # every rank takes part in creating it; only 0 and 1 are members
    whole = fsdp.comm.collectives.get_process_group_cached(world, "test-world")
    out: dict[str, object] = {
        "world_is_new": whole is not world,
        "world_ranks": dist.get_process_group_ranks(whole),
    }
    t = torch.ones(1)
    dist.all_reduce(t, group=whole)
    out["world_sum"] = t.item()
    if rank in (0, 1):
        out["sub_is_itself"] = fsdp.comm.collectives.get_process_group_cached(sub, "test-sub") is sub
    shard, _ = fsdp.comm.collectives.hybrid_groups(2)
    twin = fsdp.comm.collectives.get_process_group_cached(shard, "reduce_scatter")
    out["twin_is_new"] = twin is not shard and dist.get_process_group_ranks(
        twin
    ) == dist.get_process_group_ranks(shard)
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, group=twin)
    out["twin_sum"] = t.item()
    return out


@pytest.mark.parametrize("pool", [4], indirect=True)
def test_cached_groups_of_the_world_a_subgroup_and_a_shard_group(pool: RankPool) -> None:
    results = pool.run(_cached_groups, timeout=60)
    for rank, r in enumerate(results):
        assert r["world_is_new"] and r["world_ranks"] == [0, 1, 2, 3] and r["world_sum"] == 4.0, r
        assert r.get("sub_is_itself", rank >= 2), r
        assert r["twin_is_new"] and r["twin_sum"] == (1.0 if rank < 2 else 5.0), r


def _handed_to_the_backend(max_ranks: int) -> dict[str, object]:
    """Every CPU collective gives the backend aliases of the caller's tensors (the same storage),
    none of which a backend thread still holds once the collectives were waited for and drained
    (see [Note: gloo works at exit])."""
    group = dist.group.WORLD
    assert group is not None
    world = dist.get_world_size()
    seen: list[tuple[int, int]] = []  # (id, data_ptr) of what dist received: no reference kept
    real = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}

    def spy(name: str) -> object:
        def call(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
            seen.append((id(tensor), tensor.data_ptr()))
            return real[name](tensor, *args, **kwargs)

        return call

    t = torch.ones(6)
    out = torch.zeros(6 * world)
    for name in real:
        setattr(dist, name, spy(name))
    saved = fsdp.comm.collectives._EXCHANGE_MAX_RANKS, fsdp.comm.collectives._BROADCAST_GATHER_MAX_RANKS
    fsdp.comm.collectives._EXCHANGE_MAX_RANKS = fsdp.comm.collectives._BROADCAST_GATHER_MAX_RANKS = max_ranks
    try:
        fsdp.comm.collectives.all_reduce(t, group).wait()
        fsdp.comm.collectives.broadcast(t, 0, group).wait()
        fsdp.comm.collectives.all_gather(out, t, group).wait()
        fsdp.comm.collectives.reduce_scatter(None, out.clone(), group).wait()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
        fsdp.comm.collectives._EXCHANGE_MAX_RANKS, fsdp.comm.collectives._BROADCAST_GATHER_MAX_RANKS = saved
    return {
        "calls": len(seen),
        "aliases": all(i not in (id(t), id(out)) for i, _ in seen),
        "same_storage": seen[0][1] == t.data_ptr() and seen[1][1] == t.data_ptr(),
        "drained": fsdp.comm.collectives.drain_worker_references(timeout=10.0),
        "left": len(fsdp.comm.collectives._retired),
        "sum": t.sum().item(),
    }


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("max_ranks", [0, 4])
def test_collectives_hand_the_backend_aliases_that_are_let_go(pool: RankPool, max_ranks: int) -> None:
    for r in pool.run(_handed_to_the_backend, max_ranks):
        # all-reduce, broadcast, then one broadcast per rank for the all-gather (few ranks) or one
        # all-reduce for the reduce-scatter (the other paths: gloo's all-gather, point-to-point)
        assert r["calls"] == (2 + pool.world_size if max_ranks else 3), r
        assert r["aliases"] and r["same_storage"] and r["drained"] and r["left"] == 0, r
        assert r["sum"] == 6.0 * pool.world_size, r
