"""Chunk/pad/offset arithmetic, checked exhaustively by hypothesis."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdp.api import default_gradient_predivide_factor
from fsdp.core.sharding import chunk_numel, intersect, padded_numel, shard_spec


@given(numel=st.integers(0, 10_000), world=st.integers(1, 64))
def test_shards_tile_the_padded_tensor(numel: int, world: int) -> None:
    specs = [shard_spec(numel, world, r) for r in range(world)]
    assert padded_numel(numel, world) % world == 0
    assert 0 <= padded_numel(numel, world) - numel < world
    assert [s.start for s in specs] == [r * chunk_numel(numel, world) for r in range(world)]
    assert all(a.end == b.start for a, b in itertools.pairwise(specs))
    assert specs[-1].end == padded_numel(numel, world)
    assert sum(s.valid for s in specs) == numel  # every real element is owned exactly once
    assert all(s.valid + s.pad == s.chunk for s in specs)


def test_tiny_parameter_leaves_ranks_with_only_padding() -> None:
    specs = [shard_spec(2, 4, r) for r in range(4)]
    assert [(s.start, s.end, s.valid) for s in specs] == [(0, 1, 1), (1, 2, 1), (2, 3, 0), (3, 4, 0)]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        chunk_numel(3, 0)
    with pytest.raises(ValueError, match="rank 4"):
        shard_spec(3, 4, 4)


def test_intersect() -> None:
    assert intersect(0, 5, 3, 9) == (3, 5)
    assert intersect(0, 3, 3, 9) is None


@pytest.mark.parametrize(
    ("world", "factor"), [(1, 1.0), (2, 2.0), (3, 2.0), (4, 2.0), (8, 4.0), (16, 4.0), (64, 8.0)]
)
def test_default_predivide_factor_matches_fairscale(world: int, factor: float) -> None:
    assert default_gradient_predivide_factor(world) == factor
