"""Misuse guards and the process-wide registries they keep.

A user's mistake that torch would let pass silently is refused here with an error that names it:

- an optimizer built over the original parameters before wrapping (they never get a gradient
  again), or stepping inside ``no_sync()`` (the gradients are not reduced yet): one process-wide
  optimizer step pre-hook (:func:`mark_flattened`, :func:`unsynced`);
- a module wrapped twice (:func:`claim_modules`, :func:`check_not_wrapped_already`);
- parameters registered after wrapping: a process-wide registration counter tells the root when
  to look again (:func:`registrations`).

The registries hold weak references (or the ids of live objects for the length of a context), so a
model or an optimizer is freed as if they did not exist.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from fsdp.common.device import SideCopies

__all__ = [
    "check_not_wrapped_already",
    "claim_modules",
    "mark_flattened",
    "registrations",
    "unsynced",
]

# [Note: optimizers over flattened parameters]
# An optimizer built before wrapping holds the original parameters, which never get a gradient
# again: torch optimizers skip them silently, and training does nothing. The originals are marked
# when a wrapper flattens them (the meta ones a deferred initialization replaced included), and
# one global step pre-hook refuses an optimizer holding one. It scans an optimizer's parameters
# again only when something changed since its last scan: a wrapper flattened more parameters, or
# the optimizer's parameter lists (their objects or lengths). The marks are weak references by
# identity, not attributes, so a parameter pickled and loaded elsewhere does not carry one.
_FLATTENED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original parameter -> its name
_MARKS = [0]  # how many times parameters were marked, process-wide
_SCANNED: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, ...]] = weakref.WeakKeyDictionary()
_HOOK: list[Any] = []


# flat parameters of the roots now inside no_sync(), by root; empty nearly always
_UNSYNCED: dict[int, frozenset[int]] = {}


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # A step writes host shards in place: under CPU offload on CUDA, wait for the side-stream copies
    # that may still read them (a forward with grad enabled whose graph was dropped without a
    # backward leaves its gathers' copies queued). Nothing to wait for after a backward, which
    # drained the side stream; no instance exists off CUDA.
    SideCopies.synchronize_all()
    if _UNSYNCED:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(held & flat for flat in _UNSYNCED.values()):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() inside FullyShardedDataParallel.no_sync(): the gradients "
                "accumulated there are not reduced yet and not in .grad, so the step would use stale ones. Step "
                "after the backward outside no_sync()"
            )
    groups = optimizer.param_groups
    key = (_MARKS[0], *(id(group["params"]) for group in groups), *(len(group["params"]) for group in groups))
    if _SCANNED.get(optimizer) == key:
        return
    params = [p for group in groups for p in group["params"]]
    stale = [_FLATTENED[p] for p in params if p in _FLATTENED]
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__} holds parameters that FullyShardedDataParallel flattened (e.g. {stale[:3]}); "
            "they never get a gradient again. Build the optimizer after wrapping, from the wrapper's parameters(). "
            "If it was built after wrapping, a module outside the wrapper still uses one of them: a parameter tied "
            "(shared) with a wrapped module, such as an output layer tied to a wrapped embedding. Wrap a module that "
            "contains every user of the tied parameter"
        )
    _SCANNED[optimizer] = key


def _ensure_hook() -> None:
    """Register the process-wide optimizer step pre-hook once."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def mark_flattened(owned: Iterable[tuple[str, nn.Parameter]]) -> None:
    """Mark the original parameters a wrapper flattened. See [Note: optimizers over flattened parameters]."""
    for fqn, p in owned:
        _FLATTENED[p] = fqn
    _MARKS[0] += 1
    _ensure_hook()


@contextlib.contextmanager
def unsynced(root: object, flat_params: Iterable[torch.Tensor]) -> Iterator[None]:
    """While inside, an optimizer step over ``flat_params`` is refused (``root.no_sync()``)."""
    key = id(root)
    previous = _UNSYNCED.get(key)
    _UNSYNCED[key] = frozenset(id(p) for p in flat_params)
    _ensure_hook()
    try:
        yield
    finally:
        if previous is None:
            del _UNSYNCED[key]
        else:
            _UNSYNCED[key] = previous


# module -> weak reference to the live wrapper that flattened its parameters
_FLATTENED_BY: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def claim_modules(wrapper: object, modules: Iterable[nn.Module]) -> None:
    """Record that ``wrapper`` flattened the parameters of ``modules`` (see :func:`check_not_wrapped_already`)."""
    ref = weakref.ref(wrapper)
    for m in modules:
        _FLATTENED_BY[m] = ref


def check_not_wrapped_already(module_of: dict[str, nn.Module]) -> None:
    """Refuse to wrap a module (``module_of``: the modules a new wrapper would own, by name) whose
    parameters a live wrapper flattened."""
    for name, m in module_of.items():
        ref = _FLATTENED_BY.get(m)
        if ref is not None and ref() is not None:
            raise ValueError(
                f"FullyShardedDataParallel: module {name or '<the wrapped module>'!r} ({type(m).__name__}) is already "
                "wrapped by another FullyShardedDataParallel, which holds its parameters; wrap each module once "
                "(nest wrappers by wrapping the outer module around the inner wrapper, or build the model again)"
            )


# [Note: parameters added after wrapping]
# A wrapped module holds no parameters of its own while idle (the flat parameters replaced them),
# so one found there was added after wrapping: nothing shards or reduces it, and each rank would
# train it on its own gradients (a whole submodule attached at a path the module did not have is
# torch's skip idiom instead, adopted as ignored first: see [Note: ignored modules] in fsdp/core/flat_param.py). The root
# looks at its first forward, and again at a later forward only when some module of the process
# registered a parameter or a submodule since its last look
# (torch's global registration hooks bump a counter), so a step costs one integer comparison. A
# model whose forward builds modules (``nn.GELU()`` in forward) moves the counter every step, and
# pays a walk of the module tree per forward. The walk is ``flat_param.check_no_parameters_added``.
_REGISTRATIONS = [0]
_REGISTRATION_HOOKS: list[Any] = []


def _count_registration(module: nn.Module, name: str, value: Any) -> None:
    _REGISTRATIONS[0] += 1


def registrations() -> int:
    """How many parameters and submodules were registered in this process (counted from the first call)."""
    if not _REGISTRATION_HOOKS:
        from torch.nn.modules import module as module_lib

        _REGISTRATION_HOOKS.append(
            module_lib.register_module_parameter_registration_hook(_count_registration)
        )
        _REGISTRATION_HOOKS.append(module_lib.register_module_module_registration_hook(_count_registration))
    return _REGISTRATIONS[0]
