"""The description of a wrapped model that the state-dict and optimizer-state functions work on, and
the helpers they share. Never imports the wrapper.

- :class:`Layout` (built by :func:`describe`): every wrapper's flat parameters, every original
  parameter (by its name in the unwrapped model, in ``named_parameters()`` order), the ignored
  parameters (plain ones, see [Note: ignored modules] in ``fsdp/core/flat_param.py``), every persistent
  buffer, the unwrapped model's ``state_dict()`` keys, and each managed parameter's key by its name
  in its flat parameter (``plain_names``: without torch's activation wrapper levels).
- :func:`agree`: every rank raises the same error, before a step whose collectives only match if
  every rank takes part.
- Row sharding: an original parameter as a ``Shard(0)`` DTensor over the data-parallel group
  (:func:`to_sharded`, :func:`empty_sharded`) and back into this rank's flat chunk
  (:func:`shard_writes`, :func:`write_shard_`). See [Note: sharded state dict layout] in
  ``fsdp/state/state_dict.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp.comm.collectives import all_gather, all_gather_ints, digest_of_text
from fsdp.comm.consistency import CHECKPOINT_WRAPPED, is_activation_wrapper
from fsdp.common.device import SideCopies
from fsdp.core.flat_param import NOTHING_IGNORED, IgnoredStates, ParamInfo
from fsdp.core.handle import FlatParamHandle
from fsdp.core.sharding import intersect

if TYPE_CHECKING:  # imported where used: torch.distributed.tensor costs about 0.5 s to import
    from torch.distributed.tensor import DTensor

__all__ = [
    "BufferSlot",
    "IgnoredSlot",
    "Layout",
    "ParamSlot",
    "Unit",
    "UnitSpec",
    "agree",
    "describe",
    "digest_of",
    "empty_sharded",
    "gather_full_flat",
    "row_range",
    "shard_writes",
    "to_sharded",
    "value_kind",
    "write_shard_",
]


# ---------------------------------------------------------------------- the model's description
@dataclass(frozen=True)
class UnitSpec:
    """What one wrapper tells :func:`describe` about itself."""

    wrapped: nn.Module  # the module the wrapper wraps
    handles: Sequence[FlatParamHandle]
    param_order: Mapping[nn.Module, Sequence[str]]  # original parameter order of each owned module
    buffer_dtypes: Mapping[
        str, torch.dtype
    ]  # owned buffer (name relative to `wrapped`) -> dtype before wrapping
    no_broadcast_optim_state: bool = False
    ignored: IgnoredStates = NOTHING_IGNORED  # what the wrapper leaves alone
    flatten: bool = True  # flatten_parameters: False names each (one-parameter) handle by its parameter


@dataclass(frozen=True)
class Unit:
    path: str  # the wrapper's module path in the unwrapped model ("" for the root)
    handles: tuple[FlatParamHandle, ...]
    no_broadcast_optim_state: bool
    flatten: bool = True  # flatten_parameters of the wrapper


@dataclass(frozen=True)
class ParamSlot:
    """One original parameter: where it lives in which flat parameter, under which names."""

    name: str  # name in the unwrapped model (first name met by named_parameters())
    handle: FlatParamHandle
    index: int  # position in handle.meta.params
    aliases: tuple[str, ...]  # further names of a tied parameter

    @property
    def info(self) -> ParamInfo:
        return self.handle.meta.params[self.index]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.info.shape)

    def view(self, full_flat: torch.Tensor) -> torch.Tensor:
        """This parameter inside an unpadded full flat tensor of its handle, in its original shape."""
        return full_flat.narrow(0, self.info.offset, self.info.numel).view(self.info.shape)


@dataclass(frozen=True)
class IgnoredSlot:
    """A parameter no wrapper manages (``ignored_modules`` / ``ignored_states``): a plain parameter
    registered under its name, with this rank's values. See [Note: ignored modules]."""

    name: str  # name in the unwrapped model (first name met by named_parameters())
    module: nn.Module
    attr: str
    aliases: tuple[str, ...]  # further names of a tied parameter

    @property
    def param(self) -> nn.Parameter:
        value = self.module._parameters[self.attr]
        assert value is not None, f"ignored parameter {self.name} was removed"
        return value

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.param.shape)


@dataclass(frozen=True)
class BufferSlot:
    name: str  # state_dict() key in the unwrapped model
    module: nn.Module
    attr: str
    dtype: torch.dtype  # before wrapping (state_dict() returns this dtype)

    @property
    def tensor(self) -> torch.Tensor:
        value = self.module._buffers[self.attr]
        assert value is not None, f"buffer {self.name} was removed"
        return value


@dataclass(frozen=True)
class Layout:
    """Where every original parameter and persistent buffer of a wrapped model lives."""

    units: tuple[Unit, ...]  # every wrapper, outermost first, in module order
    params: tuple[ParamSlot, ...]  # unwrapped model's named_parameters() order (tied: once)
    buffers: tuple[BufferSlot, ...]  # persistent buffers
    keys: tuple[str, ...]  # the unwrapped model's state_dict() keys, in order (tied: every name)
    by_handle: Mapping[int, tuple[ParamSlot, ...]]  # id(handle) -> its slots in flat order
    group: dist.ProcessGroup  # every rank that trains the model (data-parallel group)
    world_size: int
    rank: int
    device: torch.device
    ignored: tuple[IgnoredSlot, ...] = ()  # unmanaged parameters, named_parameters() order (tied: once)
    items: tuple[FlatParamHandle | IgnoredSlot, ...] = ()  # what model.parameters() yields, in its order
    positions: Mapping[str, int] = dataclasses.field(default_factory=dict)  # primary name -> index in the
    # unwrapped model's named_parameters() (managed and ignored together)
    plain_names: Mapping[tuple[int, str], str] = dataclasses.field(default_factory=dict)  # (id(handle),
    # a parameter's fqn in its flat parameter, relative to the wrapped module) -> its state_dict() key:
    # without the levels of torch's activation wrappers, which their hooks hide from the keys

    def handles(self) -> list[FlatParamHandle]:
        return [h for u in self.units for h in u.handles]

    def every_param(self) -> tuple[ParamSlot | IgnoredSlot, ...]:
        """Every parameter, each once: the managed ones, then the ignored ones."""
        return (*self.params, *self.ignored)

    def slots(self, handle: FlatParamHandle) -> tuple[ParamSlot, ...]:
        return self.by_handle[id(handle)]

    def fingerprint(self) -> str:
        """SHA-1 of the wrap plan: wrapper paths and each flat parameter's names, shapes, dtype, trainability."""
        lines = []
        for u in self.units:
            for h in u.handles:
                params = " ".join(f"{p.fqn}:{tuple(p.shape)}" for p in h.meta.params)
                shared = " ".join(s.fqn for s in h.meta.shared)
                lines.append(f"{u.path}|{h.meta.dtype}|{h.meta.requires_grad}|{params}|{shared}")
        lines += [f"ignored|{s.name}:{s.shape}" for s in self.ignored]
        return hashlib.sha1("\n".join(lines).encode()).hexdigest()

    def mesh(self) -> DeviceMesh:
        if not isinstance(self.group, dist.ProcessGroup):  # a stand-in with rank() and size()
            raise RuntimeError(
                "FullyShardedDataParallel: sharded (DTensor) state dicts and torch.distributed.checkpoint need a "
                "torch.distributed process group, and this model was built with a stand-in (rank() and size() "
                "only) or unpickled without one. Use state_dict() / local_state_dict(), or call "
                "init_process_group() and set model.process_group = <group> on every wrapper"
            )
        return DeviceMesh.from_group(self.group, self.device.type)


def describe(
    root: nn.Module,
    units: Mapping[int, UnitSpec],
    group: dist.ProcessGroup,
    world_size: int,
    rank: int,
    device: torch.device,
) -> Layout:
    """Walk the wrapper tree as ``nn.Module.state_dict`` walks the unwrapped model.

    ``units`` maps ``id(wrapper)`` to its :class:`UnitSpec`; a wrapper is transparent (its wrapped
    module takes its place and its name), so names come out as in the unwrapped model. ``root`` may
    be a plain module holding wrappers (torch's whole-model functions): its parameters above them
    are plain ones, listed as ignored parameters are (:class:`IgnoredSlot`).
    """
    where: dict[tuple[int, str], tuple[FlatParamHandle, int]] = {}
    for spec in units.values():
        for h in spec.handles:
            for i, (info, m) in enumerate(zip(h.meta.params, h.modules, strict=True)):
                where[(id(m), info.param_name)] = (h, i)
            for s, m in zip(h.meta.shared, h.shared_modules, strict=True):
                where[(id(m), s.param_name)] = (h, s.primary)
    found: list[Unit] = []
    names: dict[tuple[int, int], list[str]] = {}
    order: list[tuple[FlatParamHandle, int]] = []
    buffers: list[BufferSlot] = []
    keys: list[str] = []
    ignored: dict[int, tuple[nn.Module, str, list[str]]] = {}  # id(parameter) -> where first met, its names
    met: list[tuple[FlatParamHandle, int] | int] = []  # managed slots and ignored ids, first met first
    items: list[FlatParamHandle | int] = []  # handles and ignored ids in model.parameters() order
    plain: dict[tuple[int, str], str] = {}  # (id(handle), fqn in it) -> state_dict() key

    # A depth-first walk in nn.Module.state_dict's order (a module's parameters, its buffers, then
    # each child's subtree), with an explicit stack: a recursive closure would be a reference cycle
    # that keeps the modules alive until the cyclic garbage collector runs.
    # (``inside``: the module is in an ignored module, whose parameters are all ignored)
    stack: list[tuple[nn.Module, str, UnitSpec | None, str, bool]] = [(root, "", None, "", False)]
    while stack:
        m, prefix, owner, rel, inside = stack.pop()
        wrapper_spec = units.get(id(m))
        if wrapper_spec is not None:
            found.append(
                Unit(
                    prefix[:-1],
                    tuple(wrapper_spec.handles),
                    wrapper_spec.no_broadcast_optim_state,
                    wrapper_spec.flatten,
                )
            )
            items.extend(wrapper_spec.handles)
            stack.append((wrapper_spec.wrapped, prefix, wrapper_spec, "", False))
            continue
        inside = inside or (owner is not None and owner.ignored.has_module(m))
        if is_activation_wrapper(m) and not m._parameters and not m._buffers:  # (its hooks hide its level)
            child = m._modules[CHECKPOINT_WRAPPED]
            stack.append((child, prefix, owner, rel + CHECKPOINT_WRAPPED + ".", inside))  # type: ignore[arg-type]
            continue
        own = owner.param_order.get(m) if owner is not None else None
        for pname in own if own is not None else [n for n, p in m._parameters.items() if p is not None]:
            loc = where.get((id(m), pname))
            if loc is None and pname in m._parameters and m._parameters[pname] is None:
                continue  # e.g. Linear(bias=False): registered as None, not in the state dict
            value = m._parameters.get(pname)
            if (  # ignored, or above every wrapper (a plain root's own): a plain parameter
                loc is None
                and value is not None
                and (inside or owner is None or owner.ignored.has_param(m, pname))
            ):
                if id(value) not in ignored:
                    ignored[id(value)] = (m, pname, [])
                    met.append(id(value))
                    items.append(id(value))
                ignored[id(value)][2].append(prefix + pname)
                keys.append(prefix + pname)
                continue
            if loc is None:
                raise RuntimeError(
                    f"FullyShardedDataParallel: parameter {prefix + pname!r} is not managed by any wrapper "
                    "(added after wrapping?); register parameters before wrapping the module"
                )
            slot_key = (id(loc[0]), loc[1])
            if slot_key not in names:
                names[slot_key] = []
                order.append(loc)
                met.append(loc)
            names[slot_key].append(prefix + pname)
            plain.setdefault((id(loc[0]), rel + pname), prefix + pname)
            keys.append(prefix + pname)
        for bname, b in m._buffers.items():
            if b is None or bname in m._non_persistent_buffers_set:
                continue
            dtype = owner.buffer_dtypes.get(rel + bname, b.dtype) if owner is not None else b.dtype
            buffers.append(BufferSlot(prefix + bname, m, bname, dtype))
            keys.append(prefix + bname)
        children = [
            (c, prefix + n + ".", owner, rel + n + ".", inside)
            for n, c in m._modules.items()
            if c is not None
        ]
        stack.extend(reversed(children))

    params = tuple(ParamSlot(names[(id(h), i)][0], h, i, tuple(names[(id(h), i)][1:])) for h, i in order)
    ignored_slots = {k: IgnoredSlot(n[0], m, a, tuple(n[1:])) for k, (m, a, n) in ignored.items()}
    positions = {
        (ignored_slots[x].name if isinstance(x, int) else names[(id(x[0]), x[1])][0]): k
        for k, x in enumerate(met)
    }
    by_handle: dict[int, list[ParamSlot]] = {id(h): [] for u in found for h in u.handles}
    for slot in params:
        by_handle[id(slot.handle)].append(slot)
    for u in found:
        for h in u.handles:
            slots = sorted(by_handle[id(h)], key=lambda s: s.index)
            assert [s.index for s in slots] == list(range(len(h.meta.params))), (
                f"parameters of {u.path or '<root>'} not reached by the module walk"
            )
            by_handle[id(h)] = slots
    return Layout(
        tuple(found),
        params,
        tuple(buffers),
        tuple(keys),
        {k: tuple(v) for k, v in by_handle.items()},
        group,
        world_size,
        rank,
        device,
        tuple(ignored_slots.values()),
        tuple(ignored_slots[x] if isinstance(x, int) else x for x in items),
        positions,
        plain,
    )


# ---------------------------------------------------------------------- cross-rank agreement
def agree(
    layout: Layout,
    error: str | None,
    what: str,
    digest: str = "",
    exc_type: type[Exception] = RuntimeError,
    mismatch: str = (
        "ranks passed differently structured state (every rank must pass the same keys, with values of "
        "the same kinds); nothing was loaded"
    ),
) -> None:
    """Raise the same error on every rank if any rank failed, or if the ranks' ``digest`` differ.

    Call it before a step whose collectives only match if every rank takes part (one tiny
    all-gather on the compute device), so that a mistake on one rank never leaves the others
    blocked. Only when some rank failed are the messages exchanged, as objects.
    """
    if layout.world_size == 1:
        if error is not None:
            raise exc_type(f"{what}: {error}")
        return
    flags = all_gather_ints([int(error is not None), digest_of_text(digest)], layout.group, layout.device)
    if any(failed_here for failed_here, _ in flags):
        gathered: list[Any] = [None] * layout.world_size
        dist.all_gather_object(gathered, error, group=layout.group)
        failed = [(r, e) for r, e in enumerate(gathered) if e is not None]
        distinct: dict[str, list[int]] = {}
        for r, e in failed:
            distinct.setdefault(e, []).append(r)
        lines = [f"rank(s) {ranks}: {e}" for e, ranks in distinct.items()]
        raise exc_type(f"{what} failed on rank(s) {[r for r, _ in failed]}:\n  " + "\n  ".join(lines))
    if len({d for _, d in flags}) > 1:
        raise exc_type(f"{what}: {mismatch}")


def digest_of(obj: Any) -> str:
    return hashlib.sha1(repr(obj).encode()).hexdigest()


# ---------------------------------------------------------------------- row sharding helpers
def row_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows of a ``Shard(0)`` DTensor on ``rank``: ``torch.chunk``'s rule (the last ranks may get fewer or none)."""
    chunk = -(-rows // world_size)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def _rows_numel(shape: tuple[int, ...], world_size: int, rank: int) -> int:
    lo, hi = row_range(shape[0], world_size, rank)
    return (hi - lo) * math.prod(shape[1:])


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """``isinstance(value, DTensor)`` without importing ``torch.distributed.tensor``: no DTensor
    exists before that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _row_sharded(local: torch.Tensor, mesh: DeviceMesh, shape: tuple[int, ...]) -> DTensor:
    """``local`` as this rank's rows of a ``Shard(0)`` DTensor of ``shape``, left where it is.

    ``DTensor.from_local`` would copy host rows to the mesh's device (CUDA under offload); the
    constructor keeps them on the host, as torch's FSDP2 does for its offloaded parameters.
    """
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), local.dtype)
    spec = DTensorSpec(mesh=mesh, placements=(Shard(0),), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]


def to_sharded(
    full: torch.Tensor, layout: Layout, mesh: DeviceMesh, device: torch.device | None = None
) -> torch.Tensor:
    """A copy of this rank's rows of ``full`` as a ``Shard(0)`` DTensor (a 0-dim tensor: a plain copy),
    its local rows on ``device`` (default: ``full``'s; the host for an offloaded handle, whose full
    tensor was gathered on the compute device)."""
    device = full.device if device is None else device
    if full.dim() == 0:
        return full.detach().to(device, copy=True)
    lo, hi = row_range(full.shape[0], layout.world_size, layout.rank)
    return _row_sharded(full[lo:hi].detach().to(device, copy=True), mesh, tuple(full.shape))


def empty_sharded(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    layout: Layout,
    mesh: DeviceMesh,
    device: torch.device | None = None,
) -> torch.Tensor:
    """An uninitialized :func:`to_sharded` of a tensor of ``shape``, local rows on ``device`` (default
    ``layout.device``): a template for DCP to load into."""
    device = layout.device if device is None else device
    if len(shape) == 0:
        return torch.empty((), dtype=dtype, device=device)
    lo, hi = row_range(shape[0], layout.world_size, layout.rank)
    local = torch.empty((hi - lo, *shape[1:]), dtype=dtype, device=device)
    return _row_sharded(local, mesh, shape)


def gather_full_flat(handle: FlatParamHandle, shard: torch.Tensor) -> torch.Tensor:
    """All-gather a shard-shaped tensor of ``handle`` (its flat parameter, or optimizer state like it) over
    the shard group; return the unpadded full flat tensor, shape ``(meta.numel,)``, on the compute
    device (an offloaded shard is on the host, which NCCL cannot send from). Collective."""
    assert tuple(shard.shape) == (handle.spec.chunk,), f"{tuple(shard.shape)} is not a shard of {handle.spec}"
    device = handle.compute_device
    if handle.spec.world_size == 1:  # not sharded (NO_SHARD, or a group of one): the shard is whole
        return shard.detach().to(device)[: handle.meta.numel]
    out = torch.empty(handle.spec.padded_numel, dtype=shard.dtype, device=device)
    all_gather(out, shard.detach().to(device).contiguous(), handle.comm.process_group, handle.stats).wait()
    return out[: handle.meta.numel]


def _is_rows(value: torch.Tensor, layout: Layout) -> bool:
    if not is_dtensor(value):
        return False
    from torch.distributed.tensor import Shard

    return (
        value.dim() > 0
        and tuple(value.placements) == (Shard(0),)
        and value.device_mesh.size() == layout.world_size
    )


def value_kind(value: torch.Tensor, layout: Layout) -> str:
    """How :func:`shard_writes` reads a value: "rows" (this rank's rows), "dtensor" (any other DTensor), "full"."""
    if _is_rows(value, layout):
        return "rows"
    return "dtensor" if is_dtensor(value) else "full"


def shard_writes(
    handle: FlatParamHandle, values: Sequence[torch.Tensor | None], layout: Layout, dtype: torch.dtype
) -> list[tuple[int, int, torch.Tensor]]:
    """Turn per-parameter values (sharded as by :func:`to_sharded`, other DTensors, or full tensors;
    None: leave it) into writes ``(lo, hi, data)`` of this rank's flat chunk. Collective when any value
    is row-sharded: every rank must pass values of the same kinds (check with :func:`agree` first).

    Rows are gathered over the data-parallel group in one all-gather: each rank sends its rows of
    every row-sharded parameter of the handle, back to back, padded to the longest rank's length.
    """
    slots = layout.slots(handle)
    device = handle.compute_device  # not the (possibly offloaded) shard's: the collective runs here
    full_of: dict[int, torch.Tensor] = {}
    rows_at = [i for i, v in enumerate(values) if v is not None and _is_rows(v, layout)]
    if rows_at:
        ws = layout.world_size
        lengths = [[_rows_numel(slots[i].shape, ws, r) for i in rows_at] for r in range(ws)]
        longest = max(sum(per_rank) for per_rank in lengths)
        send = torch.zeros(longest, dtype=dtype, device=device)
        pos = 0
        for i in rows_at:
            value = values[i]
            assert is_dtensor(value)
            local = value.to_local().reshape(-1)
            assert local.numel() == lengths[layout.rank][rows_at.index(i)], "rows do not follow torch.chunk"
            send[pos : pos + local.numel()].copy_(local)
            pos += local.numel()
        recv = torch.empty(ws * longest, dtype=dtype, device=device)
        all_gather(recv, send, layout.group, handle.stats).wait()
        for k, i in enumerate(rows_at):
            shape = slots[i].shape
            row_numel = math.prod(shape[1:])
            full = torch.empty(math.prod(shape), dtype=dtype, device=device)
            for r in range(ws):
                offset = r * longest + sum(lengths[r][:k])
                lo, _ = row_range(shape[0], ws, r)
                n = lengths[r][k]
                full[lo * row_numel : lo * row_numel + n].copy_(recv[offset : offset + n])
            full_of[i] = full
    for i, value in enumerate(values):
        if value is None or i in full_of:
            continue
        full_value = value.full_tensor() if is_dtensor(value) else value
        full_of[i] = full_value.detach().reshape(-1).to(device=device, dtype=dtype)
    spec = handle.spec
    writes = []
    for i, full in full_of.items():
        info = slots[i].info
        overlap = intersect(info.offset, info.offset + info.numel, spec.start, spec.start + spec.valid)
        if overlap is not None:
            a, b = overlap
            writes.append((a - spec.start, b - spec.start, full[a - info.offset : b - info.offset]))
    return writes


def write_shard_(handle: FlatParamHandle, writes: Sequence[tuple[int, int, torch.Tensor]]) -> None:
    """Copy ``writes`` into the flat parameter's local shard (between steps ``flat_param`` *is* it) and
    drop any full parameter kept from an earlier forward: it no longer matches the shard."""
    SideCopies.synchronize_all()  # no copy in flight may still read a host shard written here
    with torch.no_grad():
        for lo, hi, data in writes:
            handle.flat_param[lo:hi].copy_(data)
    handle.reshard(free_full=True)
