"""Activation checkpointing: recompute a module's forward in backward instead of saving activations.

``checkpoint_wrapper(module)`` replaces the forward of that one module instance (as fairscale
does), so the module keeps its type, its parameter names and its state-dict keys, and it composes
with FSDP in both orders:

- ``FSDP(checkpoint_wrapper(m))``: the wrapper's pre-backward hook gathers the parameters and
  points ``m``'s attributes at them before the recomputation reads them.
- ``checkpoint_wrapper(FSDP(m))``: the recomputation calls the wrapper's forward during backward,
  which then only re-points ``m`` at the already gathered parameters.

It uses torch's non-reentrant checkpoint, so the recomputed region takes part in the same backward
pass (one end-of-backward callback, hooks fire once). Batch norms update their running statistics
in the forward only, not again in the recomputation.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from fsdp.common.torch_compile import TRACED_MODULES
from fsdp.training.recompute import run_eagerly

__all__ = ["checkpoint_wrapper", "disable_checkpointing", "is_checkpointed"]

_MARK = "_fsdp_checkpointed"


class _Switch(threading.local):
    disabled = False  # inside disable_checkpointing() on this thread


_SWITCH = _Switch()


@contextlib.contextmanager
def disable_checkpointing() -> Iterator[None]:
    """fairscale's context: inside it (on this thread), checkpointed modules run their plain
    forward, keeping their activations for backward instead of recomputing them. Nests."""
    previous, _SWITCH.disabled = _SWITCH.disabled, True
    try:
        yield
    finally:
        _SWITCH.disabled = previous


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Make ``module`` recompute its forward during backward; return the same module.

    Args:
        module: the module whose activations are not kept for backward (only its inputs are).
        offload_to_cpu: also move the saved inputs to CPU memory until backward needs them (any
            truthy value, as fairscale's flag is read).

    Postcondition: ``module`` computes the same outputs and gradients as before; its parameter names
    and state-dict keys are unchanged.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper takes an nn.Module, got {type(module).__name__}")
    offload_to_cpu = bool(offload_to_cpu)  # (fairscale tests it for truth; configs pass 0/1 or None)
    if is_checkpointed(module):
        raise ValueError(f"checkpoint_wrapper: this {type(module).__name__} is already checkpointed")
    # the bound forward of the instance's class; a weak reference avoids a module -> forward -> module cycle
    original = type(module).forward
    module.forward = functools.partial(_checkpointed_forward, original, weakref.ref(module), offload_to_cpu)  # type: ignore[method-assign]
    setattr(module, _MARK, True)
    return module


def is_checkpointed(module: nn.Module) -> bool:
    return bool(module.__dict__.get(_MARK, False))


def _checkpointed_forward(
    original: Any, module_ref: weakref.ref[nn.Module], offload_to_cpu: bool, *args: Any, **kwargs: Any
) -> Any:
    module = module_ref()
    assert module is not None, "checkpointed module was garbage collected"
    if not torch.is_grad_enabled() or _SWITCH.disabled:  # nothing would be saved / not wanted
        return original(module, *args, **kwargs)
    # Keyword arguments travel as positional ones: torch's checkpoint records the CUDA RNG state only
    # of the devices of its positional tensors (dropout on a tensor passed as x=... would draw other
    # masks in the recomputation), and the CPU offload hook sees only those.
    keys, n = tuple(kwargs), len(args)

    def call(*flat: Any) -> Any:
        return original(module, *flat[:n], **dict(zip(keys, flat[n:], strict=True)))

    flat = (*args, *kwargs.values())
    norms = _norms_tracking_stats(module)
    if torch.compiler.is_compiling() and not norms and not offload_to_cpu and not _holds_eager_code(module):
        # The whole region goes into the compiled graph. A region with norms that track statistics
        # does not: a graph break inside it (or a nested offloading checkpoint) would make the
        # compiler fall back to an eager checkpoint without the context that freezes them.
        return torch.utils.checkpoint.checkpoint(call, *flat, use_reentrant=False)
    return run_eagerly(call, flat, offload_to_cpu, norms)


def _holds_eager_code(module: nn.Module) -> bool:
    """Whether the region calls a forward the compiler skips (a wrapper of this package): then it
    cannot be one compiled graph and runs eagerly, through ``recompute`` (see its docstring)."""
    package = __name__.partition(".")[0]
    return any(
        c.__module__.startswith(f"{package}.") and c.__module__ not in TRACED_MODULES
        for m in module.modules()
        for c in type(m).__mro__
    )


def _norms_tracking_stats(module: nn.Module) -> list[nn.Module]:
    """Batch and instance norms in training mode that update running statistics in forward."""
    return [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
    ]
