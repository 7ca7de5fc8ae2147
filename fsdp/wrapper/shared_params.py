"""Parameters shared (tied) across wrappers: the innermost wrapper that contains every module using
a tied parameter owns it. Never imports the wrapper (wrappers are passed in, typed as ``Wrapper``).

[Note: parameters shared across wrappers]
A parameter is tied across wrappers when modules of two wrappers hold the same ``nn.Parameter``
before wrapping: an embedding in an inner unit whose weight the outer unit's output projection
reuses, or two sibling units sharing a layer's weight (fairscale's ``append_shared_param()``
scenario). One wrapper must own it, and it must be gathered whenever any of its users runs. The
owner is the innermost wrapper that contains every user, the one torch FSDP recommends too: its
full parameters exist from its pre-forward to its post-forward and again from its pre-backward to
its post-backward, which spans the forward and backward of every unit inside it, so each user sees
a gathered view, and autograd sums the gradients of every use into the owner's flat parameter
before its post-backward reduces it, as in a plain model. Wrappers are built innermost first, so
the owner is found late:

- a wrapper whose module holds a parameter that an inner wrapper owns (the outer unit's output
  projection, tied to an inner unit's embedding) *adopts* it: the inner wrapper's flat parameters
  are gathered (a collective over its group, on every rank, at construction), rebuilt without it,
  and the parameter, with its gathered values, joins the outer wrapper's own, whose views are then
  set in the inner unit's modules too;
- a wrapper whose module holds a parameter that a wrapper outside it owns (a sibling built before)
  leaves it alone and records a *pending tie* (a placeholder stands in the module); the first
  wrapper built around both adopts it from the owner, and one that contains only the pending side
  takes the pending tie over. A root whose tree still holds a pending tie at its first forward
  raises a ``ValueError`` that says to wrap a module containing both users.

The cost is memory: the adopting wrapper keeps the tied parameter full whenever it is full itself
(the root: from forward to the end of backward). fairscale instead gathers the owner's shard in
each user (``append_shared_param``, unflattened wrappers only); here ``append_shared_param`` only
checks that the wrapper uses the parameter, since ties are found without it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from fsdp.comm.consistency import plain_name
from fsdp.common.guards import mark_flattened
from fsdp.core.flat_param import (
    PendingTie,
    collect_owned,
    set_module_tensor,
)
from fsdp.core.layout import gather_full_flat
from fsdp.core.placeholders import is_placeholder, make_placeholder
from fsdp.core.wrapper_protocol import Wrapper

__all__ = ["adopt_tied", "check_no_pending_ties", "check_shared_param"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _owner(param: nn.Parameter, wrappers: Iterable[Wrapper]) -> Wrapper | None:
    """The wrapper among ``wrappers`` that owns ``param`` (by its original parameter), or None."""
    return next((w for w in wrappers if w._original_params.get(id(param)) is param), None)


def _stand_in(name: str, param: torch.Tensor) -> torch.Tensor:
    """A placeholder for a tied parameter's place until its owner's views are set there."""
    return make_placeholder(name, param.shape, param.dtype, param.requires_grad)


def _release(
    owner: Wrapper, param: nn.Parameter, path: str, is_wrapper: Callable[[nn.Module], bool]
) -> tuple[torch.Tensor, list[tuple[str, nn.Module, str]]]:
    """Take ``param`` out of ``owner`` (its wrapper at ``path``): gather every flat parameter of the
    owner (collective over its group), put the other parameters back in its modules and flatten them
    again. Returns the parameter's full values and its places in the owner's modules (names
    relative to the adopting wrapper)."""
    if owner._is_root is not None:
        raise ValueError(
            f"FullyShardedDataParallel: the wrapper at {path or '<root>'!r} owns a parameter that the module being "
            "wrapped uses too (tied), but it already ran a forward, so it cannot give the parameter up. Build "
            "the outer wrapper before running the inner one"
        )
    fqn = owner._original_names[id(param)]
    value: torch.Tensor | None = None
    places: list[tuple[str, nn.Module, str]] = []
    for h in owner.handles:
        full = gather_full_flat(h, h.sharded_data().detach()).clone()
        restored: dict[int, nn.Parameter] = {}
        for i, (info, module) in enumerate(zip(h.meta.params, h.modules, strict=True)):
            data = full[info.offset : info.offset + info.numel].view(info.shape)
            if info.fqn == fqn:
                value = data.clone()
                places.append((_join(path, plain_name(info.fqn)), module, info.param_name))
                set_module_tensor(module, info.param_name, _stand_in(info.fqn, data), as_parameter=False)
                continue
            restored[i] = nn.Parameter(data.clone(), requires_grad=h.requires_grad)
            set_module_tensor(module, info.param_name, restored[i], as_parameter=True)
        for s, module in zip(h.meta.shared, h.shared_modules, strict=True):
            if s.primary in restored:
                set_module_tensor(module, s.param_name, restored[s.primary], as_parameter=True)
            else:
                places.append((_join(path, plain_name(s.fqn)), module, s.param_name))
                set_module_tensor(module, s.param_name, _stand_in(s.fqn, param), as_parameter=False)
    assert value is not None, f"{fqn} is not in the flat parameters of the wrapper at {path!r}"
    # an optimizer built over the old flat parameters would step on nothing: its step refuses them
    mark_flattened((_join(path, f"flat_param_{i}"), h.flat_param) for i, h in enumerate(owner.handles))
    owned, module_of, _ = collect_owned(owner._fsdp_wrapped_module, is_wrapper, owner._ignored)
    owner._build_handles(owned, module_of)
    del owner._original_params[id(param)]
    owner._original_names.pop(id(param), None)
    return value, places


def adopt_tied(
    wrapper: Wrapper,
    module: nn.Module,
    tied: Sequence[tuple[str, nn.Parameter]],
    module_of: dict[str, nn.Module],
    nested: Sequence[Wrapper],
    live: Iterable[Wrapper],
    is_wrapper: Callable[[nn.Module], bool],
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]], dict[nn.Module, list[str]]]:
    """Resolve the ties of a wrapper being built around ``module``. See [Note: parameters shared
    across wrappers].

    ``tied`` are the names in this wrapper's modules (``module_of``) of parameters other wrappers own;
    ``nested`` every wrapper inside ``module``, whose pending ties are resolved here or taken over;
    ``live`` every wrapper. Returns the parameters this wrapper adopts, one ``(name, parameter)`` per
    place (the parameter holds the owner's gathered values; ``module_of`` gets the modules of places
    inside inner wrappers), the adopted originals with their first names (for ``_original_params``),
    and the original parameter order of the inner wrappers' modules that now hold its views. Sets
    ``wrapper._pending_ties``.
    """
    wrapper._pending_ties = []
    if not tied and not any(w._pending_ties for w in nested):
        return [], [], {}  # (nearly always: no walk of the module tree)
    paths = {id(m): plain_name(name) for name, m in module.named_modules() if is_wrapper(m)}
    places: dict[int, tuple[nn.Parameter, list[tuple[str, nn.Module, str]]]] = {}
    for fqn, p in tied:
        module_name, _, attr = fqn.rpartition(".")
        places.setdefault(id(p), (p, []))[1].append((fqn, module_of[module_name], attr))
    for w in nested:
        for tie in w._pending_ties:
            places.setdefault(id(tie.param), (tie.param, []))[1].append(
                (_join(paths[id(w)], tie.fqn), tie.module, tie.attr)
            )
        w._pending_ties = []
    adopted: list[tuple[str, nn.Parameter]] = []
    originals: list[tuple[str, nn.Parameter]] = []
    orders: dict[nn.Module, list[str]] = {}
    pending: list[PendingTie] = []
    own_modules = {id(m) for m in module_of.values()}
    for p, where in places.values():
        owner, outside = _owner(p, nested), _owner(p, live)
        if owner is None and outside is not None:  # owned outside: the tie waits for a parent
            for fqn, m, attr in where:
                set_module_tensor(m, attr, _stand_in(fqn, p), as_parameter=False)
                pending.append(PendingTie(fqn, m, attr, p, weakref.ref(outside)))
            continue
        if owner is not None:
            value, inside = _release(owner, p, paths[id(owner)], is_wrapper)
            where = [*where, *inside]
            for _, m, _ in where:  # the inner modules' parameter order, kept when views are shown there
                held = [w._module_param_order[m] for w in nested if m in w._module_param_order]
                if id(m) not in own_modules and held:
                    orders.setdefault(m, list(held[0]))
            p_new = nn.Parameter(value, requires_grad=p.requires_grad)
        else:  # (its owner is gone: nothing else holds it, so this wrapper owns it as it is)
            p_new = p
        for fqn, m, _ in where:
            module_of.setdefault(fqn.rpartition(".")[0], m)
            adopted.append((fqn, p_new))
        originals.append((where[0][0], p))
    wrapper._pending_ties = pending
    return adopted, originals, orders


def check_no_pending_ties(wrappers: Sequence[Wrapper], live: Iterable[Wrapper]) -> None:
    """Refuse a tree (``wrappers``, root first) that uses a parameter owned by a wrapper outside it
    (see [Note: parameters shared across wrappers]): nothing would gather it there."""
    for w in wrappers:
        for tie in w._pending_ties:
            owner = _owner(tie.param, live)
            by = (
                f" (its {owner._original_names[id(tie.param)]!r}, in {type(owner.module).__name__})"
                if owner is not None
                else ""
            )
            raise ValueError(
                f"FullyShardedDataParallel: {tie.fqn!r} of {type(w.module).__name__} is a parameter that another "
                f"wrapper owns{by}, and no wrapper contains both. Wrap a module that contains every module using "
                "it (their common parent, e.g. the whole model) with FullyShardedDataParallel: that wrapper then "
                "owns the shared parameter"
            )


def check_shared_param(wrapper: Wrapper, param: torch.Tensor) -> None:
    """fairscale's ``append_shared_param(p)``: ``param`` (another wrapper's parameter, or the
    placeholder its module shows for it) must be one that this wrapper's modules use. Ties are found
    without the call, so this only checks."""
    if wrapper._is_root is not None:
        raise RuntimeError(
            "FullyShardedDataParallel.append_shared_param() must be called before the first forward"
        )
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"append_shared_param() takes a parameter, got {type(param).__name__}")
    for tie in wrapper._pending_ties:
        if param is tie.param or (is_placeholder(param) and any(param is q for q in _placeholders_of(tie))):
            return
    raise ValueError(
        "FullyShardedDataParallel.append_shared_param(): the parameter is not one this wrapper's modules share "
        "with another wrapper. Tie the modules before wrapping them (assign the same nn.Parameter to both), "
        "then wrap a module containing both: parameters shared across wrappers are found without this call"
    )


def _placeholders_of(tie: PendingTie) -> list[torch.Tensor]:
    """The placeholders that the owner of a tied parameter shows in its modules for it."""
    owner = tie.owner()
    if owner is None or id(tie.param) not in owner._original_names:
        return []
    fqn = owner._original_names[id(tie.param)]
    return [
        h._placeholders[i] for h in owner.handles for i, info in enumerate(h.meta.params) if info.fqn == fqn
    ]
