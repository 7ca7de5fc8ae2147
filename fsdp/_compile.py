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
a compiled model fails at its first forward instead. ``checkpoint.py`` (activation checkpointing)
is user computation and stays traceable.
"""

from __future__ import annotations

import logging
import pkgutil
from pathlib import Path

__all__ = ["run_eagerly_under_compile"]

log = logging.getLogger(__name__)

_TRACED = frozenset({"checkpoint"})  # modules whose code belongs in the compiled graph
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
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name not in _TRACED:
            add(f"{__package__}.{info.name}")
