"""State dicts beyond the full one: local shards, offline consolidation, and the sharded (DCP) form.

The wrapper describes itself once as a :class:`Layout` (:func:`describe`): every wrapper's flat
parameters, every original parameter (by its name in the unwrapped model, in
``named_parameters()`` order), every persistent buffer, and the unwrapped model's ``state_dict()``
keys. Everything here works on that description and never imports the wrapper.

- **local**: this rank's flat shards and the buffers, plus an identity entry (world size, rank and a
  fingerprint of the wrap plan) that :func:`load_local_state_dict` checks. Same world size, same
  wrap plan only; :func:`local_metadata_dict` and :func:`consolidate_shard_weights` rebuild a plain
  state dict from every rank's local shards offline, without a process group.
- **sharded**: one entry per original parameter for ``torch.distributed.checkpoint`` (DCP), which
  reshards it from any world size to any other. See [Note: sharded state dict layout].

[Note: sharded state dict layout]
A flat shard cuts the original parameters at arbitrary element offsets, which DCP cannot describe
as blocks of the parameters. So the sharded state dict holds each original parameter (original
shape, fp32 master values) as a ``DTensor`` sharded by rows, ``Shard(0)``, over the data-parallel
group: rank ``r`` holds rows ``[r * c, (r + 1) * c)`` with ``c = ceil(rows / N)`` (``torch.chunk``'s
rule, the one DTensor and DCP use). A 0-dim parameter is a plain tensor, which DCP treats as
replicated. Building it gathers one flat parameter at a time within its shard group and keeps this
rank's rows; loading gathers one flat parameter's rows over the data-parallel group and keeps this
rank's flat chunk. Example, 2 ranks, one flat parameter holding ``w`` (3x2) then ``b`` (2)::

    flat = [w00 w01 w10 w11 w20 w21 | b0 b1]     chunk 4: rank 0 [w00 .. w11], rank 1 [w20 w21 b0 b1]
    sharded: w rows 0-1 on rank 0, row 2 on rank 1; b element 0 on rank 0, element 1 on rank 1

At most one flat parameter is full at a time, the same memory as ``state_dict()``; the result is
1/N of the model per rank. The format is the one torch's own FSDP2 writes (original names and
shapes, row-sharded DTensors), so its checkpoints and ours load into each other.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.modules.module import _IncompatibleKeys

from fsdp.collectives import all_gather
from fsdp.flat_param import ParamInfo
from fsdp.handle import FlatParamHandle
from fsdp.sharding import intersect

__all__ = [
    "LOCAL_STATE_KEY",
    "BufferSlot",
    "Layout",
    "ParamSlot",
    "ShardedLoadPlan",
    "Unit",
    "UnitSpec",
    "agree",
    "apply_sharded_state_dict",
    "check_sharded_state_dict",
    "consolidate_shard_weights",
    "describe",
    "digest_of",
    "empty_sharded",
    "gather_full_flat",
    "load_local_state_dict",
    "load_sharded_state_dict",
    "local_metadata_dict",
    "local_state_dict",
    "row_range",
    "shard_writes",
    "sharded_state_dict",
    "sharded_state_dict_template",
    "to_sharded",
    "value_kind",
    "write_shard_",
]

log = logging.getLogger(__name__)

LOCAL_STATE_KEY = "_fsdp_local_state"  # identity entry of a local state dict
FORMAT_VERSION = 1


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


@dataclass(frozen=True)
class Unit:
    path: str  # the wrapper's module path in the unwrapped model ("" for the root)
    handles: tuple[FlatParamHandle, ...]
    no_broadcast_optim_state: bool


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

    def handles(self) -> list[FlatParamHandle]:
        return [h for u in self.units for h in u.handles]

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
        return hashlib.sha1("\n".join(lines).encode()).hexdigest()

    def mesh(self) -> DeviceMesh:
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
    module takes its place and its name), so names come out as in the unwrapped model.
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

    def visit(m: nn.Module, prefix: str, owner: UnitSpec | None, rel: str) -> None:
        spec = units.get(id(m))
        if spec is not None:
            found.append(Unit(prefix[:-1], tuple(spec.handles), spec.no_broadcast_optim_state))
            visit(spec.wrapped, prefix, spec, "")
            return
        own = owner.param_order.get(m) if owner is not None else None
        for pname in own if own is not None else [n for n, p in m._parameters.items() if p is not None]:
            loc = where.get((id(m), pname))
            if loc is None and pname in m._parameters and m._parameters[pname] is None:
                continue  # e.g. Linear(bias=False): registered as None, not in the state dict
            if loc is None:
                raise RuntimeError(
                    f"FullyShardedDataParallel: parameter {prefix + pname!r} is not managed by any wrapper "
                    "(added after wrapping?); register parameters before wrapping the module"
                )
            slot_key = (id(loc[0]), loc[1])
            if slot_key not in names:
                names[slot_key] = []
                order.append(loc)
            names[slot_key].append(prefix + pname)
            keys.append(prefix + pname)
        for bname, b in m._buffers.items():
            if b is None or bname in m._non_persistent_buffers_set:
                continue
            dtype = owner.buffer_dtypes.get(rel + bname, b.dtype) if owner is not None else b.dtype
            buffers.append(BufferSlot(prefix + bname, m, bname, dtype))
            keys.append(prefix + bname)
        for cname, child in m._modules.items():
            if child is not None:
                visit(child, prefix + cname + ".", owner, rel + cname + ".")

    visit(root, "", None, "")
    params = tuple(ParamSlot(names[(id(h), i)][0], h, i, tuple(names[(id(h), i)][1:])) for h, i in order)
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
    )


# ---------------------------------------------------------------------- cross-rank agreement
def agree(
    layout: Layout,
    error: str | None,
    what: str,
    digest: str = "",
    exc_type: type[Exception] = RuntimeError,
) -> None:
    """Raise the same error on every rank if any rank failed, or if the ranks' ``digest`` differ.

    Call it before a step whose collectives only match if every rank takes part (one tiny
    ``all_gather_object``), so that a mistake on one rank never leaves the others blocked.
    """
    if layout.world_size == 1:
        if error is not None:
            raise exc_type(f"{what}: {error}")
        return
    gathered: list[Any] = [None] * layout.world_size
    dist.all_gather_object(gathered, (error, digest), group=layout.group)
    failed = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
    if failed:
        distinct: dict[str, list[int]] = {}
        for r, e in failed:
            distinct.setdefault(e, []).append(r)
        lines = [f"rank(s) {ranks}: {e}" for e, ranks in distinct.items()]
        raise exc_type(f"{what} failed on rank(s) {[r for r, _ in failed]}:\n  " + "\n  ".join(lines))
    if len({d for _, d in gathered}) > 1:
        raise exc_type(
            f"{what}: ranks passed differently structured state (every rank must pass the same keys, with "
            "values of the same kinds); nothing was loaded"
        )


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


def to_sharded(full: torch.Tensor, layout: Layout, mesh: DeviceMesh) -> torch.Tensor:
    """A copy of this rank's rows of ``full`` as a ``Shard(0)`` DTensor (a 0-dim tensor: a plain copy)."""
    if full.dim() == 0:
        return full.detach().clone()
    lo, hi = row_range(full.shape[0], layout.world_size, layout.rank)
    shape = tuple(full.shape)
    return DTensor.from_local(
        full[lo:hi].detach().clone(),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )


def empty_sharded(
    shape: tuple[int, ...], dtype: torch.dtype, layout: Layout, mesh: DeviceMesh
) -> torch.Tensor:
    """An uninitialized :func:`to_sharded` of a tensor of ``shape``: a template for DCP to load into."""
    if len(shape) == 0:
        return torch.empty((), dtype=dtype, device=layout.device)
    lo, hi = row_range(shape[0], layout.world_size, layout.rank)
    local = torch.empty((hi - lo, *shape[1:]), dtype=dtype, device=layout.device)
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape)
    )


def gather_full_flat(handle: FlatParamHandle, shard: torch.Tensor) -> torch.Tensor:
    """All-gather a shard-shaped tensor of ``handle`` (its flat parameter, or optimizer state like it) over
    the shard group; return the unpadded full flat tensor, shape ``(meta.numel,)``. Collective."""
    assert tuple(shard.shape) == (handle.spec.chunk,), f"{tuple(shard.shape)} is not a shard of {handle.spec}"
    out = torch.empty(handle.spec.padded_numel, dtype=shard.dtype, device=shard.device)
    all_gather(out, shard.detach().contiguous(), handle.comm.process_group, handle.stats).wait()
    return out[: handle.meta.numel]


def _is_rows(value: torch.Tensor, layout: Layout) -> bool:
    return (
        isinstance(value, DTensor)
        and value.dim() > 0
        and tuple(value.placements) == (Shard(0),)
        and value.device_mesh.size() == layout.world_size
    )


def value_kind(value: torch.Tensor, layout: Layout) -> str:
    """How :func:`shard_writes` reads a value: "rows" (this rank's rows), "dtensor" (any other DTensor), "full"."""
    if _is_rows(value, layout):
        return "rows"
    return "dtensor" if isinstance(value, DTensor) else "full"


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
    device = handle.flat_param.device
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
            assert isinstance(value, DTensor)
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
        full_value = value.full_tensor() if isinstance(value, DTensor) else value
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
    with torch.no_grad():
        for lo, hi, data in writes:
            handle.flat_param[lo:hi].copy_(data)
    handle.reshard(free_full=True)


# ---------------------------------------------------------------------- local state dict
def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _local_identity(layout: Layout) -> dict[str, Any]:
    return {
        "version": FORMAT_VERSION,
        "world_size": layout.world_size,
        "rank": layout.rank,
        "plan": layout.fingerprint(),
    }


def local_state_dict(layout: Layout) -> dict[str, Any]:
    """This rank's flat shards (``"<wrapper path>.flat_param_<i>"``), the buffers, and an identity entry.

    Values are detached references, as in ``nn.Module.state_dict``: copy them before changing the model.
    """
    out: dict[str, Any] = {}
    for unit in layout.units:
        for i, h in enumerate(unit.handles):
            out[_join(unit.path, f"flat_param_{i}")] = h.flat_param.detach()
    for b in layout.buffers:
        out[b.name] = b.tensor.detach()
    out[LOCAL_STATE_KEY] = _local_identity(layout)
    return out


def load_local_state_dict(layout: Layout, state: Mapping[str, Any], strict: bool = True) -> NamedTuple:
    """Load what :func:`local_state_dict` returned on this rank, at the same world size and wrap plan.

    Everything is checked before anything is written: on an error the model is unchanged.
    """
    ident = state.get(LOCAL_STATE_KEY)
    mine = _local_identity(layout)
    where = "FullyShardedDataParallel.load_local_state_dict"
    if not isinstance(ident, Mapping):
        raise ValueError(
            f"{where}: this is not a local state dict (it has no {LOCAL_STATE_KEY!r} entry). Load a full "
            "state dict with load_state_dict(), a sharded one with load_sharded_state_dict()"
        )
    if ident.get("world_size") != mine["world_size"]:
        raise ValueError(
            f"{where}: the state dict was saved at world size {ident.get('world_size')} but this model runs on "
            f"{mine['world_size']} ranks. A local state dict only loads at the world size and wrap plan it was "
            "saved with; to resume on another number of ranks use fsdp.save_checkpoint/load_checkpoint (or the "
            "sharded state dict), or consolidate the shards with consolidate_shard_weights()"
        )
    if ident.get("rank") != mine["rank"]:
        raise ValueError(
            f"{where}: the state dict holds the shards of rank {ident.get('rank')}, not of rank {mine['rank']}; "
            "every rank must load the file it saved"
        )
    if ident.get("plan") != mine["plan"]:
        raise ValueError(
            f"{where}: the state dict was saved with a different wrap plan (other wrappers, or other parameter "
            "names, shapes or dtypes in them). Wrap the model exactly as when it was saved, or resume with "
            "fsdp.load_checkpoint, which loads into any wrap plan"
        )
    expected: dict[str, tuple[int, ...]] = {}
    targets: dict[str, FlatParamHandle | BufferSlot] = {}
    for unit in layout.units:
        for i, h in enumerate(unit.handles):
            key = _join(unit.path, f"flat_param_{i}")
            expected[key], targets[key] = (h.spec.chunk,), h
    for b in layout.buffers:
        expected[b.name], targets[b.name] = tuple(b.tensor.shape), b
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected and k != LOCAL_STATE_KEY]
    errors = [
        f"{k!r}: shape {tuple(state[k].shape)} in the state dict, {shape} in the model"
        for k, shape in expected.items()
        if k in state and tuple(getattr(state[k], "shape", ())) != shape
    ]
    if strict and missing:
        errors.append("missing key(s): " + ", ".join(repr(k) for k in missing))
    if strict and unexpected:
        errors.append("unexpected key(s): " + ", ".join(repr(k) for k in unexpected))
    if errors:
        raise RuntimeError(f"{where}: nothing was loaded:\n  " + "\n  ".join(errors))
    for key, target in targets.items():
        if key not in state:
            continue
        value = state[key]
        if isinstance(target, FlatParamHandle):
            write_shard_(target, [(0, target.spec.chunk, value)])
        else:
            with torch.no_grad():
                target.tensor.copy_(value)
    return _IncompatibleKeys(missing, unexpected)


def local_metadata_dict(layout: Layout) -> dict[str, Any]:
    """What :func:`consolidate_shard_weights` needs to rebuild full parameters from local shards.

    Keys as in fairscale (``param_metadata``, ``buffer_names``), plus this rank's identity, the
    buffers' original dtypes and the unwrapped model's state-dict key order.
    """
    units = []
    for unit in layout.units:
        params = {}
        shared = []
        for i, h in enumerate(unit.handles):
            params[f"flat_param_{i}"] = {
                "names": [p.fqn for p in h.meta.params],
                "shapes": [tuple(p.shape) for p in h.meta.params],
                "numels": [p.numel for p in h.meta.params],
                "padding": h.spec.pad,
                "shard_rank": h.spec.rank,
                "shard_world_size": h.spec.world_size,
            }
            shared += [
                (_join(unit.path, h.meta.params[s.primary].fqn), _join(unit.path, s.fqn))
                for s in h.meta.shared
            ]
        units.append(
            {
                "fsdp_path": unit.path,
                "params": params,
                "shared_param_info": shared,
                "no_broadcast_optim_state": unit.no_broadcast_optim_state,
            }
        )
    return {
        **_local_identity(layout),
        "param_metadata": units,
        "buffer_names": [b.name for b in layout.buffers],
        "buffer_dtypes": {b.name: str(b.dtype).removeprefix("torch.") for b in layout.buffers},
        "state_dict_keys": list(layout.keys),
    }


def consolidate_shard_weights(
    shard_weights: Sequence[Mapping[str, Any]],
    shard_metadata: Sequence[Mapping[str, Any]],
    with_module_buffers: bool = True,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """Rebuild the unwrapped model's state dict from every rank's local shards. No process group.

    ``shard_weights[i]`` / ``shard_metadata[i]`` are rank i's :func:`local_state_dict` /
    :func:`local_metadata_dict` (any order; with hybrid sharding one replica of each shard is
    enough). Buffers come from the lowest rank given. ``strict=False`` skips flat parameters and
    buffers missing from the weights instead of raising.
    """
    where = "consolidate_shard_weights"
    if not shard_weights or len(shard_weights) != len(shard_metadata):
        raise ValueError(
            f"{where}: pass one metadata dict per shard dict (got {len(shard_weights)} shard dicts and "
            f"{len(shard_metadata)} metadata dicts), at least one of each"
        )
    if len({m.get("plan") for m in shard_metadata}) > 1:
        raise ValueError(f"{where}: the shards come from different wrap plans; pass the files of one save")
    ranks = [int(m.get("rank", i)) for i, m in enumerate(shard_metadata)]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{where}: rank(s) {sorted({r for r in ranks if ranks.count(r) > 1})} given twice")
    order = sorted(range(len(ranks)), key=lambda i: ranks[i])
    first = shard_metadata[order[0]]
    out: dict[str, torch.Tensor] = {}
    for u, unit in enumerate(first["param_metadata"]):
        path = unit["fsdp_path"]
        for backing, pmeta in unit["params"].items():
            key = _join(path, backing)
            pieces: dict[int, torch.Tensor] = {}
            absent = [ranks[i] for i in order if key not in shard_weights[i]]
            if absent:
                if strict:
                    raise KeyError(f"{where}: the shard dict of rank(s) {absent} has no {key!r}")
                continue
            for i in order:
                meta_i = shard_metadata[i]["param_metadata"][u]["params"][backing]
                shard_rank = int(meta_i.get("shard_rank", ranks[i]))
                if shard_rank not in pieces:  # else: a replica of a shard already taken (hybrid sharding)
                    flat = shard_weights[i][key].detach().reshape(-1)
                    pieces[shard_rank] = flat[: flat.numel() - int(meta_i["padding"])]
            shard_world = int(pmeta.get("shard_world_size", len(shard_weights)))
            if sorted(pieces) != list(range(shard_world)):
                raise ValueError(
                    f"{where}: {key!r} is sharded over {shard_world} ranks but the shards of rank(s) "
                    f"{sorted(set(range(shard_world)) - set(pieces))} are missing; pass every rank's files"
                )
            full = torch.cat([pieces[r] for r in range(shard_world)])
            numels = [int(n) for n in pmeta["numels"]]
            if full.numel() != sum(numels):
                raise ValueError(
                    f"{where}: the shards of {key!r} hold {full.numel()} elements but its parameters need "
                    f"{sum(numels)}; the weights and the metadata come from different saves"
                )
            offset = 0
            for name, numel, shape in zip(pmeta["names"], numels, pmeta["shapes"], strict=True):
                out[_join(path, name)] = full[offset : offset + numel].view(tuple(shape)).clone()
                offset += numel
        for src, dst in unit.get("shared_param_info", []):
            if src in out:
                out[dst] = out[src]
    if with_module_buffers:
        weights0 = shard_weights[order[0]]
        dtypes = first.get("buffer_dtypes", {})
        for name in first.get("buffer_names", []):
            if name not in weights0:
                if strict:
                    raise KeyError(
                        f"{where}: the shard dict of rank {ranks[order[0]]} has no buffer {name!r}"
                    )
                continue
            value = weights0[name].detach()
            out[name] = value.to(getattr(torch, dtypes[name])) if name in dtypes else value
    keys = first.get("state_dict_keys")
    if keys is None:
        return out
    ordered = {k: out[k] for k in keys if k in out}
    ordered.update((k, v) for k, v in out.items() if k not in ordered)
    return ordered


# ---------------------------------------------------------------------- sharded (DCP) state dict
def sharded_state_dict(layout: Layout) -> dict[str, torch.Tensor]:
    """Every original parameter as a row-sharded DTensor (fp32 masters) and every persistent buffer
    (original dtype), keyed by name in the unwrapped model. Collective. See [Note: sharded state dict layout].

    A tied parameter appears once, under its first name. Values are copies.
    """
    mesh = layout.mesh()
    out: dict[str, torch.Tensor] = {}
    for h in layout.handles():
        full = gather_full_flat(h, h.flat_param.detach())
        for slot in layout.slots(h):
            out[slot.name] = to_sharded(slot.view(full), layout, mesh)
        del full
    for b in layout.buffers:
        out[b.name] = b.tensor.detach().to(b.dtype, copy=True)
    return {k: out[k] for k in layout.keys if k in out}


def sharded_state_dict_template(layout: Layout) -> dict[str, torch.Tensor]:
    """:func:`sharded_state_dict` with uninitialized values and no communication: a target for DCP to load into."""
    mesh = layout.mesh()
    out: dict[str, torch.Tensor] = {}
    for slot in layout.params:
        out[slot.name] = empty_sharded(slot.shape, slot.handle.meta.dtype, layout, mesh)
    for b in layout.buffers:
        out[b.name] = torch.empty(b.tensor.shape, dtype=b.dtype, device=b.tensor.device)
    return {k: out[k] for k in layout.keys if k in out}


@dataclass
class ShardedLoadPlan:
    """A checked sharded model state dict, ready to be applied (see :func:`check_sharded_state_dict`)."""

    values: dict[str, torch.Tensor]  # parameter or buffer name -> value
    missing: list[str]
    unexpected: list[str]
    errors: list[str]
    digest: str  # the kinds of the values: every rank must agree before applying


def check_sharded_state_dict(layout: Layout, state: Mapping[str, Any], strict: bool) -> ShardedLoadPlan:
    """Match ``state`` to the model: names (a tied parameter under any of its names), shapes. No writes."""
    values: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    errors: list[str] = []
    known: set[str] = set()
    kinds = []
    targets = [(s.name, (s.name, *s.aliases), s.shape) for s in layout.params]
    targets += [(b.name, (b.name,), tuple(b.tensor.shape)) for b in layout.buffers]
    for name, names, shape in targets:
        known.update(names)
        value = next((state[n] for n in names if n in state), None)
        if value is None:
            missing.append(name)
        elif not isinstance(value, torch.Tensor):
            errors.append(f"{name!r}: expected a tensor, got {type(value).__name__}")
        elif tuple(value.shape) != shape:
            errors.append(f"{name!r}: shape {tuple(value.shape)} in the checkpoint, {shape} in the model")
        else:
            values[name] = value
            kinds.append((name, value_kind(value, layout)))
    unexpected = [k for k in state if k not in known]
    if strict and missing:
        errors.append("missing key(s): " + ", ".join(repr(k) for k in missing))
    if strict and unexpected:
        errors.append("unexpected key(s): " + ", ".join(repr(k) for k in unexpected))
    return ShardedLoadPlan(values, missing, unexpected, errors, digest_of(kinds))


def apply_sharded_state_dict(layout: Layout, plan: ShardedLoadPlan) -> NamedTuple:
    """Write a checked plan into the shards and buffers. Collective; every rank must have agreed on it."""
    for h in layout.handles():
        values = [plan.values.get(slot.name) for slot in layout.slots(h)]
        if any(v is not None for v in values):
            write_shard_(h, shard_writes(h, values, layout, h.meta.dtype))
    with torch.no_grad():
        for b in layout.buffers:
            value = plan.values.get(b.name)
            if value is not None:
                b.tensor.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
    return _IncompatibleKeys(plan.missing, plan.unexpected)


def load_sharded_state_dict(layout: Layout, state: Mapping[str, Any], strict: bool = True) -> NamedTuple:
    """Load a sharded state dict (from :func:`sharded_state_dict`, filled by ``torch.distributed.checkpoint.load``,
    or any mix of row-sharded DTensors, other DTensors and full tensors). Collective.

    Every rank checks names and shapes and the ranks agree before anything is written: on an error
    the model is unchanged on every rank.
    """
    plan = check_sharded_state_dict(layout, state, strict)
    agree(
        layout,
        "\n  ".join(plan.errors) or None,
        "FullyShardedDataParallel.load_sharded_state_dict (nothing was loaded)",
        plan.digest,
    )
    return apply_sharded_state_dict(layout, plan)
