"""Optimizer state in the sharded (DCP) form: keyed by parameter name, per-element state as row-sharded DTensors.

``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``, the layout of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``; never gathered on one rank (see
[Note: sharded state dict layout] in state/state_dict.py). The flat view of the optimizer it reads and
writes, and the full form, are ``optim_state.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fsdp.core.layout import (
    IgnoredSlot,
    Layout,
    ParamSlot,
    agree,
    digest_of,
    empty_sharded,
    gather_full_flat,
    is_dtensor,
    shard_writes,
    to_sharded,
    value_kind,
)
from fsdp.state.optim_state import (
    Item,
    _agreed_structure,
    _canonical,
    _copy,
    _elementwise_keys,
    _flat_state_kinds,
    _groups_of,
    _hyper,
    _plain_order,
    _slots,
    refuse_partial_state,
)

__all__ = [
    "OptimLoadPlan",
    "apply_sharded_optim_state_dict",
    "check_sharded_optim_state_dict",
    "load_sharded_optim_state_dict",
    "sharded_optim_state_dict",
    "sharded_optim_state_dict_template",
]


def sharded_optim_state_dict(layout: Layout, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name, per-element state as row-sharded DTensors. Collective."""
    groups = _agreed_structure(layout, optim, "sharded_optim_state_dict")
    mesh = layout.mesh()
    per_name: dict[str, dict[str, Any]] = {}
    for handles in groups:
        for h in _canonical(layout, handles):
            if isinstance(h, IgnoredSlot):  # this rank's own, as plain tensors
                if optim.state.get(h.param):
                    per_name[h.name] = {k: _copy(v) for k, v in optim.state[h.param].items()}
                continue
            flat_state = optim.state.get(h.flat_param, {})
            if not flat_state:
                continue
            slots = layout.slots(h)
            for slot in slots:
                per_name[slot.name] = {}
            for key, kind in sorted(_flat_state_kinds(h, flat_state).items()):  # same order on every rank
                if kind == "shard":
                    full = gather_full_flat(h, flat_state[key])
                    for slot in slots:
                        per_name[slot.name][key] = to_sharded(
                            slot.view(full), layout, mesh, flat_state[key].device
                        )
                    del full
                else:
                    for slot in slots:
                        per_name[slot.name][key] = _copy(flat_state[key])
    ordered = _plain_order(layout, groups)
    param_groups = []
    for g, group in enumerate(optim.param_groups):
        saved = _hyper(group)
        saved["params"] = list(ordered[g])
        param_groups.append(saved)
    state = {name: per_name[name] for name in sorted(per_name, key=layout.positions.__getitem__)}
    return {"state": state, "param_groups": param_groups}


def sharded_optim_state_dict_template(
    layout: Layout, storage: Mapping[str, Any], prefix: str
) -> tuple[dict[str, Any], list[str]]:
    """A target for DCP to load the optimizer state into, built from a checkpoint's metadata.

    ``storage`` is ``Metadata.state_dict_metadata``; the optimizer state sits under ``prefix``
    (e.g. ``"optim."``). Returns the template and the problems found (unknown parameters, shapes).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    mesh = layout.mesh()
    slot_of: dict[str, ParamSlot | IgnoredSlot] = {s.name: s for s in layout.every_param()}
    state: dict[str, dict[str, Any]] = {}
    problems = []
    head = prefix + "state."
    for key, md in storage.items():
        if not key.startswith(head):
            continue
        rest = key[len(head) :]
        slot = next(
            (slot_of[rest[:i]] for i in range(len(rest)) if rest[i] == "." and rest[:i] in slot_of), None
        )
        if slot is None:
            problems.append(f"optimizer state {key!r} belongs to no parameter of this model")
            continue
        name = rest[len(slot.name) + 1 :]
        if isinstance(md, BytesStorageMetadata):
            value: Any = None
        elif isinstance(md, TensorStorageMetadata) and tuple(md.size) == ():
            # a scalar (Adam's step) stays on the CPU, where torch optimizers keep it unless they
            # are fused or capturable (their load_state_dict moves it to the parameter's device)
            value = torch.empty((), dtype=md.properties.dtype)
        elif isinstance(md, TensorStorageMetadata) and tuple(md.size) == slot.shape:
            if isinstance(slot, IgnoredSlot):  # a plain tensor, where the parameter is
                value = torch.empty(slot.shape, dtype=md.properties.dtype, device=slot.param.device)
            else:
                value = empty_sharded(slot.shape, md.properties.dtype, layout, mesh, slot.handle.shard_device)
        else:
            problems.append(
                f"optimizer state {name!r} of {slot.name!r} has shape {tuple(getattr(md, 'size', ()))} in the "
                f"checkpoint; the parameter has {slot.shape}"
            )
            continue
        state.setdefault(slot.name, {})[name] = value
    groups: dict[int, dict[str, Any]] = {}
    head = prefix + "param_groups."
    for key, md in storage.items():
        if key.startswith(head):
            index, _, name = key[len(head) :].partition(".")
            # DCP stores a tensor hyperparameter as a tensor and flattens a nested dict into dotted
            # names: the placeholders rebuild that shape (None for objects), DCP fills them in
            group = groups.setdefault(int(index), {})
            *parents, leaf = name.split(".")
            for part in parents:
                group = group.setdefault(part, {})
            group[leaf] = (
                torch.empty(tuple(md.size), dtype=md.properties.dtype)
                if isinstance(md, TensorStorageMetadata)
                else None
            )
    if sorted(groups) != list(range(len(groups))) or not groups:
        problems.append("the checkpoint's optimizer param_groups are missing or incomplete")
    groups = {i: _lists_back(g) for i, g in groups.items()}
    return {"state": state, "param_groups": [groups[i] for i in sorted(groups)]}, problems


def _lists_back(node: Any) -> Any:
    """DCP names a list's items ``0``, ``1``, ...: turn such placeholder dicts back into lists."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists_back(v) for k, v in node.items()}
    if node and sorted(node) == [str(i) for i in range(len(node))] and all(k.isdigit() for k in node):
        return [node[str(i)] for i in range(len(node))]
    return node


class OptimLoadPlan:
    """A checked sharded optimizer state dict, ready to be applied (see :func:`check_sharded_optim_state_dict`)."""

    def __init__(self) -> None:
        self.groups: list[list[Item]] = []
        self.param_groups: list[dict[str, Any]] = []  # hyperparameters per local group
        self.grouped = True  # whether the saved dict has "param_groups" (else the optimizer's are kept)
        self.entries: dict[str, Mapping[str, Any]] = {}  # parameter name -> its saved state
        self.unsaved: set[int] = set()  # id(item) of unmanaged parameters the dict does not list
        self.elementwise: set[str] = set()
        self.errors: list[str] = []
        self.refusal: str | None = None  # torch's ValueError for state made up (also in errors)
        self.digest = ""


def check_sharded_optim_state_dict(
    layout: Layout, optim: torch.optim.Optimizer, state: Mapping[str, Any]
) -> OptimLoadPlan:
    """Match a sharded optimizer state dict to ``optim``: groups, names, shapes. No writes."""
    plan = OptimLoadPlan()
    try:
        plan.groups = _groups_of(layout, optim)
    except ValueError as e:
        plan.errors.append(str(e))
        return plan
    saved_state = state.get("state") or {}
    plan.grouped = "param_groups" in state
    saved_groups = (state.get("param_groups") or []) if plan.grouped else [{} for _ in plan.groups]
    if len(saved_groups) != len(plan.groups):
        plan.errors.append(
            f"the checkpoint's optimizer has {len(saved_groups)} param group(s), this one {len(plan.groups)}; "
            "build the optimizer with the same groups"
        )
        return plan
    slot_of = {n: s for s in layout.every_param() for n in (s.name, *s.aliases)}
    group_of_name = {n: g for g, group in enumerate(saved_groups) for n in group.get("params", [])}
    for g, handles in enumerate(plan.groups):
        saved = {group_of_name[s.name] for h in handles for s in _slots(layout, h) if s.name in group_of_name}
        if len(saved) > 1 or (saved and saved != {g}):
            plan.errors.append(
                f"param group {g} of the optimizer holds parameters of saved group(s) {sorted(saved)}; build the "
                "optimizer with the same groups, in the same order"
            )
        plan.param_groups.append(_hyper(saved_groups[g] if plan.grouped else optim.param_groups[g]))
    for name, entry in saved_state.items():
        slot = slot_of.get(name)
        if slot is None:
            plan.errors.append(f"optimizer state of {name!r}, which is not a parameter of this model")
            continue
        plan.entries[slot.name] = entry
    # parameters the saved state does not know: see the docstring of fsdp/state/optim_state.py
    listed = {slot_of[n].name for n in (group_of_name if plan.grouped else saved_state) if n in slot_of}
    for h in (h for handles in plan.groups for h in handles):
        absent = [s.name for s in _slots(layout, h) if s.name not in listed]
        if isinstance(h, IgnoredSlot) and absent:
            plan.unsaved.add(id(h))
        elif absent:
            present = [plan.entries[s.name] for s in _slots(layout, h) if s.name in plan.entries]
            refusal = refuse_partial_state(absent, present) if present else None
            if refusal and plan.refusal is None:
                plan.refusal = refusal
                plan.errors.append(refusal)
    plan.elementwise = _elementwise_keys(plan.entries)
    kinds: list[Any] = []
    for handles in plan.groups:
        for h in _canonical(layout, handles):
            for slot in _slots(layout, h):
                entry = plan.entries.get(slot.name, {})
                for key in sorted(plan.elementwise & entry.keys()):
                    value = entry[key]
                    if not isinstance(value, torch.Tensor) or tuple(value.shape) != slot.shape:
                        plan.errors.append(
                            f"optimizer state {key!r} of {slot.name!r} has shape {tuple(getattr(value, 'shape', ()))}, "
                            f"the parameter has {slot.shape}"
                        )
                    else:
                        kinds.append((slot.name, key, value_kind(value, layout)))
            kinds.append(
                sorted(set().union(*(plan.entries.get(s.name, {}).keys() for s in _slots(layout, h))))
            )
    plan.digest = digest_of(kinds)
    return plan


def apply_sharded_optim_state_dict(
    layout: Layout,
    optim: torch.optim.Optimizer,
    plan: OptimLoadPlan,
    rekey: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Load a checked plan into ``optim``. Collective; every rank must have agreed on the plan.

    Returns what was loaded, in torch FSDP1's form (what ``optim.load_state_dict`` takes): unmanaged
    parameters the plan does not know are left out of its groups (``optim`` keeps their state; see
    the docstring of fsdp/state/optim_state.py), and it has no
    ``"param_groups"`` where the saved dict had none. ``rekey`` turns the dict into what ``optim``
    takes (a named optimizer's keys) before it is loaded and returned."""
    loaded: dict[int, dict[str, Any]] = {}  # id(item) -> its state, built in the model's order (collective)
    for handles in plan.groups:
        for h in _canonical(layout, handles):
            if id(h) in plan.unsaved:
                assert isinstance(h, IgnoredSlot)
                if optim.state.get(h.param):  # kept as it is
                    loaded[id(h)] = {k: _copy(v) for k, v in optim.state[h.param].items()}
                continue
            if isinstance(h, IgnoredSlot):
                entry = plan.entries.get(h.name)
                if entry:
                    loaded[id(h)] = {
                        k: v.full_tensor() if is_dtensor(v) else _copy(v) for k, v in entry.items()
                    }
                continue
            slots = layout.slots(h)
            entries = [plan.entries.get(s.name) for s in slots]
            if any(e is not None for e in entries):
                keys = sorted({k for e in entries if e is not None for k in e})  # same order on every rank
                flat: dict[str, Any] = {}
                for key in keys:
                    values = [e.get(key) if e is not None else None for e in entries]
                    sample = next((v for v in values if v is not None), None)
                    if sample is None:  # None for every parameter of it
                        flat[key] = None
                    elif key in plan.elementwise:
                        shard = torch.zeros(h.spec.chunk, dtype=sample.dtype, device=h.flat_param.device)
                        for lo, hi, data in shard_writes(h, values, layout, sample.dtype):
                            shard[lo:hi].copy_(data)
                        flat[key] = shard
                    else:
                        flat[key] = _copy(sample)
                loaded[id(h)] = flat
    state: dict[int, dict[str, Any]] = {}
    param_groups, returned_groups = [], []
    next_id = 0
    for g, handles in enumerate(plan.groups):  # ids in this rank's optimizer's own order
        group = dict(plan.param_groups[g])
        group["params"] = []
        for h in handles:
            if id(h) in loaded:
                state[next_id] = loaded[id(h)]
            group["params"].append(next_id)
            next_id += 1
        if "param_names" in optim.param_groups[g]:
            group["param_names"] = list(optim.param_groups[g]["param_names"])
        param_groups.append(group)
        unsaved = {i for i, h in zip(group["params"], handles, strict=True) if id(h) in plan.unsaved}
        returned_groups.append({**group, "params": [i for i in group["params"] if i not in unsaved]})
    unsaved_ids = {
        i
        for g, r in zip(param_groups, returned_groups, strict=True)
        for i in g["params"]
        if i not in r["params"]
    }
    to_load = {"state": state, "param_groups": param_groups}
    returned: dict[str, Any] = {"state": {i: v for i, v in state.items() if i not in unsaved_ids}}
    if plan.grouped:
        returned["param_groups"] = returned_groups
    if rekey is not None:
        to_load, returned = rekey(to_load), rekey(returned)
    optim.load_state_dict(to_load)
    return returned


def load_sharded_optim_state_dict(
    layout: Layout,
    optim: torch.optim.Optimizer,
    state: Mapping[str, Any],
    rekey: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Load what :func:`sharded_optim_state_dict` produced (at any world size, filled by DCP). Collective.

    The ranks agree that the state matches the optimizer before anything is written. Returns what
    was loaded, in torch's form (see :func:`apply_sharded_optim_state_dict`).
    """
    plan = check_sharded_optim_state_dict(layout, optim, state)
    try:
        agree(
            layout,
            "\n  ".join(plan.errors) or None,
            "load_sharded_optim_state_dict (nothing was loaded)",
            plan.digest,
        )
    except RuntimeError as e:
        if plan.refusal is not None and plan.errors == [plan.refusal]:  # torch's ValueError, in its words
            raise ValueError(f"{plan.refusal} (load_sharded_optim_state_dict: nothing was loaded)") from e
        raise
    return apply_sharded_optim_state_dict(layout, optim, plan, rekey)
