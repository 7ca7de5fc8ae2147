"""Clipping the gradients of a wrapper tree by their global norm, over every rank's shards."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fsdp.comm.collectives import CommStats, all_reduce
from fsdp.core.handle import FlatParamHandle

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    handles: Sequence[FlatParamHandle],
    max_norm: float,
    norm_type: float,
    device: torch.device,
    stats: CommStats,
    plain: Sequence[torch.Tensor] = (),
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip the shard gradients of ``handles`` and the gradients of the ``plain`` parameters
    (ignored ones: the same on every rank, not sharded) by their global ``norm_type``-norm; return
    the norm.

    ``group`` is the data-parallel group of the root (every rank that trains the model). Each rank
    adds ``|g|^p`` (max for the inf-norm) of the shards it holds, padding contributing zeros, and
    one all-reduce over ``group`` sums them. A shard that several ranks hold (the replicas of
    ``NO_SHARD`` and ``HYBRID_SHARD``) is counted by the first rank of its replicate group only, and
    a unit sharded over a smaller group than ``group`` (an expert on a per-rank group: each rank holds
    other parameters) is counted on each rank that holds a part of it, so every parameter of the
    model counts once. ``plain`` gradients are added locally after the reduction. Collective over
    ``group``. Example, world size 2, a shared unit sharded over both ranks (shard norms² 3 and 4)
    and an expert per rank on a one-rank group (norms² 5 and 6)::

        rank 0: 3 + 5, rank 1: 4 + 6 -> all-reduce: 18 on both -> norm sqrt(18) on both
    """
    p = norm_type
    if not (p > 0):  # also NaN; -inf and p <= 0 are no norms of the concatenated gradients
        raise ValueError(
            f"clip_grad_norm_: norm_type must be > 0 (or math.inf), got {norm_type}; use 2.0 for the usual norm"
        )
    first_replica: dict[int, bool] = {}  # id(replicate group) -> this rank is its first
    total = torch.zeros((), device=device)
    grads = [h.flat_param.grad for h in handles] + [param.grad for param in plain]
    if all(g is None for g in grads):  # (torch's warning, in its words: a forward without backward, say)
        rank = dist.get_rank(group) if group is not None else 0
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {rank} with no gradients -- returning the total norm in the "
            f"default dtype {total.dtype} (the norm of the other ranks' gradients; run backward before clipping)",
            UserWarning,
            stacklevel=4,  # (the caller of model.clip_grad_norm_: through the method and its agreement)
        )
    for h in handles:
        replicas = h.comm.replicate_group
        if replicas is not None:
            if id(replicas) not in first_replica:
                first_replica[id(replicas)] = dist.get_rank(replicas) == 0
            if not first_replica[id(replicas)]:
                continue  # another rank counts this shard
        grad = h.flat_param.grad
        if grad is None or grad.numel() == 0:
            continue
        if p == math.inf:
            total = torch.maximum(total, grad.detach().abs().max().float().to(device))
        else:
            total = total + (torch.linalg.vector_norm(grad.detach().float(), p) ** p).to(device)
    if group is not None:
        op = dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM
        all_reduce(total, group, op=op, stats=stats).wait()
    for param in plain:
        if param.grad is not None and param.grad.numel() > 0:
            g = param.grad.detach()
            value = (g.abs().max() if p == math.inf else torch.linalg.vector_norm(g.float(), p) ** p).float()
            total = torch.maximum(total, value.to(device)) if p == math.inf else total + value.to(device)
    norm = total if p == math.inf else total ** (1.0 / p)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        if grad is not None:
            grad.detach().mul_(coef.to(grad.device, grad.dtype))
    # in the gradients' dtype, as torch's (low-precision gradients: keep_low_precision_grads)
    dtypes = [g.dtype for g in grads if g is not None]
    return norm.to(functools.reduce(torch.promote_types, dtypes)) if dtypes else norm
