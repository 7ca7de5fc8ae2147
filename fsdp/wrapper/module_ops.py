"""``nn.Module`` operations on a wrapped model: ``.half()`` / ``.to()`` / ``.cuda()`` after wrapping,
``copy.deepcopy`` and pickling, and fairscale's ``model.process_group = group``.

[Note: conversions after wrapping]
``nn.Module._apply`` (behind ``.half()``, ``.float()``, ``.double()``, ``.to()``, ``.cuda()``,
``.cpu()``) replaces every registered tensor's ``.data``: here the flat parameters, whose data is
this rank's shard between steps, their gradients, and the buffers. A wrapper lets it do so, as
torch FSDP1 does, and then follows (``FlatParamHandle.follow_conversion``): the new tensor is the
shard, its dtype the master dtype, and every buffer derived from it (the full parameter, the
compute-dtype copies) is made again for the new dtype and device. Without mixed precision the
compute dtype follows the master dtype (fairscale's rule), so ``model.half()`` trains in pure fp16
and ``model.double()`` in fp64, as the plain model cast alike; the compute device follows the
shards. The root's context is released, so the next forward sets the tree up again for the new
devices and dtypes (and checks across ranks that every rank converted alike). Buffers follow as in
a plain module; one the wrapper keeps in ``buffer_dtype`` stays in it, and its dtype in the state
dict becomes the converted one. Refused, before anything changes: a conversion during a step
(forward, backward, ``no_sync()``, ``summon_full_params()``), one that changes the master dtype
under mixed precision (masters stay fp32: change ``compute_dtype`` instead), and one that moves
shards CPU offload keeps on the host.

[Note: copies of a wrapped model]
``copy.deepcopy(model)`` (an EMA copy) gives an independent wrapper tree over the same process
groups: each wrapper's modules, buffers and flat parameters are copied (this rank's shards, cloned;
no gradient, as ``nn.Parameter``'s copy has none), its handles make their full buffers anew, and
its runtime state (the root's context, full parameters kept from a forward, gradients accumulated in
``no_sync()``) is left behind, so the copy starts as a freshly wrapped model: its first forward
sets it up as a root of its own, on every rank, as any first forward. The original's shards are
never shared. Pickling (``pickle``, ``torch.save`` of the module, a model returned from a worker
process) stores the same, with each process group replaced by a :class:`DetachedGroup` that keeps
the rank and size it stood for, since process groups cannot be pickled. Unpickled in a process
whose default group matches (it was the whole world, with this rank and size), the wrapper takes
the default group back; otherwise it stays detached: at world size 1 it trains as it is (nothing
needs communicating), larger ones refuse to communicate until ``model.process_group = group`` is
set on every wrapper, as fairscale requires after unpickling. Its reductions then share that group
(a second group for them would need every rank's part in making it).
Copies are made between steps only.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import CommConfig, FSDPConfig, ProcessGroupName, ShardingStrategy, TrainingState
from fsdp.comm.consistency import wrapper_path
from fsdp.comm.topology import is_stand_in
from fsdp.common.guards import claim_modules
from fsdp.core.flat_param import collect_owned
from fsdp.core.wrapper_protocol import Wrapper, WrapperMixin, as_module

__all__ = ["DetachedGroup", "ModuleOps", "detached_comm"]


class DetachedGroup:
    """A process group as pickling leaves it: the ``rank()`` and ``size()`` it stood for, and whether
    it was the whole world. A stand-in (see ``fsdp.comm.topology.is_stand_in``) until a real group is
    given. See [Note: copies of a wrapped model]."""

    def __init__(self, rank: int, size: int, world: bool) -> None:
        self._rank, self._size, self.world = rank, size, world

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"DetachedGroup(rank={self._rank}, size={self._size}, world={self.world})"


def _detach(group: Any) -> Any:
    if group is None or is_stand_in(group):
        return group
    return DetachedGroup(dist.get_rank(group), dist.get_world_size(group), group is dist.group.WORLD)


def detached_comm(comm: CommConfig) -> CommConfig:
    """``comm`` with its process groups replaced by :class:`DetachedGroup` s (for pickling)."""
    return dataclasses.replace(
        comm,
        process_group=_detach(comm.process_group),
        process_group_reduce_scatter=_detach(comm.process_group_reduce_scatter),
        replicate_group=_detach(comm.replicate_group),
        dp_group=_detach(comm.dp_group),
    )


def bound_comm(comm: CommConfig, group: Any) -> CommConfig:
    """``comm`` over ``group`` in place of the group it was built over (or unpickled with): checked
    to hold this rank where the shards say, and to be of their size. Reductions share the group."""
    if not isinstance(group, dist.ProcessGroup) and not is_stand_in(group):
        raise TypeError(
            f"FullyShardedDataParallel.process_group must be set to a torch.distributed ProcessGroup, got {group!r}"
        )
    size = int(group.size()) if is_stand_in(group) else dist.get_world_size(group)
    rank = int(group.rank()) if is_stand_in(group) else dist.get_rank(group)
    if (size, rank) != (comm.dp_world_size, comm.dp_rank):
        raise ValueError(
            f"FullyShardedDataParallel.process_group: this wrapper was built for rank {comm.dp_rank} of "
            f"{comm.dp_world_size} (its shards are that rank's), but the group makes this process rank {rank} of "
            f"{size}; give each process the group in which it has the rank it was built for"
        )
    sharded = comm.world_size == comm.dp_world_size and comm.world_size > 1
    return dataclasses.replace(
        comm,
        process_group=group,
        process_group_reduce_scatter=group,
        replicate_group=None if sharded or size == 1 else group,
        dp_group=group,
    )


def _probe(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, device: torch.device) -> Any:
    """What ``fn`` makes of a tensor of ``dtype`` on ``device``: ``(dtype, device)`` (an empty tensor
    stands in: conversions look at the dtype and device only)."""
    out = fn(torch.empty(0, dtype=dtype, device=device))
    return out.dtype, out.device


class ModuleOps(WrapperMixin):
    """Conversions after wrapping (``_apply``), copies (``__deepcopy__``, ``__getstate__``) and
    setting the process group. See [Note: conversions after wrapping] and [Note: copies of a wrapped
    model]."""

    def _runtime_state(self) -> dict[str, Any]:
        """What a copy or a pickle does not take: a fresh wrapper's values of the state a forward, a
        step or another wrapper set. See [Note: copies of a wrapped model] in fsdp/wrapper/module_ops.py."""
        return {
            "_own_ctx": None,
            "_ctx_ref": None,
            "_is_root": None,
            "_outer": None,
            "_frozen": False,
            "_pre_backward_done": False,
            "training_state": TrainingState.IDLE,
            "_reshard_after_forward": self.fsdp_config.sharding.reshard_after_forward,
            "_original_names": {},
        }

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``.half()``, ``.to()``, ``.cuda()``, ... after wrapping. See [Note: conversions after wrapping]."""
        if self._frozen:  # an outer wrapper's deferred initialization is running
            return self
        for w in self._wrappers():  # every check first: a refused conversion changes nothing
            w._check_conversion(fn, self)
        nn.Module._apply(self, fn, recurse)  # type: ignore[arg-type, no-untyped-call]  # (inner wrappers too)
        self._follow_conversion(fn)
        return self

    def _check_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor], caller: Wrapper) -> None:
        changes = False
        for h in self.handles:
            param = h.flat_param
            dtype, device = _probe(fn, param.dtype, param.device)
            if (dtype, device) == (param.dtype, param.device):
                continue
            changes = True
            if device != param.device and h.offloaded:
                raise RuntimeError(
                    f"FullyShardedDataParallel: .to() / .cuda() after wrapping would move the shards of {wrapper_path(as_module(caller), self)!r} to "
                    f"{device}, but CPU offload (move_params_to_cpu) keeps them on the host; compute runs on "
                    f"{h.compute_device}. Move the module before wrapping it, or pass compute_device / device_id"
                )
            if dtype != param.dtype and self.fsdp_config.precision.param_dtype is not None:
                raise RuntimeError(
                    f"FullyShardedDataParallel: .half() / .to(dtype) after wrapping would make the master weights of "
                    f"{wrapper_path(as_module(caller), self)!r} {dtype}; under mixed precision they stay {param.dtype} and compute runs in "
                    f"{self.fsdp_config.precision.param_dtype}. Change compute_dtype (or MixedPrecision.param_dtype) "
                    "instead, or wrap without mixed precision to train in one dtype"
                )
        module = self._fsdp_wrapped_module
        for name in self._buffer_dtypes:
            b = _buffer(module, name)
            if b is not None and _probe(fn, b.dtype, b.device) != (b.dtype, b.device):
                changes = True
        ctx = self._ctx
        idle = self.training_state is TrainingState.IDLE and (
            ctx is None or ctx.wrappers[0]._context_is_idle()
        )
        if changes and not idle:
            raise RuntimeError(
                f"FullyShardedDataParallel: .half() / .to() / .cuda() on {wrapper_path(as_module(caller), self)!r} during a step (its state is "
                f"{self.training_state.name}, or a forward, backward or no_sync() of its tree is not over); "
                "convert the model between steps"
            )

    def _follow_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After ``nn.Module._apply``: the handles adopt the converted shards, the compute device
        follows, buffers kept in ``buffer_dtype`` return to it."""
        config = self.fsdp_config
        device = _probe(fn, torch.float32, config.compute_device)[1]
        changed = device != config.compute_device
        if changed:
            self.fsdp_config: FSDPConfig = dataclasses.replace(
                config, compute_device=device
            )  # (mypy: the declared type)
        for i, h in enumerate(self.handles):
            registered: Any = as_module(self)._parameters.get(f"flat_param_{i}", h.flat_param)
            replaced = registered is not h.flat_param
            if replaced:  # (a conversion that replaces parameters: torch.__future__'s overwrite option)
                h.flat_param = registered
            data, shard = h.flat_param.data, h.sharded_data()
            if replaced or (data.dtype, data.device, data.data_ptr()) != (
                shard.dtype,
                shard.device,
                shard.data_ptr(),
            ):
                h.follow_conversion(config.precision.param_dtype, device)
                h.accumulators.on_accumulated = self._make_post_backward_hook(h)  # (its hooks are new)
                changed = True
        cast_to = config.precision.buffer_dtype
        module = self._fsdp_wrapped_module
        for name, original in self._buffer_dtypes.items():
            b = _buffer(module, name)
            if b is None:
                continue
            converted = _probe(fn, original, b.device)[0]
            if converted != original:
                self._buffer_dtypes[name] = converted
                changed = True
            if cast_to is not None and b.is_floating_point() and b.dtype != cast_to:
                owner, _, attr = name.rpartition(".")
                module.get_submodule(owner)._buffers[attr] = b.to(cast_to)
        ctx = self._ctx
        if changed and ctx is not None:  # the next forward sets the tree up for the new dtypes and devices
            ctx.wrappers[0]._release_context()

    # ------------------------------------------------------------------ copies
    def _check_between_steps(self, what: str) -> None:
        for w in self._wrappers():
            ctx = w._ctx
            if w.training_state is not TrainingState.IDLE or (
                ctx is not None and not ctx.wrappers[0]._context_is_idle()
            ):
                raise RuntimeError(
                    f"FullyShardedDataParallel: {what} during a step (a forward, backward, no_sync() or "
                    "summon_full_params() of the model is not over); copy the model between steps"
                )

    def _copy_state(self, detach: bool) -> dict[str, Any]:
        """This wrapper's ``__dict__`` as a copy or a pickle takes it: the runtime state left behind
        (see [Note: copies of a wrapped model]), process groups detached if ``detach``."""
        state = dict(self.__dict__)
        state.update(self._runtime_state())
        del state["_original_params"]  # (weak references: made anew, empty)
        if detach:
            state["fsdp_config"] = dataclasses.replace(
                self.fsdp_config, comm=detached_comm(self.fsdp_config.comm)
            )
        return state

    def __getstate__(self) -> dict[str, Any]:
        self._check_between_steps("pickling a wrapped model")
        return self._copy_state(detach=True)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self._check_between_steps("copy.deepcopy of a wrapped model")
        comm = self.fsdp_config.comm
        for group in (
            comm.process_group,
            comm.process_group_reduce_scatter,
            comm.replicate_group,
            comm.dp_group,
        ):
            if group is not None:
                memo.setdefault(id(group), group)  # the copy communicates over the same groups
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self._copy_state(detach=False), memo))
        return new

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)  # type: ignore[arg-type, no-untyped-call]
        self._original_params = weakref.WeakValueDictionary()  # (the copy's flattened none)
        comm = self.fsdp_config.comm
        group = comm.process_group
        if isinstance(group, DetachedGroup) and group.world and _world_matches(group):
            self._bind(dist.group.WORLD)  # unpickled where it came from: the default group is its group
        for h in self.handles:  # See [Note: gradient accumulators] in fsdp/core/grad_hooks.py
            h.comm = self.fsdp_config.comm  # (a handle is copied without its groups)
            h.accumulators.on_accumulated = self._make_post_backward_hook(h)
        is_wrapper: Callable[[nn.Module], bool] = lambda m: isinstance(m, ModuleOps)  # noqa: E731
        for _, inner in collect_owned(self._fsdp_wrapped_module, is_wrapper, self._ignored)[2]:
            inner._outer = weakref.ref(self)
        claim_modules(self, self._module_param_order)
        self._register_live()

    # ------------------------------------------------------------------ process groups
    def _bind(self, group: Any) -> None:
        """fairscale's ``model.process_group = group`` (after unpickling, or building with a stand-in):
        this wrapper communicates over ``group`` from now on. Between steps; call it on every wrapper."""
        if self.fsdp_config.sharding.strategy is ShardingStrategy.HYBRID_SHARD:
            raise TypeError(
                "FullyShardedDataParallel.process_group cannot be set on a HYBRID_SHARD wrapper (its shard and "
                "replicate groups are fixed at construction); build it again with process_group=(shard, replicate)"
            )
        self._check_between_steps("setting process_group")
        self._use_comm(bound_comm(self.fsdp_config.comm, group))

    def _use_comm(self, comm: CommConfig) -> None:
        """Communicate by ``comm`` from now on: the config and every handle take it, and the root's
        context, set up over the old groups (its buckets are keyed by them), is made again."""
        self.fsdp_config = dataclasses.replace(self.fsdp_config, comm=comm)
        for h in self.handles:
            h.comm = comm
        ctx = self._ctx
        if ctx is not None:
            ctx.wrappers[0]._release_context()

    def _bind_reduce_scatter(self, group: Any) -> None:
        """fairscale's ``model.process_group_reduce_scatter = group``: gradients are reduce-scattered over
        ``group`` from now on, which must hold the ranks of ``process_group`` in the same order (the
        shards are laid out by those ranks). Between steps; call it on every wrapper."""
        comm = self.fsdp_config.comm
        if group is ProcessGroupName.default:
            group = comm.process_group
        elif group is ProcessGroupName.reduce_scatter or group is None:
            raise TypeError(
                "FullyShardedDataParallel.process_group_reduce_scatter takes a process group (or "
                "ProcessGroupName.default for process_group itself); to get a group of its own, pass "
                "dist.new_group() on every rank"
            )
        if self.fsdp_config.sharding.strategy is ShardingStrategy.HYBRID_SHARD:
            raise TypeError(
                "FullyShardedDataParallel.process_group_reduce_scatter cannot be set on a HYBRID_SHARD wrapper "
                "(it reduces over its shard group, fixed at construction)"
            )
        self._check_between_steps("setting process_group_reduce_scatter")
        mine = None if is_stand_in(comm.process_group) else comm.process_group
        ranks = dist.get_process_group_ranks(group)
        if mine is None or ranks != dist.get_process_group_ranks(mine):
            raise ValueError(
                "FullyShardedDataParallel.process_group_reduce_scatter must hold the ranks of process_group in "
                f"the same order ({ranks} given); after unpickling, set model.process_group first"
            )
        self._use_comm(dataclasses.replace(comm, process_group_reduce_scatter=group))

    def _require_groups(self, what: str) -> None:
        """Refuse to communicate over a stand-in (built with one, or unpickled) of more than one rank."""
        me: Any = self
        for w in self._wrappers():
            comm = w.fsdp_config.comm
            if is_stand_in(comm.dp_group) and comm.dp_world_size > 1:
                raise RuntimeError(
                    f"FullyShardedDataParallel: {what} needs the process group of the wrapper at "
                    f"{wrapper_path(me, w)!r}, which was built with a stand-in ({comm.dp_group!r}) or unpickled: "
                    "it holds the shards of rank "
                    f"{comm.dp_rank} of {comm.dp_world_size} and no group to communicate over. Set "
                    "`model.process_group = group` on every wrapper (for m in model.modules(), as fairscale "
                    "does after unpickling), or call init_process_group() before unpickling it"
                )


def _world_matches(group: DetachedGroup) -> bool:
    return (
        dist.is_available()
        and dist.is_initialized()
        and (dist.get_rank(), dist.get_world_size()) == (group.rank(), group.size())
    )


def _buffer(module: nn.Module, name: str) -> torch.Tensor | None:
    try:
        return module.get_buffer(name)
    except AttributeError:  # (removed since wrapping)
        return None
