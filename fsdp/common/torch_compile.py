"""``torch.compile`` runs this package's bookkeeping eagerly and compiles the user's computation.

[Note: torch.compile]
A wrapper's forward gathers parameters, points the modules at views of them, registers backward
hooks and frees memory: Python bookkeeping around collectives that the compiler cannot trace (it
stops at the placeholders that stand for sharded parameters). torch's own FSDP is compiled the same
way: the compiler skips the frames of the wrapper's code, which then run eagerly, so each wrapper
is a graph break, and it compiles the frames they call, the wrapped modules' forwards, where the
arithmetic is. The parameters come into those graphs as inputs, so the views made anew at every
forward cause no recompilation. Registering the package's files with the compiler's skip list is a
private torch API (``torch._dynamo.trace_rules.add``, present in every supported torch); without it
a compiled model fails at its first forward instead. ``training/activation_checkpoint.py`` (activation checkpointing)
is user computation and stays traceable; a checkpointed region that holds a wrapper, offloads, or
holds norms tracking statistics goes through the skipped ``training/recompute.py`` and runs eagerly (see there).
``wrapper/direct_call.py`` stays traceable too: its forward pre-hooks sit on the modules inside compiled
forwards and return at once under compilation (a skipped hook would break the graph at every module).
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["TRACED_MODULES", "queue_end_of_backward", "run_eagerly_under_compile"]

log = logging.getLogger(__name__)

# modules whose code belongs in the compiled graph; every other module of the package runs eagerly
TRACED_MODULES = frozenset({"fsdp.training.activation_checkpoint", "fsdp.wrapper.direct_call"})
# (direct_call: its hooks; see its note)
_registered = False


def run_eagerly_under_compile() -> None:
    """Have ``torch.compile`` skip this package's frames (once per process). See [Note: torch.compile]."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        from torch._dynamo import trace_rules

        add = trace_rules.add
    except (ImportError, AttributeError) as e:  # a torch without the compiler's skip list
        log.debug("torch.compile will trace the fsdp package's code (%s)", e)
        return
    for name in package_modules():
        if name not in TRACED_MODULES:
            add(name)
    # Importing the compiler leaves a frame that refers to itself (torch.fx keeps currentframe() in a
    # local), and a frame holds its callers: the constructor that got here, with the module and a
    # deferred-init unit's full parameters, would live until the cyclic collector ran. Collect now,
    # once per process, so that the first wrapper is freed like every later one.
    gc.collect()


def package_modules() -> list[str]:
    """The dotted name of every module file of the package, in its subpackages too (none is imported).

    Packages themselves are left out: the compiler skips a package by its folder, which would take in
    the traced modules."""
    root = Path(__file__).resolve().parents[1]
    return [
        ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for path in sorted(root.rglob("*.py"))
        if path.name != "__init__.py"
    ]


def queue_end_of_backward(callback: Callable[[], None], who: str) -> None:
    """Queue ``callback`` to run when the autograd engine finishes this backward.

    Compiled autograd (``torch._dynamo.config.compiled_autograd = True``) runs the tensor hooks but
    never the engine's queued callbacks, so the gradients would silently never be finished
    (reduced, set, freed): refuse it instead."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    active = ("compiled_autograd_enabled", "in_compiled_autograd_region")  # tracing, running
    if compiled_autograd is not None and any(getattr(compiled_autograd, flag, False) for flag in active):
        raise RuntimeError(
            f"{who} does not support compiled autograd (torch._dynamo.config.compiled_autograd = True): the "
            "end of its backward would never run and no gradient would be reduced. Turn compiled autograd off; "
            "torch.compile of the model itself works"
        )
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]
