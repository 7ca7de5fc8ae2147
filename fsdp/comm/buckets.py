"""Gradient buckets for replicated (all-reduce) data parallelism, learned from the backward pass.

A :class:`GradBucketer` owns a fixed list of trainable tensors (``nn.Parameter`` objects for
:class:`fsdp.DistributedDataParallel`; flat parameters for a no-shard FSDP wrapper) and reduces
their gradients in buckets of about ``message_size`` elements. The owner reports each gradient as
it becomes ready (``grad_ready``) between ``begin_backward`` and ``finish_backward``; it never
registers hooks itself, so any wrapper can drive it.

Life of a bucketer::

    first reduced backward   learn: record this rank's gradient-ready order; at finish_backward
                             rank 0's layout is broadcast and installed on every rank, then all
                             buckets are reduced at once (no overlap in this iteration)
    later backwards          a bucket is launched (async all-reduce) as soon as its last
                             gradient is ready and every earlier bucket was launched; the end of
                             backward waits for all, scales and copies the results back

This module imports no wrapper; it talks to torch.distributed only through :mod:`fsdp.comm.collectives`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdp.comm import collectives
from fsdp.comm.collectives import CommStats, Pending
from fsdp.common.device import DeviceHandle

__all__ = [
    "BucketConfig",
    "BucketLayout",
    "GradBucketer",
    "MissingGradientError",
    "layout_by_dtype",
    "learn_layout",
]

log = logging.getLogger(__name__)


class MissingGradientError(RuntimeError):
    """A trainable tensor got no gradient in a backward that reduces gradients, on some rank."""


@dataclass(frozen=True, kw_only=True)
class BucketConfig:
    """How a :class:`GradBucketer` groups, scales and returns gradients (apex's options).

    ``message_size``: elements per bucket (a bucket closes once it holds at least this many).
    ``retain_allreduce_buffers``: after reduction, each gradient *is* a view of its bucket's
    buffer (see :attr:`GradBucketer.allreduce_buffers`) instead of a copy.
    ``allreduce_always_fp32``: reduce fp16/bf16 buckets in an fp32 copy.
    ``gradient_predivide_factor`` ``f``: gradients are multiplied by ``1/f`` before the all-reduce
    and, when ``gradient_average``, by ``f/world_size`` after it; without ``gradient_average`` the
    result is the sum over ranks divided by ``f``. ``gradient_postdivide_factor``, when given,
    replaces that rule: the all-reduced sum is divided by it (FSDP's pre/post factors).
    """

    message_size: int = 10_000_000
    retain_allreduce_buffers: bool = False
    allreduce_always_fp32: bool = False
    gradient_average: bool = True
    gradient_predivide_factor: float = 1.0
    gradient_postdivide_factor: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.message_size, bool) or not isinstance(self.message_size, int):
            raise TypeError(f"message_size must be an int (elements per bucket), got {self.message_size!r}")
        if self.message_size < 1:
            raise ValueError(f"message_size must be >= 1 element, got {self.message_size}")
        for name in ("gradient_predivide_factor", "gradient_postdivide_factor"):
            f = getattr(self, name)
            if f is None and name == "gradient_postdivide_factor":
                continue
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < float(f) < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0, got {f!r}")


@dataclass(frozen=True)
class BucketLayout:
    """Buckets in launch order, each a tuple of indices into the bucketer's tensor list.

    Every index appears exactly once, and the tensors of one bucket share dtype and device.
    Example: tensors ``[w0 (fp32, 6 elements), b0 (fp32, 2), w1 (bf16, 6)]`` that became ready in
    the order ``w1, b0, w0`` with ``message_size=4`` give ``((2,), (1, 0))``: ``w1`` fills a bf16
    bucket on its own, ``b0`` (2 < 4) stays open until ``w0`` closes it.
    """

    buckets: tuple[tuple[int, ...], ...]

    def encode(self, num_tensors: int) -> torch.Tensor:
        """``[num_buckets, size_0, ..., size_k, indices..., -1 padding]``, length ``1 + 2 * num_tensors``.

        The length depends only on ``num_tensors``, so one broadcast of a fixed size carries it.
        """
        flat = [len(self.buckets), *(len(b) for b in self.buckets), *(i for b in self.buckets for i in b)]
        if len(flat) > 1 + 2 * num_tensors:
            raise AssertionError(f"layout of {len(self.buckets)} buckets does not fit {num_tensors} tensors")
        return torch.tensor(flat + [-1] * (1 + 2 * num_tensors - len(flat)), dtype=torch.int64)

    @classmethod
    def decode(cls, encoded: torch.Tensor) -> BucketLayout:
        values = [int(v) for v in encoded.tolist()]
        num = values[0]
        sizes = values[1 : 1 + num]
        out: list[tuple[int, ...]] = []
        pos = 1 + num
        for size in sizes:
            out.append(tuple(values[pos : pos + size]))
            pos += size
        return cls(tuple(out))

    def check(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        """Raise ``RuntimeError`` unless this layout covers ``tensors`` exactly, one dtype per bucket."""
        seen = sorted(i for b in self.buckets for i in b)
        if seen != list(range(len(tensors))):
            raise RuntimeError(
                f"the gradient bucket layout received from rank 0 covers tensor indices {seen}, but this "
                f"rank has {len(tensors)} trainable tensors: every rank must wrap the same model and "
                "have the same parameters trainable (requires_grad) in each step"
            )
        for bucket in self.buckets:
            kinds = {(tensors[i].dtype, tensors[i].device) for i in bucket}
            if len(kinds) != 1:
                raise RuntimeError(
                    f"the gradient bucket layout received from rank 0 mixes {sorted(map(str, kinds))} in one "
                    f"bucket ({[names[i] for i in bucket]}): parameter dtypes must be the same on every rank"
                )


def learn_layout(
    tensors: Sequence[torch.Tensor],
    ready_order: Sequence[int],
    message_size: int,
    triggers: Collection[int] | None = None,
) -> BucketLayout:
    """Group tensor indices into buckets in the order their gradients became ready.

    Each (dtype, device) has one open bucket. A tensor joins the open bucket of its kind; the bucket
    closes when it holds ``>= message_size`` elements, or, with ``triggers``, exactly when a trigger
    index joins it (``message_size`` is then ignored). Indices missing from ``ready_order`` (no
    gradient on this rank) are taken as ready after all others, in index order, so the layout always
    covers every tensor. Buckets still open at the end close in the order their kinds first appeared.
    """
    seen: set[int] = set()
    order: list[int] = []
    for i in [*ready_order, *range(len(tensors))]:
        if i not in seen:
            seen.add(i)
            order.append(i)
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_numel: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: list[tuple[int, ...]] = []
    for i in order:
        kind = (tensors[i].dtype, tensors[i].device)
        open_buckets.setdefault(kind, []).append(i)
        open_numel[kind] = open_numel.get(kind, 0) + tensors[i].numel()
        ship = (i in triggers) if triggers is not None else open_numel[kind] >= message_size
        if ship:
            closed.append(tuple(open_buckets.pop(kind)))
            del open_numel[kind]
    closed.extend(tuple(rest) for rest in open_buckets.values())
    return BucketLayout(tuple(closed))


def layout_by_dtype(tensors: Sequence[torch.Tensor]) -> BucketLayout:
    """One bucket per (dtype, device), in index order: the layout of ``delay_allreduce``."""
    return learn_layout(tensors, range(len(tensors)), message_size=sys.maxsize)


class _Bucket:
    """Runtime state of one bucket.

    ``flat`` is ``(numel + 1,)`` in the gradients' dtype and lives as long as the bucket: elements
    ``offsets[k] : offsets[k] + tensors[k].numel()`` hold gradient ``k``; the last element is the
    missing-gradient flag (see [Note: missing-gradient flag]).
    """

    indices: tuple[int, ...]  # positions in the bucketer's tensor list, in bucket order
    tensors: list[torch.Tensor]  # the trainable tensors whose .grad this bucket reduces
    numel: int  # gradient elements (without the flag)
    flat: torch.Tensor | None  # (numel + 1,), allocated at the first launch
    views: list[torch.Tensor]  # views of flat shaped like each tensor
    filled: list[bool]  # slot k's gradient is ready in this backward
    num_filled: int
    comm: torch.Tensor | None  # what goes over the wire: flat, or its fp32 copy
    pending: Pending | None  # the launched all-reduce, until finish_backward

    def __init__(self, indices: tuple[int, ...], tensors: list[torch.Tensor]) -> None:
        self.indices = indices
        self.tensors = tensors
        self.numel = sum(t.numel() for t in tensors)
        self.flat = None
        self.views = []
        self.filled = [False] * len(tensors)
        self.num_filled = 0
        self.comm = None
        self.pending = None

    @property
    def complete(self) -> bool:
        return self.num_filled == len(self.tensors)

    def ensure_flat(self) -> torch.Tensor:
        if self.flat is None:
            first = self.tensors[0]
            self.flat = torch.empty(self.numel + 1, dtype=first.dtype, device=first.device)
            offset = 0
            for t in self.tensors:
                self.views.append(self.flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
        return self.flat

    def reset(self) -> None:
        self.filled = [False] * len(self.tensors)
        self.num_filled = 0
        self.comm = None
        self.pending = None


# [Note: bucket launch order]
# All-reduces pair up across ranks by the order in which each rank launches them, not by content.
# Ranks can see gradients ready in different orders (different control flow, or the autograd
# engine's choices), so every rank uses rank 0's layout and launches bucket k only after buckets
# 0..k-1: a bucket that completes early waits in `_launch_ready` until its predecessors launched.
#
# [Note: missing-gradient flag]
# Each bucket's buffer carries one extra element, set to 1 by a rank that launched the bucket with
# some gradient missing (zeros stand in for it) and 0 otherwise. After the all-reduce, the flag is
# non-zero on every rank exactly when some rank missed a gradient, so all ranks raise together,
# after every bucket was launched and waited on: no rank is left waiting in a collective, and the
# check costs no extra collective. (Scaling by the predivide factor keeps a non-zero flag non-zero.)
# Reading the flags is one host synchronization per backward on CUDA; at world size 1 the host
# knows the answer already (``bucket.complete``) and reads nothing.


class GradBucketer:
    """Reduces the gradients of a fixed list of tensors in learned, overlapped buckets.

    Preconditions: every rank builds its bucketer with the same tensors (same order, shapes, dtypes)
    and calls ``begin_backward`` / ``grad_ready`` / ``finish_backward`` for the same backwards.
    Postcondition of ``finish_backward``: each tensor's ``.grad`` holds the (averaged) sum over ranks;
    or :class:`MissingGradientError` was raised on every rank.

    Worked example, 2 ranks, ``gradient_average=True``: rank 0's ``w.grad = [1., 2.]`` and rank 1's
    ``w.grad = [3., 6.]`` become ``[2., 4.]`` on both ranks.
    """

    tensors: list[torch.Tensor]  # the trainable tensors, in the order indices refer to
    names: list[str]  # their names, for error messages
    config: BucketConfig
    group: dist.ProcessGroup  # the layout broadcast, and the bucket groups' ranks
    layout: BucketLayout | None  # None until learned (first reduced backward)
    _device: DeviceHandle
    _streams: list[Any]  # bucket k is launched on _streams[k % len]; no-op streams on CPU
    _groups: list[dist.ProcessGroup]  # bucket k is reduced on _groups[k % len]
    _stats: CommStats | None
    _triggers: frozenset[int] | None  # indices that close a bucket while learning
    _delay: bool  # launch every bucket at finish_backward (delay_allreduce)
    _checked: bool  # delay mode: the ranks' trainable tensors were compared
    _seen: set[int]  # indices in _ready_order
    _buckets: list[_Bucket]
    _where: list[tuple[int, int]]  # tensor index -> (bucket, slot)
    _ready_order: list[int]  # this backward's gradient-ready order (kept while learning)
    _next: int  # the next bucket to launch in this backward
    _active: bool  # between begin_backward and finish_backward

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        group: dist.ProcessGroup,
        config: BucketConfig,
        device: DeviceHandle,
        *,
        delay: bool = False,
        triggers: Collection[int] | None = None,
        layout: BucketLayout | None = None,
        streams: Sequence[Any] | None = None,
        groups: Sequence[dist.ProcessGroup] | None = None,
        stats: CommStats | None = None,
    ) -> None:
        if len(names) != len(tensors):
            raise AssertionError("one name per tensor")
        self.tensors = list(tensors)
        self.names = list(names)
        self.config = config
        self.group = group
        self._device = device
        self._streams = list(streams) if streams else [device.new_stream()]
        self._groups = list(groups) if groups else [group]
        self._stats = stats
        self._triggers = frozenset(triggers) if triggers is not None else None
        self._delay = delay
        self._checked = False  # delay mode: the ranks' trainable tensors were compared
        self._buckets = []
        self._where = []
        self._ready_order = []
        self._seen = set()
        self._next = 0
        self._active = False
        self.layout = None
        if delay and layout is None:
            layout = layout_by_dtype(self.tensors)
        if layout is not None:
            self._install(layout)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def layout_names(self) -> tuple[tuple[str, ...], ...] | None:
        """The layout with tensor names instead of indices (None until learned)."""
        if self.layout is None:
            return None
        return tuple(tuple(self.names[i] for i in b) for b in self.layout.buckets)

    @property
    def allreduce_buffers(self) -> list[torch.Tensor]:
        """Each bucket's reduced gradients as one flat tensor (valid after a reduced backward).

        With ``retain_allreduce_buffers`` the tensors' ``.grad`` are views of these.
        """
        return [b.flat[: b.numel] for b in self._buckets if b.flat is not None]

    @property
    def ready_order(self) -> list[int]:
        """This rank's gradient-ready order in the current (or last learning) backward."""
        return list(self._ready_order)

    # ---- the backward protocol -------------------------------------------------------------------
    def begin_backward(self) -> None:
        if self._active:
            raise AssertionError("begin_backward called twice without finish_backward")
        self._active = True
        self._next = 0
        self._ready_order = []
        self._seen = set()
        for b in self._buckets:
            b.reset()

    def grad_ready(self, index: int) -> None:
        """Tensor ``index``'s gradient is final for this backward; launch what became launchable."""
        if not self._active:
            raise AssertionError("grad_ready outside begin_backward/finish_backward")
        if self.layout is None:  # learning: only record the order (a repeat adds to .grad only)
            if index not in self._seen:
                self._seen.add(index)
                self._ready_order.append(index)
            return
        b, slot = self._where[index]
        bucket = self._buckets[b]
        if bucket.filled[slot]:
            if self._delay:  # nothing is launched before the end: the repeat just adds to .grad
                return
            raise RuntimeError(
                f"parameter {self.names[index]} received a second gradient in one backward after its "
                "bucket was filled (reentrant activation checkpointing runs a backward inside the "
                "backward); use non-reentrant checkpointing (use_reentrant=False) or delay_allreduce=True"
            )
        bucket.filled[slot] = True
        bucket.num_filled += 1
        if not self._delay and bucket.complete and b == self._next:
            self._launch_ready()

    def finish_backward(self) -> None:
        """Launch what is left, wait for every bucket, scale and copy back; check for missing grads.

        Raises :class:`MissingGradientError` on every rank if any rank missed a gradient.
        """
        if not self._active:
            raise AssertionError("finish_backward without begin_backward")
        try:
            if self.layout is None:
                self._install(self._sync_layout())
                for index in self._ready_order:
                    b, slot = self._where[index]
                    if not self._buckets[b].filled[slot]:
                        self._buckets[b].filled[slot] = True
                        self._buckets[b].num_filled += 1
            if self._delay and not self._checked:  # the layout was not learned, so not compared yet
                self._check_same_tensors()
                self._checked = True
            while self._next < len(self._buckets):
                self._launch(self._next)
                self._next += 1
            missing_somewhere = self._wait_and_copy_back()
        finally:
            self._active = False
        if missing_somewhere:
            local = [
                self.names[i]
                for bucket in self._buckets
                for i, f in zip(bucket.indices, bucket.filled)
                if not f
            ]
            here = f"on this rank: {', '.join(local)}" if local else "none on this rank"
            raise MissingGradientError(
                "some trainable parameters got no gradient in this backward on "
                f"at least one rank ({here}). Every parameter with requires_grad=True must take part in "
                "the loss of every backward that reduces gradients. Either use it, or freeze it with "
                "requires_grad_(False) before the forward (the set of trainable parameters is checked "
                "at each forward and the buckets are rebuilt when it changes), or skip the reduction "
                "for this backward (no_sync() / need_reduction=False). Gradients that did arrive were "
                "reduced with zeros standing in for the missing ones."
            )

    def abort(self) -> None:
        """Forget a backward that never reached ``finish_backward`` (it raised part-way).

        Launched all-reduces are waited for, so that their buffers are not reused while in flight.
        """
        for bucket in self._buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
            bucket.reset()
        self._active = False

    # ---- internals -------------------------------------------------------------------------------
    def _install(self, layout: BucketLayout) -> None:
        layout.check(self.tensors, self.names)
        self.layout = layout
        self._buckets = [_Bucket(b, [self.tensors[i] for i in b]) for b in layout.buckets]
        self._where = [(0, 0)] * len(self.tensors)
        for b, indices in enumerate(layout.buckets):
            for slot, i in enumerate(indices):
                self._where[i] = (b, slot)
        log.debug("gradient buckets: %s", self.layout_names)

    def _check_same_tensors(self) -> None:
        """Raise on every rank unless all ranks reduce the same tensors (names, shapes, dtypes): their
        layouts, and so the broadcast below and every bucket, would not pair up. Fixed-size, so
        ranks with different numbers of trainable tensors still meet in it."""
        world = dist.get_world_size(self.group)
        if world == 1:
            return
        text = ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in zip(self.names, self.tensors))
        mine = [len(self.tensors), collectives.digest_of_text(text)]
        rows = collectives.all_gather_ints(mine, self.group, self._device.device, self._stats)
        differ = [r for r in range(world) if rows[r] != rows[0]]
        if differ:
            raise RuntimeError(
                f"gradient buckets: rank(s) {differ} reduce other parameters than rank 0 ({rows[differ[0]][0]} "
                f"trainable tensors against {rows[0][0]}, or other names, shapes or dtypes). Every rank must "
                "have the same parameters trainable (requires_grad) in each step"
            )

    def _sync_layout(self) -> BucketLayout:
        """Rank 0's learned layout, on every rank. See [Note: bucket launch order]."""
        self._check_same_tensors()
        mine = learn_layout(self.tensors, self._ready_order, self.config.message_size, self._triggers)
        encoded = mine.encode(len(self.tensors)).to(self._device.device)
        collectives.broadcast(encoded, 0, self.group, self._stats).wait()
        layout = BucketLayout.decode(encoded.cpu())
        if layout != mine:
            log.debug("rank %d uses rank 0's bucket layout instead of its own", dist.get_rank(self.group))
        return layout

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets) and self._buckets[self._next].complete:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        """Flatten bucket ``b``'s gradients (zeros for missing ones) and start its all-reduce."""
        bucket = self._buckets[b]
        cfg = self.config
        stream = self._streams[b % len(self._streams)]
        self._device.wait_stream(stream, self._device.current_stream())  # the gradients are ready
        with self._device.stream(stream), torch.no_grad():
            flat = bucket.ensure_flat()
            dst: list[torch.Tensor] = []
            src: list[torch.Tensor] = []
            for view, t, filled in zip(bucket.views, bucket.tensors, bucket.filled):
                grad = t.grad if filled else None
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr():  # retained buffers: the grad already is the view
                    dst.append(view)
                    src.append(grad)
            if dst:
                torch._foreach_copy_(dst, src)
            flat[-1].fill_(0.0 if bucket.complete else 1.0)  # See [Note: missing-gradient flag]
            comm = flat
            if cfg.allreduce_always_fp32 and flat.dtype in (torch.float16, torch.bfloat16):
                comm = flat.float()
            if cfg.gradient_predivide_factor != 1.0:
                comm.div_(cfg.gradient_predivide_factor)
            bucket.comm = comm
            bucket.pending = collectives.all_reduce(
                comm, self._groups[b % len(self._groups)], stats=self._stats
            )

    def _wait_and_copy_back(self) -> bool:
        """Wait for every bucket; return whether any rank flagged a missing gradient."""
        cfg = self.config
        current = self._device.current_stream()
        for stream in self._streams:
            self._device.wait_stream(current, stream)
        world = dist.get_world_size(self.group)
        if cfg.gradient_postdivide_factor is not None:
            post = cfg.gradient_postdivide_factor
        else:
            post = world / cfg.gradient_predivide_factor if cfg.gradient_average else 1.0
        flags: list[torch.Tensor] = []
        with torch.no_grad():
            for bucket in self._buckets:
                assert bucket.pending is not None and bucket.comm is not None and bucket.flat is not None
                comm = bucket.pending.wait()
                if post != 1.0:
                    comm.div_(post)
                if comm is not bucket.flat:
                    bucket.flat.copy_(comm)
                flags.append(comm[-1:].float())
                present = [(t, v) for t, v, f in zip(bucket.tensors, bucket.views, bucket.filled) if f]
                if cfg.retain_allreduce_buffers:
                    for t, v in present:
                        if t.grad is None or t.grad.data_ptr() != v.data_ptr():
                            t.grad = v
                else:
                    grads = [t.grad for t, _ in present if t.grad is not None]
                    views = [v for t, v in present if t.grad is not None]
                    if grads:
                        torch._foreach_copy_(grads, views)
                bucket.comm = None
                bucket.pending = None
        if world == 1:  # this rank's own flags say it all: no device read, no host synchronization
            return not all(bucket.complete for bucket in self._buckets)
        return bool(torch.cat(flags).ne(0).any().item()) if flags else False
