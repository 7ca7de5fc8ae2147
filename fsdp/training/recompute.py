"""The eager half of activation checkpointing: torch's checkpoint with batch-norm statistics frozen
during the recomputation.

This module is on the compiler's skip list (see [Note: torch.compile]), so ``run_eagerly`` always
executes eagerly, also when it is called from a compiled region. ``training/activation_checkpoint.py`` calls it for the
regions it does not leave to the compiler: one holding a wrapper of this package, one offloading
its saved inputs, and one holding norms that track statistics (a graph break inside such a region
would make the compiler fall back to an eager checkpoint without the freezing context). Such a
region runs uncompiled as a whole: torch's checkpoint function is itself excluded from compilation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from fsdp.common.device import default_compute_device

__all__ = ["run_eagerly"]


def run_eagerly(
    call: Callable[..., Any], args: tuple[Any, ...], offload_to_cpu: bool, norms: list[nn.Module]
) -> Any:
    """``torch.utils.checkpoint.checkpoint(call, *args)`` (non-reentrant); ``norms`` do not update
    their running statistics again in the recomputation; with ``offload_to_cpu`` the saved inputs
    wait in CPU memory (pinned on CUDA: the copies do not block the host)."""
    options: dict[str, Any] = {}
    if norms:
        options["context_fn"] = lambda: (contextlib.nullcontext(), _running_stats_frozen(norms))
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, call, use_reentrant=False, **options)
    if offload_to_cpu:
        with torch.autograd.graph.save_on_cpu(pin_memory=default_compute_device(set()).type == "cuda"):
            return checkpoint(*args)
    return checkpoint(*args)


@contextlib.contextmanager
def _running_stats_frozen(norms: list[nn.Module]) -> Iterator[None]:
    """During the recomputation, norms do not update their running statistics a second time
    (fairscale's ``patch_batchnorm``): the buffers are copied before and restored after. The
    recomputation itself runs exactly as the forward did (same saved tensors, same outputs)."""
    names = ("running_mean", "running_var", "num_batches_tracked")
    saved = [(m, {n: b.clone() for n in names if (b := getattr(m, n, None)) is not None}) for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, values in saved:
                for n, value in values.items():
                    getattr(m, n).copy_(value)
