"""Attributes set on original parameters, and parameters linked to one another through them.

[Note: parameter attributes]
A module may set attributes on its parameters and read them in forward (fairscale keeps the
parameter objects; torch's ``use_orig_params`` shows them). The originals' attributes (their
``__dict__`` when flattened) are recorded in their ``ParamInfo`` and set on their views and
stand-ins: one ``setattr`` per attribute, for the few parameters that have any.

[Note: linked parameters]
An attribute whose value is another parameter links the two. fairscale's MEVO does it: its trigger
parameter carries ``_linked_param = proj_weight``; its forward computes with the tensor it reads
there, and its backward writes ``proj_weight.grad`` by hand (its custom functions compute the
weight's gradient tile by tile and give autograd none). The original object would hold its values
from wrapping time and get no gradient, so:

- every flattened parameter's place (module, attribute name) is recorded when its handle is built,
  and a link made to it keeps that place (a link made to a parameter not flattened yet gets it
  when the parameter is). A view that carries a link shows what the place holds when the view is
  made: the linked parameter's view while its wrapper is gathered (the wrapper owning a parameter
  is gathered whenever a module inside it runs, and the handles of one wrapper are gathered in the
  order of its parameters, so the linked one must come first or lie outside), else its stand-in;
- a handle holding a parameter that some link points at keeps the views it set in forward
  (``linked_views``). Its post-backward adds a gradient set by hand on one of them into the flat
  gradient before reducing it, and clears it, so a hand-set gradient sums with autograd's as on a
  plain parameter. Its kept full parameters are not released early (the gradient sits on a view).
  A hand-set gradient left when no gradient from autograd reached the flat parameter (nothing
  reduced it) raises at the end of backward;
- a stand-in between steps keeps a link as a stand-in of its own that raises when used: there is no
  full parameter to show then. A copy or a pickle of the model keeps the link without its place (a
  weak reference into the original's modules), so there it is that stand-in too.

Reading ``.grad`` of such a view warns once, as torch does for any tensor that is not a leaf
(autograd does not fill it); the value read is the one set by hand, as on fairscale's parameter.

[Note: torch's flat parameter attributes]
Code written for torch FSDP1 tells whether a unit is gathered by comparing ``flat_param.data`` with
``flat_param._local_shard``, reads the freed compute-dtype shard ``flat_param._mp_shard`` (torch's
own mixed-precision tests do, in the forward of their modules), and the storage size of the full
buffer ``flat_param._full_param_padded`` to see whether a unit resharded (reaching the flat
parameter through the wrapper's private ``_handle``, which the wrapper answers with its handle).
The names are torch's and so is the meaning: ``_local_shard`` is ``_shard``, set whenever
``_shard`` changes; ``_full_param_padded`` is ``_full`` (the compute-dtype padded full buffer,
storage freed while resharded; the shard itself where the two are one, at world size 1 without a
cast); ``_mp_shard``, under mixed precision only, is ``_lp_shard``, whose storage is freed except
during an all-gather. They
are plain attributes of the ``nn.Parameter``, as torch's are (a subclass would change what
``torch.compile`` and ``isinstance`` see). A pickle or ``torch.save`` of the parameter leaves them
out (a freed storage saved by ``torch.save`` cannot be loaded): the parameter carries its own
``__getstate__`` for that, and the handle of a loaded or copied model sets them again.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from fsdp.core.placeholders import make_placeholder

__all__ = [
    "Link",
    "attributes_of",
    "carry_attributes",
    "linked_indices",
    "linked_version",
    "publish_torch_attributes",
    "record_places",
    "take_hand_set_grad",
]


class Link:
    """An attribute of an original parameter whose value is a parameter. See [Note: linked parameters]."""

    __slots__ = ("attr", "dtype", "holder", "place", "shape")

    def __init__(self, holder: str, attr: str, target: nn.Parameter) -> None:
        self.holder = holder  # the name of the parameter carrying the attribute
        self.attr = attr
        self.shape = target.shape
        self.dtype = target.dtype
        self.place: tuple[weakref.ref[nn.Module], str] | None = _place_of(target)

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy or a pickle of the model keeps the link without its place (a weak reference to a module
        # of the original): it shows the stand-in, which says so when used.
        return (_unplaced, (self.holder, self.attr, self.shape, self.dtype))

    def resolve(self) -> torch.Tensor:
        """What the linked parameter's place holds now (its view while gathered)."""
        module = self.place[0]() if self.place is not None else None
        if module is None or self.place is None:
            return self.stand_in()
        return getattr(module, self.place[1])  # type: ignore[no-any-return]

    def stand_in(self) -> torch.Tensor:
        reason = (
            f"FullyShardedDataParallel: attribute {self.attr!r} of parameter {self.holder!r} refers to another "
            "parameter, which is sharded now (or was never flattened by a wrapper that knew its place, or the model "
            "was copied or unpickled, which drops the link): it shows "
            "that parameter's full values only inside a forward and its backward, where the module that carries "
            "the attribute runs after the linked parameter's wrapper gathered it. Read it there, or through its "
            "module (keep a reference to the module and use module.weight)"
        )
        return make_placeholder(f"{self.holder}.{self.attr}", self.shape, self.dtype, False, reason=reason)


def _unplaced(holder: str, attr: str, shape: torch.Size, dtype: torch.dtype) -> Link:
    link = Link.__new__(Link)
    link.holder, link.attr, link.shape, link.dtype, link.place = holder, attr, shape, dtype, None
    return link


# Places of flattened parameters, by id, while the parameter lives; links waiting for a parameter
# not flattened yet; and the places some link points at (a version counts their changes, so that a
# handle asks again only when one was added).
_places: dict[int, tuple[weakref.ref[nn.Parameter], weakref.ref[nn.Module], str]] = {}
_waiting: dict[int, tuple[weakref.ref[nn.Parameter], list[Link]]] = {}
_linked: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
_version = [0]


def _forget(table: dict[int, Any], key: int) -> Any:
    return lambda _ref: table.pop(key, None)


def _place_of(param: nn.Parameter) -> tuple[weakref.ref[nn.Module], str] | None:
    entry = _places.get(id(param))
    if entry is not None and entry[0]() is param:
        module, name = entry[1](), entry[2]
        if module is not None:
            _linked.setdefault(module, set()).add(name)
            _version[0] += 1
        return entry[1], name
    return None


def record_places(params: Iterable[tuple[nn.Parameter, nn.Module, str]]) -> None:
    """Record where each parameter a handle flattens lives (its first place), and give the links
    made to it before the place."""
    for param, module, name in params:
        key = id(param)
        _places[key] = (weakref.ref(param, _forget(_places, key)), weakref.ref(module), name)
        waiting = _waiting.pop(key, None)
        if waiting is not None and waiting[0]() is param:
            for link in waiting[1]:
                link.place = _place_of(param)


def attributes_of(param: nn.Parameter, fqn: str) -> tuple[tuple[str, Any], ...]:
    """The attributes ``param`` carries (its ``__dict__``), a parameter among them as a :class:`Link`."""
    items = []
    for k, v in vars(param).items():
        if k in _TORCH_ATTRIBUTES or k == "__getstate__":  # (a flat parameter's own: not carried)
            continue
        if isinstance(v, nn.Parameter):
            link = Link(fqn, k, v)
            if link.place is None:
                key = id(v)
                entry = _waiting.get(key)
                if entry is None or entry[0]() is not v:
                    entry = _waiting[key] = (weakref.ref(v, _forget(_waiting, key)), [])
                entry[1].append(link)
            v = link
        items.append((k, v))
    return tuple(items)


class _Info(Protocol):
    @property
    def attrs(self) -> tuple[tuple[str, Any], ...]: ...


def carry_attributes(tensor: torch.Tensor, info: _Info, resolve: bool = True) -> torch.Tensor:
    """``tensor`` (what a module shows for the original parameter of ``info``) with the attributes
    the original carried; returned. A link shows its parameter's place now (``resolve``: a view in
    forward), else a stand-in. Nothing to do, and no cost, for nearly every parameter."""
    for name, value in info.attrs:
        if isinstance(value, Link):
            value = value.resolve() if resolve else value.stand_in()
        setattr(tensor, name, value)
    return tensor


def linked_version() -> int:
    """Changes whenever a link to a new place is made (a handle's :func:`linked_indices` may change)."""
    return _version[0]


def linked_indices(places: Iterable[tuple[nn.Module, str]]) -> tuple[int, ...]:
    """The indices of ``places`` (a handle's parameters, in order) that some link points at."""
    if not _linked:
        return ()
    return tuple(i for i, (module, name) in enumerate(places) if name in _linked.get(module, ()))


def take_hand_set_grad(view: torch.Tensor) -> torch.Tensor | None:
    """The gradient set by hand on ``view`` (not a leaf: autograd never fills it), cleared; None if none."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's warning for reading .grad of a tensor not a leaf)
        grad = view.grad
    if grad is not None:
        view.grad = None
    return grad


_TORCH_ATTRIBUTES = ("_local_shard", "_mp_shard", "_full_param_padded")


class _StateWithoutBuffers:
    """A flat parameter's ``__getstate__`` (what ``pickle`` and ``torch.save`` keep of its attributes):
    its ``__dict__`` without torch's buffer attributes, which its handle sets again after loading. A
    freed ``_mp_shard`` or ``_full_param_padded`` saved by ``torch.save`` could not be loaded."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = weakref.ref(param)

    def __call__(self) -> dict[str, Any]:
        param = self.param()
        kept = {} if param is None else param.__dict__
        return {k: v for k, v in kept.items() if k not in _TORCH_ATTRIBUTES and k != "__getstate__"}


def publish_torch_attributes(
    param: nn.Parameter, shard: torch.Tensor, mp_shard: torch.Tensor | None, full: torch.Tensor
) -> None:
    """Set torch FSDP1's ``_local_shard``, ``_full_param_padded`` and (under mixed precision)
    ``_mp_shard`` on ``param``."""
    if not isinstance(param.__dict__.get("__getstate__"), _StateWithoutBuffers):
        param.__getstate__ = _StateWithoutBuffers(param)  # type: ignore[attr-defined]
    param._local_shard = shard  # type: ignore[attr-defined]
    param._full_param_padded = full  # type: ignore[attr-defined]
    if mp_shard is None:
        param.__dict__.pop("_mp_shard", None)
    else:
        param._mp_shard = mp_shard  # type: ignore[attr-defined]
