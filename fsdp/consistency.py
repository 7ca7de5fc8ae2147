"""Cross-rank agreement: every rank must build the same wrappers and reduce the same parameters.

A distributed mistake must fail on every rank with a message that names it, never hang or
silently produce wrong results. These checks run at the root's lazy init (a fingerprint of the
wrapper tree) and at the end of every synchronized backward (which flat parameters were reduced).
Wrappers are passed duck-typed: this module never imports the wrapper.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp.collectives import CommStats, all_gather_ints, all_reduce, digest_of_text

__all__ = [
    "CHECKPOINT_WRAPPED",
    "WRAPPED",
    "check_hybrid_grids",
    "check_same_reductions_on_all_ranks",
    "check_same_wrappers_on_all_ranks",
    "fingerprint",
    "is_activation_wrapper",
    "plain_name",
    "wrapper_path",
]

WRAPPED = "_fsdp_wrapped_module"  # the attribute under which a wrapper holds its module
# the attribute under which torch's activation checkpoint / offload wrappers hold their module
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"


def plain_name(name: str) -> str:
    """A name inside the wrapper tree as it is in the unwrapped module."""
    return name.replace(WRAPPED + ".", "").replace("." + WRAPPED, "").replace(WRAPPED, "")


def is_activation_wrapper(module: nn.Module) -> bool:
    """torch's ``CheckpointWrapper`` / ``OffloadWrapper`` (``apply_activation_checkpointing``): a level
    that its own state-dict hooks hide from the keys."""
    return CHECKPOINT_WRAPPED in module._modules and any(
        c.__name__ == "ActivationWrapper" for c in type(module).__mro__
    )


def wrapper_path(root: nn.Module, wrapper: Any) -> str:
    for name, m in root.named_modules():
        if m is wrapper:
            return plain_name(name) or "<root>"
    return "<unknown>"


def fingerprint(root: Any, wrappers: list[Any]) -> list[str]:
    lines = []
    for w in wrappers:
        params = [
            f"{info.fqn}:{tuple(info.shape)}:{str(h.meta.dtype)[6:]}:{'T' if h.requires_grad else 'F'}"
            for h in w.handles
            for info in h.meta.params
        ]
        comm = w.fsdp_config.comm
        layout = f"{w.fsdp_config.sharding.strategy.name} {comm.world_size}x{comm.dp_world_size // comm.world_size}"
        lines.append(
            f"{wrapper_path(root, w)} [{type(w._fsdp_wrapped_module).__name__}] {layout} " + " ".join(params)
        )
    return lines


def check_same_wrappers_on_all_ranks(root: Any, wrappers: list[Any]) -> None:
    """Compare a fingerprint of the wrapper tree across ranks; raise on every rank if they differ."""
    group = root.fsdp_config.comm.dp_group
    if root.world_size == 1:
        return
    lines = fingerprint(root, wrappers)
    digests = all_gather_ints([digest_of_text("\n".join(lines))], group, root.compute_device)
    if len(set(digests)) == 1:
        return
    everyone: list[Any] = [None] * root.world_size
    dist.all_gather_object(everyone, lines, group=group)
    first = next(r for r in range(root.world_size) if digests[r] != digests[0])
    rank0, theirs = everyone[0], everyone[first]
    diff = next(
        (f"rank 0: {a}\n  rank {first}: {b}" for a, b in zip(rank0, theirs) if a != b),
        f"rank 0 has {len(rank0)} wrappers, rank {first} has {len(theirs)}",
    )
    raise RuntimeError(
        "FullyShardedDataParallel: ranks built different FSDP wrappers (every rank must wrap the same model "
        f"the same way):\n  {diff}"
    )


def check_hybrid_grids(root: Any, wrappers: list[Any]) -> None:
    """Every replicate group must hold the ranks that keep the same shard: the same position in
    shard groups of one size. One small all-gather over each distinct pair's groups, after the
    fingerprint showed that every rank built the same strategies (so every member is here)."""
    seen = set()
    for w in wrappers:
        comm = w.fsdp_config.comm
        if w.fsdp_config.sharding.strategy.name != "HYBRID_SHARD" or comm.replicate_group is None:
            continue
        shard, replicate = comm.process_group, comm.replicate_group
        if (id(shard), id(replicate)) in seen:
            continue
        seen.add((id(shard), id(replicate)))
        positions = all_gather_ints([comm.rank, comm.world_size], replicate, root.compute_device)
        sizes = all_gather_ints([dist.get_world_size(replicate)], shard, root.compute_device)
        if len(set(positions)) != 1 or len(set(sizes)) != 1:
            raise RuntimeError(
                f"FullyShardedDataParallel: the replicate group {dist.get_process_group_ranks(replicate)} of "
                f"{wrapper_path(root, w)!r} must hold the ranks that keep the same shard (the same position in "
                f"shard groups of one size); their (position, shard group size) are {positions}, and the "
                f"replicate group sizes in the shard group are {[s for (s,) in sizes]}"
            )


def check_same_reductions_on_all_ranks(root: Any, wrappers: list[Any], stats: CommStats | None) -> None:
    """Every rank must have reduced the same flat parameters in this backward, else collectives mismatch
    (``stats`` counts the check's all-reduce)."""
    handles = [(w, h) for w in wrappers for h in w.handles if h.requires_grad]
    if root.world_size == 1 or not handles:
        return
    mine = torch.tensor([1 if h.reduced_this_backward else 0 for _, h in handles], dtype=torch.int32)
    both = torch.cat([mine, -mine]).to(root.compute_device)
    assert root.fsdp_config.comm.dp_group is not None
    all_reduce(both, root.fsdp_config.comm.dp_group, op=dist.ReduceOp.MAX, stats=stats).wait()
    both = both.cpu()
    hi, lo = both[: len(handles)], -both[len(handles) :]
    differ = [i for i in range(len(handles)) if hi[i] != lo[i]]
    if differ:
        w, h = handles[differ[0]]
        status = "reduced" if mine[differ[0]] else "did not reduce"
        raise RuntimeError(
            f"FullyShardedDataParallel: ranks disagree on which parameters got gradients in this backward. Rank "
            f"{root.rank} {status} the flat parameter of {wrapper_path(root, w)!r} (parameters "
            f"{list(h.meta.fqns)[:4]}...) while another rank did the opposite. Every rank must run the same modules "
            "and use the same parameters in its loss"
        )
