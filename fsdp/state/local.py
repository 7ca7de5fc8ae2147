"""Local state dicts: this rank's shards, and offline consolidation of every rank's into one.

- :func:`local_state_dict`: this rank's shards (``"<wrapper path>.flat_param_<i>"``; under
  ``flatten_parameters=False`` each parameter's shard under its name, as in fairscale), the buffers,
  and an identity entry (world size, rank and a fingerprint of the wrap plan, as a ``uint8``
  tensor) that :func:`load_local_state_dict` checks: same world size, rank and wrap plan only.
  Every value is a tensor. A local state dict saved by fairscale (no identity entry) loads too.
- :func:`local_metadata_dict` and :func:`consolidate_shard_weights` rebuild a plain state dict from
  every rank's local shards offline, without a process group (fairscale's pair of the same names).

Works on a :class:`~fsdp.core.layout.Layout`, never on the wrapper.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.nn.modules.module import _IncompatibleKeys

from fsdp.core.handle import FlatParamHandle
from fsdp.core.layout import BufferSlot, IgnoredSlot, Layout, Unit, write_shard_

__all__ = [
    "LOCAL_STATE_KEY",
    "consolidate_shard_weights",
    "identity_of",
    "load_local_state_dict",
    "local_identity",
    "local_metadata_dict",
    "local_state_dict",
]

LOCAL_STATE_KEY = "_fsdp_local_state"  # the identity entry of versions 1 and 2; in _metadata since 3
# 1: the identity entry was a dict, and every shard was "flat_param_<i>", flatten_parameters=False too;
# 2: the identity entry is a uint8 tensor (its JSON), and unflattened shards are named by parameter;
# 3: the identity is in the state dict's ``_metadata`` (torch's place for such information), under
#    the wrapper's prefix, key LOCAL_STATE_KEY: every entry of the dict is a parameter or a buffer.
FORMAT_VERSION = 3


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def local_identity(layout: Layout) -> dict[str, Any]:
    return {
        "version": FORMAT_VERSION,
        "world_size": layout.world_size,
        "rank": layout.rank,
        "plan": layout.fingerprint(),
    }


def identity_of(state: Mapping[str, Any], prefix: str = "") -> Any:
    """The identity a local state dict carries: in its ``_metadata`` under ``prefix`` (version 3), or
    as the entry of versions 1 and 2; ``None`` when it has none."""
    metadata = getattr(state, "_metadata", None)
    if isinstance(metadata, Mapping):
        entry = metadata.get(prefix.rstrip("."))
        if isinstance(entry, Mapping) and LOCAL_STATE_KEY in entry:
            return entry[LOCAL_STATE_KEY]
    return state.get(prefix + LOCAL_STATE_KEY)


def _read_identity(value: Any, where: str) -> Mapping[str, Any] | None:
    """The identity entry of a local state dict: a tensor (this version), a dict (version 1), or
    absent (``None``: fairscale's local state dict, which has none)."""
    if value is None or isinstance(value, Mapping):
        return value
    try:  # a tensor cast or moved along with the others (.half(), .cuda()) still holds the bytes
        text = bytes(value.detach().reshape(-1).cpu().round().to(torch.uint8).tolist())
        ident = json.loads(text.decode())
    except (AttributeError, TypeError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"{where}: the {LOCAL_STATE_KEY!r} entry is not the identity a local state dict holds "
            f"(a uint8 tensor of JSON); it was changed after saving ({e})"
        ) from None
    if not isinstance(ident, dict):
        raise ValueError(
            f"{where}: the {LOCAL_STATE_KEY!r} entry is not the identity a local state dict holds"
        )
    return ident


def _shard_names(layout: Layout, unit: Unit, version: int = FORMAT_VERSION) -> list[str]:
    """The name of each flat parameter of ``unit`` in a local state dict and its metadata, relative
    to the wrapper: ``flat_param_<i>``, or under ``flatten_parameters=False`` (one parameter per flat
    parameter) the parameter's own, as fairscale names them (format version 2 on)."""
    if unit.flatten or version < 2:
        return [f"flat_param_{i}" for i in range(len(unit.handles))]
    cut = len(unit.path) + 1 if unit.path else 0  # (the state_dict() names of a unit start with its path)
    return [layout.slots(h)[0].name[cut:] for h in unit.handles]


def _alias_names(
    layout: Layout, unit: Unit, version: int = FORMAT_VERSION
) -> list[tuple[str, FlatParamHandle]]:
    """Further keys of a local state dict under ``flatten_parameters=False``: each further name of a
    tied parameter, holding the same shard (fairscale writes its module's ``state_dict()`` there,
    which names a tied parameter under each name)."""
    if unit.flatten or version < 2:
        return []
    return [(alias, h) for h in unit.handles for alias in layout.slots(h)[0].aliases]


def local_state_dict(layout: Layout, keep_vars: bool = False) -> dict[str, Any]:
    """This rank's shards (``"<wrapper path>.flat_param_<i>"``, or the parameter's name under
    ``flatten_parameters=False``), the ignored parameters and the buffers under their names. The
    identity (:func:`local_identity`) goes into the dict's ``_metadata``, by the caller.

    Values are detached references, as in ``nn.Module.state_dict``: copy them before changing the
    model. With ``keep_vars`` the flat parameters and buffers themselves. Buffers are in their dtype
    from before wrapping, as in ``state_dict()``: one the wrapper keeps in another dtype
    (``buffer_dtype``, the compute dtype under ``mixed_precision=True``) is a cast copy, with
    ``keep_vars`` too.
    """
    out: dict[str, Any] = {}
    for unit in layout.units:
        for name, h in zip(_shard_names(layout, unit), unit.handles, strict=True):
            out[_join(unit.path, name)] = h.flat_param if keep_vars else h.flat_param.detach()
        for alias, h in _alias_names(layout, unit):
            out[alias] = h.flat_param if keep_vars else h.flat_param.detach()
    for s in layout.ignored:  # unmanaged: this rank's parameter under its name
        out[s.name] = s.param if keep_vars else s.param.detach()
    for b in layout.buffers:
        value = b.tensor if keep_vars else b.tensor.detach()
        out[b.name] = value if value.dtype == b.dtype else value.detach().to(b.dtype)
    return out


def load_local_state_dict(layout: Layout, state: Mapping[str, Any], strict: bool = True) -> NamedTuple:
    """Load what :func:`local_state_dict` returned on this rank, at the same world size and wrap plan.

    Everything is checked before anything is written: on an error the model is unchanged. Buffers
    are cast to the dtype the wrapper keeps them in, so a dict holding them in their original dtype
    loads, and so does one saved by earlier versions, which held them in the kept dtype. A dict
    without the identity entry (fairscale's ``local_state_dict()``, or ours with that entry dropped)
    loads when its keys and shapes fit: the rank that saved it cannot be checked then.
    """
    where = "FullyShardedDataParallel.load_local_state_dict"
    ident = _read_identity(identity_of(state), where)
    mine = local_identity(layout)
    version = FORMAT_VERSION
    if ident is not None:
        version = int(ident.get("version", 1))
        if version > FORMAT_VERSION:
            raise ValueError(
                f"{where}: the state dict was saved by a newer version of fsdp (local state dict format {version}, "
                f"this one reads up to {FORMAT_VERSION}); upgrade fsdp, or save a checkpoint with fsdp.save_checkpoint"
            )
    if ident is not None and ident.get("world_size") != mine["world_size"]:
        raise ValueError(
            f"{where}: the state dict was saved at world size {ident.get('world_size')} but this model runs on "
            f"{mine['world_size']} ranks. A local state dict only loads at the world size and wrap plan it was "
            "saved with; to resume on another number of ranks use fsdp.save_checkpoint/load_checkpoint (or the "
            "sharded state dict), or consolidate the shards with consolidate_shard_weights()"
        )
    if ident is not None and ident.get("rank") != mine["rank"]:
        raise ValueError(
            f"{where}: the state dict holds the shards of rank {ident.get('rank')}, not of rank {mine['rank']}; "
            "every rank must load the file it saved"
        )
    if ident is not None and ident.get("plan") != mine["plan"]:
        raise ValueError(
            f"{where}: the state dict was saved with a different wrap plan (other wrappers, or other parameter "
            "names, shapes or dtypes in them). Wrap the model exactly as when it was saved, or resume with "
            "fsdp.load_checkpoint, which loads into any wrap plan"
        )
    expected: dict[str, tuple[int, ...]] = {}
    targets: dict[str, FlatParamHandle | BufferSlot | IgnoredSlot] = {}
    for unit in layout.units:
        for name, h in zip(_shard_names(layout, unit, version), unit.handles, strict=True):
            key = _join(unit.path, name)
            expected[key], targets[key] = (h.spec.chunk,), h
        for alias, h in _alias_names(layout, unit, version):  # the same shard again: checked, not written
            expected[alias] = (h.spec.chunk,)
    for s in layout.ignored:
        expected[s.name], targets[s.name] = s.shape, s
    for b in layout.buffers:
        expected[b.name], targets[b.name] = tuple(b.tensor.shape), b
    if ident is None and _is_full_state_dict(layout, state, expected):
        raise ValueError(
            f"{where}: this is not a local state dict but a full one (the unwrapped model's keys and shapes). Load "
            "it with load_state_dict(), or a sharded one with load_sharded_state_dict()"
        )
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected and k != LOCAL_STATE_KEY]  # (versions 1 and 2)
    errors = [
        f"{k!r}: shape {tuple(state[k].shape)} in the state dict, {shape} in the model"
        for k, shape in expected.items()
        if k in state and tuple(getattr(state[k], "shape", ())) != shape
    ]
    if strict and missing:
        errors.append("missing key(s): " + ", ".join(repr(k) for k in missing))
    if strict and unexpected:
        errors.append("unexpected key(s): " + ", ".join(repr(k) for k in unexpected))
    if errors and ident is None:
        errors.append(
            "(the state dict carries no identity (its _metadata was dropped, or it is fairscale's), so it was read as "
            "fairscale's local state dict: "
            "this rank's shards and the buffers. A full state dict loads with load_state_dict(), a sharded one "
            "with load_sharded_state_dict())"
        )
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
                (target.param if isinstance(target, IgnoredSlot) else target.tensor).copy_(value)
    return _IncompatibleKeys(missing, unexpected)


def _is_full_state_dict(
    layout: Layout, state: Mapping[str, Any], local: Mapping[str, tuple[int, ...]]
) -> bool:
    """Whether ``state`` holds the unwrapped model's keys with every managed parameter in its full
    shape, and so is not a local state dict (whose shards are 1-D chunks)."""
    keys = set(state) - {LOCAL_STATE_KEY}
    if not layout.params or keys != set(layout.keys):
        return False
    if any(tuple(getattr(state[s.name], "shape", ())) != s.shape for s in layout.params):
        return False
    return keys != set(local) or any(local[s.name] != s.shape for s in layout.params if s.name in local)


def _name_in(layout: Layout, path: str, handle: FlatParamHandle, fqn: str) -> str:
    """The ``state_dict()`` key of the parameter that ``handle`` holds under ``fqn``, relative to its
    wrapper's ``path`` (fairscale's consolidator joins the two with a dot): the name in the flat
    parameter without the levels of torch's activation checkpoint / offload wrappers, whose hooks hide
    them from ``state_dict()``. (A plain child that happens to be called like their attribute keeps
    its level.)"""
    key = layout.plain_names.get((id(handle), fqn))
    if key is None or (path and not key.startswith(path + ".")):  # (not met by the walk: as it is)
        return fqn
    return key[len(path) + 1 :] if path else key


def local_metadata_dict(layout: Layout) -> dict[str, Any]:
    """What :func:`consolidate_shard_weights` needs to rebuild full parameters from local shards.

    Keys as in fairscale (``param_metadata``, ``buffer_names``), plus this rank's identity, the
    buffers' original dtypes and the unwrapped model's state-dict key order. fairscale's own
    ``consolidate_shard_weights`` reads it too: each flat parameter's entry holds exactly fairscale's
    four keys, in its order (it unpacks their values by position); where this rank's shard sits in
    the unit's shard group (``shard_rank``, ``shard_world_size``: they differ from the rank and world
    size under ``NO_SHARD`` and ``HYBRID_SHARD``) is written beside ``fsdp_path`` in the unit's
    entry, where fairscale reads only the keys it knows. See :func:`consolidate_shard_weights` for
    the older layout, with those two keys in every flat parameter's entry.

    Parameter names (``names``, ``shared_param_info``) are ``state_dict()``'s, relative to the
    wrapper's ``fsdp_path``: without the level of torch's activation checkpoint / offload wrappers
    (earlier versions kept it, and their metadata consolidates under those names, as it did).
    """
    units = []
    for unit in layout.units:
        params = {}
        shared = []
        for backing, h in zip(_shard_names(layout, unit), unit.handles, strict=True):
            params[backing] = {  # fairscale's keys in fairscale's order: nothing else here
                "names": [_name_in(layout, unit.path, h, p.fqn) for p in h.meta.params],
                "shapes": [tuple(p.shape) for p in h.meta.params],
                "numels": [p.numel for p in h.meta.params],
                "padding": h.spec.pad,
            }
            shared += [
                (
                    _join(unit.path, _name_in(layout, unit.path, h, h.meta.params[s.primary].fqn)),
                    _join(unit.path, _name_in(layout, unit.path, h, s.fqn)),
                )
                for s in h.meta.shared
            ]
        # one shard group per wrapper; a wrapper without parameters has no shards (rank 0 of 1)
        places = {(h.spec.rank, h.spec.world_size) for h in unit.handles} or {(0, 1)}
        assert len(places) == 1, (
            f"the flat parameters of wrapper {unit.path!r} are sharded over different groups"
        )
        ((shard_rank, shard_world_size),) = places
        units.append(
            {
                "fsdp_path": unit.path,
                "params": params,
                "shared_param_info": shared,
                "no_broadcast_optim_state": unit.no_broadcast_optim_state,
                "shard_rank": shard_rank,
                "shard_world_size": shard_world_size,
            }
        )
    return {
        **local_identity(layout),
        "param_metadata": units,
        "buffer_names": [b.name for b in layout.buffers],
        "ignored_param_names": [s.name for s in layout.ignored],
        "buffer_dtypes": {b.name: str(b.dtype).removeprefix("torch.") for b in layout.buffers},
        "state_dict_keys": list(layout.keys),
    }


def _placement(unit: Mapping[str, Any], param: Mapping[str, Any], key: str, default: int) -> Any:
    """``shard_rank`` / ``shard_world_size`` of a flat parameter: in its wrapper's entry (the current
    layout), else in its own entry (the layout before fairscale's consolidator could read ours)."""
    return unit.get(key, param.get(key, default))


def consolidate_shard_weights(
    shard_weights: Sequence[Mapping[str, Any]],
    shard_metadata: Sequence[Mapping[str, Any]],
    with_module_buffers: bool = True,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """Rebuild the unwrapped model's state dict from every rank's local shards. No process group.

    ``shard_weights[i]`` / ``shard_metadata[i]`` are rank i's :func:`local_state_dict` /
    :func:`local_metadata_dict` (any order; with hybrid sharding one replica of each shard is
    enough). Buffers and ignored parameters come from the lowest rank given. ``strict=False`` skips flat parameters and
    buffers missing from the weights instead of raising.

    Metadata of both layouts is read: the current one, with ``shard_rank`` / ``shard_world_size`` in
    each wrapper's entry of ``param_metadata``, and the older one, with them in each flat
    parameter's entry (which fairscale's consolidator could not read). Without either, a rank's
    shard index is its rank and the shard group is every rank given.
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
                unit_i = shard_metadata[i]["param_metadata"][u]
                meta_i = unit_i["params"][backing]
                shard_rank = int(_placement(unit_i, meta_i, "shard_rank", ranks[i]))
                if shard_rank not in pieces:  # else: a replica of a shard already taken (hybrid sharding)
                    flat = shard_weights[i][key].detach().reshape(-1)
                    pieces[shard_rank] = flat[: flat.numel() - int(meta_i["padding"])]
            shard_world = int(_placement(unit, pmeta, "shard_world_size", len(shard_weights)))
            if sorted(pieces) != list(range(shard_world)):
                raise ValueError(
                    f"{where}: {key!r} is sharded over {shard_world} ranks but the shards of rank(s) "
                    f"{sorted(set(range(shard_world)) - set(pieces))} are missing; pass every rank's files"
                )
            parts = [pieces[r] for r in range(shard_world)]
            if len({p.device for p in parts}) > 1:  # e.g. each rank's file loaded onto its own GPU
                parts = [p.cpu() for p in parts]
            full = torch.cat(parts)
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
    weights0 = shard_weights[order[0]]
    for name in first.get("ignored_param_names", []):  # unmanaged parameters: the lowest rank's
        if name in weights0:
            out[name] = weights0[name].detach().clone()
        elif strict:
            raise KeyError(f"{where}: the shard dict of rank {ranks[order[0]]} has no parameter {name!r}")
    if with_module_buffers:
        dtypes = first.get("buffer_dtypes", {})
        for name in first.get("buffer_names", []):
            if name not in weights0:
                if strict:
                    raise KeyError(
                        f"{where}: the shard dict of rank {ranks[order[0]]} has no buffer {name!r}"
                    )
                continue
            value = weights0[name].detach()
            dtype = getattr(torch, dtypes[name]) if name in dtypes else value.dtype
            # a copy (the caller's tensor stays theirs), with the parameters when theirs moved to the host
            device = next(iter(out.values())).device if out else value.device
            out[name] = value.to(device=device, dtype=dtype, copy=True)
    keys = first.get("state_dict_keys")
    if keys is None:
        return out
    ordered = {k: out[k] for k in keys if k in out}
    ordered.update((k, v) for k, v in out.items() if k not in ordered)
    return ordered
