"""What a tracker of live tensors is told about the wrapper's tensors as a step makes them.

A memory tracker (``fsdp.training.memory_tracker``) sees every allocation but not what it is for.
The wrapper tells it at the few places where a tensor becomes a full gradient, a gradient being
reduced, a reduced gradient shard, or where an optimizer steps inside backward. With no tracker
installed each call is one attribute check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "OPTIMIZER_STEP",
    "REDUCE_SCATTER",
    "SHARDED_GRAD",
    "UNSHARDED_GRAD",
    "observing",
    "stepping",
    "tag",
]

UNSHARDED_GRAD = "unsharded_grad"  # a unit's full gradient, before its reduction
REDUCE_SCATTER = "reduce_scatter"  # a gradient given to (or made for) a reduction
SHARDED_GRAD = "sharded_grad"  # this rank's reduced gradient shard, set on the flat parameter
OPTIMIZER_STEP = "optimizer_step"  # (stepping) an optimizer step inside backward begins (True) / ends

_observer: Callable[[torch.Tensor | None, str, bool], None] | None = None


def tag(t: torch.Tensor | None, kind: str) -> None:
    """``t`` is now a tensor of ``kind`` (one of the constants above)."""
    if _observer is not None and t is not None:
        _observer(t, kind, True)


@contextmanager
def stepping() -> Iterator[None]:
    """An optimizer step inside backward: what it allocates is the optimizer's."""
    if _observer is not None:
        _observer(None, OPTIMIZER_STEP, True)
    try:
        yield
    finally:
        if _observer is not None:
            _observer(None, OPTIMIZER_STEP, False)


@contextmanager
def observing(observer: Callable[[torch.Tensor | None, str, bool], None]) -> Iterator[None]:
    """Install ``observer(tensor, kind, begins)`` for the duration (one at a time)."""
    global _observer
    if _observer is not None:
        raise RuntimeError("fsdp: a memory tracker is already observing this process; nest none")
    _observer = observer
    try:
        yield
    finally:
        _observer = None
