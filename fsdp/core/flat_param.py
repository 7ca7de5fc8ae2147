"""Flat-parameter metadata: which original parameter sits where in a flat tensor.

[Note: flattening]
A wrapper owns the parameters of its module that no inner wrapper owns. They are grouped by
(requires_grad, dtype) so that frozen and trainable parameters can live in one wrapper: each group
becomes one flat parameter, and a frozen group gets no gradient and no reduction. Parameters are
laid out back to back in the order ``named_parameters()`` first meets them; a parameter reachable
under several names (tied weights) is stored once and every other name is recorded as a
:class:`SharedParamInfo` pointing at it. Example, a module with ``a.weight`` (2x3), ``a.bias`` (2)
and ``b.weight`` tied to ``a.weight``::

    flat = [a.weight.flatten() (offset 0, 6 elements) | a.bias (offset 6, 2 elements)]   numel 8
    shared: b.weight -> params[0]

Original parameters are removed from their modules; the module attributes are set to plain tensor
views of the flat parameter while it is unsharded (forward, backward) and, inside
``summon_full_params`` / ``state_dict``, registered as ``nn.Parameter`` views again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fsdp.common.guards import check_not_wrapped_already
from fsdp.core.deferred_init import materialize_if_meta_
from fsdp.core.param_attrs import attributes_of, carry_attributes
from fsdp.core.placeholders import make_placeholder

__all__ = [
    "FlatParamMeta",
    "IgnoredStates",
    "ParamInfo",
    "PendingTie",
    "SharedParamInfo",
    "check_no_parameters_added",
    "collect_owned",
    "group_params",
    "own_parameters",
    "set_module_tensor",
    "split_tied",
    "unflatten_views",
]


@dataclass(frozen=True)
class ParamInfo:
    """One original parameter inside a flat parameter."""

    fqn: str  # name relative to the wrapped module, e.g. "layers.0.weight"
    module_name: str  # "layers.0" ("" for the wrapped module itself)
    param_name: str  # "weight"
    shape: torch.Size  # original shape; () for a scalar parameter
    numel: int
    offset: int  # first element in the (unpadded) flat tensor
    # the attributes the original carried (its __dict__), set on its views in forward too (a parameter
    # among them as a Link): see [Note: parameter attributes] in fsdp/core/param_attrs.py
    attrs: tuple[tuple[str, Any], ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class SharedParamInfo:
    """A second name of a parameter stored once: ``module_name.param_name`` is ``params[primary]``."""

    fqn: str
    module_name: str
    param_name: str
    primary: int


@dataclass(frozen=True)
class FlatParamMeta:
    """Layout of one flat parameter (see [Note: flattening])."""

    params: tuple[ParamInfo, ...]
    shared: tuple[SharedParamInfo, ...]
    numel: int  # sum of the parameters' numel, without padding
    dtype: torch.dtype
    requires_grad: bool
    attributed: tuple[int, ...] = field(default=(), compare=False)  # the params[i] with attrs

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(p.fqn for p in self.params)


@dataclass
class _Entry:
    fqn: str
    module_name: str
    param_name: str
    param: nn.Parameter


def _split_fqn(fqn: str) -> tuple[str, str]:
    module_name, _, param_name = fqn.rpartition(".")
    return module_name, param_name


def group_params(
    named_params: Iterable[tuple[str, nn.Parameter]], flatten: bool
) -> list[tuple[list[_Entry], list[tuple[_Entry, int]]]]:
    """Group owned parameters into flat-parameter groups.

    ``named_params`` must yield every name of every parameter (``remove_duplicate=False``).
    Returns, per group, the unique parameters and the extra names as ``(entry, index of the
    primary in the group)``. With ``flatten=False`` every unique parameter is its own group.
    """
    groups: dict[tuple[bool, torch.dtype] | int, list[_Entry]] = {}
    shared: dict[tuple[bool, torch.dtype] | int, list[tuple[_Entry, int]]] = {}
    where: dict[int, tuple[tuple[bool, torch.dtype] | int, int]] = {}
    for fqn, param in named_params:
        module_name, param_name = _split_fqn(fqn)
        entry = _Entry(fqn, module_name, param_name, param)
        if id(param) in where:
            key, index = where[id(param)]
            shared.setdefault(key, []).append((entry, index))
            continue
        key = (param.requires_grad, param.dtype) if flatten else len(where)
        group = groups.setdefault(key, [])
        where[id(param)] = (key, len(group))
        group.append(entry)
    return [(entries, shared.get(key, [])) for key, entries in groups.items()]


def make_meta(entries: Sequence[_Entry], shared: Sequence[tuple[_Entry, int]]) -> FlatParamMeta:
    infos, offset = [], 0
    for e in entries:
        n = e.param.numel()
        attrs = attributes_of(e.param, e.fqn)
        infos.append(ParamInfo(e.fqn, e.module_name, e.param_name, e.param.shape, n, offset, attrs))
        offset += n
    shared_infos = tuple(SharedParamInfo(e.fqn, e.module_name, e.param_name, i) for e, i in shared)
    first = entries[0].param
    attributed = tuple(i for i, info in enumerate(infos) if info.attrs)
    return FlatParamMeta(tuple(infos), shared_infos, offset, first.dtype, first.requires_grad, attributed)


def unflatten_views(
    flat: torch.Tensor, meta: FlatParamMeta, before_concat: Callable[[], None] | None = None
) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like the original parameters (autograd-tracked if ``flat`` is).

    ``flat`` may extend past ``meta.numel`` (padding). One ``split`` rather than one ``narrow`` per
    parameter: the backward of a split concatenates the gradients once, whereas each narrow's
    backward would allocate and zero-fill a tensor the size of the whole flat parameter.
    ``before_concat`` (when ``flat`` requires grad) runs in backward once every view's gradient
    is computed, just before that concatenation allocates the flat gradient.
    """
    sizes = [p.numel for p in meta.params]
    rest = flat.numel() - meta.numel
    parts = torch.split(flat, [*sizes, rest] if rest else sizes)
    node = parts[0].grad_fn
    if before_concat is not None and node is not None:
        hook = before_concat
        node.register_prehook(lambda grad_outputs: hook())
    views = [part.view(p.shape) for part, p in zip(parts, meta.params)]
    return views


class _HoldsFlatParam(Protocol):
    @property
    def meta(self) -> FlatParamMeta: ...

    @property
    def flat_param(self) -> torch.Tensor: ...


def make_placeholders(holder: _HoldsFlatParam) -> list[torch.Tensor]:
    """The stand-ins of ``holder``'s parameters (a FlatParamHandle's) while sharded. Where the flat
    parameter holds one parameter alone, its stand-in sets ``requires_grad`` on it; the stand-ins
    reach the holder weakly (they live in its modules, which it holds)."""
    ref = weakref.ref(holder)

    def owner() -> torch.Tensor | None:
        held = ref()
        return None if held is None else held.flat_param

    alone = owner if len(holder.meta.params) == 1 else None
    flag = holder.flat_param.requires_grad
    return [
        carry_attributes(make_placeholder(info.fqn, info.shape, holder.meta.dtype, flag, alone), info, False)
        for info in holder.meta.params
    ]


def set_module_tensor(module: nn.Module, name: str, tensor: torch.Tensor, as_parameter: bool) -> None:
    """Make ``module.<name>`` return ``tensor``.

    As a parameter it is registered in ``module._parameters`` (seen by ``named_parameters`` and
    ``state_dict``); otherwise it is a plain attribute that neither of them sees.
    """
    module.__dict__.pop(name, None)
    module._parameters.pop(name, None)
    if as_parameter:
        param = (
            tensor
            if isinstance(tensor, nn.Parameter)
            else nn.Parameter(tensor, requires_grad=tensor.requires_grad)
        )
        module._parameters[name] = param
    else:
        module.__dict__[name] = tensor


# [Note: ignored modules]
# torch FSDP1's ``ignored_modules`` / ``ignored_states``: a wrapper leaves the parameters and buffers
# of the ignored modules (and their descendants), and the ignored parameters, where they are. They
# stay registered under their names, so ``parameters()`` yields them (the optimizer steps on them
# as on any plain parameter) and ``state_dict()`` holds them as they are on this rank. Nothing
# gathers, reduces, casts or moves them: their gradients are this rank's own, and keeping them
# equal across ranks is the user's affair, as in torch. A parameter is ignored by where it is
# registered, (module, attribute), not by identity, so a meta parameter that a deferred
# initialization replaces stays ignored. The walks that decide what a wrapper owns
# (:func:`collect_owned`, :func:`check_no_parameters_added`, the buffer move) take nothing from an
# ignored module (:func:`collect_owned` enters it only to find the wrappers inside, which stay
# managed, as in torch); the state-dict layout walks into it and lists its parameters as ignored
# slots. A module attached after wrapping at a new path (torch's skip idiom) is adopted as ignored
# (:func:`attached_after_wrapping`, :meth:`IgnoredStates.with_attached`).
class IgnoredStates:
    """What one wrapper leaves alone. See [Note: ignored modules]."""

    roots: tuple[nn.Module, ...]  # the ignored modules as given (none when parameters were given)
    params: tuple[nn.Parameter, ...]  # the ignored parameters as given (ignored_states=[parameters])
    detached: weakref.WeakSet[nn.Module]  # modules given but outside the wrapped module then: attached
    # after wrapping (torch's skip idiom), they are ignored without a warning
    _modules: dict[int, nn.Module]  # every module inside an ignored module, the roots included, by id
    _locations: dict[tuple[int, str], nn.Module]  # (id(module), attribute) of every name of an ignored
    # parameter -> that module

    def __init__(
        self,
        roots: Iterable[nn.Module] = (),
        params: Iterable[nn.Parameter] = (),
        module: nn.Module | None = None,
        detached: Iterable[nn.Module] = (),
    ) -> None:
        """``roots`` and ``params`` must lie inside ``module`` (the wrapped module); checked by the caller."""
        self.roots, self.params = tuple(roots), tuple(params)
        self.detached = weakref.WeakSet(detached)
        self._modules = {id(m): m for r in self.roots for m in r.modules()}
        wanted = {id(p) for p in self.params}
        self._locations = {}
        for m in module.modules() if module is not None else ():
            for name, p in m._parameters.items():
                if p is not None and (id(m) in self._modules or id(p) in wanted):
                    self._locations[(id(m), name)] = m

    def __bool__(self) -> bool:
        return bool(self.roots or self.params)

    # copied and pickled by the modules and parameters themselves (ids change in a copy)
    def __getstate__(self) -> dict[str, Any]:
        return {"roots": self.roots, "params": self.params, "where": list(self._locations.items())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.roots, self.params = state["roots"], state["params"]
        self._modules = {id(m): m for r in self.roots for m in r.modules()}
        self._locations = {(id(m), name): m for (_, name), m in state["where"]}

    def has_module(self, m: nn.Module) -> bool:
        return id(m) in self._modules

    def has_param(self, m: nn.Module, name: str) -> bool:
        """Whether ``m.<name>`` is an ignored parameter (it is inside an ignored module, or was given)."""
        return id(m) in self._modules or (id(m), name) in self._locations

    def tensors(self) -> list[nn.Parameter]:
        """The ignored parameters registered now (each once), found where they are registered."""
        found: dict[int, nn.Parameter] = {}
        for m in self._modules.values():
            found.update((id(p), p) for p in m._parameters.values() if p is not None)
        for (_, name), m in self._locations.items():
            p = m._parameters.get(name)
            if p is not None:
                found[id(p)] = p
        return list(found.values())

    def with_attached(self, modules: Iterable[nn.Module], module: nn.Module) -> IgnoredStates:
        """These, and ``modules`` (attached inside ``module``, the wrapped module, after wrapping) ignored too."""
        return IgnoredStates([*self.roots, *modules], self.params, module, self.detached)

    def inside(self, module: nn.Module) -> IgnoredStates:
        """The part of these that lies inside ``module`` (for a wrapper built there by a policy)."""
        below = {id(m) for m in module.modules()}
        held = {id(p) for m in module.modules() for p in m._parameters.values() if p is not None}
        return IgnoredStates(
            [r for r in self.roots if id(r) in below], [p for p in self.params if id(p) in held], module
        )


NOTHING_IGNORED = IgnoredStates()


def collect_owned(
    module: nn.Module,
    is_wrapper: Callable[[nn.Module], bool],
    ignored: IgnoredStates = NOTHING_IGNORED,
) -> tuple[list[tuple[str, nn.Parameter]], dict[str, nn.Module], list[tuple[str, Any]]]:
    """Parameters (every name, tied ones included) not under an inner wrapper nor ``ignored``; modules
    by name (ignored ones left out); inner wrappers."""
    owned: list[tuple[str, nn.Parameter]] = []
    module_of: dict[str, nn.Module] = {}
    inner: list[tuple[str, Any]] = []
    if is_wrapper(module):  # FSDP(FSDP(m)): the inner wrapper owns everything
        return owned, {"": module}, [("", module)]
    # an explicit stack, not a recursive closure: a closure referring to itself is a reference
    # cycle that would keep ``owned`` (a deferred-init unit's full parameters) alive until the
    # garbage collector runs
    stack: list[tuple[nn.Module, str]] = [(module, "")]
    while stack:
        m, prefix = stack.pop()
        if m is not module and is_wrapper(m):
            inner.append((prefix[:-1], m))
            continue
        if m is module or not ignored.has_module(m):  # (an ignored module is entered for the wrappers in it)
            module_of[prefix.rstrip(".")] = m
            for name, p in m._parameters.items():
                if p is not None and not ignored.has_param(m, name):
                    owned.append((prefix + name, p))
        children = [(c, prefix + name + ".") for name, c in m._modules.items() if c is not None]
        stack.extend(reversed(children))  # depth first, in module order
    return owned, module_of, inner


def check_no_parameters_added(
    module: nn.Module,
    is_wrapper: Callable[[nn.Module], bool],
    where: str,
    ignored: IgnoredStates = NOTHING_IGNORED,
) -> None:
    """Between wrapping and the first forward a wrapper's modules hold no parameters of their own
    (its flat parameters replace them) but the ``ignored`` ones: one found there was added after
    wrapping, and would train on this rank's gradients alone. See [Note: parameters added after
    wrapping] in fsdp/common/guards.py."""
    stack: list[tuple[nn.Module, str]] = [(module, "")]
    while stack:
        m, prefix = stack.pop()
        if is_wrapper(m) or ignored.has_module(m):
            continue
        added = [
            prefix + n for n, p in m._parameters.items() if p is not None and not ignored.has_param(m, n)
        ]
        if added:
            raise RuntimeError(
                f"FullyShardedDataParallel: parameter(s) {added} inside the wrapper at {where!r} were added after "
                "wrapping (a replaced layer, or register_parameter on a wrapped module); no wrapper shards or "
                "reduces them. Change the model before wrapping it"
            )
        stack.extend((c, f"{prefix}{n}.") for n, c in m._modules.items() if c is not None)


def attached_after_wrapping(
    module: nn.Module,
    is_wrapper: Callable[[nn.Module], bool],
    paths_at_wrap: frozenset[str],
    ignored: IgnoredStates = NOTHING_IGNORED,
) -> list[tuple[str, nn.Module]]:
    """The submodules of ``module`` (the wrapped module) that hold parameters at a path it did not have
    when it was wrapped: attached after wrapping (torch's skip idiom: a module taken out before
    wrapping and put back after), outermost ones. A module at a path it had is a replaced one."""
    found: list[tuple[str, nn.Module]] = []
    stack: list[tuple[nn.Module, str]] = [(module, "")]
    while stack:
        m, path = stack.pop()
        if m is not module and (is_wrapper(m) or ignored.has_module(m)):
            continue
        if path not in paths_at_wrap:
            if any(
                p is not None for sub in _unwrapped_modules(m, is_wrapper) for p in sub._parameters.values()
            ):
                found.append((path, m))
            continue
        stack.extend((c, f"{path}.{n}" if path else n) for n, c in m._modules.items() if c is not None)
    return found


def _unwrapped_modules(module: nn.Module, is_wrapper: Callable[[nn.Module], bool]) -> list[nn.Module]:
    out, stack = [], [module]
    while stack:
        m = stack.pop()
        if m is module or not is_wrapper(m):
            out.append(m)
            stack.extend(c for c in m._modules.values() if c is not None)
    return out


@dataclass(frozen=True)
class PendingTie:
    """A place in a wrapper's modules of a parameter that a wrapper outside it owns (a tie across wrappers
    not resolved yet: see [Note: parameters shared across wrappers] in fsdp/wrapper/shared_params.py)."""

    fqn: str  # plain name relative to the wrapped module of the wrapper that records it
    module: nn.Module  # the module that uses the parameter as ``module.<attr>``
    attr: str
    param: nn.Parameter  # the owner's original parameter (by identity)
    owner: Callable[[], Any]  # weak reference to the wrapper that owned it when the tie was found


def split_tied(
    owned: list[tuple[str, nn.Parameter]], taken: Collection[int]
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """Split ``owned`` into the parameters that are new to wrapping and those that another wrapper
    already owns (``taken``: the ids of the original parameters of every inner wrapper and every
    other live wrapper, a sibling wrapped before), tied (shared) with a module of this one. See
    [Note: parameters shared across wrappers] in ``fsdp/wrapper/shared_params.py``."""
    kept = [(fqn, p) for fqn, p in owned if id(p) not in taken]
    return kept, [(fqn, p) for fqn, p in owned if id(p) in taken]


def own_parameters(
    module: nn.Module,
    is_wrapper: Callable[[nn.Module], bool],
    taken: Collection[int],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
    ignored: IgnoredStates = NOTHING_IGNORED,
) -> tuple[
    list[tuple[str, nn.Parameter]],
    dict[str, nn.Module],
    list[tuple[str, Any]],
    list[tuple[str, nn.Parameter]],
    list[tuple[str, nn.Parameter]],
]:
    """What a new wrapper of ``module`` owns: :func:`collect_owned` less the parameters other wrappers
    own (``taken``: the ids of their original parameters), after materializing a unit built on the
    meta device on ``device``. Also returns the meta parameters that materialization replaced (empty if none), and
    the names in this wrapper's modules of parameters that another wrapper owns (tied across wrappers,
    :func:`split_tied`), each with the owner's original parameter. Ignored modules are not
    materialized (an ignored parameter of a materialized module is, like torch's)."""
    owned, module_of, inner = collect_owned(module, is_wrapper, ignored)
    check_not_wrapped_already(module_of)
    owned, tied = split_tied(owned, taken)
    _check_not_tied_to_ignored([*owned, *tied], ignored)
    replaced = owned if materialize_if_meta_(module, owned, module_of, device, param_init_fn) else []
    if replaced:  # (a tied name now holds a materialized stand-in: it stays the owner's parameter)
        owned, module_of, inner = collect_owned(module, is_wrapper, ignored)
        owned = [(fqn, p) for fqn, p in owned if fqn not in {name for name, _ in tied}]
    return owned, module_of, inner, replaced, tied


def _check_not_tied_to_ignored(owned: list[tuple[str, nn.Parameter]], ignored: IgnoredStates) -> None:
    if not ignored:
        return
    kept = {id(p) for p in ignored.tensors()}
    tied = [fqn for fqn, p in owned if id(p) in kept]
    if tied:
        raise ValueError(
            f"FullyShardedDataParallel: parameter(s) {tied[:3]} are ignored (ignored_modules / ignored_states) under "
            "another name but used here by a module the wrapper manages; a tied parameter is either managed or "
            "ignored under every name. Ignore every module that uses it, or none"
        )
