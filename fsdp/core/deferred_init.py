"""Deferred initialization: a model built on the meta device is materialized one wrapper at a time.

Build the model under ``torch.device("meta")`` (no memory), wrap it innermost first, and each
wrapper materializes only the modules it owns, initializes them, flattens and shards them, and
drops the full tensors before the next wrapper is built. No rank ever holds more than one unit's
full parameters, and after wrapping each rank holds its ``1/N`` shards only.

Initialization runs ``param_init_fn(module)`` when given, else the module's own
``reset_parameters()``, module by module in a fixed order, so ranks seeded alike produce identical
values (each then keeps its own slice).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["has_meta_tensors", "materialize_", "materialize_if_meta_"]


def has_meta_tensors(owned: list[tuple[str, nn.Parameter]], modules: dict[str, nn.Module]) -> bool:
    """Whether this unit is to be materialized: all its parameters (at least one) are on the meta
    device, or it has none and some buffer is. A mix of meta and real parameters is left for the
    caller to refuse as parameters on several devices."""
    if owned:
        return all(p.is_meta for _, p in owned)
    return any(b is not None and b.is_meta for m in modules.values() for b in m._buffers.values())


def materialize_(
    owned: list[tuple[str, nn.Parameter]],
    modules: dict[str, nn.Module],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> None:
    """Give every meta parameter and buffer of ``modules`` real memory on ``device`` and initialize it.

    ``owned`` lists every name of every owned parameter (tied ones included), so that a parameter
    shared by two modules stays one tensor after materialization. Modules are processed one at a
    time, parent before child: their meta tensors get empty memory on ``device`` (real ones are
    kept), then ``param_init_fn(module)`` or ``module.reset_parameters()`` runs.
    """
    names_of: dict[int, list[tuple[nn.Module, str]]] = {}
    for fqn, p in owned:
        module_name, _, param_name = fqn.rpartition(".")
        names_of.setdefault(id(p), []).append((modules[module_name], param_name))
    # the tensors before: an initialization that raises part-way leaves the unit on the meta
    # device as it was, not half real (with uninitialized memory a second wrap would accept)
    before = {id(m): (m, dict(m._parameters), dict(m._buffers)) for m in modules.values()}
    try:
        _materialize(names_of, modules, device, param_init_fn)
    except BaseException as e:
        for m, params, buffers in before.values():
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
        if sys.version_info >= (3, 11):  # (notes are new in 3.11)
            e.add_note(
                "FullyShardedDataParallel: the module was left on the meta device, as it was before the wrap"
            )
        raise


def _materialize(
    names_of: dict[int, list[tuple[nn.Module, str]]],
    modules: dict[str, nn.Module],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> None:
    replaced: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its materialized successor
    seen: set[int] = set()
    for name, module in modules.items():
        if id(module) in seen:
            continue
        seen.add(id(module))
        params = {n: p for n, p in module._parameters.items() if p is not None}
        pending = [p for p in params.values() if p.is_meta and id(p) not in replaced]
        buffers = [b for b in module._buffers.values() if b is not None and b.is_meta]
        if not pending and not buffers:
            continue
        # like to_empty(recurse=False), but a real tensor among meta ones keeps its values
        module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t, recurse=False)  # type: ignore[no-untyped-call]
        if param_init_fn is not None:
            with torch.no_grad():  # in-place initialization of leaves that require grad
                param_init_fn(module)
        elif callable(getattr(module, "reset_parameters", None)):
            with torch.no_grad():
                module.reset_parameters()  # type: ignore[operator]
        else:
            raise ValueError(
                f"FullyShardedDataParallel: {type(module).__name__} at {name or '<root>'!r} is on the meta device and "
                "has no reset_parameters(); pass param_init_fn=... to initialize it after materialization"
            )
        for n, old in params.items():
            if old.is_meta and id(old) not in replaced:
                replaced[id(old)] = module._parameters[n]  # type: ignore[assignment]
    # a tied parameter is one tensor again: every name of it points at the same successor
    for old_id, new in replaced.items():
        for module, param_name in names_of.get(old_id, []):
            if module._parameters.get(param_name) is not new:
                module._parameters[param_name] = new


def materialize_if_meta_(
    module: nn.Module,
    owned: list[tuple[str, nn.Parameter]],
    modules: dict[str, nn.Module],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> bool:
    """Materialize the unit when it is on the meta device (see :func:`has_meta_tensors`); return
    whether it was. ``param_init_fn`` for a unit that is not on the meta device is an error."""
    if has_meta_tensors(owned, modules):
        materialize_(owned, modules, device, param_init_fn)
        return True
    if param_init_fn is not None and owned:  # (one that owns nothing: the same config as its inner ones)
        raise ValueError(
            "FullyShardedDataParallel: param_init_fn initializes modules built on the meta device, but "
            f"{type(module).__name__} has no meta parameters or buffers; drop param_init_fn"
        )
    return False
