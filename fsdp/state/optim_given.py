"""Optimizer state dicts given by the caller, and keyed by parameter name (torch FSDP1's named optimizers).

torch FSDP1's ``FSDP.optim_state_dict(model, optim, optim_state_dict=osd)`` converts ``osd``, which
need not be the optimizer's current state: a copy saved before later steps, one with entries of
its own added (values of any type, ``None`` too), one without ``"param_groups"`` (the result has
none then either), or the state dict of a named optimizer (torch's ``_NamedOptimizer``, TorchRec's
``KeyedOptimizer``), keyed by the names ``model.named_parameters()`` gives the optimizer's
parameters instead of by ids. :func:`view_of` presents such a dict as the optimizer that
``optim_state.py`` and ``optim_sharded.py`` read (its ``param_groups``, ``state`` and
``state_dict()``): the optimizer's own parameters, the dict's state and hyperparameters.
:func:`finish` gives the converted dict the dict's shape; :func:`keyed_by_name` re-keys what a
named optimizer loads (``optim_state_dict_to_load(..., is_named_optimizer=True)``).

Ids number the optimizer's parameters group by group, in its ``param_groups`` order, as its
``state_dict()`` does. State under a key that names no parameter of the optimizer (a user's own
entry) is copied into the result as it is, with a warning, as torch does.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fsdp.comm.consistency import CHECKPOINT_WRAPPED, plain_name

__all__ = ["OptimizerView", "finish", "keyed_by_name", "names_of", "view_of"]


class OptimizerView:
    """What the optimizer-state converters read of an optimizer, from a given state dict."""

    param_groups: list[dict[str, Any]]  # the dict's hyperparameters over the optimizer's parameters
    state: dict[torch.Tensor, Mapping[str, Any]]  # the dict's state, per parameter of the optimizer
    extras: dict[str, Any]  # the dict's top-level entries other than "state" and "param_groups"
    strays: dict[Any, Any]  # state under keys that name no parameter of the optimizer (copied as is)

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        state: dict[torch.Tensor, Mapping[str, Any]],
        extras: dict[str, Any],
        strays: dict[Any, Any],
    ) -> None:
        self.param_groups, self.state, self.extras, self.strays = param_groups, state, extras, strays

    def state_dict(self) -> dict[str, Any]:
        """The dict's other top-level entries (what the converters keep of ``state_dict()``)."""
        return dict(self.extras)


def _names(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every name ``model`` gives a parameter (tied ones under each), as it gives them and as the
    unwrapped model would (without the wrappers' levels)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(name, p)
        out.setdefault(plain_name(name).replace(CHECKPOINT_WRAPPED + ".", ""), p)
    return out


def view_of(optim: Any, given: Mapping[str, Any], model: nn.Module, where: str) -> OptimizerView:
    """``given`` (an optimizer state dict over ``optim``'s parameters, keyed by ids or by the names
    ``model`` gives them) as the optimizer the converters read."""
    if not isinstance(given, Mapping) or not isinstance(given.get("state"), Mapping):
        raise ValueError(
            f"{where}: `optim_state_dict` must be an optimizer state dict, with a 'state' entry (what "
            f"optim.state_dict() returns); got {type(given).__name__} with keys "
            f"{sorted(map(str, given)) if isinstance(given, Mapping) else '-'}"
        )
    params = [p for group in optim.param_groups for p in group["params"]]
    owned = {id(p) for p in params}
    by_name = _names(model)

    def param_of(key: Any) -> torch.Tensor | None:
        if isinstance(key, int) and not isinstance(key, bool):
            return params[key] if 0 <= key < len(params) else None
        found = by_name.get(key) if isinstance(key, str) else None
        return found if found is not None and id(found) in owned else None

    state: dict[torch.Tensor, Mapping[str, Any]] = {}
    strays: dict[Any, Any] = {}
    for key, entry in given["state"].items():
        param = param_of(key)
        if param is None:
            strays[key] = entry
        else:
            state[param] = entry
    if "param_groups" in given:
        groups = []
        for g, group in enumerate(given["param_groups"]):
            members = [param_of(key) for key in group["params"]]
            unknown = [key for key, p in zip(group["params"], members, strict=True) if p is None]
            if unknown:
                raise ValueError(
                    f"{where}: param group {g} of `optim_state_dict` lists {unknown[:4]}, which name no parameter of "
                    f"the optimizer (it has {len(params)}); pass the optimizer's own state dict (optim.state_dict(), "
                    "or a copy of it)"
                )
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
    else:  # (the result has no param groups either: these only place the parameters)
        groups = [dict(group) for group in optim.param_groups]
    extras = {k: v for k, v in given.items() if k not in ("state", "param_groups")}
    return OptimizerView(groups, state, extras, strays)


def finish(out: dict[str, Any], given: Mapping[str, Any], view: OptimizerView, where: str) -> dict[str, Any]:
    """The converted ``out`` in the given dict's shape: no ``"param_groups"`` if it had none, its
    stray state entries copied in. ``out`` is ``{}`` on ranks that keep nothing."""
    if not out:
        return out
    if "param_groups" not in given:
        out.pop("param_groups", None)
    if view.strays:
        warnings.warn(
            f"{where}: `optim_state_dict` holds state under {list(view.strays)[:4]}, which name(s) no parameter of "
            "the optimizer; it is copied into the result as it is (as torch FSDP does)",
            stacklevel=3,
        )
        out["state"].update((k, copy.copy(v)) for k, v in view.strays.items())
    return out


def names_of(params: list[Any], name_of: dict[int, str], where: str, why: str = "") -> list[str]:
    """The name ``name_of`` (parameter id -> name) gives each of ``params``; a ``ValueError`` saying how
    many are not the model's (``why``: what that prevents) otherwise."""
    strangers = sum(id(p) not in name_of for p in params)
    if strangers:
        raise ValueError(
            f"{where}: {strangers} of the optimizer's parameters are not parameters of `model`{why}; pass the "
            "model the optimizer was built over"
        )
    return [name_of[id(p)] for p in params]


def keyed_by_name(shard: dict[str, Any], optim: Any, model: nn.Module, where: str) -> dict[str, Any]:
    """``shard`` (keyed by ids in ``optim``'s order) keyed by the names ``model.named_parameters()``
    gives the optimizer's parameters instead, what a named optimizer's ``load_state_dict`` takes;
    each group's names sorted, as torch's named optimizers list them."""
    name_of: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(p), name)
    params = [p for group in optim.param_groups for p in group["params"]]
    keys = names_of(params, name_of, where, ", so they have no name to be keyed by (is_named_optimizer=True)")

    def key(i: Any) -> Any:
        return keys[i] if isinstance(i, int) and 0 <= i < len(keys) else i

    out = {k: v for k, v in shard.items() if k not in ("state", "param_groups")}
    out["state"] = {key(i): v for i, v in shard["state"].items()}
    if "param_groups" in shard:
        out["param_groups"] = [
            {**group, "params": sorted(key(i) for i in group["params"])} for group in shard["param_groups"]
        ]
    return out
