"""torch FSDP1's spellings on the wrapper: its option objects, constructor arguments and static methods.

Code written for ``torch.distributed.fsdp.FullyShardedDataParallel`` runs after changing the import
of the wrapper alone: torch's own option objects are converted to ours
(:func:`~fsdp.api.from_torch_fsdp`), ``device_id`` names the compute device, and the static
optimizer-state methods (``optim_state_dict``, ``full_optim_state_dict``, ...) map onto the
wrapper's fairscale-style ones. What cannot be honoured is refused with an error that says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import BackwardPrefetch, FSDPConfig, MixedPrecision, StateDictType, from_torch_fsdp
from fsdp.consistency import CHECKPOINT_WRAPPED, collective, plain_name
from fsdp.flat_param import NOTHING_IGNORED, IgnoredStates
from fsdp.mixed_precision import cast_inputs
from fsdp.nest import visit_tensors
from fsdp.topology import checked_device
from fsdp.wrap import AutoWrapPolicy, transformer_auto_wrap_policy, wrap_children

__all__ = [
    "TorchFSDPMethods",
    "own_precision_modules",
    "resolve_ignored",
    "torch_fsdp_options",
    "without_own_precision",
    "wrap_children_with_policy",
]

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
) -> tuple[Any, Any, Any, tuple[bool, bool], Any, Any]:
    """The constructor's torch-FSDP arguments in this library's terms: ``(sharding_strategy,
    mixed_precision, cpu_offload, (backward_prefetch, backward_prefetch_post), compute_device,
    flatten_parameters)``.

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


def _prefetch_flag(value: Any) -> tuple[bool, bool]:
    """``(backward_prefetch, backward_prefetch_post)`` of a bool, a ``BackwardPrefetch`` or ``None``."""
    if value is None:
        return False, False
    if isinstance(value, BackwardPrefetch):
        return True, value is BackwardPrefetch.BACKWARD_POST
    if not isinstance(value, bool):
        raise TypeError(
            f"FullyShardedDataParallel: `backward_prefetch` must be a bool, a BackwardPrefetch or None, got {value!r}"
        )
    return value, False


def resolve_ignored(
    module: nn.Module, ignored_modules: Any, ignored_states: Any, is_wrapper: Callable[[nn.Module], bool]
) -> IgnoredStates:
    """The constructor's ``ignored_modules`` / ``ignored_states`` (torch FSDP1's), checked. See
    [Note: ignored modules] in fsdp/flat_param.py.

    ``ignored_states`` holds parameters or modules, not both; the two arguments exclude each other.
    Every ignored module or parameter must be inside ``module``; a wrapper cannot be ignored nor sit
    inside an ignored module. What an inner wrapper already ignores may be given again."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "FullyShardedDataParallel: pass either ignored_modules or ignored_states, not both (ignored_states "
            "takes modules too)"
        )
    arg = "ignored_states" if ignored_states is not None else "ignored_modules"
    given = ignored_states if ignored_states is not None else ignored_modules
    if given is None:
        return NOTHING_IGNORED
    if isinstance(given, torch.Tensor):
        given = [given]
    try:
        items = list(given)
    except TypeError:
        raise TypeError(
            f"FullyShardedDataParallel: `{arg}` must be an iterable (a list) of nn.Module"
            f"{'s or of nn.Parameters' if arg == 'ignored_states' else 's'}, got {type(given).__name__}"
        ) from None
    are_modules = all(isinstance(x, nn.Module) for x in items)
    are_params = arg == "ignored_states" and all(isinstance(x, nn.Parameter) for x in items)
    if not (are_modules or are_params):
        kinds = sorted({type(x).__name__ for x in items})
        raise ValueError(
            f"FullyShardedDataParallel: `{arg}` must hold "
            + ("all nn.Parameters or all nn.Modules" if arg == "ignored_states" else "nn.Modules")
            + f", got {kinds}"
        )
    if not items:
        return NOTHING_IGNORED
    # every module inside `module`: its plain path and the nearest inner wrapper above it
    where: dict[int, tuple[str, Any]] = {}
    stack: list[tuple[nn.Module, str, Any]] = [(module, "", None)]
    while stack:
        m, path, above = stack.pop()
        if id(m) in where:
            continue
        where[id(m)] = (plain_name(path), above)
        below = m if m is not module and is_wrapper(m) else above
        stack.extend((c, f"{path}.{n}" if path else n, below) for n, c in m._modules.items() if c is not None)
    roots = [x for x in items if isinstance(x, nn.Module)] if are_modules else []
    kept_roots = [r for r in roots if not _ignored_by_inner(r, module, where, is_wrapper, arg)]
    params = [x for x in items if isinstance(x, nn.Parameter)] if are_params else []
    held: dict[int, tuple[nn.Module, str]] = {}
    for m in module.modules():
        for n, p in m._parameters.items():
            if p is not None:
                held.setdefault(id(p), (m, n))
    kept_params = []
    for p in params:
        if id(p) not in held:
            raise ValueError(
                f"FullyShardedDataParallel: `ignored_states` holds a parameter of shape {tuple(p.shape)} that is not "
                "a parameter of the wrapped module (or an inner wrapper already manages it); ignore only parameters "
                "of the module, and pass them to the inner wrapper when it is built"
            )
        m, n = held[id(p)]
        path, above = where[id(m)]
        if is_wrapper(m):
            raise ValueError(
                f"FullyShardedDataParallel: `ignored_states` holds the flat parameter {n!r} of the wrapper at "
                f"{path or '<the wrapped module>'!r}; ignore original parameters, before they are wrapped"
            )
        if above is None:
            kept_params.append(p)
    return IgnoredStates(kept_roots, kept_params, module)


def _ignored_by_inner(
    root: nn.Module,
    module: nn.Module,
    where: Mapping[int, tuple[str, Any]],
    is_wrapper: Callable[[nn.Module], bool],
    arg: str,
) -> bool:
    """Check one ignored module; True when an inner wrapper already ignores it (nothing left to do)."""
    name = f"{type(root).__name__}"
    if root is module:
        raise ValueError(
            f"FullyShardedDataParallel: `{arg}` holds the wrapped module itself ({name}); nothing would be left "
            "to shard. Do not wrap it, or ignore only some of its submodules"
        )
    if id(root) not in where:
        raise ValueError(
            f"FullyShardedDataParallel: `{arg}` holds a {name} that is not inside the wrapped module "
            f"{type(module).__name__}; ignore only submodules of the module being wrapped"
        )
    path, above = where[id(root)]
    if is_wrapper(root):
        raise ValueError(
            f"FullyShardedDataParallel: `{arg}` holds the FullyShardedDataParallel at {path!r}; a wrapper cannot be "
            "ignored. Pass the module before wrapping it (and do not wrap it), or leave it out"
        )
    inner = [where[id(m)][0] for m in root.modules() if m is not root and is_wrapper(m)]
    if inner:
        raise ValueError(
            f"FullyShardedDataParallel: the ignored module at {path!r} holds the FullyShardedDataParallel wrapper(s) "
            f"{inner}; an ignored module's parameters stay unmanaged, so it cannot hold a wrapper. Do not wrap "
            "inside an ignored module, or ignore only the modules beside the inner wrapper"
        )
    if above is None:
        return False
    if above._ignored.has_module(root):
        return True
    raise ValueError(
        f"FullyShardedDataParallel: the module at {path!r} given in `{arg}` is inside the inner wrapper at "
        f"{where[id(above)][0] or '<the wrapped module>'!r}, which already manages it; pass it in that wrapper's "
        "ignored_modules when building it"
    )


def _options_inside(options: Mapping[str, Any], ignored: IgnoredStates, module: nn.Module) -> dict[str, Any]:
    """The constructor's ``options`` for a wrapper a policy builds around ``module``: the ignored
    modules or parameters inside it (torch passes its ignored modules down too)."""
    part = ignored.inside(module)
    if part.params:
        return {**options, "ignored_modules": None, "ignored_states": list(part.params)}
    return {**options, "ignored_modules": list(part.roots) or None, "ignored_states": None}


_PRECISION_OPTIONS = ("mixed_precision", "compute_dtype", "buffer_dtype", "fp32_reduce_scatter")


def _policy_targets(
    module: nn.Module, policy: Any, ignored: IgnoredStates
) -> dict[nn.Module, dict[str, Any]] | None:
    """A torch policy object without ``__call__`` (``CustomPolicy``, a user's ``_Policy``): the
    modules under ``module`` it picks, each with the options it overrides, through torch's own
    ``_run_policy``. ``None`` for a callable policy. The root is left out: the constructor wraps it."""
    run = getattr(policy, "_run_policy", None)
    if callable(policy) or not callable(run):
        return None
    inside_ignored = {m for r in ignored.roots for m in r.modules()}
    targets = run(module, inside_ignored, {})
    return {
        m: {k: v for k, v in kw.items() if k != "auto_wrap_policy"}
        for m, kw in targets.items()
        if m is not module
    }


def own_precision_modules(
    module: nn.Module, policy: Any, mixed_precision: Any, ignored: IgnoredStates
) -> list[nn.Module]:
    """The modules under ``module`` that ``auto_wrap_policy`` wraps with a precision of their own:
    those of a ``MixedPrecision``'s ``_module_classes_to_ignore`` (batch norm), in full precision, and
    those a ``CustomPolicy`` gives precision options. Their wrappers check their parameters."""
    targets = _policy_targets(module, policy, ignored) or {}
    own = [m for m, kw in targets.items() if any(k in kw for k in _PRECISION_OPTIONS)]
    mp = from_torch_fsdp(mixed_precision)
    if isinstance(mp, MixedPrecision) and mp._module_classes_to_ignore:
        classes = tuple(set(mp._module_classes_to_ignore))
        own += [
            m
            for m in module.modules()
            if m is not module and isinstance(m, classes) and not ignored.has_module(m)
        ]
    return own


def without_own_precision(
    params: list[tuple[str, nn.Parameter]],
    module: nn.Module,
    policy: Any,
    mixed_precision: Any,
    ignored: IgnoredStates,
) -> list[tuple[str, nn.Parameter]]:
    """``params`` less those of the modules :func:`own_precision_modules` names, whose wrappers check
    them: what the constructor checks for its precision before ``policy`` wraps anything."""
    own = {
        id(p) for m in own_precision_modules(module, policy, mixed_precision, ignored) for p in m.parameters()
    }
    return [(fqn, p) for fqn, p in params if id(p) not in own]


def wrap_children_with_policy(
    module: nn.Module,
    policy: AutoWrapPolicy,
    wrapper_cls: type,
    options: Mapping[str, Any],
    ignored: IgnoredStates = NOTHING_IGNORED,
) -> None:
    """The constructor's ``auto_wrap_policy``: wrap what ``policy`` picks under ``module`` with the
    constructor's other ``options`` (torch's rule); torch's ``CustomPolicy`` may override options per
    module. Under a ``MixedPrecision``, the modules of its ``_module_classes_to_ignore`` (batch norm)
    are wrapped first, in full precision, and run in fp32 between casts of their inputs and outputs,
    as torch FSDP does. Nothing inside ``ignored`` is wrapped; each wrapper built ignores the part of
    ``ignored`` inside it."""
    targets = _policy_targets(module, policy, ignored)
    if targets is None and not callable(policy):  # before anything is wrapped
        raise TypeError(
            f"FullyShardedDataParallel: auto_wrap_policy must be callable (or a torch policy object such as "
            f"ModuleWrapPolicy or CustomPolicy), got {policy!r}"
        )
    options = {k: v for k, v in options.items() if k != "auto_wrap_policy"}
    mp = from_torch_fsdp(options.get("mixed_precision"))
    full_precision = own_precision_modules(module, None, mp, ignored)
    if isinstance(mp, MixedPrecision) and full_precision:
        classes = tuple(set(mp._module_classes_to_ignore))
        log.info(
            "FullyShardedDataParallel: modules of %s get wrappers of their own in full precision "
            "(MixedPrecision._module_classes_to_ignore)",
            sorted({type(m).__name__ for m in full_precision}),
        )
        fp32_options = {**options, "mixed_precision": None}
        wrap_children(
            module,
            transformer_auto_wrap_policy(set(classes)),
            wrapper_cls,
            lambda m: wrapper_cls(m, **_options_inside(fp32_options, ignored, m)),
            ignored,
        )
        for m in full_precision:
            _run_in_fp32(m)
    if targets is None:
        wrap_children(
            module,
            policy,
            wrapper_cls,
            lambda m: wrapper_cls(m, **_options_inside(options, ignored, m)),
            ignored,
        )
        return
    picked = targets

    def pick(module: nn.Module, recurse: bool, **_: Any) -> bool:
        return recurse or module in picked

    wrap_children(
        module,
        pick,
        wrapper_cls,
        lambda m: wrapper_cls(m, **_options_inside({**options, **picked[m]}, ignored, m)),
        ignored,
    )


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
    """torch FSDP1's methods on the wrapper class. The static ones take the outermost wrapper as ``model``."""

    fsdp_config: FSDPConfig
    _is_root: bool | None

    @property
    def _inside_another(self) -> bool:
        raise NotImplementedError

    def _lazy_init(self) -> None:
        raise NotImplementedError

    def check_is_root(self) -> bool:
        """torch FSDP1's: whether this wrapper is the root (outermost) one. Before the first forward
        the outermost wrapper becomes the root here, as the first forward would make it (collective
        then: the ranks compare their wrapper trees)."""
        if self._is_root is None and not self._inside_another:
            self._lazy_init()
        return bool(self._is_root)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch FSDP1's gradient communication hook: not supported."""
        raise NotImplementedError(
            "FullyShardedDataParallel.register_comm_hook is not supported: gradients are reduced by this library's "
            "own reduce-scatter (all-reduce under NO_SHARD). For communication in lower precision pass "
            "mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16); to change how gradients are averaged use "
            "set_gradient_divide_factors"
        )

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
    @collective("full_optim_state_dict()", agreed=("rank0_only",), owner="model")
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
    @collective("scatter_full_optim_state_dict()", owner="model")
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
    @collective("optim_state_dict_to_load()", owner="model")
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

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: Any,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Re-key a full optimizer state dict between parameter names (``OptimStateKeyType.PARAM_NAME``:
        the form :meth:`full_optim_state_dict` returns) and parameter ids (``PARAM_ID``: positions in
        ``optim``'s parameter groups, else in ``model.parameters()``: what a plain optimizer's
        ``state_dict()`` holds). ``model`` is the unwrapped model (or one wrapped with
        ``use_orig_params=True``). A dict already keyed so is returned as it is. Not collective."""
        _refuse(optim_input=optim_input)
        kind = getattr(optim_state_key_type, "name", optim_state_key_type)
        if kind not in ("PARAM_NAME", "PARAM_ID"):
            raise ValueError(
                "FullyShardedDataParallel.rekey_optim_state_dict: optim_state_key_type must be "
                f"OptimStateKeyType.PARAM_NAME or OptimStateKeyType.PARAM_ID, got {optim_state_key_type!r}"
            )
        if any(
            isinstance(w, TorchFSDPMethods) and w.fsdp_config.sharding.flatten_parameters
            for w in model.modules()
        ):
            raise ValueError(
                "FullyShardedDataParallel.rekey_optim_state_dict: the model holds flattened parameters, whose ids "
                "name no original parameter. Pass the unwrapped model (or one wrapped with use_orig_params=True); "
                "to load a full optimizer state dict into the wrapped model use shard_full_optim_state_dict"
            )
        name_of: dict[int, str] = {}
        for name, p in model.named_parameters():  # a tied parameter goes by its first name
            name_of.setdefault(id(p), plain_name(name).replace(CHECKPOINT_WRAPPED + ".", ""))
        params = (
            [p for g in optim.param_groups for p in g["params"]]
            if optim is not None
            else list(model.parameters())
        )
        strangers = sum(id(p) not in name_of for p in params)
        if strangers:
            raise ValueError(
                f"FullyShardedDataParallel.rekey_optim_state_dict: {strangers} of the optimizer's parameters are not "
                "parameters of `model`; pass the model the optimizer was built over"
            )
        names = [name_of[id(p)] for p in params]
        groups = optim_state_dict["param_groups"]
        keys = [k for g in groups for k in g["params"]]
        if kind == "PARAM_NAME":
            if all(isinstance(k, str) for k in keys):
                return optim_state_dict
            table: Mapping[Any, Any] = dict(enumerate(names))
        else:
            if all(isinstance(k, int) for k in keys):
                return optim_state_dict
            table = {n: i for i, n in enumerate(names)}
        unknown = [k for k in [*keys, *optim_state_dict["state"]] if k not in table]
        if unknown:
            raise ValueError(
                f"FullyShardedDataParallel.rekey_optim_state_dict: keys {unknown[:4]} name no parameter of the model "
                f"(it has {len(names)}, e.g. {names[:3]}); the state dict and the model must come from the same "
                "architecture"
            )
        extras = {k: v for k, v in optim_state_dict.items() if k not in ("state", "param_groups")}
        return {
            **extras,
            "state": {table[k]: v for k, v in optim_state_dict["state"].items()},
            "param_groups": [{**g, "params": [table[k] for k in g["params"]]} for g in groups],
        }

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """torch FSDP1's deprecated reader of its ``ShardedTensor`` optimizer state: not supported."""
        raise NotImplementedError(
            "FullyShardedDataParallel.flatten_sharded_optim_state_dict (deprecated in torch) is not supported. Load "
            "a sharded optimizer state with FullyShardedDataParallel.optim_state_dict_to_load(model, optim, osd) under "
            "StateDictType.SHARDED_STATE_DICT, or model.load_sharded_optim_state_dict(optim, osd)"
        )


def _refuse(**given: Any) -> None:
    """torch's arguments this library does not take, refused unless left at their defaults."""
    for name, value in given.items():
        if value is not None:
            raise NotImplementedError(
                f"FullyShardedDataParallel: `{name}` is not supported; leave it unset (the optimizer's own param "
                "groups are used)"
            )
