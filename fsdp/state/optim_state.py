"""Optimizer state of flat parameters, per original parameter: full (gathered on one rank) and sharded (DCP).

The optimizer holds flat parameters (``model.parameters()`` after wrapping), so its state is flat
too: per-element state such as SGD's ``momentum_buffer`` or Adam's ``exp_avg`` is shaped like the
local shard, ``(chunk,)``, and scalar state such as Adam's ``step`` is one value per flat
parameter. This module converts that state to and from two forms keyed per original parameter:

- **full** (fairscale's API): :func:`gather_full_optim_state_dict` returns, on one rank, the state
  dict a plain ``torch.optim`` optimizer over the unwrapped model would have: ids numbered group by
  group in the model's ``named_parameters()`` order, every per-element tensor shaped like its
  parameter, scalar state copied to every parameter of the flat parameter. It adds
  ``"param_names"`` (id -> name). :func:`get_shard_from_optim_state_dict` turns such a dict back
  into this rank's optimizer state at any world size and any wrap plan; it also reads the same
  dict keyed by parameter name instead of id (torch FSDP's full form).
- **sharded** (DCP): ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``,
  the layout of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, with
  per-element state as row-sharded DTensors like the parameters (see [Note: sharded state dict
  layout] in state/state_dict.py). It is never gathered on one rank; it is ``optim_sharded.py``.

A per-element state is recognised by its shape: the shard's in flat form; a parameter's shape with
at least one dimension in the per-parameter forms (so for 0-dim parameters it is inferred from the
other parameters that have the same key).

Ignored parameters (``ignored_modules``, see [Note: ignored modules] in ``fsdp/core/flat_param.py``) are
plain parameters of the optimizer: their state is kept as it is on each rank, in every form, as
torch FSDP1 does (the full form holds the recipient's own, the sharded form plain tensors).

Parameters the saved state does not know (the loading model and optimizer have them, the saved dict
does not list them; torch FSDP1's ``test_shard_full_optim_state_dict_unmanaged_params``): one that
no wrapper manages (a plain root's own, an ignored one) is left out of the loaded groups, its id
skipped, so that its state can come from elsewhere (model parallelism), as torch does; a sharded
load into the optimizer keeps its current state. One flattened with parameters whose state the
saved dict holds gets zeros for their per-element state, but no scalar or other state can be made
up for it: :func:`refuse_partial_state` refuses that, in torch's words.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fsdp.core.handle import FlatParamHandle
from fsdp.core.layout import (
    IgnoredSlot,
    Layout,
    ParamSlot,
    agree,
    digest_of,
    gather_full_flat,
)
from fsdp.state.optim_fairscale import (
    STEP_DTYPE,
    fairscale_order,
    one_rank_singletons,
    restore_tensor_steps,
    to_fairscale_form,
)

__all__ = [
    "gather_full_optim_state_dict",
    "get_shard_from_optim_state_dict",
    "refuse_partial_state",
]

log = logging.getLogger(__name__)

_GROUP_SKIP = ("params", "param_names")  # per-group entries that are not hyperparameters

Item = FlatParamHandle | IgnoredSlot  # what the optimizer holds: a flat parameter or an ignored one


def _slots(layout: Layout, item: Item) -> tuple[ParamSlot, ...] | tuple[IgnoredSlot]:
    return (item,) if isinstance(item, IgnoredSlot) else layout.slots(item)


def _param(item: Item) -> torch.Tensor:
    return item.param if isinstance(item, IgnoredSlot) else item.flat_param


# ---------------------------------------------------------------------- the optimizer's flat view
def _groups_of(layout: Layout, optim: torch.optim.Optimizer) -> list[list[Item]]:
    """The model's handles (and ignored parameters) in each of the optimizer's param groups, in the
    optimizer's order."""
    handle_of: dict[int, Item] = {id(h.flat_param): h for h in layout.handles()}
    handle_of.update((id(s.param), s) for s in layout.ignored)
    groups = []
    for g, group in enumerate(optim.param_groups):
        handles = []
        for p in group["params"]:
            h = handle_of.get(id(p))
            if h is None:
                raise ValueError(
                    f"the optimizer's param group {g} holds a parameter of shape {tuple(p.shape)} that is not a flat "
                    "parameter of this model; build the optimizer from model.parameters() after wrapping"
                )
            handles.append(h)
        groups.append(handles)
    return groups


def _canonical(layout: Layout, items: Sequence[Item]) -> list[Item]:
    """``items`` (one param group's) in the model's order: the order collectives run in, the same on
    every rank whatever order each rank's optimizer lists its parameters in (torch allows that)."""
    position = {id(h): i for i, h in enumerate(layout.items)}
    return sorted(items, key=lambda h: position[id(h)])


def _flat_states(optim: Any) -> dict[int, Mapping[str, Any]]:
    """The optimizer's state per parameter, keyed by ``id(parameter)``. A torch optimizer's ``state``
    is read directly; an optimizer wrapper without one (fairseq's) through ``state_dict()``, whose
    ids number the parameters in param-group order."""
    state = getattr(optim, "state", None)
    if isinstance(state, Mapping):
        return {id(p): v for p, v in state.items() if isinstance(p, torch.Tensor)}
    params = [p for group in optim.param_groups for p in group["params"]]
    return {id(params[int(i)]): v for i, v in optim.state_dict()["state"].items()}


def _state_kinds(state: Mapping[str, Any], shape: tuple[int, ...], per_element: str) -> dict[str, str]:
    """Each entry's kind: ``per_element`` (shaped ``shape``), ``"scalar"`` (0-dim tensor),
    ``"object"``, or ``"shape (...)"`` for a tensor of another shape."""
    kinds = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            kinds[key] = "object"
        elif value.dim() == 0:
            kinds[key] = "scalar"
        else:
            kinds[key] = per_element if tuple(value.shape) == shape else f"shape {tuple(value.shape)}"
    return kinds


def _flat_state_kinds(handle: FlatParamHandle, state: Mapping[str, Any]) -> dict[str, str]:
    """``"shard"`` (per element, shaped like the local shard), ``"scalar"`` (0-dim tensor) or ``"object"``."""
    kinds = _state_kinds(state, (handle.spec.chunk,), "shard")
    for key, kind in kinds.items():
        if kind.startswith("shape "):
            raise NotImplementedError(
                f"optimizer state {key!r} has {kind}; only per-element state shaped like the flat parameter "
                f"({handle.spec.chunk},) and scalar state can be converted (optimizers with factored state such as "
                "Adafactor are not supported)"
            )
    return kinds


def _plain_state_kinds(slot: IgnoredSlot, state: Mapping[str, Any]) -> dict[str, str]:
    """An ignored parameter's state: ``"full"`` (shaped like it), ``"scalar"`` or ``"object"``."""
    return _state_kinds(state, tuple(slot.shape), "full")


def _agreed_structure(
    layout: Layout, optim: torch.optim.Optimizer, what: str, uncollected: bool = False
) -> list[list[Item]]:
    """:func:`_structure`, with every rank agreeing that it succeeded and matches (else all raise)."""
    error, shape = None, None
    groups: list[list[Item]] = []
    try:
        groups, shape = _structure(layout, optim, uncollected)
    except (ValueError, NotImplementedError) as e:
        error = str(e)
    mismatch = (  # (torch's first sentence, which its tests match, then ours)
        "FSDP currently requires each rank to have at least the optimizer states needed by rank 0's optimizer "
        "but some ranks are missing some of those states: the ranks' optimizers hold differently structured "
        "state (every rank's optimizer must hold the same parameters, groups and state keys); nothing was loaded"
    )
    agree(layout, error, what, digest_of(shape), mismatch=mismatch)
    return groups


def _structure(
    layout: Layout, optim: torch.optim.Optimizer, uncollected: bool = False
) -> tuple[list[list[Item]], list[Any]]:
    """The optimizer's groups over handles, and a description every rank must share (checked by
    :func:`agree`). ``uncollected``: units with ``no_broadcast_optim_state`` (experts) are allowed
    when each holds its parameters whole (a one-rank group), as fairscale's gather keeps them."""
    for unit in layout.units:
        if unit.no_broadcast_optim_state and not uncollected:
            raise NotImplementedError(
                f"the wrapper at {unit.path or '<root>'!r} has no_broadcast_optim_state=True (fairscale's option for "
                "expert-parallel units, set for a wrapper on a one-rank group inside a larger root): each rank holds "
                "other parameters under its names, so its optimizer state cannot be sharded by name; use "
                "gather_full_optim_state_dict(), which keeps the recipient's own experts' state as fairscale does"
            )
        if unit.no_broadcast_optim_state and any(h.spec.world_size > 1 for h in unit.handles):
            raise NotImplementedError(
                f"the wrapper at {unit.path or '<root>'!r} has no_broadcast_optim_state=True but is sharded over "
                f"{unit.handles[0].spec.world_size} ranks: its state is not gathered, so no rank holds it whole. "
                "Give such a wrapper a one-rank process group, or leave the flag unset"
            )
    groups = _groups_of(layout, optim)
    position = {id(h): i for i, h in enumerate(layout.items)}
    states = _flat_states(optim)
    shape = [
        [(position[id(h)], _kinds_of(h, states)) for h in _canonical(layout, handles)] for handles in groups
    ]
    return groups, shape


def _kinds_of(item: Item, states: Mapping[int, Mapping[str, Any]]) -> list[tuple[str, str]]:
    state = states.get(id(_param(item)), {})
    if isinstance(item, IgnoredSlot):
        return sorted(_plain_state_kinds(item, state).items())
    return sorted(_flat_state_kinds(item, state).items())


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in group.items() if k not in _GROUP_SKIP}


def _plain_order(layout: Layout, groups: Sequence[Sequence[Item]]) -> list[list[str]]:
    """The names of the original (and ignored) parameters of each group, in the model's
    named_parameters() order."""
    return [
        sorted((s.name for h in items for s in _slots(layout, h)), key=layout.positions.__getitem__)
        for items in groups
    ]


def _copy(value: Any, device: torch.device | None = None) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, copy=True) if device is not None else value.detach().clone()
    return copy.deepcopy(value)


# ---------------------------------------------------------------------- full optimizer state dict
def gather_full_optim_state_dict(
    layout: Layout,
    optim: torch.optim.Optimizer,
    recipient_rank: int | None = 0,
    device: torch.device | None = None,
    fairscale_form: bool = False,
) -> dict[str, Any] | None:
    """The optimizer state per original parameter, on ``recipient_rank`` only (None elsewhere; with
    ``None``, on every rank, each holding its own state of the parameters no wrapper manages, as
    torch's full form keeps it). Collective.

    Per-element state is gathered one flat parameter at a time and moved to ``device`` (default:
    the CPU), so the recipient needs room for the whole optimizer state there, the others for one
    flat parameter's at a time. With ``fairscale_form`` the dict is also fairscale's (see
    [Note: fairscale's optimizer state form] in ``fsdp/state/optim_fairscale.py``); without it, the state of experts
    (``no_broadcast_optim_state``) is refused.
    """
    if recipient_rank is not None and not 0 <= recipient_rank < layout.world_size:
        raise ValueError(f"recipient_rank must be in [0, {layout.world_size}), got {recipient_rank}")
    device = device if device is not None else torch.device("cpu")
    groups = _agreed_structure(layout, optim, "gather_full_optim_state_dict", fairscale_form)
    keep = recipient_rank is None or layout.rank == recipient_rank  # (the shards are all-gathered)
    ordered = _plain_order(layout, groups)
    ids = {name: i for i, name in enumerate(n for group in ordered for n in group)}
    uncollected = {id(h) for u in layout.units if u.no_broadcast_optim_state for h in u.handles}
    state: dict[int, dict[str, Any]] = {}
    states = _flat_states(optim)
    for handles in groups:
        for h in _canonical(layout, handles):
            if isinstance(h, IgnoredSlot):  # this rank's own state (the recipient's is kept)
                if keep and states.get(id(h.param)):
                    state[ids[h.name]] = {k: _copy(v, device) for k, v in states[id(h.param)].items()}
                continue
            flat_state = states.get(id(h.flat_param), {})
            slots = layout.slots(h)
            per_param: list[dict[str, Any]] = [{} for _ in slots]
            for key, kind in sorted(_flat_state_kinds(h, flat_state).items()):  # same order on every rank
                if kind == "shard":
                    full = gather_full_flat(h, flat_state[key])  # (an expert's: its one rank's, whole)
                    if keep:
                        for entry, slot in zip(per_param, slots, strict=True):
                            entry[key] = slot.view(full).to(device, copy=True)
                    del full
                elif keep:
                    for entry in per_param:
                        entry[key] = _copy(flat_state[key], device)
            if keep and flat_state:
                for slot, entry in zip(slots, per_param, strict=True):
                    state[ids[slot.name]] = {k: entry[k] for k in flat_state}  # the optimizer's key order
    if not keep:
        return None
    param_groups = []
    for g, group in enumerate(optim.param_groups):
        saved = _hyper(group)
        saved["params"] = [ids[name] for name in ordered[g]]
        if "param_names" in group:
            saved["param_names"] = list(ordered[g])
        param_groups.append(saved)
    names = [name for group in ordered for name in group]
    # other top-level keys of the optimizer's state dict (a wrapper's loss scale, say) are kept
    extras = {
        k: copy.deepcopy(v) for k, v in optim.state_dict().items() if k not in ("state", "param_groups")
    }
    out = {**extras, "state": dict(sorted(state.items())), "param_groups": param_groups, "param_names": names}
    if fairscale_form:  # See [Note: fairscale's optimizer state form] in fsdp/state/optim_fairscale.py
        id_map: dict[int, int | None] = {}
        uncollected_ids = []
        for local, item in enumerate(h for handles in groups for h in handles):
            stateful = bool(states.get(id(_param(item))))
            id_map.update((ids[slot.name], local if stateful else None) for slot in _slots(layout, item))
            if id(item) in uncollected:
                uncollected_ids.append(local)
        to_fairscale_form(out, id_map, uncollected_ids)
    return out


def _elementwise_keys(per_param: Mapping[str, Mapping[str, Any]]) -> set[str]:
    return {
        key
        for entry in per_param.values()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    }


def _combine(
    handle: FlatParamHandle,
    slots: Sequence[ParamSlot],
    entries: Sequence[Mapping[str, Any] | None],
    elementwise: set[str],
) -> dict[str, Any]:
    """One flat parameter's full state (per-element tensors: ``(meta.numel,)``) from its parameters' entries."""
    keys = list(dict.fromkeys(k for e in entries if e is not None for k in e))
    out: dict[str, Any] = {}
    if any(e is None for e in entries):
        lacking = [s.name for s, e in zip(slots, entries, strict=True) if e is None]
        warnings.warn(
            f"optimizer state: parameter(s) {lacking} have no state but share a flat parameter with parameters that "
            "have; their per-element state starts at zero",
            stacklevel=3,
        )
    for key in keys:
        values = [e.get(key) if e is not None else None for e in entries]
        sample = next((v for v in values if v is not None), None)
        if sample is None:  # None for every parameter (torch's SGD without momentum, a user's entry)
            out[key] = None
        elif key in elementwise:
            parts = []
            for slot, value in zip(slots, values, strict=True):
                if value is None:
                    parts.append(torch.zeros(slot.info.numel, dtype=sample.dtype))
                elif tuple(value.shape) != slot.shape:
                    raise ValueError(
                        f"optimizer state {key!r} of {slot.name!r} has shape {tuple(value.shape)}, the parameter has "
                        f"{slot.shape}"
                    )
                else:
                    parts.append(value.detach().reshape(-1).cpu())
            out[key] = torch.cat(parts).to(sample.dtype)
        else:
            differ = [
                s.name for s, v in zip(slots, values, strict=True) if v is not None and not _same(v, sample)
            ]
            if differ:
                warnings.warn(
                    f"optimizer state {key!r} differs between parameters flattened together ({differ} differ from "
                    f"{slots[[v is not None for v in values].index(True)].name!r}); a flat parameter holds one "
                    "value, the first one is kept",
                    stacklevel=3,
                )
            out[key] = sample
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    try:
        return bool(a == b)
    except Exception:  # values without a plain comparison count as the same
        return True


def _canonical_names(
    layout: Layout, groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Any], where: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A name-keyed optimizer state dict with every alias of a tied parameter replaced by its first
    name. State under a name that no param group lists is refused (it would be dropped)."""
    primary = {n: s.name for s in layout.every_param() for n in (s.name, *s.aliases)}
    renamed = [{**g, "params": [primary.get(n, n) for n in g["params"]]} for g in groups]
    listed = {n for g in renamed for n in g["params"]}
    canonical: dict[str, Any] = {}
    for key, value in state.items():
        name = primary.get(key, key) if isinstance(key, str) else key
        if name not in listed:
            raise ValueError(
                f"{where}: the state holds an entry for {key!r}, which no param group lists; the saved dict does not "
                "fit this model (or was edited): save it again from the model"
            )
        canonical[name] = value
    return renamed, canonical


def get_shard_from_optim_state_dict(
    layout: Layout, full: Mapping[str, Any], optim: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """This rank's optimizer state dict, to pass to ``optim.load_state_dict``, from a full one. Not collective.

    ``full`` comes from :func:`gather_full_optim_state_dict` (any world size, any wrap plan), is
    keyed by parameter name (torch FSDP's ``full_optim_state_dict`` and ``optim_state_dict``), or is
    a plain optimizer's state dict over the unwrapped model with one param group (ids then follow
    the model's trainable parameters in ``named_parameters()`` order). ``full`` is not modified.
    The flat parameters are listed group by group in ``optim``'s order if it is given, else in
    ``model.parameters()`` order. A name-keyed ``full`` without ``"param_groups"`` (torch's
    ``optim_state_dict`` of such a dict) is placed in ``optim``'s groups, and the result has none.

    Parameters that ``full`` does not list are handled as the module docstring says (parameters
    the saved state does not know).
    """
    where = "get_shard_from_optim_state_dict"
    saved_state = full["state"]
    grouped = "param_groups" in full
    if grouped:
        saved_groups = full["param_groups"]
    elif optim is not None and all(isinstance(k, str) for k in saved_state):
        saved_groups = [
            {"params": [s.name for h in hs for s in _slots(layout, h)]} for hs in _groups_of(layout, optim)
        ]
    else:
        raise ValueError(
            f"{where}: the state dict has no 'param_groups'; pass one that has them, or (for a state dict keyed by "
            "parameter name) the optimizer to place its parameters in"
        )
    names = full.get("param_names")
    all_ids = [i for group in saved_groups for i in group["params"]]
    fairscale = names is None and "param_id_map" in full
    named = names is None and bool(all_ids) and all(isinstance(i, str) for i in all_ids)
    if named:  # torch FSDP's form: keyed by parameter name (a tied parameter under any of its names)
        saved_groups, saved_state = _canonical_names(layout, saved_groups, saved_state, where)
        all_ids = [i for group in saved_groups for i in group["params"]]
        name_of: dict[Any, str] = {i: i for i in all_ids}
    elif fairscale:
        order = fairscale_order(layout)
        if len(full["param_id_map"]) != len(order) or sorted(all_ids) != list(range(len(order))):
            raise ValueError(
                f"{where}: the fairscale state dict numbers {len(full['param_id_map'])} parameters, this model "
                f"has {len(order)}; load it into the model (and wrap plan) it was saved from"
            )
        name_of = dict(enumerate(order))
    elif names is None:
        if any(isinstance(i, str) for i in all_ids):
            raise ValueError(f"{where}: the param groups mix parameter names and ids; pass one form")
        plain = [(s.name, s.handle.requires_grad) for s in layout.params]
        plain += [(s.name, s.param.requires_grad) for s in layout.ignored]
        plain.sort(key=lambda entry: layout.positions[entry[0]])
        trainable = [name for name, requires_grad in plain if requires_grad]
        every = [name for name, _ in plain]
        candidates = [c for c in (trainable, every) if len(c) == len(all_ids)]
        if len(saved_groups) != 1 or not candidates:
            raise ValueError(
                f"{where}: the state dict has no 'param_names' and its {len(all_ids)} parameters in "
                f"{len(saved_groups)} group(s) cannot be matched to the model's; save it with "
                "gather_full_optim_state_dict (which records the names)"
            )
        name_of = dict(zip(all_ids, candidates[0], strict=True))
    else:
        name_of = dict(enumerate(names))
    if full.get("uncollected_local_ids"):
        warnings.warn(
            f"{where}: the optimizer state of the expert wrappers (no_broadcast_optim_state, local ids "
            f"{full['uncollected_local_ids']}) is the saving rank's own experts'; every rank loads it as it is, as "
            "fairscale does. Restore each rank's experts' state from that rank's own optimizer.state_dict() "
            "if they differ",
            stacklevel=3,
        )
    slot_of: dict[str, ParamSlot | IgnoredSlot] = {
        n: s for s in layout.every_param() for n in (s.name, *s.aliases)
    }
    unknown = [name_of[i] for i in all_ids if name_of[i] not in slot_of]
    if unknown:
        raise ValueError(f"{where}: parameter(s) {unknown[:5]} of the saved state are not in this model")
    group_of: dict[int, int] = {}
    per_name: dict[str, Mapping[str, Any]] = {}
    for g, group in enumerate(saved_groups):
        for i in group["params"]:
            slot = slot_of[name_of[i]]
            item: Item = slot if isinstance(slot, IgnoredSlot) else slot.handle
            if group_of.setdefault(id(item), g) != g:
                raise ValueError(
                    f"{where}: {slot.name!r} is in saved param group {g} but a parameter flattened with it is in group "
                    f"{group_of[id(item)]}; all parameters of one flat parameter must share a param group"
                )
            entry = saved_state.get(i, saved_state.get(str(i)))
            if entry and fairscale:
                entry = one_rank_singletons(entry, layout.rank)
            if entry:
                per_name[slot.name] = entry
    covered = [h for h in layout.items if id(h) in group_of]
    listed = {slot_of[name_of[i]].name for i in all_ids}
    for h in covered:
        absent = [s.name for s in _slots(layout, h) if s.name not in listed]
        if absent and len(absent) < len(_slots(layout, h)):
            present = [per_name[s.name] for s in _slots(layout, h) if s.name in per_name]
            refusal = refuse_partial_state(absent, present)
            if refusal:
                raise ValueError(f"{refusal} ({where})")
    if optim is not None:
        groups = _groups_of(layout, optim)
        if len(groups) != len(saved_groups) or any(
            {id(h) for h in handles if id(h) in group_of or not isinstance(h, IgnoredSlot)}
            != {id(h) for h in covered if group_of[id(h)] == g}
            for g, handles in enumerate(groups)
        ):
            raise ValueError(
                f"{where}: the optimizer's param groups hold other parameters than the saved ones "
                f"({len(groups)} groups here, {len(saved_groups)} saved)"
            )
    else:
        groups = [[h for h in covered if group_of[id(h)] == g] for g in range(len(saved_groups))]
    elementwise = _elementwise_keys(per_name)
    state: dict[int, dict[str, Any]] = {}
    local_groups = []
    next_id = 0
    for g, handles in enumerate(groups):
        group = _hyper(saved_groups[g])
        group["params"] = []
        for h in handles:
            if isinstance(h, IgnoredSlot) and id(h) not in group_of:  # not saved: left out, its id skipped
                next_id += 1
                continue
            if isinstance(h, IgnoredSlot):  # kept as saved
                entry = per_name.get(h.name)
                if entry:
                    state[next_id] = {k: _copy(v) for k, v in entry.items()}
                group["params"].append(next_id)
                next_id += 1
                continue
            slots = layout.slots(h)
            entries = [per_name.get(s.name) for s in slots]
            if any(e is not None for e in entries):
                flat = _combine(h, slots, entries, elementwise)
                for key in (k for k in elementwise & flat.keys() if flat[k] is not None):
                    padded = torch.zeros(h.spec.padded_numel, dtype=flat[key].dtype)
                    padded[: h.meta.numel] = flat[key]
                    flat[key] = padded[h.spec.start : h.spec.end].clone()
                state[next_id] = {k: _copy(v) for k, v in flat.items()}
            group["params"].append(next_id)
            next_id += 1
        if optim is not None and "param_names" in optim.param_groups[g]:
            group["param_names"] = list(optim.param_groups[g]["param_names"])
        local_groups.append(group)
    restore_tensor_steps(full, state)  # (a gathered dict in fairscale's form holds numbers)
    skip = ("state", "param_groups", "param_names", "param_id_map", "uncollected_local_ids", STEP_DTYPE)
    extras = {k: copy.deepcopy(v) for k, v in full.items() if k not in skip}
    if not grouped:
        return {**extras, "state": state}
    return {**extras, "state": state, "param_groups": local_groups}


def refuse_partial_state(absent: Sequence[str], present: Sequence[Mapping[str, Any]]) -> str | None:
    """The refusal for parameters ``absent`` from the saved state, flattened with parameters whose
    saved entries are ``present``, or None when those hold per-element state only."""
    scalar = sorted(
        {k for e in present for k, v in e.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
    )
    if not scalar:
        return None
    return (
        "All unflattened parameters comprising a single flat parameter must have scalar state with the same "
        f"value and dtype: parameter(s) {list(absent)} have no entry in the saved optimizer state, but are "
        f"flattened with parameters whose state holds {scalar}. Load a state saved from a model with the same "
        "parameters, or add their entries to the saved state"
    )
