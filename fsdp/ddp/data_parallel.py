"""apex-style data parallelism: replicated parameters, learned gradient buckets overlapped with backward.

:class:`DistributedDataParallel` keeps a full copy of the module on every rank and averages
gradients with all-reduces. It takes the arguments of apex's ``apex.parallel.DistributedDataParallel``,
plus ``process_group``. The bucket engine is :mod:`fsdp.comm.buckets`; this
module owns the hooks, the forward, the trainable-set check and the no-sync switch.

[Note: which backward reduces]
Each grad-enabled forward gets a number (a token), remembered with the value ``need_reduction``
had then, and hooks on its non-leaf outputs. A backward that reaches one of those outputs records
the token, and queues its end-of-backward callback there, in the backward the user started: a
parameter's hook may run inside a nested backward (reentrant checkpointing), which ends first. At
the first parameter hook the backward decides: it reduces when ``need_reduction`` is set now and
one of the forwards it reached (or, if it reached no output, any forward still waiting) ran with it
set. Its end forgets the forwards it reached, so a second backward through them stays local, as
does a backward of the module called directly; ``l1 = m(x1); l2 = m(x2)`` then ``l1.backward();
l2.backward()`` reduces both. A backward in which no parameter got a gradient
(``torch.autograd.grad`` to the inputs, a gradient penalty) decides nothing and forgets nothing. A
forward that runs inside a backward (a recomputation) is not counted.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakTensorKeyDictionary

from fsdp.comm import collectives
from fsdp.comm.buckets import BucketConfig, BucketLayout, GradBucketer
from fsdp.comm.collectives import CommStats
from fsdp.common.device import DeviceHandle, default_compute_device
from fsdp.common.nest import visit_tensors
from fsdp.common.torch_compile import queue_end_of_backward, run_eagerly_under_compile

__all__ = ["DistributedDataParallel"]

log = logging.getLogger(__name__)


class _Phase(enum.Enum):
    IDLE = "idle"
    REDUCING = "reducing"  # a backward whose gradients are reduced
    LOCAL = "local"  # a backward under no_sync() / need_reduction=False: gradients stay local


@dataclass
class _BackwardState:
    """Per-backward state, a plain object so that the hot hook path avoids ``nn.Module.__setattr__``."""

    phase: _Phase = _Phase.IDLE
    reached: set[int] = field(default_factory=set)  # tokens of forwards whose outputs this backward reached
    end_queued: bool = False  # the end-of-backward callback is queued (in the backward that reached them)
    unexpected: list[str] | None = None  # parameters that got a gradient but were not trainable at forward


# grad-enabled forwards kept waiting for their backward, at most (the oldest are forgotten)
_MAX_PENDING = 64


# parameter -> a weak reference to the wrapper whose hooks reduce it (held weakly: pickling the
# module, or dropping it, is not affected)
_OWNERS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _owner_of(param: torch.Tensor) -> weakref.ref[DistributedDataParallel] | None:
    return _OWNERS.get(param)  # type: ignore[no-untyped-call,no-any-return]


def _grad_ready(owner: weakref.ref[DistributedDataParallel], param: torch.Tensor) -> None:
    """A parameter's hook. It holds its wrapper weakly and acts only while that wrapper is the
    parameter's owner: a wrapper that was dropped, or replaced by a newer one, reduces nothing."""
    wrapper = owner()
    if wrapper is not None and _owner_of(param) is owner:
        wrapper._on_grad_ready(param)


def _inside_backward() -> bool:
    """Whether autograd is running a backward in this thread (a recomputation calls forward there)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


# The key of a trainable set: the positions (in module.parameters()) and dtypes of the trainable ones.
_TrainableKey = tuple[tuple[int, torch.dtype], ...]


class DistributedDataParallel(nn.Module):
    """Replicate ``module`` on every rank and average its gradients over ``process_group``.

    At construction rank 0's parameters and buffers are broadcast, so all ranks start identical.
    The first backward that reduces learns the buckets: gradients are grouped, per dtype, into
    buckets of about ``message_size`` elements in the order they became ready, rank 0's grouping is
    broadcast, and everything is reduced at the end of that backward. From then on each bucket's
    all-reduce starts as soon as its last gradient is ready (overlapping the rest of backward) and a
    callback at the end of backward waits for all of them and writes the averaged gradients back.

    Args (apex's names and defaults):
        module: the model, already on its device (all parameters on one device).
        message_size: elements per bucket.
        delay_allreduce: reduce everything at the end of backward, one bucket per dtype (no overlap).
        shared_param: ignored, with a ``DeprecationWarning`` (buckets are safe with shared parameters).
        allreduce_trigger_params: parameters of ``module``; while learning, a bucket closes exactly
            when one of these gets its gradient (``message_size`` is then ignored).
        retain_allreduce_buffers: after reduction each ``.grad`` is a view of its bucket's buffer
            (:attr:`allreduce_buffers`) instead of a copy.
        allreduce_always_fp32: reduce fp16/bf16 gradients in fp32.
        num_allreduce_streams: CUDA only: buckets round-robin over this many side streams, each with
            its own process group. Accepted on CPU, where it changes nothing.
        allreduce_communicators: ``(process_groups, streams)``, each of length
            ``num_allreduce_streams``, to use instead of creating them.
        gradient_average: divide the sum over ranks by the world size.
        gradient_predivide_factor: ``f``: multiply by ``1/f`` before the all-reduce and by
            ``f/world_size`` after it (without ``gradient_average``: only ``1/f`` before).
        process_group: the ranks to average over (default: the default group).

    Every parameter with ``requires_grad=True`` must get a gradient in every backward that reduces;
    otherwise every rank raises :class:`fsdp.comm.buckets.MissingGradientError` naming the parameters.
    Freeze parameters that a step does not use (``requires_grad_(False)`` before its forward): the
    trainable set is checked after every forward and the buckets are rebuilt when it changes.
    """

    module: nn.Module
    process_group: dist.ProcessGroup
    need_reduction: bool  # False: backwards keep their gradients local (no_sync(), disable_allreduce())
    comm_stats: CommStats  # every collective this wrapper launched (calls, elements, bytes, dtypes)
    bucket_config: BucketConfig
    delay_allreduce: bool
    num_allreduce_streams: int
    _device: DeviceHandle
    _trigger_ids: frozenset[int] | None  # id() of allreduce_trigger_params
    _streams: list[Any]  # side streams for buckets (no-op streams on CPU)
    _groups: list[dist.ProcessGroup]  # bucket k is reduced on _groups[k % len]
    _trainable: list[nn.Parameter]  # the trainable set at the last check, in module order
    _trainable_dtypes: list[torch.dtype]
    _bucketer: GradBucketer
    _index: dict[int, int]  # id(param) -> index in _trainable
    _layouts: dict[_TrainableKey, BucketLayout]  # learned layouts of every trainable set seen
    _layout_key: _TrainableKey  # the key of the current trainable set
    _hooks: list[RemovableHandle]  # post-accumulate-grad hooks on the module's parameters
    _ref: weakref.ref[DistributedDataParallel]  # what a parameter's _OWNER holds
    _state: _BackwardState
    _token: int  # the last grad-enabled forward's number
    _pending: dict[int, bool]  # forwards not yet backpropagated -> need_reduction at that forward

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10_000_000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Iterable[nn.Parameter] | None = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: tuple[Sequence[dist.ProcessGroup], Sequence[Any]] | None = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        run_eagerly_under_compile()  # See [Note: torch.compile]
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
        if shared_param is not None:
            warnings.warn(
                "DistributedDataParallel: shared_param is ignored (buckets are safe with shared "
                "parameters; apex stopped supporting it too); remove the argument. To reduce only at "
                "the end of backward, pass delay_allreduce=True.",
                DeprecationWarning,
                stacklevel=2,
            )
        sharded = [
            name or "<root>"
            for name, m in module.named_modules()
            if any(c.__name__ in ("FullyShardedDataParallel", "FSDPModule") for c in type(m).__mro__)
        ]
        if sharded:
            raise ValueError(
                f"DistributedDataParallel: the module holds sharded (FullyShardedDataParallel) parts at {sharded[:3]}; "
                "their parameters are per-rank shards that must not be broadcast or averaged across ranks. To "
                "replicate and shard at once use FullyShardedDataParallel(sharding_strategy=HYBRID_SHARD), or "
                "NO_SHARD to replicate only"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call torch.distributed.init_process_group first"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None
        if dist.get_rank(group) < 0:
            raise ValueError(
                "DistributedDataParallel: this rank is not a member of process_group; create the wrapper only "
                "on the group's ranks, or pass a group this rank belongs to"
            )
        self.bucket_config = BucketConfig(
            message_size=message_size,
            retain_allreduce_buffers=retain_allreduce_buffers,
            allreduce_always_fp32=allreduce_always_fp32,
            gradient_average=gradient_average,
            gradient_predivide_factor=gradient_predivide_factor,
        )
        if isinstance(num_allreduce_streams, bool) or not isinstance(num_allreduce_streams, int):
            raise TypeError(f"num_allreduce_streams must be an int, got {num_allreduce_streams!r}")
        if num_allreduce_streams < 1:
            raise ValueError(f"num_allreduce_streams must be >= 1, got {num_allreduce_streams}")
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError(
                "num_allreduce_streams > 1 overlaps buckets on several streams, which needs "
                "delay_allreduce=False; drop one of the two"
            )
        if allreduce_trigger_params is not None and delay_allreduce:
            raise ValueError(
                "allreduce_trigger_params chooses when buckets are launched during backward, which "
                "needs delay_allreduce=False; drop one of the two"
            )

        self.module = module
        self.process_group = group
        self.need_reduction = True
        self.comm_stats = CommStats()
        self.delay_allreduce = delay_allreduce
        self.num_allreduce_streams = num_allreduce_streams
        devices = {p.device for p in module.parameters()} | {b.device for b in module.buffers()}
        if len(devices) > 1:
            raise ValueError(
                f"DistributedDataParallel needs the module on one device, found {sorted(map(str, devices))}; "
                "move it with module.to(device) before wrapping"
            )
        self._device = DeviceHandle(default_compute_device(devices))
        self._trigger_ids = self._check_triggers(allreduce_trigger_params)
        self._streams, self._groups = self._make_streams_and_groups(
            num_allreduce_streams, allreduce_communicators
        )
        self._check_same_model()
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                "DistributedDataParallel: the module has no parameter that requires a gradient, so there "
                "is nothing to reduce; run it unwrapped, or set requires_grad=True on what should train"
            )
        self._broadcast_state()

        self._trainable = []
        self._trainable_dtypes = []
        self._index = {}
        self._layouts = {}
        self._hooks = []
        self._ref = weakref.ref(self)
        self._token = 0
        self._pending = {}
        self._state = _BackwardState()
        self._refresh_trainable(force=True)

    # ---- public --------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if _inside_backward():  # a recomputation (activation checkpointing around the wrapper)
            return self.module(*inputs, **kwargs)
        if self._state.phase is not _Phase.IDLE:
            # the last backward raised before its end-of-backward callback ran
            warnings.warn(
                "DistributedDataParallel: the previous backward did not finish (it raised part-way); "
                "its gradient reduction is abandoned and gradients may differ across ranks",
                RuntimeWarning,
                stacklevel=2,
            )
            if self._state.phase is _Phase.REDUCING:
                self._bucketer.abort()
            self._state = _BackwardState()
        first = next(iter(self._trainable), None)
        if first is not None and _owner_of(first) is not self._ref:
            raise RuntimeError(
                "DistributedDataParallel: a newer DistributedDataParallel wraps this module and reduces its "
                "gradients; use that one (this wrapper's hooks are inactive)"
            )
        result = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled():
            # After the module's forward, like apex: a forward that freezes or unfreezes parameters
            # is seen before the backward it feeds.
            self._refresh_trainable()
            self._token += 1
            token = self._token
            self._pending[token] = self.need_reduction
            while len(self._pending) > _MAX_PENDING:
                del self._pending[next(iter(self._pending))]
            # (the hook holds the wrapper: DDP(m)(x).sum().backward() reduces although nothing else does)
            hook = functools.partial(self._on_output_grad, token)

            def hook_output(t: torch.Tensor) -> None:
                if t.grad_fn is not None:  # a leaf (a parameter returned as is) would collect hooks
                    t.register_hook(hook)  # type: ignore[no-untyped-call]

            visit_tensors(result, hook_output, [])
        return result

    def _on_output_grad(self, token: int, grad: torch.Tensor) -> None:
        """A backward reached an output of the forward ``token``: queue the end of this backward
        here, in the backward the user started (a parameter's hook may run in a nested one)."""
        state = self._state
        state.reached.add(token)
        if not state.end_queued:
            state.end_queued = True
            queue_end_of_backward(self._end_backward, "DistributedDataParallel")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Keep gradients local (accumulate) in backwards whose forward or backward runs inside.

        The first backward after leaving the context reduces the accumulated gradients.
        """
        previous = self.need_reduction
        self.need_reduction = False
        try:
            yield
        finally:
            self.need_reduction = previous

    def disable_allreduce(self) -> None:
        """apex's spelling of ``need_reduction = False``."""
        self.need_reduction = False

    def enable_allreduce(self) -> None:
        """apex's spelling of ``need_reduction = True``."""
        self.need_reduction = True

    @property
    def bucket_layout(self) -> tuple[tuple[str, ...], ...] | None:
        """Parameter names per bucket, in launch order; None until the first reduced backward learned it."""
        return self._bucketer.layout_names

    @property
    def allreduce_buffers(self) -> list[torch.Tensor]:
        """Each bucket's flat reduced gradients (the ``.grad`` tensors are views of them when
        ``retain_allreduce_buffers=True``); valid until the next reduced backward."""
        return self._bucketer.allreduce_buffers

    # ---- construction helpers --------------------------------------------------------------------
    def _check_triggers(self, params: Iterable[nn.Parameter] | None) -> frozenset[int] | None:
        if params is None:
            return None
        ids = {id(p) for p in params}
        own = {id(p) for p in self.module.parameters()}
        if not ids <= own:
            raise ValueError(
                f"allreduce_trigger_params has {len(ids - own)} tensor(s) that are not parameters of the "
                "wrapped module; pass parameters taken from the module you wrap"
            )
        return frozenset(ids)

    def _make_streams_and_groups(
        self, n: int, communicators: tuple[Sequence[dist.ProcessGroup], Sequence[Any]] | None
    ) -> tuple[list[Any], list[dist.ProcessGroup]]:
        if communicators is not None:
            groups, streams = communicators
            if n < 2 or len(groups) != n or len(streams) != n:
                raise ValueError(
                    "allreduce_communicators must be (process_groups, streams), each of length "
                    f"num_allreduce_streams (> 1); got {len(groups)} groups and {len(streams)} streams "
                    f"for num_allreduce_streams={n}"
                )
            return (list(streams) if self._device.is_cuda else [self._device.new_stream()]), list(groups)
        if not self._device.is_cuda:
            if n > 1:
                log.info("num_allreduce_streams=%d has no effect on CPU: buckets use one gloo group", n)
            return [self._device.new_stream()], [self.process_group]
        streams = [self._device.new_stream() for _ in range(n)]
        if n == 1:
            return streams, [self.process_group]
        # one process group per stream, so that NCCL can run the streams' all-reduces concurrently
        groups = [
            collectives.get_process_group_cached(self.process_group, f"ddp-bucket-{k}") for k in range(n)
        ]
        return streams, groups

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = [(f"parameter {n}", p.detach()) for n, p in self.module.named_parameters()]
        return named + [(f"buffer {n}", b) for n, b in self.module.named_buffers()]

    def _check_same_model(self) -> None:
        """Every rank must wrap the same model; compare a fingerprint before any broadcast pairs up."""
        world = dist.get_world_size(self.process_group)
        if world == 1:
            return
        text = ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in self._state_tensors())
        text += f";trainable:{any(p.requires_grad for p in self.module.parameters())}"
        digest = collectives.digest_of_text(text)
        everyone = collectives.all_gather_ints(
            [digest], self.process_group, self._device.device, self.comm_stats
        )
        differ = [r for r, v in enumerate(everyone) if v != everyone[0]]
        if differ:
            raise ValueError(
                f"DistributedDataParallel: rank(s) {differ} wrap a different model than rank 0 (parameter "
                "or buffer names, shapes or dtypes, or whether anything trains, differ); build the same model on every rank"
            )

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Copy rank 0's parameters and buffers to every rank: one broadcast per dtype."""
        by_kind: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, t in self._state_tensors():
            if t.numel():
                by_kind.setdefault(t.dtype, []).append(t.view(torch.uint8) if t.dtype == torch.bool else t)
        for tensors in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            collectives.broadcast(flat, 0, self.process_group, self.comm_stats).wait()
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    # ---- trainable set ---------------------------------------------------------------------------
    def _refresh_trainable(self, force: bool = False) -> None:
        """Rebuild the bucketer if the set (or dtypes) of trainable parameters changed since last time."""
        current = [p for p in self.module.parameters() if p.requires_grad]
        if (
            not force
            and len(current) == len(self._trainable)
            and all(
                p is q and p.dtype == d for p, q, d in zip(current, self._trainable, self._trainable_dtypes)
            )
        ):
            return
        if not force:
            log.info("the set of trainable parameters changed; gradient buckets follow the new set")
        names = {id(p): n for n, p in self.module.named_parameters()}
        position = {id(p): i for i, p in enumerate(self.module.parameters())}
        for p in current:
            if _owner_of(p) is not self._ref:  # a parameter this wrapper has not hooked yet
                hook = p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    functools.partial(_grad_ready, self._ref)
                )
                _OWNERS[p] = self._ref
                self._hooks.append(hook)
        key: _TrainableKey = tuple((position[id(p)], p.dtype) for p in current)
        triggers = None
        if self._trigger_ids is not None:
            triggers = [i for i, p in enumerate(current) if id(p) in self._trigger_ids]
        self._trainable = current
        self._trainable_dtypes = [p.dtype for p in current]
        self._index = {id(p): i for i, p in enumerate(current)}
        self._bucketer = GradBucketer(
            current,
            [names[id(p)] for p in current],
            self.process_group,
            self.bucket_config,
            self._device,
            delay=self.delay_allreduce,
            triggers=triggers,
            layout=self._layouts.get(key),
            streams=self._streams,
            groups=self._groups,
            stats=self.comm_stats,
        )
        self._layout_key = key

    # ---- hooks -------------------------------------------------------------------------------------
    def _begin(self) -> None:
        """The first parameter hook of a backward: decide whether it reduces. See [Note: which backward reduces]."""
        state = self._state
        if state.reached:
            from_forward = any(self._pending.get(t, False) for t in state.reached)
        else:  # no output of the wrapper on the way (outputs it cannot hook, or the module called directly)
            from_forward = any(self._pending.values())
        reduce = self.need_reduction and from_forward
        state.phase = _Phase.REDUCING if reduce else _Phase.LOCAL
        if not state.end_queued:
            state.end_queued = True
            queue_end_of_backward(self._end_backward, "DistributedDataParallel")
        if reduce:
            self._bucketer.begin_backward()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ``param.grad`` is final for this backward."""
        state = self._state
        if state.phase is _Phase.IDLE:  # no output of the wrapper was reached first
            self._begin()
        if state.phase is _Phase.REDUCING:
            if param.grad is not None and param.grad.is_sparse:
                raise RuntimeError(
                    f"DistributedDataParallel: parameter {self._name_of(param)} has a sparse gradient, which "
                    "the dense buckets cannot reduce; build the module with dense gradients (e.g. "
                    "nn.Embedding(..., sparse=False))"
                )
            index = self._index.get(id(param))
            if index is None:
                state.unexpected = [*(state.unexpected or []), self._name_of(param)]
            else:
                self._bucketer.grad_ready(index)

    def _end_backward(self) -> None:
        """Queued by the first hook of a backward; runs once the whole backward is done."""
        state = self._state
        phase, unexpected = state.phase, state.unexpected
        self._state = _BackwardState()
        if phase is _Phase.IDLE:  # no parameter got a gradient (torch.autograd.grad to the inputs, say)
            return
        if state.reached:  # those forwards are done with; a later backward of theirs stays local
            for t in state.reached:
                self._pending.pop(t, None)
        else:
            self._pending.clear()
        if phase is not _Phase.REDUCING:
            return
        self._bucketer.finish_backward()
        if self._bucketer.layout is not None:
            self._layouts[self._layout_key] = self._bucketer.layout
        if unexpected:
            raise RuntimeError(
                f"DistributedDataParallel: parameter(s) {unexpected} got a gradient but were frozen "
                "(requires_grad=False) at the last forward, so their gradients were not reduced; "
                "change requires_grad before the forward, not between forward and backward"
            )

    def _name_of(self, param: torch.Tensor) -> str:
        for n, p in self.module.named_parameters():
            if p is param:
                return n
        return "<unknown>"
