"""``torch.distributed.checkpoint.state_dict``'s functions for this library's models, with its signatures.

torch's ``get_state_dict(model, optim)`` recognizes only torch's own wrappers: given this library's
model it would read the optimizer's flat per-unit shards under internal names, valid at this world
size only, so it refuses such a model with an error naming these functions (see
``TorchFSDPMethods.named_buffers``). These take the same arguments (``model``: a wrapper, a plain
module holding wrappers, or one without any) and give what torch gives for its FSDP1: the model's
and the optimizers' state keyed by parameter name, row-sharded ``DTensor``\\ s by default (DCP saves
and reshards them to any world size), full tensors with ``StateDictOptions(full_state_dict=True)``
(rank 0 alone and on the CPU with ``cpu_offload=True``). ``options`` is torch's ``StateDictOptions``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from fsdp.wrapper.state_methods import StateDictMethods
from fsdp.wrapper.torch_methods import TorchFSDPMethods, WholeModel

__all__ = [
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


def _options(options: Any, what: str) -> Any:
    """torch's ``StateDictOptions`` (the defaults for ``None``), checked for what is supported."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions() if options is None else options
    default = StateDictOptions()
    for field in ("ignore_frozen_params", "flatten_optimizer_state_dict"):
        if getattr(options, field, False) != getattr(default, field, False):
            raise NotImplementedError(
                f"fsdp.dcp_state.{what}: StateDictOptions({field}=...) is not supported; leave it at its default"
            )
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(
            f"fsdp.dcp_state.{what}: broadcast_from_rank0=True needs full_state_dict=True (as in torch)"
        )
    return options


def _check_submodules(submodules: Any, what: str) -> None:
    if submodules is not None:
        raise NotImplementedError(
            f"fsdp.dcp_state.{what}: `submodules` (deprecated in torch) is not supported; filter the returned dict by key"
        )


@contextlib.contextmanager
def _as_options(model: nn.Module, options: Any) -> Iterator[None]:
    """``FSDP.state_dict_type`` set as torch's functions set it for ``options``."""
    if options.full_state_dict:
        kind = StateDictType.FULL_STATE_DICT
        config: Any = FullStateDictConfig(offload_to_cpu=options.cpu_offload, rank0_only=options.cpu_offload)
        optim_config: Any = FullOptimStateDictConfig(
            offload_to_cpu=options.cpu_offload, rank0_only=options.cpu_offload or options.broadcast_from_rank0
        )
    else:
        kind = StateDictType.SHARDED_STATE_DICT
        config, optim_config = ShardedStateDictConfig(), ShardedOptimStateDictConfig()
    with StateDictMethods.state_dict_type(model, kind, config, optim_config):
        yield


def _optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """torch's way to give an optimizer that never stepped its state (so that a checkpoint has a
    template to load into): one step with zero gradients at learning rate 0."""
    if optim.state or any(p.grad is not None for g in optim.param_groups for p in g["params"]):
        return
    for g in optim.param_groups:
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    rates = [g["lr"] for g in optim.param_groups if "lr" in g]
    for g in optim.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optim.step()
    for g in optim.param_groups:
        if "lr" in g:
            g["lr"] = rates.pop(0)
    optim.zero_grad(set_to_none=True)


def get_model_state_dict(model: nn.Module, *, submodules: Any = None, options: Any = None) -> dict[str, Any]:
    """The model's state dict keyed by parameter name (torch's ``get_model_state_dict``). Collective."""
    _check_submodules(submodules, "get_model_state_dict")
    options = _options(options, "get_model_state_dict")
    with _as_options(model, options):
        return dict(model.state_dict())


def get_optimizer_state_dict(
    model: nn.Module, optimizers: Any, *, submodules: Any = None, options: Any = None
) -> dict[str, Any]:
    """The optimizers' state keyed by parameter name, as ``FSDP.optim_state_dict`` gives it, several
    optimizers merged (torch's ``get_optimizer_state_dict``). Collective."""
    _check_submodules(submodules, "get_optimizer_state_dict")
    options = _options(options, "get_optimizer_state_dict")
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    with _as_options(model, options):
        for optim in _optimizers(optimizers):
            _init_optim_state(optim)
            osd = TorchFSDPMethods.optim_state_dict(model, optim)
            if osd:
                merged["state"].update(osd["state"])
                merged["param_groups"].extend(osd["param_groups"])
    return merged if merged["state"] or merged["param_groups"] else {}


def get_state_dict(
    model: nn.Module, optimizers: Any, *, submodules: Any = None, options: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``. Collective."""
    return (
        get_model_state_dict(model, submodules=submodules, options=options),
        get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options),
    )


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _from_rank0(value: Any, layout_group: Any, options: Any) -> Any:
    """``broadcast_from_rank0``: rank 0's dict, on every rank (one ``broadcast_object_list``)."""
    if not options.broadcast_from_rank0 or dist.get_world_size(layout_group) == 1:
        return value
    box = [value if dist.get_rank(layout_group) == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(layout_group, 0), group=layout_group)
    return box[0]


def set_model_state_dict(
    model: nn.Module, model_state_dict: Mapping[str, Any], *, options: Any = None
) -> Any:
    """Load what :func:`get_model_state_dict` gave (from any world size); returns the missing and
    unexpected keys (torch's ``set_model_state_dict``). Collective."""
    options = _options(options, "set_model_state_dict")
    group = WholeModel(model, "set_model_state_dict").layout().group
    model_state_dict = _from_rank0(model_state_dict, group, options)
    with _as_options(model, options):
        result = model.load_state_dict(model_state_dict, strict=options.strict)
    return _IncompatibleKeys(list(result.missing_keys), list(result.unexpected_keys))


def _part_of(osd: Mapping[str, Any], names: set[str]) -> dict[str, Any]:
    """The entries of a merged optimizer state dict that belong to the parameters ``names``."""
    groups = [g for g in osd.get("param_groups", []) if set(g["params"]) <= names and g["params"]]
    return {
        **{k: v for k, v in osd.items() if k not in ("state", "param_groups")},
        "state": {n: v for n, v in osd.get("state", {}).items() if n in names},
        "param_groups": groups,
    }


def set_optimizer_state_dict(
    model: nn.Module, optimizers: Any, optim_state_dict: Mapping[str, Any], *, options: Any = None
) -> None:
    """Load what :func:`get_optimizer_state_dict` gave (from any world size) into the optimizers
    (torch's ``set_optimizer_state_dict``). Collective."""
    options = _options(options, "set_optimizer_state_dict")
    optims = _optimizers(optimizers)
    layout = WholeModel(model, "set_optimizer_state_dict").layout()
    by_param = {id(s.param): [s.name] for s in layout.ignored}
    by_param.update((id(h.flat_param), [s.name for s in layout.slots(h)]) for h in layout.handles())
    with _as_options(model, options):
        for optim in optims:
            _init_optim_state(optim)
            part = dict(optim_state_dict)
            if len(optims) > 1:
                names = {n for g in optim.param_groups for p in g["params"] for n in by_param.get(id(p), [])}
                part = _part_of(optim_state_dict, names)
            TorchFSDPMethods.optim_state_dict_to_load(model, optim, part, load_directly=True)


def set_state_dict(
    model: nn.Module,
    optimizers: Any,
    *,
    model_state_dict: Mapping[str, Any],
    optim_state_dict: Mapping[str, Any],
    options: Any = None,
) -> Any:
    """:func:`set_model_state_dict` and :func:`set_optimizer_state_dict` (torch's ``set_state_dict``)."""
    result = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return result
