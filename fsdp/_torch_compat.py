"""torch FSDP1's spellings on the wrapper: its option objects, constructor arguments and static methods.

Code written for ``torch.distributed.fsdp.FullyShardedDataParallel`` runs after changing the import
of the wrapper alone: torch's own option objects are converted to ours
(:func:`~fsdp.api.from_torch_fsdp`), ``device_id`` names the compute device, and the static
optimizer-state methods (``optim_state_dict``, ``full_optim_state_dict``, ...) map onto the
wrapper's fairscale-style ones. What cannot be honoured is refused with an error that says so.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import BackwardPrefetch, FSDPConfig, MixedPrecision, StateDictType, from_torch_fsdp
from fsdp.mixed_precision import cast_inputs
from fsdp.nest import visit_tensors
from fsdp.topology import checked_device
from fsdp.wrap import AutoWrapPolicy, transformer_auto_wrap_policy, wrap_children

__all__ = ["TorchFSDPMethods", "torch_fsdp_options", "wrap_children_with_policy"]

log = logging.getLogger(__name__)


def torch_fsdp_options(
    sharding_strategy: Any,
    mixed_precision: Any,
    cpu_offload: Any,
    backward_prefetch: Any,
    device_id: Any,
    use_orig_params: Any,
    compute_device: Any,
    flatten_parameters: Any,
) -> tuple[Any, Any, Any, bool, Any, Any]:
    """The constructor's torch-FSDP arguments in this library's terms: ``(sharding_strategy,
    mixed_precision, cpu_offload, backward_prefetch, compute_device, flatten_parameters)``.

    ``use_orig_params=True`` is ``flatten_parameters=False``: ``parameters()`` are then one 1-D
    shard per original parameter, as torch's ``use_orig_params=True`` shows them to the optimizer
    outside forward (under plain names, wrapper by wrapper; see docs/api.md)."""
    if not isinstance(use_orig_params, bool):
        raise TypeError(
            f"FullyShardedDataParallel: `use_orig_params` must be a bool, got {use_orig_params!r}"
        )
    if use_orig_params:
        flatten_parameters = False
    if device_id is not None:
        if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
            raise TypeError(
                f"FullyShardedDataParallel: `device_id` must be a CUDA device index or a torch.device, got {device_id!r}"
            )
        device = checked_device(
            torch.device("cuda", device_id) if isinstance(device_id, int) else device_id, "device_id"
        )
        if compute_device is not None and torch.device(compute_device) != device:
            raise ValueError(
                f"FullyShardedDataParallel: device_id={device_id!r} and compute_device={compute_device!r} name different "
                "devices; pass one of them (device_id is torch FSDP's name of compute_device)"
            )
        compute_device = device
    return (
        from_torch_fsdp(sharding_strategy),
        from_torch_fsdp(mixed_precision),
        from_torch_fsdp(cpu_offload),
        _prefetch_flag(from_torch_fsdp(backward_prefetch)),
        compute_device,
        flatten_parameters,
    )


def _prefetch_flag(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, BackwardPrefetch):
        if value is BackwardPrefetch.BACKWARD_POST:
            warnings.warn(
                "FullyShardedDataParallel: backward_prefetch=BACKWARD_POST is taken as BACKWARD_PRE: the next unit's "
                "all-gather is launched when a unit's backward starts",
                stacklevel=4,
            )
        return True
    if not isinstance(value, bool):
        raise TypeError(
            f"FullyShardedDataParallel: `backward_prefetch` must be a bool, a BackwardPrefetch or None, got {value!r}"
        )
    return value


def wrap_children_with_policy(
    module: nn.Module, policy: AutoWrapPolicy, wrapper_cls: type, options: Mapping[str, Any]
) -> None:
    """The constructor's ``auto_wrap_policy``: wrap what ``policy`` picks under ``module`` with the
    constructor's other ``options`` (torch's rule). Under a ``MixedPrecision``, the modules of its
    ``_module_classes_to_ignore`` (batch norm) are wrapped first, in full precision, and run in fp32
    between casts of their inputs and outputs, as torch FSDP does."""
    if not callable(policy):  # before anything is wrapped
        raise TypeError(f"FullyShardedDataParallel: auto_wrap_policy must be callable, got {policy!r}")
    options = {k: v for k, v in options.items() if k != "auto_wrap_policy"}
    mp = from_torch_fsdp(options.get("mixed_precision"))
    if isinstance(mp, MixedPrecision) and mp._module_classes_to_ignore:
        classes = tuple(set(mp._module_classes_to_ignore))
        ignored = [m for m in module.modules() if m is not module and isinstance(m, classes)]
        if ignored:
            log.info(
                "FullyShardedDataParallel: modules of %s get wrappers of their own in full precision "
                "(MixedPrecision._module_classes_to_ignore)",
                sorted({type(m).__name__ for m in ignored}),
            )
            wrap_children(
                module,
                transformer_auto_wrap_policy(set(classes)),
                wrapper_cls,
                **{**options, "mixed_precision": None},
            )
            for m in ignored:
                _run_in_fp32(m)
    wrap_children(module, policy, wrapper_cls, **options)


def _run_in_fp32(module: nn.Module) -> None:
    """Cast the floating inputs of ``module`` to fp32 and its outputs back to the inputs' dtype
    (torch FSDP's hooks on the modules mixed precision ignores)."""
    seen: list[torch.dtype] = []  # the dtypes cast to fp32 in the current call (per module: no cycle)

    def to_fp32(_: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        seen.clear()
        visit_tensors(
            (args, kwargs),
            lambda t: seen.append(t.dtype) if t.is_floating_point() and t.dtype != torch.float32 else None,
            [],
        )
        return cast_inputs((args, kwargs), None, torch.float32, detach=False)  # type: ignore[no-any-return]

    def back(_: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        return cast_inputs(output, None, seen[0], detach=False) if seen else output

    module.register_forward_pre_hook(to_fp32, with_kwargs=True)
    module.register_forward_hook(back, with_kwargs=True)


def _root(model: nn.Module, what: str, group: Any = None) -> Any:
    """The outermost wrapper: ``model`` itself (the static methods take the wrapped model). A
    ``group`` given must be the one the model trains over."""
    if not isinstance(model, TorchFSDPMethods):
        raise TypeError(
            f"FullyShardedDataParallel.{what}: pass the outermost FullyShardedDataParallel (the model you train), got "
            f"{type(model).__name__}"
        )
    if group is not None:
        comm = model.fsdp_config.comm
        ours = comm.dp_group or comm.process_group
        if dist.get_rank(group) < 0 or dist.get_process_group_ranks(group) != dist.get_process_group_ranks(
            ours
        ):
            raise ValueError(
                f"FullyShardedDataParallel.{what}: `group` must hold the ranks the model trains over "
                f"({dist.get_process_group_ranks(ours)}); leave it unset"
            )
    return model


def _full_named(root: Any, optim: torch.optim.Optimizer, rank0_only: bool) -> dict[str, Any]:
    """The full optimizer state keyed by parameter name (torch's full form), on rank 0 or on every
    rank; ``{}`` on the others. Collective."""
    full = root.gather_full_optim_state_dict(optim)
    if not rank0_only:
        full = _broadcast_object(full, root._state_layout())
    if full is None:
        return {}
    names = full["param_names"]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in full["param_groups"]]
    for g in groups:
        g.pop("param_names", None)
    extras = {k: v for k, v in full.items() if k not in ("state", "param_groups", "param_names")}
    return {**extras, "state": {names[i]: v for i, v in full["state"].items()}, "param_groups": groups}


def _same_state_dict(given: Mapping[str, Any], own: Mapping[str, Any]) -> bool:
    """``given`` holds the values of the optimizer's own ``state_dict()`` (torch's docs pass that)."""
    try:
        if given.keys() != own.keys() or given["param_groups"] != own["param_groups"]:
            return False
        a, b = given["state"], own["state"]
        return a.keys() == b.keys() and all(
            a[i].keys() == b[i].keys()
            and all(torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k])) for k in b[i])
            for i in b
        )
    except (RuntimeError, TypeError, KeyError):  # (tensor-valued hyperparameters compare ambiguously)
        return False


def _optim_rank0_only(root: Any) -> bool:
    config = root._state_dict_settings.optim_state_dict_config
    return bool(getattr(config, "rank0_only", False))


def _broadcast_object(obj: Any, layout: Any) -> Any:
    """``obj`` of the layout's first rank, on every rank of its group. Collective."""
    box = [obj]
    dist.broadcast_object_list(
        box, src=dist.get_global_rank(layout.group, 0), group=layout.group, device=layout.device
    )
    return box[0]


class TorchFSDPMethods:
    """torch FSDP1's static methods on the wrapper class. Each takes the outermost wrapper as ``model``."""

    fsdp_config: FSDPConfig

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[Any]:
        """Every wrapper in ``module`` (itself included), outermost first; with ``root_only`` the
        outermost ones only."""
        found = [m for m in module.modules() if isinstance(m, TorchFSDPMethods)]
        if not root_only:
            return found
        inner = {id(w) for m in found for w in m.modules() if w is not m and isinstance(w, TorchFSDPMethods)}
        return [m for m in found if id(m) not in inner]

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: Any = None,
    ) -> dict[str, Any]:
        """The optimizer state a plain optimizer over the unwrapped model would have, keyed by
        parameter name as torch's is, on rank 0 (with ``rank0_only``, the other ranks get ``{}``)
        or on every rank. Collective."""
        root = _root(model, "full_optim_state_dict", group)
        _refuse(optim_input=optim_input)
        return _full_named(root, optim, rank0_only)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """This rank's state dict for ``optim.load_state_dict`` from a full one held by every rank."""
        root = _root(model, "shard_full_optim_state_dict")
        _refuse(optim_input=optim_input)
        return root.get_shard_from_optim_state_dict(full_optim_state_dict, optim)  # type: ignore[no-any-return]

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """As :meth:`shard_full_optim_state_dict`, with the full state dict on rank 0 alone (the
        other ranks may pass None): rank 0 sends it to the others. Collective."""
        root = _root(model, "scatter_full_optim_state_dict", group)
        _refuse(optim_input=optim_input)
        layout = root._state_layout()
        if layout.rank == 0 and full_optim_state_dict is None:
            raise ValueError(
                "FullyShardedDataParallel.scatter_full_optim_state_dict: rank 0 must pass the full state dict"
            )
        full = _broadcast_object(full_optim_state_dict if layout.rank == 0 else None, layout)
        return root.get_shard_from_optim_state_dict(full, optim)  # type: ignore[no-any-return]

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (the formats are described in
        fsdp/optim_state.py), as the model's state dict type says: under
        ``FULL_STATE_DICT`` full tensors (on every rank, or rank 0 alone with
        ``FullOptimStateDictConfig(rank0_only=True)``: the others get ``{}``); under
        ``SHARDED_STATE_DICT`` row-sharded DTensors. Collective."""
        root = _root(model, "optim_state_dict", group)
        if optim_state_dict is not None and not _same_state_dict(optim_state_dict, optim.state_dict()):
            raise NotImplementedError(
                "FullyShardedDataParallel.optim_state_dict: an `optim_state_dict` other than optim.state_dict() is not "
                "supported; leave it unset (the optimizer's own state is read)"
            )
        kind = root._state_dict_type
        if kind is StateDictType.SHARDED_STATE_DICT:
            return root.sharded_optim_state_dict(optim)  # type: ignore[no-any-return]
        if kind is not StateDictType.FULL_STATE_DICT:
            raise NotImplementedError(
                f"FullyShardedDataParallel.optim_state_dict: {kind.name} has no optimizer state form; use "
                "FULL_STATE_DICT or SHARDED_STATE_DICT"
            )
        return _full_named(root, optim, _optim_rank0_only(root))

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        """What ``optim.load_state_dict`` takes, from an :meth:`optim_state_dict` saved at any world
        size (under the same state dict type). Under ``FULL_STATE_DICT`` every rank passes the whole
        dict, or, with ``FullOptimStateDictConfig(rank0_only=True)``, rank 0 does and rank 0 sends it
        to the others. ``load_directly=True`` loads it into ``optim`` too. Collective under
        ``SHARDED_STATE_DICT`` and with ``rank0_only``."""
        root = _root(model, "optim_state_dict_to_load", group)
        if is_named_optimizer:
            raise NotImplementedError(
                "FullyShardedDataParallel.optim_state_dict_to_load: is_named_optimizer=True is not supported; the "
                "optimizer steps on the flat parameters"
            )
        if root._state_dict_type is StateDictType.SHARDED_STATE_DICT:
            root.load_sharded_optim_state_dict(optim, optim_state_dict)
            loaded: dict[str, Any] = optim.state_dict()
            return loaded
        if root._state_dict_type is not StateDictType.FULL_STATE_DICT:
            raise NotImplementedError(
                f"FullyShardedDataParallel.optim_state_dict_to_load: {root._state_dict_type.name} has no optimizer "
                "state form; use FULL_STATE_DICT or SHARDED_STATE_DICT"
            )
        if _optim_rank0_only(root):
            layout = root._state_layout()
            optim_state_dict = _broadcast_object(optim_state_dict if layout.rank == 0 else None, layout)
        shard: dict[str, Any] = root.get_shard_from_optim_state_dict(optim_state_dict, optim)
        if load_directly:
            optim.load_state_dict(shard)
        return shard


def _refuse(**given: Any) -> None:
    """torch's arguments this library does not take, refused unless left at their defaults."""
    for name, value in given.items():
        if value is not None:
            raise NotImplementedError(
                f"FullyShardedDataParallel: `{name}` is not supported; leave it unset (the optimizer's own param "
                "groups are used)"
            )
