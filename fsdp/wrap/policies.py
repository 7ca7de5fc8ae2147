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
``torch.distributed.fsdp.wrap`` imports change to ``fsdp.wrap``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = [
    "AutoWrapPolicy",
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "is_torch_style",
    "lambda_auto_wrap_policy",
    "no_split_modules_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]

log = logging.getLogger(__name__)

# policy(module=..., recurse=..., unwrapped_params=..., module_is_root=...) -> bool (see module docstring)
AutoWrapPolicy = Callable[..., bool]
WrapperCls = Callable[..., nn.Module]


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
