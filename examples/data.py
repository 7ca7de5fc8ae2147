"""The example's data: Python's standard library source as characters, cut into training windows,
split across ranks by a ``DistributedSampler`` that can resume part-way through an epoch.

Every window of ``block_size + 1`` consecutive characters is one sample: ``x`` is its first
``block_size`` characters and ``y`` the same shifted left by one (the next character at every
position). Each epoch, every rank draws the same permutation of all windows (seeded with
``seed + epoch``) and keeps every ``world_size``-th one starting at its rank, so a step at any world
size reads the windows at positions ``[k * G, (k + 1) * G)`` of the permutation, G = batch per rank
x ranks: the global batch is the same set of windows whatever the number of ranks that share it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["CharWindows", "ResumableSampler", "endless_batches", "load_corpus"]


def load_corpus(max_chars: int) -> str:
    """The first ``max_chars`` characters of the standard library's top-level ``*.py`` files.

    Sorted file order makes the corpus, and so the vocabulary, the same on every rank without any
    communication; top-level modules only: plenty of text, and no test data with odd bytes.
    """
    stdlib = Path(os.__file__).parent
    parts, n = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        n += len(text)
        if n >= max_chars:
            break
    return "".join(parts)[:max_chars]


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every window of ``block_size + 1`` characters of ``data`` (a 1-D tensor of character ids)."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if len(data) <= block_size:
            raise ValueError(f"{len(data)} characters hold no window of {block_size + 1}; use more text")
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block_size + 1]  # (T + 1,)
        return chunk[:-1], chunk[1:]  # x: (T,), y: (T,) the next character at every position


class ResumableSampler(DistributedSampler[int]):
    """torch's ``DistributedSampler`` (shuffled, every rank its share) that can start mid-epoch.

    ``consumed`` counts the windows that all ranks together have taken in this epoch;
    ``state_dict()`` records it with the epoch, so it is ``Stateful`` and goes into a checkpoint's
    ``app_state``. A new iterator skips this rank's share of the consumed windows: positions below
    ``consumed`` of the epoch's permutation, at this or another world size.
    """

    def __init__(self, dataset: Dataset[Any], **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.consumed = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.consumed // self.num_replicas, None)

    def __len__(self) -> int:
        return self.num_samples - self.consumed // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.consumed = state["epoch"], state["consumed"]


def endless_batches(loader: DataLoader[Any], sampler: ResumableSampler) -> Iterator[Any]:
    """This rank's batches, epoch after epoch (each epoch a new permutation)."""
    per_batch = loader.batch_size * sampler.num_replicas  # type: ignore[operator]  # windows per step, all ranks
    if sampler.num_samples < loader.batch_size:  # type: ignore[operator]
        raise ValueError(
            f"an epoch of {sampler.num_samples} windows per rank holds no batch of {loader.batch_size}; "
            "use more text or smaller batches"
        )
    while True:
        for batch in loader:
            # counted when handed out: a checkpoint saved after this step resumes after this batch
            sampler.consumed += per_batch
            yield batch
        sampler.set_epoch(sampler.epoch + 1)
