"""State dicts beyond the full one: the sharded (DCP) form, loading a full one, and a wrapper under a plain parent.

The wrapper describes itself once as a :class:`~fsdp.core.layout.Layout` (``describe`` in
``fsdp/core/layout.py``: every wrapper's flat parameters, every original parameter, every
persistent buffer, the unwrapped model's ``state_dict()`` keys). Everything here works on that
description and never imports the wrapper (loading a full state dict acts on the wrappers it is
given, as ``fsdp.core.wrapper_protocol.Wrapper``).

- **local**: this rank's flat shards; in ``fsdp/state/local.py``.
- **sharded**: one entry per original parameter for ``torch.distributed.checkpoint`` (DCP), which
  reshards it from any world size to any other. See [Note: sharded state dict layout].

[Note: sharded state dict layout]
A flat shard cuts the original parameters at arbitrary element offsets, which DCP cannot describe
as blocks of the parameters. So the sharded state dict holds each original parameter (original
shape, fp32 master values) as a ``DTensor`` sharded by rows, ``Shard(0)``, over the data-parallel
group: rank ``r`` holds rows ``[r * c, (r + 1) * c)`` with ``c = ceil(rows / N)`` (``torch.chunk``'s
rule, the one DTensor and DCP use). A 0-dim parameter is a plain tensor, which DCP treats as
replicated. Building it gathers one flat parameter at a time within its shard group and keeps this
rank's rows; loading gathers one flat parameter's rows over the data-parallel group and keeps this
rank's flat chunk. Example, 2 ranks, one flat parameter holding ``w`` (3x2) then ``b`` (2)::

    flat = [w00 w01 w10 w11 w20 w21 | b0 b1]     chunk 4: rank 0 [w00 .. w11], rank 1 [w20 w21 b0 b1]
    sharded: w rows 0-1 on rank 0, row 2 on rank 1; b element 0 on rank 0, element 1 on rank 1

At most one flat parameter is full at a time, the same memory as ``state_dict()``; the result is
1/N of the model per rank. The format is the one torch's own FSDP2 writes (original names and
shapes, row-sharded DTensors), so its checkpoints and ours load into each other.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from fsdp.api import TrainingState
from fsdp.comm.consistency import CHECKPOINT_WRAPPED, WRAPPED, is_activation_wrapper, plain_name
from fsdp.core.layout import (
    Layout,
    agree,
    digest_of,
    empty_sharded,
    gather_full_flat,
    is_dtensor,
    shard_writes,
    to_sharded,
    value_kind,
    write_shard_,
)
from fsdp.core.wrapper_protocol import Wrapper, as_module

__all__ = [
    "ShardedLoadPlan",
    "apply_sharded_state_dict",
    "check_sharded_state_dict",
    "load_sharded_state_dict",
    "module_names",
    "own_call",
    "own_call_running",
    "own_full_values",
    "sharded_state_dict",
    "sharded_state_dict_template",
    "skip_children_once",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- a wrapper under a plain parent
# See [Note: loading through a plain parent] in fsdp/wrapper/state_methods.py.
_depth = threading.local()  # .load / .save > 0 while a wrapper's load_state_dict / state_dict runs


@contextlib.contextmanager
def own_call(kind: str) -> Iterator[None]:
    """Marks a wrapper's own ``load_state_dict`` or ``state_dict`` (``kind`` "load" or "save") on
    this thread, so the wrappers and the walk inside it know they are not a parent's."""
    setattr(_depth, kind, own_call_running(kind) + 1)
    try:
        yield
    finally:
        setattr(_depth, kind, own_call_running(kind) - 1)


def own_call_running(kind: str) -> int:
    return int(getattr(_depth, kind, 0))


class _NoChildrenOnce(dict):  # type: ignore[type-arg]
    """Stands in for a module's ``_modules`` until torch's load walk, right after the module's
    ``_load_from_state_dict``, asks for its children: it gets none, and the real ones are back.
    Any other use puts them back too (and sees them)."""

    def __init__(self, module: nn.Module, children: dict[str, Any]) -> None:
        super().__init__()
        self._module, self._children = module, children

    def _restore(self) -> dict[str, Any]:
        self._module.__dict__["_modules"] = self._children
        return self._children

    def items(self) -> Any:  # the walk's call
        self._restore()
        return iter(())

    def __getitem__(self, key: str) -> Any:
        return self._restore()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._restore()

    def __iter__(self) -> Iterator[str]:
        return iter(self._restore())

    def __len__(self) -> int:
        return len(self._restore())

    def keys(self) -> Any:
        return self._restore().keys()

    def values(self) -> Any:
        return self._restore().values()

    def get(self, key: str, default: Any = None) -> Any:
        return self._restore().get(key, default)


def skip_children_once(module: nn.Module) -> None:
    """Have torch's load walk, now at ``module``, not descend into it (its part was loaded)."""
    module.__dict__["_modules"] = _NoChildrenOnce(module, module.__dict__["_modules"])


# ---------------------------------------------------------------------- sharded (DCP) state dict
def sharded_state_dict(layout: Layout) -> dict[str, torch.Tensor]:
    """Every original parameter as a row-sharded DTensor (fp32 masters), every ignored parameter as
    this rank's plain tensor, and every persistent buffer (original dtype), keyed by name in the
    unwrapped model. Collective. See [Note: sharded state dict layout].

    A tied parameter appears once, under its first name. The ignored parameters, and the buffers kept
    in their original dtype, are the module's own tensors (detached), as in ``state_dict()`` and in
    torch FSDP1; the rest are copies.
    """
    mesh = layout.mesh()
    out: dict[str, torch.Tensor] = {}
    for h in layout.handles():
        full = gather_full_flat(h, h.flat_param.detach())
        for slot in layout.slots(h):
            out[slot.name] = to_sharded(slot.view(full), layout, mesh, h.shard_device)
        del full
    for s in layout.ignored:
        out[s.name] = s.param.detach()
    for b in layout.buffers:
        out[b.name] = b.tensor.detach().to(b.dtype)
    return {k: out[k] for k in layout.keys if k in out}


def sharded_state_dict_template(layout: Layout) -> dict[str, torch.Tensor]:
    """:func:`sharded_state_dict` with uninitialized values and no communication: a target for DCP to load into."""
    mesh = layout.mesh()
    out: dict[str, torch.Tensor] = {}
    for slot in layout.params:
        out[slot.name] = empty_sharded(
            slot.shape, slot.handle.meta.dtype, layout, mesh, slot.handle.shard_device
        )
    for s in layout.ignored:
        out[s.name] = torch.empty_like(s.param.detach())
    for b in layout.buffers:
        out[b.name] = torch.empty(b.tensor.shape, dtype=b.dtype, device=b.tensor.device)
    return {k: out[k] for k in layout.keys if k in out}


@dataclass
class ShardedLoadPlan:
    """A checked sharded model state dict, ready to be applied (see :func:`check_sharded_state_dict`)."""

    values: dict[str, torch.Tensor]  # parameter or buffer name -> value
    missing: list[str]
    unexpected: list[str]
    errors: list[str]
    digest: str  # the kinds of the values: every rank must agree before applying


def check_sharded_state_dict(layout: Layout, state: Mapping[str, Any], strict: bool) -> ShardedLoadPlan:
    """Match ``state`` to the model: names (a tied parameter under any of its names), shapes. No writes."""
    values: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    errors: list[str] = []
    known: set[str] = set()
    kinds = []
    targets = [(s.name, (s.name, *s.aliases), s.shape) for s in layout.params]
    targets += [(s.name, (s.name, *s.aliases), s.shape) for s in layout.ignored]
    targets += [(b.name, (b.name,), tuple(b.tensor.shape)) for b in layout.buffers]
    for name, names, shape in targets:
        known.update(names)
        value = next((state[n] for n in names if n in state), None)
        if value is None:
            missing.append(name)
        elif not isinstance(value, torch.Tensor):
            errors.append(f"{name!r}: expected a tensor, got {type(value).__name__}")
        elif tuple(value.shape) != shape:
            errors.append(f"{name!r}: shape {tuple(value.shape)} in the checkpoint, {shape} in the model")
        else:
            values[name] = value
            kinds.append((name, value_kind(value, layout)))
    unexpected = [k for k in state if k not in known]
    if strict and missing:
        errors.append("missing key(s): " + ", ".join(repr(k) for k in missing))
    if strict and unexpected:
        errors.append("unexpected key(s): " + ", ".join(repr(k) for k in unexpected))
    return ShardedLoadPlan(values, missing, unexpected, errors, digest_of(kinds))


def apply_sharded_state_dict(layout: Layout, plan: ShardedLoadPlan) -> NamedTuple:
    """Write a checked plan into the shards and buffers. Collective; every rank must have agreed on it."""
    for h in layout.handles():
        values = [plan.values.get(slot.name) for slot in layout.slots(h)]
        if any(v is not None for v in values):
            write_shard_(h, shard_writes(h, values, layout, h.meta.dtype))
    with torch.no_grad():
        plain = [(s.name, s.param) for s in layout.ignored] + [(b.name, b.tensor) for b in layout.buffers]
        for name, tensor in plain:
            value = plan.values.get(name)
            if value is not None:
                tensor.copy_(value.full_tensor() if is_dtensor(value) else value)
    return _IncompatibleKeys(plan.missing, plan.unexpected)


def load_sharded_state_dict(layout: Layout, state: Mapping[str, Any], strict: bool = True) -> NamedTuple:
    """Load a sharded state dict (from :func:`sharded_state_dict`, filled by ``torch.distributed.checkpoint.load``,
    or any mix of row-sharded DTensors, other DTensors and full tensors). Collective.

    Every rank checks names and shapes and the ranks agree before anything is written: on an error
    the model is unchanged on every rank.
    """
    plan = check_sharded_state_dict(layout, state, strict)
    agree(
        layout,
        "\n  ".join(plan.errors) or None,
        "FullyShardedDataParallel.load_sharded_state_dict (nothing was loaded)",
        plan.digest,
    )
    return apply_sharded_state_dict(layout, plan)


def positional_args(
    args: tuple[Any, ...], destination: Any, prefix: str, keep_vars: bool
) -> tuple[Any, str, bool]:
    """``state_dict(destination, prefix, keep_vars)`` given positionally, as ``nn.Module`` still
    accepts with a deprecation warning (fairscale's wrapper passed them on)."""
    if len(args) > 3:
        raise TypeError(f"state_dict() takes at most 3 positional arguments, got {len(args)}")
    warnings.warn(
        "Positional arguments to state_dict() are deprecated (as in torch); pass destination=, prefix=, "
        "keep_vars= by keyword",
        FutureWarning,
        stacklevel=3,
    )
    given = [*args, *[destination, prefix, keep_vars][len(args) :]]
    return given[0], str(given[1]), bool(given[2])


def module_names(root: nn.Module) -> list[tuple[str, str, str]]:
    """``(name, state name, load name)`` of every module under ``root`` (shared ones under each name).

    The state name is the unwrapped model's: without this library's wrapper levels nor those of
    torch's activation checkpoint / offload wrappers, whose state-dict hooks drop their level. The
    load name keeps this library's levels but not those: the wrappers' load pre-hooks add theirs
    back. A plain child that happens to be called ``_checkpoint_wrapped_module`` keeps its name."""
    out: list[tuple[str, str, str]] = []
    stack: list[tuple[nn.Module, str, str, str]] = [(root, "", "", "")]
    while stack:
        m, name, state, load = stack.pop()
        out.append((name, state, load))
        hidden = CHECKPOINT_WRAPPED if is_activation_wrapper(m) else None
        for n, c in reversed(m._modules.items()):
            if c is None:
                continue
            child = f"{name}.{n}" if name else n
            if n == hidden:
                stack.append((c, child, state, load))
                continue
            child_state = state if n == WRAPPED else (f"{state}.{n}" if state else n)
            stack.append((c, child, child_state, f"{load}.{n}" if load else n))
    return out


def own_full_values(
    wrapped: nn.Module,
    handles: Sequence[Any],
    buffer_dtypes: Mapping[str, torch.dtype],
    destination: dict[str, Any],
    prefix: str,
    device: torch.device,
    keep: bool,
) -> None:
    """In a wrapper's part of a full state dict (written while its full parameters are shown),
    replace the views of its flat parameters by copies on ``device`` (removed where not ``keep``:
    ``state_dict_on_rank_0_only`` off rank 0), a tied parameter by its primary's copy, and cast its
    buffers to their state dict dtypes."""

    def put(key: str, value: torch.Tensor | None) -> None:
        if value is None:
            del destination[key]
        else:
            destination[key] = value

    # the keys as the state dict has them: torch's activation checkpoint wrappers inside the unit
    # dropped their level (their state-dict hooks ran during the walk)
    renamed: dict[str, str] | None = None

    def key_of(name: str) -> str:
        nonlocal renamed
        if CHECKPOINT_WRAPPED not in name:
            return prefix + name
        if renamed is None:
            renamed = {real: state for real, state, _ in module_names(wrapped)}
        module_name, _, leaf = name.rpartition(".")
        mapped = renamed.get(module_name, module_name)
        return prefix + (f"{mapped}.{leaf}" if mapped else leaf)

    for h in handles:
        clones: dict[int, torch.Tensor | None] = {}
        for i, info in enumerate(h.meta.params):
            key = key_of(info.fqn)
            if key in destination:
                clones[i] = destination[key].detach().to(device, copy=True) if keep else None
                put(key, clones[i])
        for sinfo in h.meta.shared:
            key = key_of(sinfo.fqn)
            if key in destination:
                put(key, clones.get(sinfo.primary))
    for name, dtype in buffer_dtypes.items():
        key = key_of(name)
        value = destination.get(key)
        if isinstance(value, torch.Tensor) and value.dtype != dtype:
            destination[key] = value.to(dtype)


def load_full_state_dict(
    root: Wrapper,
    wrappers: Sequence[Wrapper],
    layout: Layout,
    state_dict: Mapping[str, Any],
    strict: bool,
    errors_out: list[str] | None = None,
    prefix: str = "",
) -> NamedTuple:
    """Load a full state dict with the unwrapped module's keys into a wrapper tree; report keys
    under their plain names. Collective: every rank gathers every unit, in module order.

    First the ranks agree that they pass state dicts of one structure (keys, shapes), so a rank
    with another dict (e.g. the empty one ``state_dict_on_rank_0_only`` leaves on other ranks)
    makes every rank raise before anything is loaded. Plain names are then mapped onto the tree's
    internal module names (which contain the wrappers' ``_fsdp_wrapped_module``), and
    ``nn.Module.load_state_dict`` does the loading. Each wrapper shows its full parameters only
    while its own part loads: a load pre-hook gathers them before the wrapper's subtree is visited,
    and a post-hook, which runs once the subtree is done, writes them back to the shards and frees
    them. So at most one unit and its ancestors are full at a time, as in ``state_dict()``. With
    ``errors_out`` (a parent's load walk), errors such as size mismatches go there, their keys under
    ``prefix``, instead of being raised. Where
    user load code runs above an inner wrapper (a load hook, or a ``_load_from_state_dict``
    override, on a module or wrapper that contains one), it may touch the inner units' parameters,
    so every unit is shown for the whole load instead, as fairscale does.
    """
    structure = sorted(
        (k, tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__)
        for k, v in state_dict.items()
    )
    agree(
        layout,
        None,
        "FullyShardedDataParallel.load_state_dict (nothing was loaded; a state dict saved with "
        "state_dict_on_rank_0_only=True is empty on the other ranks: load the saved file on every rank)",
        digest_of(structure),
    )
    if _user_code_above_a_unit(as_module(root), wrappers):
        with root.summon_full_params(recurse=True):
            return _load_renamed(root, state_dict, strict, errors_out, prefix)
    shown: list[Wrapper] = []
    visited: list[Wrapper] = []

    def show(w: Wrapper) -> Callable[..., None]:
        def pre_hook(*args: Any) -> None:
            w.training_state = TrainingState.SUMMON_FULL_PARAMS
            visited.append(w)
            shown.append(w)
            w._show_full_params()

        return pre_hook

    def hide(w: Wrapper, *args: Any) -> None:
        if w in shown:  # a wrapper's post-hook runs after its whole subtree
            shown.remove(w)
            w._hide_full_params(write_back=True)
            w.training_state = TrainingState.IDLE

    hooks = []
    for w in wrappers:
        module = as_module(w)
        first = module._register_load_state_dict_pre_hook(show(w))  # type: ignore[no-untyped-call]
        pre_hooks: Any = module._load_state_dict_pre_hooks  # (an OrderedDict)
        pre_hooks.move_to_end(first.id, last=False)  # before the user's own
        hooks += [first, module.register_load_state_dict_post_hook(hide)]  # type: ignore[no-untyped-call]
    try:
        return _load_renamed(root, state_dict, strict, errors_out, prefix)
    except BaseException:
        # User code raised part-way (on this rank only, perhaps): what was loaded is kept, as in
        # torch, and the gathers the other ranks still make are paired before the error goes on.
        for w in reversed(list(shown)):
            hide(w)
        for w in wrappers:
            if not any(w is v for v in visited):
                w._show_full_params()
                w._hide_full_params(write_back=False)
        raise
    finally:
        for hook in hooks:
            hook.remove()
        for w in reversed(list(shown)):
            hide(w)


def _user_code_above_a_unit(root: nn.Module, wrappers: Sequence[Wrapper]) -> bool:
    """Whether a module that contains an inner wrapper has load hooks or its own ``_load_from_state_dict``."""
    is_wrapper = {id(w) for w in wrappers}
    modules = dict(root.named_modules(remove_duplicate=False))
    above: set[str] = set()
    for name, m in modules.items():
        if name and id(m) in is_wrapper:
            parts = name.split(".")
            above.update(".".join(parts[:i]) for i in range(len(parts)))
    for name in above:
        m = modules[name]
        if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
            return True
        if id(m) not in is_wrapper and type(m)._load_from_state_dict is not nn.Module._load_from_state_dict:
            return True
    return False


def _prefix_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """A hint when the unexpected keys are the missing ones under one extra prefix (``module.``
    from DDP, ``_orig_mod.`` from ``torch.compile``)."""
    wanted = set(missing)
    prefixes: set[str] = set()
    for key in unexpected:
        cuts = [i + 1 for i, c in enumerate(key) if c == "."]
        prefixes.update(key[:i] for i in cuts if key[i:] in wanted)
    if len(prefixes) != 1:
        return ""
    (prefix,) = prefixes
    return (
        f"The unexpected keys are the missing ones with the prefix {prefix!r} (a state dict saved from a wrapped "
        f"model, such as DDP's?): load {{k.removeprefix({prefix!r}): v for k, v in state_dict.items()}}."
    )


def _load_renamed(
    root: Wrapper, state_dict: Mapping[str, Any], strict: bool, errors_out: list[str] | None, prefix: str
) -> NamedTuple:
    module = as_module(root)
    names = module_names(module)
    to_internal = {state: load for _, state, load in names}
    to_state = {name: state for name, state, _ in names}

    def state_key(key: str) -> str:  # an internal key as torch reports it (levels and all)
        module_name, _, leaf = key.rpartition(".")
        mapped = to_state.get(module_name)
        if mapped is None:
            return plain_name(key)
        return f"{mapped}.{leaf}" if mapped else leaf

    def internal(key: str) -> str:
        module_name, _, leaf = key.rpartition(".")
        mapped = to_internal.get(module_name)
        if mapped is None:
            return key
        return f"{mapped}.{leaf}" if mapped else leaf

    renamed: OrderedDict[str, Any] = OrderedDict((internal(k), v) for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        renamed._metadata = OrderedDict((to_internal.get(k, k), v) for k, v in metadata.items())  # type: ignore[attr-defined]
    keys: list[Any] = []  # the root's incompatible keys, as torch hands them to its post-hooks
    capture = module.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
        lambda _, incompatible: keys.append(incompatible)
    )
    errors: list[str] = []
    try:
        result = nn.Module.load_state_dict(module, renamed, strict=False)
    except RuntimeError as e:  # size mismatches: torch names the internal keys
        text = str(e)
        if "Error(s) in loading state_dict" not in text:
            raise
        errors = [plain_name(line) for line in text.split("\n\t")[1:]]
        result = keys[-1] if keys else _IncompatibleKeys([], [])
    finally:
        capture.remove()
    missing = [state_key(k) for k in result.missing_keys]
    unexpected = [state_key(k) for k in result.unexpected_keys]
    if strict:
        hint = _prefix_hint(missing, unexpected)
        if hint:
            errors.insert(0, hint)
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        if unexpected:
            errors.insert(
                0, "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + "."
            )
    if errors and errors_out is not None:
        for line in errors:  # torch's wording names the key after one of these
            for lead in ("size mismatch for ", 'parameter named "'):
                line = line.replace(lead, lead + prefix, 1)
            errors_out.append(line)
    elif errors:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(root._fsdp_wrapped_module).__name__}:\n\t"
            + "\n\t".join(errors)
        )
    return _IncompatibleKeys(missing, unexpected)
