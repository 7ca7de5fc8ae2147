"""Mixed precision: resolving the dtype options, casting inputs and buffers.

The casting of flat-parameter shards before the all-gather, and of gradients around the
reduction, lives with the tensors in :mod:`fsdp.core.handle`; see [Note: flat parameter data].
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fsdp.api import MixedPrecision, PrecisionConfig, from_torch_fsdp

__all__ = ["buffers_for_mode", "cast_inputs", "move_owned_buffers", "resolve_precision"]


def resolve_precision(
    mixed_precision: Any,
    compute_dtype: torch.dtype | None,
    buffer_dtype: torch.dtype | None,
    fp32_reduce_scatter: bool,
    force_input_to_fp32: bool,
    clear_autocast_cache: bool,
    owned: list[tuple[str, nn.Parameter]],
) -> PrecisionConfig:
    """Map fairscale's flags (or a MixedPrecision) onto one validated PrecisionConfig."""
    for name, value in (("compute_dtype", compute_dtype), ("buffer_dtype", buffer_dtype)):
        if value is not None and not isinstance(value, torch.dtype):
            raise TypeError(
                f"FullyShardedDataParallel: `{name}` must be a torch.dtype or None, got {value!r}"
            )
    if buffer_dtype is not None and not buffer_dtype.is_floating_point:
        raise ValueError(
            f"FullyShardedDataParallel: `buffer_dtype` is the dtype floating-point buffers are cast to, so it "
            f"must be a floating-point dtype, got {buffer_dtype}; pass e.g. torch.float32, or None to keep them"
        )
    mixed_precision = from_torch_fsdp(mixed_precision)
    if isinstance(mixed_precision, MixedPrecision):
        if compute_dtype is not None or buffer_dtype is not None or fp32_reduce_scatter:
            raise ValueError(
                "FullyShardedDataParallel: pass either mixed_precision=MixedPrecision(...) or fairscale's "
                "compute_dtype / buffer_dtype / fp32_reduce_scatter, not both"
            )
        mp: MixedPrecision | None = mixed_precision
    elif mixed_precision is True:
        for name, value in (("compute_dtype", compute_dtype), ("buffer_dtype", buffer_dtype)):
            if value is not None and value not in (torch.float16, torch.bfloat16, torch.float32):
                raise ValueError(
                    f"FullyShardedDataParallel: `{name}` with mixed_precision=True must be torch.float16, "
                    f"torch.bfloat16 or torch.float32, got {value}"
                )
        mp = MixedPrecision(
            param_dtype=compute_dtype or torch.float16,
            reduce_dtype=torch.float32 if fp32_reduce_scatter else None,
            buffer_dtype=buffer_dtype or compute_dtype or torch.float16,
            cast_root_forward_inputs=True,
        )
    elif mixed_precision is False or mixed_precision is None:
        mp = None
    else:
        raise TypeError(
            f"FullyShardedDataParallel: `mixed_precision` must be a bool or fsdp.MixedPrecision, got {mixed_precision!r}"
        )
    if mp is None or mp.param_dtype is None:  # no parameter cast (a MixedPrecision may still cast the rest)
        if fp32_reduce_scatter:
            raise ValueError(
                "FullyShardedDataParallel: fp32_reduce_scatter=True only applies with mixed_precision=True "
                "(full-precision gradients are already reduced in fp32); drop it or enable mixed precision"
            )
        if compute_dtype is not None:
            bad = sorted(
                {str(p.dtype) for _, p in owned if p.is_floating_point() and p.dtype != compute_dtype}
            )
            if bad:
                raise ValueError(
                    f"FullyShardedDataParallel: compute_dtype={compute_dtype} with mixed_precision=False means the "
                    f"parameters already are {compute_dtype} (pure low precision), but some are {', '.join(bad)}. "
                    "Pass mixed_precision=True to keep fp32 master weights and compute in that dtype, or convert "
                    "the module first"
                )
        for fqn, p in owned:
            if not (p.is_floating_point() or p.is_complex()) and p.requires_grad:
                raise ValueError(
                    f"FullyShardedDataParallel: parameter {fqn!r} has dtype {p.dtype} and requires grad"
                )
        if mp is not None:  # torch's reading: the reduction and the buffers may still be cast
            return PrecisionConfig(
                reduce_dtype=mp.reduce_dtype,
                buffer_dtype=mp.buffer_dtype,
                force_input_to_fp32=force_input_to_fp32,
                clear_autocast_cache=clear_autocast_cache,
                keep_low_precision_grads=mp.keep_low_precision_grads,
            )
        return PrecisionConfig(
            buffer_dtype=buffer_dtype,
            force_input_to_fp32=force_input_to_fp32,
            clear_autocast_cache=clear_autocast_cache,
        )
    for (
        fqn,
        p,
    ) in owned:  # the parameters' own dtype is the master dtype (fp64 kept, as torch and fairscale do)
        if p.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"FullyShardedDataParallel: mixed precision keeps fp32 (or fp64) master weights, but parameter "
                f"{fqn!r} is {p.dtype}. Convert the module with .float() before wrapping (integer parameters "
                "cannot be used with mixed precision; register them as buffers instead)"
            )
    return PrecisionConfig(
        param_dtype=mp.param_dtype,
        reduce_dtype=mp.reduce_dtype,
        buffer_dtype=mp.buffer_dtype,
        cast_root_forward_inputs=mp.cast_root_forward_inputs or mp.cast_forward_inputs,
        force_input_to_fp32=force_input_to_fp32,
        clear_autocast_cache=clear_autocast_cache,
        cast_forward_inputs=mp.cast_forward_inputs,
        torch_input_casts=mixed_precision is not True,  # (a MixedPrecision: torch's way)
        keep_low_precision_grads=mp.keep_low_precision_grads,
    )


def cast_inputs(obj: Any, src: torch.dtype | None, dst: torch.dtype, detach: bool) -> Any:
    """Cast every ``src`` tensor (``None``: every floating-point one) in a nest of tuples, lists and
    dicts to ``dst``.

    With ``detach`` the cast is not recorded by autograd (the root's inputs), and a leaf keeps its
    ``requires_grad``; otherwise gradients flow back through the cast.
    """
    if isinstance(obj, torch.Tensor):
        if obj.dtype == dst or (obj.dtype != src if src is not None else not obj.is_floating_point()):
            return obj
        if detach:
            with torch.no_grad():
                out = obj.to(dst)
            if obj.is_leaf and obj.requires_grad:
                out.requires_grad_(True)
            return out
        return obj.to(dst)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_inputs(v, src, dst, detach) for v in obj))
    if isinstance(obj, tuple):
        return type(obj)(cast_inputs(v, src, dst, detach) for v in obj)
    if isinstance(obj, (list, dict)):
        cast = [
            (k, cast_inputs(v, src, dst, detach))
            for k, v in (enumerate(obj) if isinstance(obj, list) else obj.items())
        ]
        try:  # a shallow copy keeps a subclass's state (a defaultdict's factory)
            copied = copy.copy(obj)
            for k, v in cast:
                copied[k] = v
            return copied
        except TypeError:  # an immutable subclass (torch.fx's immutable_dict): build a new one
            values = [v for _, v in cast] if isinstance(obj, list) else dict(cast)
            try:
                return type(obj)(values)
            except TypeError:
                return values
    return obj


def move_owned_buffers(
    module: nn.Module,
    device: torch.device,
    dtype: torch.dtype | None,
    is_wrapper: Callable[[nn.Module], bool],
) -> dict[str, torch.dtype]:
    """Move the buffers a wrapper owns (none under an inner wrapper) to ``device``, floating ones to
    ``dtype``; return every owned buffer's dtype before the move, by name."""
    original: dict[str, torch.dtype] = {}
    if is_wrapper(module):  # FSDP(FSDP(m)): the inner wrapper owns them
        return original

    stack = [(module, "")]  # depth first, in module order (a recursive closure would be a reference cycle)
    while stack:
        m, prefix = stack.pop()
        for name, b in m._buffers.items():
            if b is None:
                continue
            original[prefix + name] = b.dtype
            cast = dtype if dtype is not None and b.is_floating_point() else b.dtype
            if b.device != device or b.dtype != cast:
                m._buffers[name] = b.to(device=device, dtype=cast)
        children = [
            (c, prefix + n + ".") for n, c in m._modules.items() if c is not None and not is_wrapper(c)
        ]
        stack.extend(reversed(children))
    return original


def buffers_for_mode(
    module: nn.Module, original: Mapping[str, torch.dtype], buffer_dtype: torch.dtype | None, full: bool
) -> None:
    """torch's rule under ``FSDP_USE_FULL_PREC_IN_EVAL=1`` for the buffers a wrapper owns (named in
    ``original``, relative to ``module``, with their dtypes before wrapping): a full-precision forward
    (eval) puts them back in their own dtypes, where they stay until a forward in the compute dtype
    casts the floating ones to ``buffer_dtype`` again. A buffer is copied only when its dtype changes."""
    for name, dtype in original.items():
        if not full and (buffer_dtype is None or not dtype.is_floating_point):
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        kept = owner._buffers.get(attr)
        target = dtype if full else buffer_dtype
        if kept is not None and kept.dtype != target:
            owner._buffers[attr] = kept.to(target)
