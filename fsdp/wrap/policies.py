"""Wrapping policies: ``enable_wrap`` / ``wrap`` / ``auto_wrap``, with fairscale 0.4.13's semantics.

This module never imports the FSDP wrapper: the class to wrap with is passed in as ``wrapper_cls``
(any callable ``wrapper_cls(module, **kwargs) -> nn.Module``), so it works for any wrapper.

``enable_wrap(wrapper_cls=FSDP, **kwargs)`` opens a context; inside it ``wrap(m)`` returns
``FSDP(m, **kwargs)`` and ``auto_wrap(m, policy)`` walks ``m`` and wraps the submodules the policy
picks. Outside it both return ``m`` unchanged, so a model that calls ``wrap`` in its ``__init__``
builds plainly or sharded without code changes.

A policy is called with keyword arguments only::

    policy(module=m, recurse=True,  unwrapped_params=n, module_is_root=r)  # descend into m?
    policy(module=m, recurse=False, unwrapped_params=n, module_is_root=r)  # wrap m itself?

``unwrapped_params`` counts the elements of ``m``'s parameters that no wrapper owns yet: for the
``recurse=True`` call all of them (minus those under already-wrapped submodules), for the
``recurse=False`` call what is left after ``m``'s children were wrapped. A worked example with
``default_auto_wrap_policy`` and ``min_num_params=100``::

    Sequential(                      recurse: 226 >= 100 -> descend; wrap: remainder 6 < 100 -> no
      (0) Linear(10, 10)   110       recurse: 110 >= 100 -> descend (no children); wrap: 110 -> yes
      (1) Linear(10, 10)   110       wrapped likewise
      (2) Linear(2, 2)       6       recurse: 6 < 100 -> skipped, left to its parent
    )

Policies written for torch FSDP1 (``policy(module, recurse, nonwrapped_numel)``, e.g.
``functools.partial(torch.distributed.fsdp.wrap.size_based_auto_wrap_policy, min_num_params=...)``)
are recognized by their ``nonwrapped_numel`` parameter and called that way. This module also has
torch FSDP1's policies under their names, in torch's calling style (``functools.partial(
transformer_auto_wrap_policy, transformer_layer_cls={Block})``, :func:`size_based_auto_wrap_policy`,
:func:`always_wrap_policy`, :class:`ModuleWrapPolicy`, :class:`CustomPolicy`), so that
``torch.distributed.fsdp.wrap`` imports change to ``fsdp.wrap.policies``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from fsdp.core.flat_param import NOTHING_IGNORED, IgnoredStates

__all__ = [
    "AutoWrapPolicy",
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "auto_wrap",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "is_torch_style",
    "lambda_auto_wrap_policy",
    "no_split_modules_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
    "wrap_children",
]

log = logging.getLogger(__name__)

# policy(module=..., recurse=..., unwrapped_params=..., module_is_root=...) -> bool (see module docstring)
AutoWrapPolicy = Callable[..., bool]
WrapperCls = Callable[..., nn.Module]


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


def default_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
    skip_params_check_for_root: bool = False,
) -> bool:
    """Size-based policy: wrap a module once ``unwrapped_params >= min_num_params``.

    Bind the options with ``functools.partial(default_auto_wrap_policy, min_num_params=...)``.

    Args:
        module, recurse, unwrapped_params, module_is_root: supplied by :func:`auto_wrap`.
        min_num_params: the size (in elements) from which a module is descended into and wrapped.
        force_leaf_modules: module types never descended into: neither they nor their children
            are wrapped on their own, their parameters go to the enclosing wrapper; default
            ``default_auto_wrap_policy.FORCE_LEAF_MODULES`` (``{nn.MultiheadAttention}``, whose
            forward reads its ``out_proj`` weights directly).
        exclude_wrap_modules: module types never wrapped themselves (their children still may
            be); default ``default_auto_wrap_policy.EXCLUDE_WRAP_MODULES``
            (``{nn.ModuleList, nn.ModuleDict}``, which have no forward).
        skip_params_check_for_root: wrap the root whatever its remaining size.
    """
    if force_leaf_modules is None:
        force_leaf_modules = default_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    if exclude_wrap_modules is None:
        exclude_wrap_modules = default_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    assert force_leaf_modules is not None and exclude_wrap_modules is not None
    is_large = unwrapped_params >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf_modules))
    wanted = is_large or (module_is_root and skip_params_check_for_root)
    return wanted and not isinstance(module, tuple(exclude_wrap_modules))


# The defaults live on the function, as in fairscale, so that they can be read (or extended) there.
default_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]
default_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]


def config_auto_wrap_policy(
    module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool
) -> bool:
    """Wrap exactly the modules tagged with a ``wrapper_config`` attribute (a dict of wrapper kwargs).

    Always descends, so tags anywhere in the tree are found; sizes and the root play no part.
    Tagging lets :func:`auto_wrap` place wrappers in several passes or by hand-written rules.
    """
    if recurse:
        return True
    return getattr(module, "wrapper_config", None) is not None


class _ModuleTypePolicy:
    """Wrap every instance of the given module types (descending everywhere); see
    :func:`transformer_auto_wrap_policy`."""

    module_types: tuple[type[nn.Module], ...]

    def __init__(self, module_types: tuple[type[nn.Module], ...]) -> None:
        self.module_types = module_types

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return recurse or isinstance(module, self.module_types)

    def __repr__(self) -> str:
        names = ", ".join(t.__qualname__ for t in self.module_types)
        return f"transformer_auto_wrap_policy({{{names}}})"


def _module_classes(what: str, classes: Any) -> tuple[type[nn.Module], ...]:
    """``classes`` (a class or an iterable of classes) as a tuple of ``nn.Module`` subclasses, checked."""
    found = (classes,) if isinstance(classes, type) else tuple(classes) if _iterable(classes) else (classes,)
    for cls in found:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(
                f"{what} takes nn.Module subclasses, got {cls!r}; pass the block class itself, e.g. "
                f"{what}({{Block}})"
            )
    if not found:
        raise ValueError(f"{what} needs at least one module class to wrap")
    return found


def _iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return not isinstance(value, (str, bytes, nn.Module))


def transformer_auto_wrap_policy(
    module: Any = None,
    recurse: bool | None = None,
    nonwrapped_numel: int | None = None,
    transformer_layer_cls: Any = None,
    unwrapped_params: int | None = None,
    module_is_root: bool | None = None,
) -> Any:
    """Wrap every instance of ``transformer_layer_cls`` (a class or a set of classes), in either
    calling style:

    - ours: ``transformer_auto_wrap_policy({Block})`` returns the policy;
    - torch FSDP1's: ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``
      is the policy, called as ``policy(module=m, recurse=r, nonwrapped_numel=n)`` (or with
      fairscale's ``unwrapped_params`` / ``module_is_root``): it returns whether to descend into
      (always) or wrap ``m``.

    Every module is descended into, so blocks nested at any depth are found, and a block's own
    children are wrapped too if they are instances of the listed classes. Nothing else is wrapped,
    the root included unless it is such an instance.
    """
    if isinstance(module, nn.Module):  # torch's form: a policy call
        if transformer_layer_cls is None or recurse is None:
            raise TypeError(
                "transformer_auto_wrap_policy(module, recurse, ...) needs recurse and transformer_layer_cls; bind "
                "the classes with functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})"
            )
        return _ModuleTypePolicy(_module_classes("transformer_auto_wrap_policy", transformer_layer_cls))(
            module, recurse
        )
    classes = transformer_layer_cls if module is None else module
    if classes is None:
        raise TypeError(
            "transformer_auto_wrap_policy needs the block classes: transformer_auto_wrap_policy({Block}), or "
            "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}) as torch FSDP1 writes it"
        )
    return _ModuleTypePolicy(_module_classes("transformer_auto_wrap_policy", classes))


class _LambdaPolicy:
    """Wrap the modules for which ``lambda_fn(module)`` is true (descending everywhere); see
    :func:`lambda_auto_wrap_policy`."""

    lambda_fn: Callable[[nn.Module], bool]

    def __init__(self, lambda_fn: Callable[[nn.Module], bool]) -> None:
        self.lambda_fn = lambda_fn

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return recurse or bool(self.lambda_fn(module))

    def __repr__(self) -> str:
        return f"lambda_auto_wrap_policy({self.lambda_fn!r})"


def lambda_auto_wrap_policy(
    module: Any = None,
    recurse: bool | None = None,
    nonwrapped_numel: int | None = None,
    lambda_fn: Callable[[nn.Module], bool] | None = None,
    unwrapped_params: int | None = None,
    module_is_root: bool | None = None,
) -> Any:
    """Wrap every module for which ``lambda_fn(module)`` is true, at any depth (the root only if
    ``lambda_fn`` picks it), in either calling style: ours, ``lambda_auto_wrap_policy(fn)`` returns
    the policy; torch FSDP1's, ``functools.partial(lambda_auto_wrap_policy, lambda_fn=fn)`` is it.
    Example: ``lambda_auto_wrap_policy(lambda m: isinstance(m, nn.Linear) and m.weight.numel() >= 4096)``.
    """
    if isinstance(module, nn.Module):  # torch's form: a policy call
        if lambda_fn is None or recurse is None:
            raise TypeError(
                "lambda_auto_wrap_policy(module, recurse, ...) needs recurse and lambda_fn; bind the function with "
                "functools.partial(lambda_auto_wrap_policy, lambda_fn=fn)"
            )
        return recurse or bool(lambda_fn(module))
    fn = lambda_fn if module is None else module
    if not callable(fn):
        raise TypeError(f"lambda_auto_wrap_policy takes a callable module -> bool, got {fn!r}")
    return _LambdaPolicy(fn)


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int | None = None,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
    unwrapped_params: int | None = None,
    module_is_root: bool | None = None,
) -> bool:
    """torch FSDP1's size-based policy, with its keywords and defaults (bind them with
    ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``): descend into a module
    with at least ``min_num_params`` elements no wrapper owns yet unless it is a
    ``force_leaf_modules`` type (default ``size_based_auto_wrap_policy.FORCE_LEAF_MODULES``,
    ``{nn.MultiheadAttention}``), and wrap it when what remains after its children were wrapped is at
    least as large, unless it is an ``exclude_wrap_modules`` type (default
    ``size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES``, ``{nn.ModuleList, nn.ModuleDict}``).
    fairscale's :func:`default_auto_wrap_policy` is the same rule with fairscale's signature."""
    numel = nonwrapped_numel if nonwrapped_numel is not None else unwrapped_params
    if numel is None:
        raise TypeError(
            "size_based_auto_wrap_policy needs nonwrapped_numel (the elements no wrapper owns yet)"
        )
    if force_leaf_modules is None:
        force_leaf_modules = size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    if exclude_wrap_modules is None:
        exclude_wrap_modules = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    assert force_leaf_modules is not None and exclude_wrap_modules is not None
    if recurse:
        return numel >= min_num_params and not isinstance(module, tuple(force_leaf_modules))
    return numel >= min_num_params and not isinstance(module, tuple(exclude_wrap_modules))


size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """torch FSDP1's policy that wraps every submodule (and descends everywhere)."""
    return True


class ModuleWrapPolicy:
    """torch FSDP1's ``ModuleWrapPolicy(module_classes)``: wrap every instance of these classes, with
    the constructor's arguments. The same rule as :func:`transformer_auto_wrap_policy`."""

    _module_classes: tuple[type[nn.Module], ...]

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = _module_classes("ModuleWrapPolicy", module_classes)

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return recurse or isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({{{', '.join(t.__qualname__ for t in self._module_classes)}}})"


class CustomPolicy:
    """torch FSDP1's ``CustomPolicy(lambda_fn)``, for the constructor's ``auto_wrap_policy``:
    ``lambda_fn(module)`` returns ``False`` (or ``{}``) to leave ``module`` alone, ``True`` to wrap it
    with the constructor's arguments, or a dict of arguments that override them for ``module``
    (e.g. ``{"sharding_strategy": ShardingStrategy.NO_SHARD}``). Every module is visited."""

    _lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(f"CustomPolicy takes a callable module -> bool | dict, got {lambda_fn!r}")
        self._lambda_fn = lambda_fn

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        """The modules under ``root_module`` (itself included) to wrap, each with its arguments
        (torch's method, which the constructor calls)."""
        targets: dict[nn.Module, dict[str, Any]] = {}
        for m in root_module.modules():
            if m in ignored_modules:
                continue
            picked = self._lambda_fn(m)
            if not isinstance(picked, (bool, dict)):
                raise ValueError(
                    f"CustomPolicy: lambda_fn must return True, False or a dict of wrapper arguments, got {picked!r} "
                    f"for a {type(m).__name__}"
                )
            if picked:
                targets[m] = {**root_kwargs, **(picked if isinstance(picked, dict) else {})}
        return targets

    def __repr__(self) -> str:
        return f"CustomPolicy({self._lambda_fn!r})"


_TORCH_NAMED = ("transformer_auto_wrap_policy", "lambda_auto_wrap_policy", "size_based_auto_wrap_policy")


def is_torch_style(policy: Any) -> bool:
    """Whether ``policy`` is written the way torch FSDP1 writes policies: one of torch's own, ours
    under torch's names in torch's calling style (``functools.partial(transformer_auto_wrap_policy,
    ...)``, :func:`always_wrap_policy`, :class:`ModuleWrapPolicy`, :class:`CustomPolicy`), or a
    function of ``nonwrapped_numel``. fairscale has none of these. Inside :func:`enable_wrap`, such a
    policy is passed on by :func:`wrap` to the wrapper, as torch's ``wrap`` does."""
    func = policy.func if isinstance(policy, functools.partial) else policy
    if isinstance(func, (ModuleWrapPolicy, CustomPolicy)) or func is always_wrap_policy:
        return True
    if isinstance(policy, functools.partial) and getattr(func, "__name__", "") in _TORCH_NAMED:
        return True
    if str(getattr(func, "__module__", None) or type(func).__module__).startswith("torch.distributed.fsdp"):
        return True
    try:
        names = set(inspect.signature(policy).parameters)
    except (TypeError, ValueError):
        return False
    return "nonwrapped_numel" in names and "unwrapped_params" not in names


class _ClassNamePolicy:
    """Wrap every module whose class is named (or given) in a set of blocks, except one that shares a
    parameter with a module outside it; see :func:`no_split_modules_auto_wrap_policy`."""

    names: frozenset[str]  # class names (``Block``) or qualified names (``package.module.Block``)
    classes: tuple[type[nn.Module], ...]  # classes given as such
    _tied_out: set[int]  # ids of the matching modules under the last root whose parameters are tied outside

    def __init__(self, names: frozenset[str], classes: tuple[type[nn.Module], ...]) -> None:
        self.names, self.classes = names, classes
        self._tied_out = set()

    def matches(self, module: nn.Module) -> bool:
        cls = type(module)
        return (
            cls.__name__ in self.names
            or f"{cls.__module__}.{cls.__qualname__}" in self.names
            or isinstance(module, self.classes)
        )

    def __call__(
        self, module: nn.Module, recurse: bool, unwrapped_params: int = 0, module_is_root: bool = False
    ) -> bool:
        if recurse:
            if module_is_root:  # the walk starts here: look at the whole tree once
                self._tied_out = self._check_tree(module)
            return True
        return self.matches(module) and id(module) not in self._tied_out

    def _check_tree(self, root: nn.Module) -> set[int]:
        """The matching modules whose parameters are tied to a module outside them (left to the parent's
        wrapper, which would adopt the tied parameter anyway); refuses a tree where nothing matches."""
        found = [m for m in root.modules() if self.matches(m)]
        if not found:
            wanted = sorted(self.names | {c.__qualname__ for c in self.classes})
            present = sorted({type(m).__name__ for m in root.modules()})
            raise ValueError(
                f"no_split_modules_auto_wrap_policy: no module of the classes {wanted} in "
                f"{type(root).__name__} (its classes: {present[:20]}{' ...' if len(present) > 20 else ''}); "
                "pass the names of its block classes"
            )
        uses: dict[int, int] = {}  # parameter id -> how many (module, name) pairs register it
        for m in root.modules():
            for p in m._parameters.values():
                if p is not None:
                    uses[id(p)] = uses.get(id(p), 0) + 1
        tied_out: set[int] = set()
        for m in found:
            inside: dict[int, int] = {}
            for sub in m.modules():
                for p in sub._parameters.values():
                    if p is not None:
                        inside[id(p)] = inside.get(id(p), 0) + 1
            if any(uses[pid] > n for pid, n in inside.items()):
                tied_out.add(id(m))
                log.info(
                    "no_split_modules_auto_wrap_policy: %s shares a parameter with a module outside it (tied "
                    "weights); it is not wrapped on its own, its parameters go to the enclosing wrapper",
                    type(m).__name__,
                )
        return tied_out

    def __repr__(self) -> str:
        names = sorted(self.names | {c.__qualname__ for c in self.classes})
        return f"no_split_modules_auto_wrap_policy({names})"


def no_split_modules_auto_wrap_policy(
    blocks: nn.Module | str | type[nn.Module] | Iterable[str | type[nn.Module]],
) -> AutoWrapPolicy:
    """A policy that wraps a model's blocks as the model itself declares them, by class name.

    ``blocks`` is a model, or block classes given by name (``"GPT2Block"``, or with its module:
    ``"transformers.models.gpt2.modeling_gpt2.GPT2Block"``) or as classes. From a model, the names
    are those its modules list in ``_no_split_modules`` (Hugging Face ``transformers`` models list
    their blocks there: the modules that must not be split across devices), so no import of the
    model's internals is needed::

        model = FSDP(hf_model, auto_wrap_policy=no_split_modules_auto_wrap_policy(hf_model))

    Every module is descended into; each instance of a named class is wrapped, except one that shares
    a parameter with a module outside it (tied weights, e.g. BERT's embeddings and its MLM head): that
    one is left to the enclosing wrapper, which would adopt the tied parameter anyway. Nothing else is
    wrapped, the root included unless it is such a block. A walk over a tree where no module matches
    raises ``ValueError`` naming the classes it found, so a misspelt name does not leave the whole
    model in one unit.
    """
    if isinstance(blocks, nn.Module):
        declared: set[str] = set()
        for m in blocks.modules():
            names = getattr(m, "_no_split_modules", None)
            if names:
                declared.update((names,) if isinstance(names, str) else names)
        if not declared:
            raise ValueError(
                f"no_split_modules_auto_wrap_policy: {type(blocks).__name__} declares no _no_split_modules (a "
                "list of its block class names, as Hugging Face models have); pass the block classes or their "
                "names instead, e.g. no_split_modules_auto_wrap_policy({'Block'})"
            )
        items: list[Any] = sorted(declared)
    elif isinstance(blocks, (str, type)):
        items = [blocks]
    else:
        items = list(blocks)
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(
                f"no_split_modules_auto_wrap_policy takes a model, or class names (str) or nn.Module subclasses, "
                f"got {item!r}"
            )
    if not items:
        raise ValueError("no_split_modules_auto_wrap_policy needs at least one block class name")
    return _ClassNamePolicy(
        frozenset(i for i in items if isinstance(i, str)), tuple(i for i in items if isinstance(i, type))
    )


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
