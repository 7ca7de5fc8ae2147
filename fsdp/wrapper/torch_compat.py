"""torch FSDP1's spellings at the wrapper's construction: its option objects and constructor arguments.

Code written for ``torch.distributed.fsdp.FullyShardedDataParallel`` runs after changing the import
of the wrapper alone: torch's own option objects are converted to ours
(:func:`~fsdp.api.from_torch_fsdp`), ``device_id`` names the compute device, ``ignored_modules`` /
``ignored_states`` and ``auto_wrap_policy`` follow torch's rules, and a wrapper built torch's way
shows torch's option objects as its attributes (:func:`torch_options_of`). The static whole-model
methods are in ``fsdp/wrapper/torch_methods.py``. What cannot be honoured is refused with an error that
says so.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from fsdp.api import BackwardPrefetch, MixedPrecision, TorchOptions, from_torch_fsdp
from fsdp.comm.consistency import plain_name
from fsdp.comm.topology import checked_device
from fsdp.common.nest import visit_tensors
from fsdp.core.flat_param import NOTHING_IGNORED, IgnoredStates
from fsdp.core.wrapper_protocol import Wrapper, as_module
from fsdp.wrap.context import wrap_children
from fsdp.wrap.policies import AutoWrapPolicy, transformer_auto_wrap_policy
from fsdp.wrapper.mixed_precision import cast_inputs

__all__ = [
    "FULL_PREC_IN_EVAL",
    "adopt_attached",
    "adopt_torch_optimizer_in_backward",
    "check_full_prec_in_eval",
    "own_precision_modules",
    "resolve_ignored",
    "torch_fsdp_options",
    "torch_options_of",
    "without_own_precision",
    "wrap_children_with_policy",
]


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


FULL_PREC_IN_EVAL = "FSDP_USE_FULL_PREC_IN_EVAL"  # torch FSDP1's environment variable


_TORCH_ONLY_DEFAULTS = {  # torch-only constructor arguments and the default that says "not given"
    "sharding_strategy": None,
    "param_init_fn": None,
    "backward_prefetch": True,
    "forward_prefetch": None,
    "limit_all_gathers": True,
    "auto_wrap_policy": None,
    "sync_module_states": False,
    "device_id": None,
    "use_orig_params": False,
    "ignored_modules": None,
    "ignored_states": None,
}


def torch_options_of(options: Mapping[str, Any], by_torch_policy: bool = False) -> TorchOptions:
    """The :class:`~fsdp.api.TorchOptions` of a constructor call (``options``: its arguments as given).

    A wrapper is built torch FSDP1's way when it was given a torch option object (``MixedPrecision``,
    ``CPUOffload``, ``BackwardPrefetch``), ``None`` (or anything but a bool) where fairscale takes a
    bool, or any argument fairscale does not have at other than its default (``limit_all_gathers=False``
    included), or when the ``auto_wrap_policy`` of a constructor call built it (``by_torch_policy``:
    torch's way of wrapping, whose wrappers are torch's like their root). Otherwise fairscale's way."""
    mp = from_torch_fsdp(options.get("mixed_precision", False))
    offload = from_torch_fsdp(options.get("cpu_offload", False))
    torch_style = (
        by_torch_policy
        or not isinstance(mp, bool)
        or not isinstance(offload, bool)
        or any(options.get(k, default) is not default for k, default in _TORCH_ONLY_DEFAULTS.items())
    )
    return TorchOptions(
        torch_style=torch_style,
        mixed_precision=mp,
        cpu_offload=offload,
        full_prec_in_eval=os.environ.get(FULL_PREC_IN_EVAL, "") == "1",
    )


def full_precision_in_eval(options: TorchOptions, mixed: bool, training: bool) -> bool:
    """Whether a forward, and the backward of its outputs, run in full precision under
    ``FSDP_USE_FULL_PREC_IN_EVAL=1`` (torch's switch): in eval mode under mixed precision, with or
    without gradients. The inputs are then left as they are, the fp32 master shards are gathered,
    and the owned buffers are in their own dtypes (:func:`~fsdp.wrapper.mixed_precision.buffers_for_mode`)."""
    return options.full_prec_in_eval and mixed and not training


def check_full_prec_in_eval(wrappers: Sequence[Wrapper]) -> None:
    """torch's rule: ``FSDP_USE_FULL_PREC_IN_EVAL`` (read when each wrapper is built) is one value for
    the whole tree; a tree built partly with it and partly without is refused at the root's lazy init."""
    with_it = [w for w in wrappers if w._torch_options.full_prec_in_eval]
    if with_it and len(with_it) != len(wrappers):
        raise ValueError(
            f"FullyShardedDataParallel: {FULL_PREC_IN_EVAL}=1 was set when {len(with_it)} of the {len(wrappers)} "
            "wrappers of this model were built and not for the others (torch expects one value for the tree); set "
            "it before building the first wrapper"
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
    [Note: ignored modules] in fsdp/core/flat_param.py.

    ``ignored_states`` holds parameters or modules, not both; the two arguments exclude each other.
    As in torch, modules and parameters outside ``module`` are passed over silently (a module given
    so and attached inside ``module`` after wrapping is ignored there: torch's skip idiom), as are
    parameters that a wrapper already flattened; an ignored module may hold wrappers (they stay
    managed, the rest of it is ignored). A wrapper, and ``module`` itself, cannot be ignored. What
    an inner wrapper already ignores may be given again."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(  # (torch's first sentence, which its tests match)
            "FullyShardedDataParallel: Cannot pass both ignored_modules and ignored_states at the same time; pass "
            "either ignored_modules or ignored_states, not both (ignored_states takes modules too)"
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
            f"FullyShardedDataParallel: `{arg}` should be an iterable of `torch.nn.Module`s"
            f"{' or of nn.Parameters' if arg == 'ignored_states' else ''} but got {type(given)}; pass a list"
        ) from None
    are_modules = all(isinstance(x, nn.Module) for x in items)
    are_params = arg == "ignored_states" and all(isinstance(x, nn.Parameter) for x in items)
    if not (are_modules or are_params):
        kinds = sorted(
            {type(x) for x in items}, key=repr
        )  # (torch's wording and order, which its tests match)
        if arg == "ignored_states":
            raise ValueError(
                "FullyShardedDataParallel: ignored_states expects all nn.Parameter or all nn.Module list elements "
                f"but got types {kinds}; pass all nn.Parameters or all nn.Modules"
            )
        raise ValueError(
            f"FullyShardedDataParallel: ignored_modules expects nn.Module list elements but got types {kinds}; "
            "pass nn.Modules there (parameters go in ignored_states)"
        )
    if not items:
        return NOTHING_IGNORED
    # every module inside `module`: its plain path and the nearest inner wrapper above it
    where: dict[int, tuple[str, Wrapper | None]] = {}
    stack: list[tuple[nn.Module, str, Wrapper | None]] = [(module, "", None)]
    while stack:
        m, path, above = stack.pop()
        if id(m) in where:
            continue
        where[id(m)] = (plain_name(path), above)
        below = cast(Wrapper, m) if m is not module and is_wrapper(m) else above
        stack.extend((c, f"{path}.{n}" if path else n, below) for n, c in m._modules.items() if c is not None)
    roots = [x for x in items if isinstance(x, nn.Module)] if are_modules else []
    outside = [r for r in roots if id(r) not in where and not is_wrapper(r)]  # (torch: passed over)
    kept_roots = [
        r for r in roots if r not in outside and not _ignored_by_inner(r, module, where, is_wrapper, arg)
    ]
    params = [x for x in items if isinstance(x, nn.Parameter)] if are_params else []
    held: dict[int, tuple[nn.Module, str]] = {}
    for m in module.modules():
        for n, p in m._parameters.items():
            if p is not None:
                held.setdefault(id(p), (m, n))
    kept_params = []
    for p in params:  # (outside the module, or flattened by a wrapper already: passed over, as torch does)
        if id(p) in held and not is_wrapper(held[id(p)][0]) and where[id(held[id(p)][0])][1] is None:
            kept_params.append(p)
    return IgnoredStates(kept_roots, kept_params, module, detached=outside)


def _ignored_by_inner(
    root: nn.Module,
    module: nn.Module,
    where: Mapping[int, tuple[str, Wrapper | None]],
    is_wrapper: Callable[[nn.Module], bool],
    arg: str,
) -> bool:
    """Check one ignored module; True when an inner wrapper already ignores it (nothing left to do)."""
    name = f"{type(root).__name__}"
    if root is module:  # (torch's reading: warned, and every parameter of the module is left alone)
        warnings.warn(  # (torch's first sentence, which its tests match)
            "FullyShardedDataParallel: Trying to ignore the top-level module passed into the FSDP constructor "
            f"itself will result in all parameters being ignored: `{arg}` holds the wrapped module itself ({name}), "
            "none of its parameters is sharded and the wrapper only passes calls through. Do not wrap the module, "
            "or ignore only some of its submodules",
            UserWarning,
            stacklevel=6,  # (the user's call of the constructor)
        )
        return False
    path, above = where.get(id(root), ("<outside the wrapped module>", None))
    if is_wrapper(root):
        raise ValueError(
            f"FullyShardedDataParallel: `{arg}` should not include FSDP modules, but holds the "
            f"FullyShardedDataParallel at {path!r}; a wrapper cannot be ignored. Pass the module before wrapping it "
            "(and do not wrap it), or leave it out"
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


def adopt_attached(
    ignored: IgnoredStates, found: list[tuple[str, nn.Module]], module: nn.Module, where: str
) -> IgnoredStates:
    """``ignored`` with ``found`` (modules attached inside ``module`` after wrapping, see
    :func:`~fsdp.core.flat_param.attached_after_wrapping`) ignored too: torch FSDP1 leaves such a module's
    parameters alone, and so does this library. Warned unless the module was given in
    ``ignored_modules`` at construction (while it was detached)."""
    unexpected = [path for path, m in found if m not in ignored.detached]
    if unexpected:
        warnings.warn(
            f"FullyShardedDataParallel: module(s) {unexpected} were attached inside the wrapper at {where!r} after "
            "wrapping; no wrapper manages their parameters, which each rank trains on its own gradients (as torch "
            "FSDP does). Pass them in ignored_modules= when wrapping to say so and silence this warning, or attach "
            "them before wrapping to have them sharded",
            stacklevel=3,
        )
    return ignored.with_attached([m for _, m in found], module)


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
    are wrapped first, in full precision (with the other arguments a ``CustomPolicy`` gives them), and
    run in fp32 between casts of their inputs and outputs, as torch FSDP does. Nothing inside ``ignored`` is wrapped; each wrapper built ignores the part of
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
        warnings.warn(  # (torch warns here too; its second sentence kept, which filters may match)
            f"FullyShardedDataParallel: mixed precision with an auto_wrap_policy, over modules of "
            f"{sorted({type(m).__name__ for m in full_precision})} (MixedPrecision._module_classes_to_ignore). "
            "These modules will be wrapped as separate FSDP instances with mixed precision disabled; pass "
            "_module_classes_to_ignore=() to keep them in their units' precision",
            UserWarning,
            stacklevel=3,
        )
        # a CustomPolicy's own arguments for such a module apply too, in full precision (torch's rule)
        overrides = targets or {}
        wrap_children(
            module,
            transformer_auto_wrap_policy(set(classes)),
            wrapper_cls,
            lambda m: _built_by_policy(
                wrapper_cls,
                m,
                _options_inside({**options, **overrides.get(m, {}), "mixed_precision": None}, ignored, m),
            ),
            ignored,
        )
        for m in full_precision:
            _run_in_fp32(m)
    if targets is None:
        wrap_children(
            module,
            policy,
            wrapper_cls,
            lambda m: _built_by_policy(wrapper_cls, m, _options_inside(options, ignored, m)),
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
        lambda m: _built_by_policy(wrapper_cls, m, _options_inside({**options, **picked[m]}, ignored, m)),
        ignored,
    )


def _built_by_policy(wrapper_cls: type, module: nn.Module, options: Mapping[str, Any]) -> nn.Module:
    """A wrapper that the constructor's ``auto_wrap_policy`` builds around ``module``, with ``options``:
    built torch's way, like its root (see :func:`torch_options_of`)."""
    wrapper: Wrapper = wrapper_cls(module, **options)
    wrapper._torch_options = torch_options_of(options, by_torch_policy=True)
    return as_module(wrapper)


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


def adopt_torch_optimizer_in_backward(wrappers: Sequence[Any]) -> None:
    """Step, in backward, the flat parameters torch's private ``_apply_optimizer_in_backward`` was
    applied to (torchrec's optimizer in backward), as torch FSDP1 does under ``use_orig_params=True``:
    each parameter's ``_in_backward_optimizers`` step as soon as its gradient is reduced onto the
    shard, then ``.grad`` is set to None. Run at the root's forward. See [Note: torch's optimizer in
    backward]."""
    for w in wrappers:
        for h in w.handles:
            if not hasattr(h.flat_param, "_in_backward_optimizers") or h.on_reduced is _step_torch_optimizers:
                continue
            if w.fsdp_config.sharding.flatten_parameters:
                raise RuntimeError(
                    "FullyShardedDataParallel: torch's private _apply_optimizer_in_backward was applied to the "
                    f"parameters of {w._path or '<root>'!r}. Optimizer in backward is only supported with "
                    "use_orig_params=True (or flatten_parameters=False), as in torch FSDP: a flat parameter holds "
                    "many original parameters, and each needs its own optimizer. Pass use_orig_params=True, or "
                    "use fsdp.optimizer_in_backward(model, optimizer_class, **optimizer_kwargs), which steps "
                    "each unit's flat shard as soon as its gradient is reduced"
                )
            if h.on_reduced is not None:
                raise RuntimeError(
                    "FullyShardedDataParallel: the parameters of "
                    f"{w._path or '<root>'!r} step in backward twice: through fsdp.optimizer_in_backward and "
                    "torch's _apply_optimizer_in_backward. Use one of them (call .detach_() on the optimizer "
                    "fsdp.optimizer_in_backward returned to stop it)"
                )
            _forget_autograd_node(h.flat_param)
            h.on_reduced = _step_torch_optimizers


# [Note: torch's optimizer in backward]
# torch's _apply_optimizer_in_backward(optimizer_class, params, kwargs, register_hook) gives each
# parameter a list of optimizers over it alone (``_in_backward_optimizers``) and keeps the
# parameter's AccumulateGrad node alive in a module-level map, with a hook on it unless
# register_hook=False. On a wrapper's flat parameter that node was made when the parameter was the
# 1-D shard; in forward the flat parameter becomes the full one, and autograd would hand the full
# gradient to the shard-shaped node ("returned an invalid gradient"). torch FSDP1 runs the optimizers
# itself after the reduce-scatter and ignores the hook (its original parameters are not leaves in
# forward); so here: the node is dropped from torch's map at the root's first forward (autograd makes
# a new one, shaped as the parameter is then), and the handle's ``on_reduced`` (the hook
# fsdp.optimizer_in_backward uses) steps the parameter's optimizers once its reduced gradient is on
# the shard (at the end of backward for a unit that keeps its full parameter through it). Only with
# one original parameter per flat parameter (use_orig_params=True / flatten_parameters=False): a
# flat parameter of many originals would need each one's optimizer over a slice, torch refuses it
# too ("only supported with use_orig_params=True").
def _forget_autograd_node(param: torch.Tensor) -> None:
    """Drop torch's kept AccumulateGrad node (and with it the hook) of ``param``."""
    try:
        from torch.distributed.optim import apply_optimizer_in_backward as torch_aoib
    except ImportError:  # pragma: no cover (present in every supported torch)
        return
    for kept in (torch_aoib.param_to_acc_grad_map, torch_aoib.param_to_optim_hook_handle_map):
        if param in kept:
            del kept[param]


def _step_torch_optimizers(handle: Any) -> None:
    """``on_reduced`` of a handle whose flat parameter carries torch's ``_in_backward_optimizers``: step
    them once the reduced gradient is on the shard, then free the gradient."""
    p = handle.flat_param
    if not handle.reduced_onto_shard():
        return  # (none, or the full parameter still shown: called again at the end of backward)
    with torch.no_grad():
        for optimizer in p._in_backward_optimizers:
            optimizer.step()
    p.grad = None
