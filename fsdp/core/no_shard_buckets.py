"""NO_SHARD flat parameters reduced in learned buckets: the bucket engine over a tree's handles."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsdp.comm.buckets import BucketConfig, GradBucketer
from fsdp.comm.collectives import CommStats
from fsdp.common.device import DeviceHandle
from fsdp.core.handle import FlatParamHandle

__all__ = ["finish_no_shard_buckets", "make_no_shard_bucketer"]


def make_no_shard_bucketer(
    items: Sequence[tuple[str, FlatParamHandle]], bucket_cap_mb: float, device: DeviceHandle, stats: CommStats
) -> tuple[GradBucketer | None, dict[int, int]]:
    """A bucket engine over the trainable NO_SHARD handles of ``items`` ((name, handle) pairs).

    Buckets of about ``bucket_cap_mb`` are learned in the first backward (rank 0's layout wins);
    each is all-reduced as soon as its last flat parameter's gradient is ready. Returns the engine
    and ``id(handle) -> index``; ``(None, {})`` when there is nothing to bucket or the handles do not
    share one replicate group and divide factor (each is then all-reduced on its own).
    """
    chosen = [
        (name, h)
        for name, h in items
        # an offloaded CUDA handle keeps its gradient on the device until reduced (the engine's
        # buckets live where the flat parameters are between steps: the host, which NCCL cannot send)
        if h.requires_grad
        and h.spec.world_size == 1
        and h.comm.replicate_group is not None
        and h.copies is None
    ]
    if not chosen:
        return None, {}
    group = chosen[0][1].comm.replicate_group
    factors = (chosen[0][1].comm.gradient_predivide_factor, chosen[0][1].comm.gradient_postdivide_factor)
    if any(
        h.comm.replicate_group is not group
        or (h.comm.gradient_predivide_factor, h.comm.gradient_postdivide_factor) != factors
        for _, h in chosen
    ):
        return None, {}
    assert group is not None
    config = BucketConfig(
        message_size=max(1, int(bucket_cap_mb * 2**20 / 4)),
        gradient_predivide_factor=factors[0],
        gradient_postdivide_factor=factors[1],
    )
    bucketer = GradBucketer(
        [h.flat_param for _, h in chosen], [name for name, _ in chosen], group, config, device, stats=stats
    )
    return bucketer, {id(h): i for i, (_, h) in enumerate(chosen)}


def finish_no_shard_buckets(bucketer: GradBucketer, index: dict[int, int], units: Sequence[Any]) -> None:
    """Hand the bucket engine the flat parameters that got no gradient this backward (zeros stand in,
    so every rank launches every bucket), then wait for every bucket. Runs before the end-of-backward
    consistency check, which then reports a rank that skipped parameters the others reduced: the
    buckets and the check share the data-parallel group, so the check's all-reduce must not meet a
    bucket another rank sent."""
    for unit in units:
        for h in unit.handles:
            i = index.get(id(h))
            if i is not None and not h.reduced_this_backward:
                bucketer.grad_ready(i)  # contributes zeros; a None gradient stays None
    bucketer.finish_backward()
