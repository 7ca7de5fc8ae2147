"""Meta-device stand-ins for the module attributes of sharded parameters.

See [Note: sharded placeholders]. Imports nothing of the package: the flat-parameter metadata and
the parameter attributes build on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

__all__ = ["is_placeholder", "make_placeholder", "resharded_in_backward"]


# [Note: sharded placeholders]
# While its unit is sharded, an original parameter's module attribute (``layer.weight``) is a
# meta-device stand-in of the original shape, dtype and requires_grad. Metadata reads work; any
# operation on values raises, naming the parameter: without this, ``nn.init.zeros_(layer.weight)``
# or ``layer.weight.requires_grad_(False)`` between steps would act on the stand-in and be ignored
# silently. A call of a module (the wrapped one or one below it) gathers its unit first, so the
# stand-ins meet only operations outside any call (See [Note: calls past the wrapper] in
# fsdp/wrapper/direct_call.py). Setting requires_grad is passed on where the parameter is a flat parameter
# of its own (use_orig_params): torch's staged unfreezing through module attributes.
_METADATA_ATTRS = frozenset(
    {"shape", "dtype", "device", "requires_grad", "ndim", "is_meta", "layout", "grad", "grad_fn", "is_leaf"}
    | {"is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_nested", "names", "itemsize", "nbytes"}
)
_METADATA_METHODS = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
    }
    | {
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.stride,
        torch.Tensor.is_contiguous,
    }
    | {torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.__len__, torch.Tensor.__hash__}
    | {
        torch.Tensor.get_device,
        torch.Tensor.ndimension,
        torch.numel,
        torch.is_floating_point,
        torch.is_complex,
    }
)


class _ShardedPlaceholder(torch.Tensor):
    """See [Note: sharded placeholders]."""

    _fsdp_name: str
    _fsdp_owner: Callable[[], torch.Tensor | None] | None
    _fsdp_reason: str | None  # why it stands where a value was expected (None: a sharded parameter)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        descriptor = getattr(func, "__self__", None)
        attr = getattr(descriptor, "__name__", None) if func.__name__ in ("__get__", "__set__") else None
        metadata = func in _METADATA_METHODS or (func.__name__ == "__get__" and attr in _METADATA_ATTRS)
        if metadata or (func is torch.Tensor.type and len(args) == 1 and not kwargs):  # (.type(): a name)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if (func.__name__ == "__set__" and attr == "requires_grad") or func is torch.Tensor.requires_grad_:
            changed = _set_requires_grad(args, kwargs or {})
            if changed is not None:
                return changed
        reason = next(
            (a._fsdp_reason for a in args if isinstance(a, _ShardedPlaceholder) and a._fsdp_reason), None
        )
        if reason is not None:
            raise RuntimeError(reason)
        name = next((a._fsdp_name for a in args if isinstance(a, _ShardedPlaceholder)), "a parameter")
        what = {"__set__": f"setting .{attr}", "__get__": f"reading .{attr}"}.get(
            func.__name__, f"{func.__name__}()"
        )
        if torch._C._current_graph_task_id() >= 0:  # inside a backward: a forward recomputed too late
            raise RuntimeError(resharded_in_backward(f"{what} on {name!r}"))
        raise RuntimeError(
            f"FullyShardedDataParallel: {what} on {name!r}, which is sharded: outside a call of the wrapped module "
            "(or of one of its submodules) and its backward, a wrapped module's parameters are meta-device "
            "stand-ins with no values, and the operation would be ignored. Read or change full parameters inside "
            "`with model.summon_full_params():`; freeze or initialize parameters before wrapping"
        )

    # A copy or a pickle of a wrapped module holds stand-ins again (the wrapper copies its shards):
    # see [Note: copies of a wrapped model] in fsdp/wrapper/module_ops.py.
    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return make_placeholder(self._fsdp_name, self.shape, self.dtype, self.requires_grad)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return make_placeholder, (self._fsdp_name, tuple(self.shape), self.dtype, self.requires_grad)


def resharded_in_backward(what: str) -> str:
    """The error for a parameter used in backward after its wrapper reduced and resharded."""
    return (
        f"FullyShardedDataParallel: {what} during backward, after the wrapper that owns it reduced its "
        "gradient and resharded: the wrapper's gradient came in more than one backward. torch's reentrant "
        "activation checkpointing (use_reentrant=True, CheckpointImpl.REENTRANT) inside a wrapper does that, "
        "each checkpointed region running its own backward, unless it holds all of the wrapper's parameters "
        "and runs once. Use use_reentrant=False / CheckpointImpl.NO_REENTRANT, or give each checkpointed "
        "block a wrapper of its own"
    )


def make_placeholder(
    name: str,
    shape: torch.Size,
    dtype: torch.dtype,
    requires_grad: bool,
    owner: Callable[[], torch.Tensor | None] | None = None,
    reason: str | None = None,
) -> torch.Tensor:
    """A stand-in for the sharded parameter ``name``. See [Note: sharded placeholders]. ``owner``
    gives the flat parameter that holds this parameter alone (``use_orig_params`` /
    ``flatten_parameters=False``): setting ``requires_grad`` on the stand-in sets it there.
    ``reason``: the error any use of it raises, where it stands for something other than a sharded
    parameter (an attribute referring to a parameter: see ``_ParameterReference``)."""
    data = torch.empty(shape, dtype=dtype, device="meta")
    placeholder = torch.Tensor._make_subclass(_ShardedPlaceholder, data, requires_grad)
    placeholder._fsdp_name = name
    placeholder._fsdp_owner = owner
    placeholder._fsdp_reason = reason
    return placeholder


def _set_requires_grad(args: Any, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """``placeholder.requires_grad = flag`` / ``placeholder.requires_grad_(flag)`` between steps, on a
    parameter that is a flat parameter of its own: set on that flat parameter (torch's staged
    unfreezing through module attributes), the stand-in following. None where it cannot be (several
    parameters share the flat parameter): the caller refuses."""
    placeholder = args[0]
    owner = placeholder._fsdp_owner
    flat = owner() if owner is not None else None
    if flat is None:
        return None
    flag = bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    flat.requires_grad_(flag)
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.requires_grad_(placeholder, flag)
    return cast(torch.Tensor, placeholder)


def is_placeholder(value: Any) -> bool:
    return isinstance(value, _ShardedPlaceholder)
