"""fairscale's form of a gathered optimizer state dict: its parameter numbering, its keys, its 0-dim
state. Works on a :class:`~fsdp.core.layout.Layout` and on plain dicts; ``fsdp/state/optim_state.py``
gathers and shards.

[Note: fairscale's optimizer state form]
fairscale's ``gather_full_optim_state_dict`` adds two keys that its ``get_shard_from_optim_state_dict``
reads: ``"param_id_map"`` (each parameter's id -> the index of its flat parameter among the
optimizer's parameters, its "local id", or None for a flat parameter without state) and
``"uncollected_local_ids"`` (the local ids of ``no_broadcast_optim_state`` wrappers: experts, whose
state was not gathered; the recipient's own is in ``"state"``). Its reader concatenates, per local
id, the state of the ids that map to it in the order ``"state"`` lists them, and counts the flat
parameters as the runs of equal values in ``"param_id_map"``. Our ids follow the unwrapped model (a
plain optimizer's numbering, so the dict also loads into one), not fairscale's wrapper-by-wrapper
numbering (:func:`fairscale_order`), but every flat parameter's parameters come in its layout order
there, and ``"param_id_map"`` lists them flat parameter by flat parameter, so both readings agree.
fairscale stores ``"step"`` as a number (its reader would shard a 0-dim tensor); the dict records
the dtype of the tensors it was (``"step_dtype"``, a key fairscale's reader ignores), and our
reader gives the shard tensors of that dtype again, as the optimizer's own ``state_dict()`` holds
them (a dict without the key, fairscale's own, keeps numbers: torch's optimizers make tensors of
them when they load). Its reader turns the dict it is given into
the shard it returns (:func:`become_shard_`), so the full state is not held twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fsdp.core.layout import Layout

__all__ = [
    "STEP_DTYPE",
    "become_shard_",
    "fairscale_order",
    "one_rank_singletons",
    "restore_tensor_steps",
    "to_fairscale_form",
]

# The key of a gathered dict that records the dtype of the ``step`` tensors it holds as numbers
STEP_DTYPE = "step_dtype"


def to_fairscale_form(
    out: dict[str, Any], id_map: Mapping[int, int | None], uncollected_ids: Sequence[int]
) -> None:
    """Give a gathered dict ``out`` fairscale's keys, in place: ``id_map`` (id -> local id, listed
    flat parameter by flat parameter) and the local ids of the experts. See [Note: fairscale's
    optimizer state form]."""
    step_dtypes = set()
    for entry in out["state"].values():
        step = entry.get("step")
        if isinstance(step, torch.Tensor) and step.dim() == 0:
            step_dtypes.add(step.dtype)
            entry["step"] = step.item()
    if len(step_dtypes) == 1:
        out[STEP_DTYPE] = str(step_dtypes.pop()).removeprefix("torch.")
    out["param_id_map"] = dict(id_map)
    out["uncollected_local_ids"] = list(uncollected_ids)


def restore_tensor_steps(full: Mapping[str, Any], state: dict[int, dict[str, Any]]) -> None:
    """Make the numbers ``to_fairscale_form`` made of 0-dim ``step`` tensors tensors again, in the
    shard ``state`` read from ``full``: the form the optimizer's own ``state_dict()`` has."""
    name = full.get(STEP_DTYPE)
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        return
    for entry in state.values():
        step = entry.get("step")
        if isinstance(step, (int, float)) and not isinstance(step, bool):
            entry["step"] = torch.tensor(float(step), dtype=dtype)


def fairscale_order(layout: Layout) -> list[str]:
    """How fairscale numbers a gathered state dict's parameters: wrapper by wrapper (outermost first,
    in module order), each wrapper's own parameters in its module's ``named_parameters()`` order."""
    position = {slot.name: k for k, slot in enumerate(layout.params)}
    order = []
    for unit in layout.units:
        names = [slot.name for h in unit.handles for slot in layout.slots(h)]
        order += sorted(names, key=position.__getitem__)
    return order


def one_rank_singletons(entry: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """fairscale keeps 0-dim state as a list with one tensor per saving rank; take this rank's (or the first)."""
    out = dict(entry)
    for key, value in entry.items():
        if (
            isinstance(value, list)
            and value
            and all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in value)
        ):
            out[key] = value[rank] if rank < len(value) else value[0]
    return out


def become_shard_(full: dict[str, Any], shard: dict[str, Any]) -> dict[str, Any]:
    """Make ``full`` (a gathered state dict) the shard read from it, in place, and return it, as
    fairscale's ``get_shard_from_optim_state_dict`` does: afterwards ``full`` holds the shard's
    keys only (``"state"`` and ``"param_groups"`` this rank's, fairscale's and our extra keys
    gone, other top-level entries kept), so the caller's full state can be freed. Only the
    top-level entries are replaced; the dicts and tensors inside the old ones are left as they were
    (they may be a live optimizer's)."""
    full.clear()
    full.update(shard)
    return full
