"""Behaviour of the test harness's rank pool (tests/rank_pool.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tests.rank_pool import RankFailure, RankPool, RankTimeout


def _rank_and_allreduce(scale: float) -> tuple[int, int, float, int]:
    t = torch.tensor([float(dist.get_rank() + 1)]) * scale
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.getpid()


def _scaled_tensor(base: torch.Tensor, *, offset: torch.Tensor) -> torch.Tensor:
    return base * dist.get_rank() + offset


def _raise_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom on rank {bad_rank}")
    return os.getpid()


def _unpicklable_result() -> Callable[[], int]:
    return lambda: dist.get_rank()


def _rank0_waits_in_collective() -> int:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return dist.get_rank()


def _rank1_raises_rank0_waits() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gave up")
    dist.all_reduce(torch.ones(1))


def _exit_on_rank1() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


@pytest.mark.parametrize("pool", [1, 2, 3], indirect=True)
def test_run_returns_per_rank_values_in_rank_order(pool: RankPool) -> None:
    n = pool.world_size
    out = pool.run(_rank_and_allreduce, 2.0)
    assert [o[:3] for o in out] == [(r, n, 2.0 * n * (n + 1) / 2) for r in range(n)]
    pids = [o[3] for o in out]
    assert len(set(pids)) == n and os.getpid() not in pids
    again = pool.run(_rank_and_allreduce, 1.0)
    assert [o[3] for o in again] == pids  # the same processes serve the next task


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_tensors_and_kwargs_travel_both_ways(pool: RankPool) -> None:
    out = pool.run(_scaled_tensor, torch.arange(3.0), offset=torch.ones(3))
    assert [t.tolist() for t in out] == [[1.0, 1.0, 1.0], [1.0, 2.0, 3.0]]


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_exception_on_one_rank_names_it_and_pool_survives(pool: RankPool) -> None:
    pids = pool.run(_raise_on_rank, -1)
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_on_rank, 1)
    failure = info.value
    assert set(failure.errors) == {1} and failure.unfinished == []
    err = failure.errors[1]
    assert (err.type_name, err.message) == ("ValueError", "boom on rank 1")
    assert "_raise_on_rank" in err.traceback
    assert "rank 1" in str(failure) and "ValueError: boom on rank 1" in str(failure)
    assert pool.pids() == pids  # rank 0 finished, so nothing was killed
    assert pool.run(_raise_on_rank, -1) == pids


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_bad_fn_or_result_is_reported_without_killing(pool: RankPool) -> None:
    with pytest.raises(TypeError, match="picklable"):
        pool.run(lambda: 1)
    pids = pool.run(_raise_on_rank, -1)
    with pytest.raises(RankFailure) as info:
        pool.run(_unpicklable_result)
    assert set(info.value.errors) == {0, 1}
    assert pool.run(_raise_on_rank, -1) == pids


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_hang_in_collective_times_out_and_pool_restarts(pool: RankPool) -> None:
    old = pool.run(_raise_on_rank, -1)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(_rank0_waits_in_collective, timeout=5)
    assert 5 <= time.monotonic() - start < 10
    assert info.value.unfinished == [0] and "rank(s) [0]" in str(info.value)
    assert pool.pids() == []  # killed
    assert [o[:3] for o in pool.run(_rank_and_allreduce, 1.0)] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert set(pool.pids()).isdisjoint(old)


def test_failure_while_another_rank_waits_kills_after_grace() -> None:
    pool = RankPool(2, grace=1.0)
    try:
        pool.run(_raise_on_rank, -1)  # start-up is not part of the measurement
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(_rank1_raises_rank0_waits)
        assert time.monotonic() - start < 5
        assert set(info.value.errors) == {1} and info.value.unfinished == [0]
        assert "RuntimeError: rank 1 gave up" in str(info.value)
        assert pool.pids() == []
    finally:
        pool.close()


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_worker_that_exits_is_reported(pool: RankPool) -> None:
    with pytest.raises(RankFailure) as info:
        pool.run(_exit_on_rank1, timeout=30)
    assert set(info.value.errors) == {1}
    assert info.value.errors[1].type_name == "WorkerDied"
    assert "exited with 3" in info.value.errors[1].message
    assert pool.pids() == []
    assert pool.run(_raise_on_rank, -1) == pool.pids()
