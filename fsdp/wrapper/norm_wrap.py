"""``auto_wrap_bn``: batch-norm layers in full-precision wrappers of their own (fairscale's helper).

Under mixed precision a wrapper computes with its parameters in the compute dtype. Batch norm
wants fp32 weights and running statistics (apex's ``keep_batchnorm_fp32``): in a wrapper of its own,
without mixed precision, a batch-norm layer keeps fp32 parameters and buffers while its input and
output stay in the outer wrapper's compute dtype.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from fsdp.wrap.context import wrap_children
from fsdp.wrap.policies import config_auto_wrap_policy
from fsdp.wrapper.fully_sharded import FullyShardedDataParallel

__all__ = ["auto_wrap_bn"]


def _default_config(process_group: dist.ProcessGroup | None) -> dict[str, Any]:
    return {
        "process_group": process_group,
        "mixed_precision": False,  # fp32 weights and statistics
        "flatten_parameters": False,
        # kept from forward to backward: cheap for small layers, and needed when the layer sits in
        # an activation-checkpointed block that runs its forward twice (as in fairscale)
        "reshard_after_forward": False,
        "bucket_cap_mb": 0,
        "force_input_to_fp32": False,
    }


def auto_wrap_bn(
    module: nn.Module,
    single_rank_pg: bool = False,
    process_group: dist.ProcessGroup | None = None,
    fsdp_config: dict[str, Any] | None = None,
    wrap_it: bool = True,
    assert_on_collision: bool = True,
) -> nn.Module:
    """Wrap every batch-norm layer in ``module`` (``SyncBatchNorm`` included) in a wrapper of its own.

    Call it on every rank before wrapping the rest of the model; the outer wrappers leave the
    wrapped layers to their own wrappers. Each layer is tagged with ``wrapper_config`` (the wrapper
    kwargs: ``fsdp_config``, or fp32 without flattening by default) and, with ``wrap_it``, every
    tagged module is wrapped with its tag's kwargs (:func:`~fsdp.config_auto_wrap_policy`, as in
    fairscale: modules a user tagged before the call too). With ``wrap_it=False`` the tags are left
    for :func:`~fsdp.config_auto_wrap_policy`.

    Args:
        module: the model, or a batch-norm layer (then its wrapper is returned).
        single_rank_pg: fairscale's unfinished option (one-rank groups): refused, since the layers'
            gradients would never be averaged and the ranks' weights would drift apart.
        process_group: the group the layers are sharded over (default: the world).
        fsdp_config: the wrapper kwargs, replacing the defaults.
        wrap_it: wrap the tagged layers; otherwise only tag them.
        assert_on_collision: refuse a layer that already carries a ``wrapper_config``.

    Returns:
        ``module`` with its batch-norm layers replaced by their wrappers (or the wrapper of
        ``module`` itself, if it is one).
    """
    if single_rank_pg:
        raise NotImplementedError(
            "auto_wrap_bn(single_rank_pg=True): in one-rank groups the batch-norm gradients would never be averaged "
            "and each rank's weights would drift apart; leave single_rank_pg=False (the world, or process_group=)"
        )
    config = _default_config(process_group) if fsdp_config is None else dict(fsdp_config)
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if assert_on_collision and getattr(m, "wrapper_config", None) is not None:
                raise ValueError(
                    f"auto_wrap_bn: {name or type(m).__name__!r} already has a wrapper_config (tagged by another "
                    "policy?); remove it, or pass assert_on_collision=False to replace it"
                )
            m.wrapper_config = config  # type: ignore[assignment]  # a plain attribute, as fairscale
    if not wrap_it:
        return module
    return _wrap_tagged(module)


def _wrap_tagged(module: nn.Module) -> nn.Module:
    """Every module tagged with a ``wrapper_config``, in a wrapper built with its tag's kwargs,
    innermost first (fairscale's ``config_auto_wrap_policy``): the batch norms, and any module a
    user tagged before the call. Needs no ``enable_wrap`` context, and works inside one."""
    if isinstance(module, FullyShardedDataParallel):
        return module  # already wrapped: its layers belong to that wrapper's plan

    def make(m: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(m, **m.wrapper_config)  # type: ignore[arg-type]

    wrap_children(module, config_auto_wrap_policy, FullyShardedDataParallel, make)
    return make(module) if getattr(module, "wrapper_config", None) is not None else module
