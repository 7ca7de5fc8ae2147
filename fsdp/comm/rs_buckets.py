"""Reduce-scatter buckets: the small gradients of a tree's sharded units coalesced into one collective.

Used by :class:`~fsdp.core.handle.FlatParamHandle` through the root's context; the all-reduce buckets of
replicated training are ``buckets.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp.comm import collectives
from fsdp.comm.collectives import CommStats, Pending

__all__ = ["SMALL_GRADIENT_BYTES", "ReduceScatterBucketer"]

# A gradient this large is reduce-scattered on its own even when it would fit a bucket. Measured with
# gloo at world size 2 on the development machine: a reduce-scatter costs about 1.5 ms per call plus
# 1.5 ms per MiB, so from 1 MiB on the per-call cost is at most half of the total, while a
# bucket costs a copy of the gradient and delays its reduction to the bucket's launch (docs/design.md).
SMALL_GRADIENT_BYTES = 1 << 20


class ReduceScatterBucketer:
    """Coalesces the reduce-scatters of small padded flat gradients into one collective per bucket.

    Only *small* gradients are coalesced: those under ``min(cap_bytes, SMALL_GRADIENT_BYTES)``. They
    are queued per (dtype, device, group) and sent together once the queue reaches ``cap_bytes``, or
    when the first of them is waited on (the end of backward): fewer collectives for models with many
    small units. Every other gradient is reduce-scattered on its own, at once, overlapping the rest
    of backward: a collective of a MiB or more is bandwidth-bound, so a bucket would only add a copy
    and hold the gradient back. Every rank adds the same gradients in the same order and waits in
    the same order, so every rank launches the same collectives.

    Layout of a bucket of k gradients over N ranks (padded gradient i is N chunks of c_i)::

        input  = [g1 chunk 0 | g2 chunk 0 | ... | gk chunk 0 | g1 chunk 1 | ... | gk chunk N-1]
        output = [g1 shard | g2 shard | ... | gk shard]      (this rank's reduced chunks)
    """

    cap_bytes: int  # bytes per bucket; 0 disables bucketing
    stats: CommStats | None
    _queues: dict[tuple[torch.dtype, torch.device, int], _RSQueue]  # buckets still being filled

    def __init__(self, cap_bytes: int, stats: CommStats | None) -> None:
        self.cap_bytes = cap_bytes
        self.stats = stats
        self._queues = {}

    def reduce_scatter(
        self, out: torch.Tensor | None, full: torch.Tensor, group: dist.ProcessGroup
    ) -> Pending:
        """Like :func:`fsdp.comm.collectives.reduce_scatter`, possibly deferred into a shared bucket."""
        if full.numel() * full.element_size() >= min(self.cap_bytes, SMALL_GRADIENT_BYTES):
            return collectives.reduce_scatter(out, full, group, self.stats)
        if out is None:
            out = full.new_empty(full.numel() // dist.get_world_size(group))
        key = (full.dtype, full.device, id(group))
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _RSQueue(self, key, group)
        item = queue.add(out, full)
        if queue.nbytes >= self.cap_bytes:
            queue.launch()
        return item

    def flush(self) -> None:
        """Launch every bucket still being filled."""
        for queue in list(self._queues.values()):
            queue.launch()


class _RSQueue:
    """One bucket: its gradients, until it is launched as a single reduce-scatter."""

    def __init__(self, owner: ReduceScatterBucketer, key: tuple[torch.dtype, torch.device, int],
                 group: dist.ProcessGroup) -> None:  # fmt: skip
        self.owner = owner
        self.key = key
        self.group = group
        self.items: list[_RSItem] = []
        self.nbytes = 0
        self.launched = False

    def add(self, out: torch.Tensor, full: torch.Tensor) -> _RSItem:
        item = _RSItem(self, out, full)
        self.items.append(item)
        self.nbytes += full.numel() * full.element_size()
        return item

    def launch(self) -> None:
        if self.launched:
            return
        self.launched = True
        if self.owner._queues.get(self.key) is self:
            del self.owner._queues[self.key]
        world = dist.get_world_size(self.group)
        chunks = [item.output.numel() for item in self.items]
        fulls = [item.full for item in self.items]
        assert all(f is not None for f in fulls)
        with torch.no_grad():
            flat_in = torch.cat([f.view(world, c) for f, c in zip(fulls, chunks) if f is not None], dim=1)
        first = self.items[0].output
        flat_out = torch.empty(sum(chunks), dtype=first.dtype, device=first.device)
        pending = collectives.reduce_scatter(flat_out, flat_in.reshape(-1), self.group, self.owner.stats)
        offset = 0
        for item, c in zip(self.items, chunks):
            item.shared = pending
            item.view = flat_out[offset : offset + c]
            item.full = None  # the bucket holds its own copy of what is sent
            offset += c


class _RSItem(Pending):
    """One gradient's share of a bucket; ``wait()`` launches the bucket first if it is not yet sent."""

    def __init__(self, queue: _RSQueue, out: torch.Tensor, full: torch.Tensor) -> None:
        super().__init__(None, out)
        self.queue = queue
        self.full: torch.Tensor | None = full
        self.shared: Pending | None = None
        self.view: torch.Tensor | None = None

    @property
    def launched(self) -> bool:
        return self.queue.launched

    def wait(self) -> torch.Tensor:
        self.queue.launch()
        assert self.shared is not None and self.view is not None
        self.shared.wait()
        self.output.copy_(self.view)
        return self.output
