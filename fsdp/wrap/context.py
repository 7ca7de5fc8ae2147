"""The wrapping context: ``enable_wrap`` / ``wrap`` / ``auto_wrap`` / ``wrap_children``, fairscale 0.4.13's semantics.

``enable_wrap(wrapper_cls=FSDP, **kwargs)`` opens a context; inside it ``wrap(m)`` returns
``FSDP(m, **kwargs)`` and ``auto_wrap(m, policy)`` walks ``m`` and wraps the submodules the policy
picks (the policies and how they are called: ``policies.py``). Never imports the wrapper.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from fsdp.core.flat_param import NOTHING_IGNORED, IgnoredStates
from fsdp.wrap.policies import AutoWrapPolicy, WrapperCls, default_auto_wrap_policy, is_torch_style

__all__ = ["auto_wrap", "enable_wrap", "wrap", "wrap_children"]


@dataclasses.dataclass(frozen=True)
class _WrapContext:
    """What ``enable_wrap`` set up; at most one is active at a time."""

    wrapper_cls: WrapperCls  # called as wrapper_cls(module, **kwargs)
    kwargs: dict[str, Any]  # passed to every wrapper built inside the context
    auto_wrap_policy: AutoWrapPolicy  # auto_wrap's policy when none is passed to it
    move_module_cuda_half: bool  # fairscale's flag: wrap() moves the module to CUDA fp16 first
    # a torch-style policy given to enable_wrap: wrap() passes it on to the wrapper
    wrap_policy: AutoWrapPolicy | None = None


_context: _WrapContext | None = None  # the active enable_wrap context, process-wide as in fairscale


@contextlib.contextmanager
def enable_wrap(auto_wrap_policy: AutoWrapPolicy | None = None, **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside this context, :func:`wrap` and :func:`auto_wrap` wrap with ``wrapper_cls``.

    Usage::

        with enable_wrap(wrapper_cls=FSDP, mixed_precision=True):
            model = Net()  # whose __init__ does self.fc = wrap(nn.Linear(...)): sharded when built
            model = auto_wrap(model, transformer_auto_wrap_policy({Block}))
        model = FSDP(model)  # the root

    Args:
        auto_wrap_policy: the policy :func:`auto_wrap` uses when it is given none
            (default: :func:`default_auto_wrap_policy`). :func:`wrap` passes it on to the wrapper
            only when it is written in torch FSDP1's style (:func:`is_torch_style`), as torch does.
        wrapper_kwargs: must hold ``wrapper_cls``; the rest are passed to every wrapper built
            inside the context. ``move_module_cuda_half=True`` (fairscale's flag) makes
            :func:`wrap` move each module to CUDA in fp16 before wrapping it.

    Raises:
        TypeError: ``wrapper_cls`` is missing or not callable.
        NotImplementedError: another ``enable_wrap`` context is already active (as fairscale).
    """
    global _context
    if _context is not None:
        raise NotImplementedError(
            "enable_wrap contexts cannot be nested; pass per-module options to wrap(module, **overrides) "
            "or auto_wrap(module, policy, **overrides) inside the one context instead"
        )
    kwargs = dict(wrapper_kwargs)
    wrapper_cls = kwargs.pop("wrapper_cls", None)
    if wrapper_cls is None or not callable(wrapper_cls):
        raise TypeError(
            f"enable_wrap needs wrapper_cls=<the wrapper class>, e.g. enable_wrap(wrapper_cls=FSDP); "
            f"got {wrapper_cls!r}"
        )
    move_module_cuda_half = bool(kwargs.pop("move_module_cuda_half", False))
    policy = default_auto_wrap_policy if auto_wrap_policy is None else auto_wrap_policy
    passed_on = (
        auto_wrap_policy if auto_wrap_policy is not None and is_torch_style(auto_wrap_policy) else None
    )
    _context = _WrapContext(wrapper_cls, kwargs, policy, move_module_cuda_half, passed_on)
    try:
        yield
    finally:
        _context = None


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` if inside :func:`enable_wrap`; otherwise return it unchanged.

    The wrapper's kwargs merge three sources, later ones winning: the ``enable_wrap`` kwargs, the
    module's ``wrapper_config`` dict (if it has one), and ``wrap_overrides``. ``wrapper_cls`` may be
    overridden the same way. The module is wrapped even if it already is a wrapper (as fairscale);
    only :func:`auto_wrap` skips wrapped modules. The context's policy is :func:`auto_wrap`'s
    (fairscale's rule), unless it is written in torch FSDP1's style (:func:`is_torch_style`): then,
    as torch's ``wrap`` does, it is passed on as the wrapper's ``auto_wrap_policy``.
    """
    ctx = _context
    if ctx is None:
        return module
    if ctx.wrap_policy is not None:
        wrap_overrides = {"auto_wrap_policy": ctx.wrap_policy, **wrap_overrides}
    return _wrap(ctx, module, wrap_overrides)


def _wrap(ctx: _WrapContext, module: nn.Module, wrap_overrides: dict[str, Any]) -> nn.Module:
    module_config = getattr(module, "wrapper_config", None)
    if module_config is not None and not isinstance(module_config, dict):
        raise TypeError(
            f"{type(module).__name__}.wrapper_config must be a dict of wrapper kwargs, "
            f"got {type(module_config).__name__}"
        )
    kwargs = {**ctx.kwargs, **(module_config or {}), **wrap_overrides}
    wrapper_cls: WrapperCls = kwargs.pop("wrapper_cls", ctx.wrapper_cls)
    if ctx.move_module_cuda_half:
        module = module.cuda().half()
    return wrapper_cls(module, **kwargs)


def auto_wrap(module: nn.Module, auto_wrap_policy: AutoWrapPolicy | None = None, **kwargs: Any) -> nn.Module:
    """Inside :func:`enable_wrap`, wrap the submodules of ``module`` (and ``module`` itself) that the
    policy picks, innermost first; outside it, return ``module`` unchanged.

    Children are replaced in place (``setattr`` on their parent); the return value is ``module``,
    or its wrapper if the policy wrapped the root too. Modules that already are instances of the
    wrapper class are left as they are and their parameters count as wrapped, so ``auto_wrap`` may
    be applied again after wrapping some modules by hand (fairscale refuses that).

    Args:
        module: the root of the tree to wrap.
        auto_wrap_policy: decides what to descend into and what to wrap (see the module
            docstring); default: the ``enable_wrap`` context's policy.
        kwargs: wrapper kwargs for the wrappers built here, over the context's (as :func:`wrap`).

    Tied parameters must end up in one wrapper: pick a policy that wraps their common ancestor.
    """
    ctx = _context
    if ctx is None:
        return module
    policy = ctx.auto_wrap_policy if auto_wrap_policy is None else auto_wrap_policy
    wrapper_types = tuple(
        cls for cls in (ctx.wrapper_cls, kwargs.get("wrapper_cls")) if isinstance(cls, type)
    )
    walker = _Walker(_policy_caller(policy), wrapper_types, lambda m: _wrap(ctx, m, kwargs))
    wrapped, _ = walker.visit(module, module_is_root=True)
    return wrapped


def wrap_children(
    module: nn.Module,
    auto_wrap_policy: AutoWrapPolicy,
    wrapper_cls: type,
    make: Callable[[nn.Module], nn.Module],
    ignored: IgnoredStates = NOTHING_IGNORED,
) -> None:
    """Wrap the submodules of ``module`` that the policy picks with ``make(m)`` (a ``wrapper_cls``),
    in place, innermost first; never ``module`` itself. Needs no :func:`enable_wrap` context.

    This is torch FSDP's constructor argument ``auto_wrap_policy``: the constructor calls it before
    wrapping ``module`` itself. Instances of ``wrapper_cls`` are left as they are. A module's
    ``wrapper_config`` is not read here (it belongs to :func:`wrap`). ``ignored`` is left alone: an
    ignored module is neither entered nor wrapped, and ignored parameters do not count towards a
    module's size (torch FSDP1's rule for ``ignored_modules``).
    """
    walker = _Walker(_policy_caller(auto_wrap_policy), (wrapper_cls,), make, ignored)
    walker.visit(module, module_is_root=True, wrap_root=False)


_PolicyCall = Callable[[nn.Module, bool, int, bool], bool]  # (module, recurse, unwrapped, is_root)


def _policy_caller(policy: AutoWrapPolicy) -> _PolicyCall:
    """Adapt ``policy`` to one calling convention: fairscale's, or torch FSDP1's ``nonwrapped_numel``."""
    if not callable(policy):
        raise TypeError(
            f"auto_wrap_policy must be callable, got {policy!r}"
            + (
                "; a CustomPolicy is for the constructor: FullyShardedDataParallel(model, auto_wrap_policy=policy)"
                if hasattr(policy, "_run_policy")
                else ""
            )
        )
    try:
        names = set(inspect.signature(policy).parameters)
    except (TypeError, ValueError):  # no inspectable signature: assume fairscale's convention
        names = set()
    if "nonwrapped_numel" in names and "unwrapped_params" not in names:

        def call_torch_style(module: nn.Module, recurse: bool, unwrapped: int, is_root: bool) -> bool:
            return bool(policy(module=module, recurse=recurse, nonwrapped_numel=unwrapped))

        return call_torch_style

    def call(module: nn.Module, recurse: bool, unwrapped: int, is_root: bool) -> bool:
        return bool(
            policy(module=module, recurse=recurse, unwrapped_params=unwrapped, module_is_root=is_root)
        )

    return call


class _Walker:
    """One bottom-up pass of :func:`auto_wrap` over a module tree."""

    policy: _PolicyCall
    wrapper_types: tuple[type, ...]  # instances of these are already wrapped: never entered
    make: Callable[[nn.Module], nn.Module]  # builds the wrapper of a module the policy picked
    ignored: IgnoredStates  # never entered nor wrapped, not counted (the constructor's ignored_modules)

    def __init__(
        self,
        policy: _PolicyCall,
        wrapper_types: tuple[type, ...],
        make: Callable[[nn.Module], nn.Module],
        ignored: IgnoredStates = NOTHING_IGNORED,
    ) -> None:
        self.policy, self.wrapper_types, self.make, self.ignored = policy, wrapper_types, make, ignored

    def visit(self, module: nn.Module, module_is_root: bool, wrap_root: bool = True) -> tuple[nn.Module, int]:
        """Wrap what the policy picks under (and including, unless not ``wrap_root``) ``module``.

        Returns the module (or its wrapper) and how many parameter elements this call wrapped.
        """
        if isinstance(module, self.wrapper_types) or self.ignored.has_module(module):
            return module, 0
        unwrapped = self.unwrapped_numel(module)
        if not self.policy(module, True, unwrapped, module_is_root):
            return module, 0
        wrapped = 0
        for name, child in list(module.named_children()):
            new_child, numel = self.visit(child, module_is_root=False)
            if new_child is not child:
                setattr(module, name, new_child)
            wrapped += numel
        if wrap_root and self.policy(module, False, unwrapped - wrapped, module_is_root):
            return self.make(module), unwrapped
        return module, wrapped

    def unwrapped_numel(self, module: nn.Module) -> int:
        """Elements of the distinct parameters under ``module`` that no existing wrapper owns and
        that are not ignored."""
        seen_params: set[int] = set()
        seen_modules: set[int] = set()
        total = 0
        stack = [module]
        while stack:
            m = stack.pop()
            if id(m) in seen_modules:
                continue
            seen_modules.add(id(m))
            for name, p in m._parameters.items():
                if p is not None and id(p) not in seen_params and not self.ignored.has_param(m, name):
                    seen_params.add(id(p))
                    total += p.numel()
            stack.extend(
                c
                for c in m.children()
                if not isinstance(c, self.wrapper_types) and not self.ignored.has_module(c)
            )
        return total
