"""Pure chunk / pad / offset arithmetic for sharding a flat tensor. No torch.distributed here.

A flat tensor of ``numel`` elements is padded at its end to ``padded_numel``, a multiple of the
world size, and cut into ``world_size`` equal chunks; rank ``r`` owns chunk ``r``.

Example (numel=10, world_size=4)::

    padded_numel = 12, chunk = 3
    rank 0: [0, 3)   rank 1: [3, 6)   rank 2: [6, 9)   rank 3: [9, 12) -> elements 9 and pad 10, 11

With numel=2 and world_size=4, chunk = 1 and ranks 2 and 3 hold only padding.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardSpec", "chunk_numel", "intersect", "padded_numel", "shard_spec"]


def chunk_numel(numel: int, world_size: int) -> int:
    """Elements per rank: ``ceil(numel / world_size)`` (0 only when ``numel`` is 0)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return -(-numel // world_size)


def padded_numel(numel: int, world_size: int) -> int:
    """Size of the padded flat tensor: the smallest multiple of ``world_size`` >= ``numel``."""
    return chunk_numel(numel, world_size) * world_size


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's chunk sits in the padded flat tensor.

    ``start``/``end`` bound the chunk in padded coordinates; ``valid`` is how many of its elements
    are real (the rest, ``chunk - valid``, is padding).
    """

    numel: int
    world_size: int
    rank: int
    chunk: int
    start: int
    end: int
    valid: int

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world_size

    @property
    def pad(self) -> int:
        return self.chunk - self.valid


def shard_spec(numel: int, world_size: int, rank: int) -> ShardSpec:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    chunk = chunk_numel(numel, world_size)
    start = rank * chunk
    end = start + chunk
    valid = max(0, min(end, numel) - start)
    return ShardSpec(numel, world_size, rank, chunk, start, end, valid)


def intersect(a_start: int, a_end: int, b_start: int, b_end: int) -> tuple[int, int] | None:
    """The overlap of two half-open ranges, or None when they do not overlap."""
    lo, hi = max(a_start, b_start), min(a_end, b_end)
    return (lo, hi) if lo < hi else None
