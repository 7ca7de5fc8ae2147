"""Shared fixtures: pools of gloo ranks reused across the session, and the ``gpu`` marker.

Distributed tests take a pool of ranks by world size::

    @pytest.mark.parametrize("pool", [1, 2, 3, 4], indirect=True)
    def test_something(pool: RankPool) -> None:
        assert pool.run(_module_level_fn, 3) == [...]

``FSDP_TEST_WORLD_SIZES=2`` (or ``1,2,3,4``) deselects the ``pool`` parameters not listed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.rank_pool import RankPool

WORLD_SIZES_ENV = "FSDP_TEST_WORLD_SIZES"


def _allowed_world_sizes() -> set[int] | None:
    raw = os.environ.get(WORLD_SIZES_ENV, "").strip()
    if not raw:
        return None
    try:
        sizes = {int(part) for part in raw.split(",") if part.strip()}
    except ValueError:
        raise pytest.UsageError(f"{WORLD_SIZES_ENV} must be comma-separated integers, got {raw!r}") from None
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"{WORLD_SIZES_ENV} must list world sizes >= 1, got {raw!r}")
    return sizes


def pytest_report_header(config: pytest.Config) -> str:
    allowed = _allowed_world_sizes()
    return f"pool world sizes: {sorted(allowed) if allowed else 'all'}; cuda: {torch.cuda.is_available()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    allowed = _allowed_world_sizes()
    if allowed is not None:
        keep: list[pytest.Item] = []
        drop: list[pytest.Item] = []
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            (drop if "pool" in params and params["pool"] not in allowed else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if not torch.cuda.is_available():
        needs_cuda = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(needs_cuda)


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[Callable[[int], RankPool]]:
    """``get(world_size) -> RankPool``: one lazily started pool per world size, closed at session end."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def pool(request: pytest.FixtureRequest, rank_pools: Callable[[int], RankPool]) -> RankPool:
    """The shared pool of ``request.param`` ranks; use ``parametrize("pool", [...], indirect=True)``."""
    world_size = getattr(request, "param", None)
    if not isinstance(world_size, int):
        pytest.fail('the pool fixture needs @pytest.mark.parametrize("pool", [2, ...], indirect=True)')
    return rank_pools(world_size)
