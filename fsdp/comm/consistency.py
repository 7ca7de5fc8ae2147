"""Cross-rank agreement: every rank must build the same wrappers, make the same calls into them and
reduce the same parameters.

A distributed mistake must fail on every rank with a message that names it, never hang, abort in
the backend or silently produce wrong results. Before anything communicates, every rank says in a
fixed-size handshake which operation it enters and a digest of what decides its collectives
(:func:`agree_on_entry`; see [Note: agreement before communication]): each wrapper's construction
(its options), the root's first use (a fingerprint of the wrapper tree), each forward and backward
of the root, and each collective method. The end of every synchronized backward checks which flat
parameters were reduced. Wrappers are passed duck-typed: this module never imports the wrapper.
"""

from __future__ import annotations

import enum
import functools
import inspect
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import ShardingStrategy
from fsdp.comm.collectives import (
    CommStats,
    all_gather_ints,
    all_reduce,
    control_group,
    digest_of_text,
    set_activity,
)
from fsdp.comm.lost_ranks import host_code, note_processes, note_siblings
from fsdp.comm.simulation import is_simulating

__all__ = [
    "BACKWARD",
    "CHECKPOINT_WRAPPED",
    "FORWARD",
    "SCALER_CHECK",
    "WRAPPED",
    "agree_on_construction",
    "agree_on_entry",
    "agree_on_step",
    "agreement_group",
    "check_hybrid_grids",
    "check_same_reductions_on_all_ranks",
    "check_same_wrappers_on_all_ranks",
    "collective",
    "fingerprint",
    "is_activation_wrapper",
    "plain_name",
    "wrapper_path",
    "wrapper_paths",
]

F = TypeVar("F", bound=Callable[..., Any])

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


def wrapper_paths(root: nn.Module, wrappers: Sequence[Any]) -> dict[int, str]:
    """``id(wrapper) -> wrapper_path(root, wrapper)`` for every one of ``wrappers``, in one walk."""
    wanted = {id(w) for w in wrappers}
    paths = {id(m): plain_name(name) or "<root>" for name, m in root.named_modules() if id(m) in wanted}
    return {id(w): paths.get(id(w), "<unknown>") for w in wrappers}


def fingerprint(root: Any, wrappers: list[Any]) -> list[str]:
    lines = []
    paths = wrapper_paths(root, wrappers)
    for w in wrappers:
        params = [
            f"{info.fqn}:{tuple(info.shape)}:{str(h.meta.dtype)[6:]}:{'T' if h.requires_grad else 'F'}"
            for h in w.handles
            for info in h.meta.params
        ]
        comm = w.fsdp_config.comm
        layout = f"{w.fsdp_config.sharding.strategy.name} {comm.world_size}x{comm.dp_world_size // comm.world_size}"
        lines.append(f"{paths[id(w)]} [{type(w._fsdp_wrapped_module).__name__}] {layout} " + " ".join(params))
    return lines


def check_same_wrappers_on_all_ranks(root: Any, wrappers: list[Any]) -> int:
    """Compare a fingerprint of the wrapper tree across ranks (the handshake of the root's first
    use); raise on every rank if they differ. Returns the fingerprint's digest, which every later
    forward and backward of the root carries (:func:`agree_on_step`)."""
    lines = fingerprint(root, wrappers)
    digest = digest_of_text("\n".join(lines))

    def explain(control: dist.ProcessGroup) -> NoReturn:
        _raise_different_wrappers(control, lines)

    agree_on_entry(root.fsdp_config.comm.dp_group, FIRST_USE, digest, explain)
    return digest


def _raise_different_wrappers(
    control: dist.ProcessGroup,
    lines: list[str],
    what: str = "ranks built different FSDP wrappers (every rank must wrap the same model the same way)",
) -> NoReturn:
    n = dist.get_world_size(control)
    everyone: list[Any] = [None] * n
    dist.all_gather_object(everyone, lines, group=control)
    ranks = dist.get_process_group_ranks(control)
    first = next((r for r in range(n) if everyone[r] != everyone[0]), 0)
    rank0, theirs = everyone[0], everyone[first]
    diff = next(
        (f"rank {ranks[0]}: {a}\n  rank {ranks[first]}: {b}" for a, b in zip(rank0, theirs) if a != b),
        f"rank {ranks[0]} has {len(rank0)} wrappers, rank {ranks[first]} has {len(theirs)}",
    )
    raise RuntimeError(f"FullyShardedDataParallel: {what}:\n  {diff}")


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
    # every flat parameter of the tree (the same on every rank: the tree is agreed), so that the
    # message has the same size on every rank even where requires_grad differs
    handles = [(w, h) for w in wrappers for h in w.handles]
    if root.world_size == 1 or not any(h.requires_grad for _, h in handles) or is_simulating():
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


# [Note: agreement before communication]
# A rank that issues other collectives than its peers does not fail cleanly by itself: collectives
# of different sizes pair up (gloo aborts the process when a larger message arrives than it posted
# a buffer for, and silently accepts a smaller one), and ones on different groups wait for each
# other until the timeout (30 minutes by default). So before anything that communicates, every
# rank of the data-parallel group sends the same fixed-size message in one all-gather: a magic
# number, the code of the operation it enters, a digest of everything that decides that
# operation's collectives, its process id and host (for fsdp/comm/lost_ranks.py). Ranks that entered
# different operations, or the same one with different digests, raise on every rank, naming the
# operations, or exchanging the details (only then, as objects) to name what differs and each
# rank's value. The handshakes are:
# - each wrapper's construction, before it makes a process group or sends anything: its options
#   that decide collectives, and the wrapped module's class and parameter count (ranks that build
#   a different number of wrappers meet a construction on one side and something else on the
#   other). One per construction, not one per root: the constructor makes groups before any root
#   exists, and most wrappers' construction communicates nothing else;
# - the root's first use (lazy init): the wrapper tree's fingerprint;
# - every forward and every backward of the root: the fingerprint, grad mode, no_sync() and which
#   flat parameters require a gradient (which decides what the backward reduces);
# - every forward of a unit under the root, before it gathers: its place in the tree and grad mode;
#   and the end of the root's forward, so that a rank that skipped a unit meets it there. These cost
#   one small gloo exchange per unit (0.75% of a step of the 35M benchmark GPT with 11 units at
#   world size 2 on the CPU, benchmarks/agreement.py); FSDP_CHECK_UNITS=0, read at a root's lazy
#   init, turns them off, and a branch taken on some ranks then fails at the timeout again;
# - each collective method (state_dict(), summon_full_params(), clip_grad_norm_(), the optimizer
#   state methods, save_checkpoint(), ...), on entry, with the arguments that decide collectives;
#   and the inf/nan check of ShardedGradScaler, every step that uses one.
# So a collective method called on some ranks only meets, on the others, the next forward,
# backward or collective method, and every rank raises at once. The handshakes run on a gloo
# group of their own for a group of the whole world (collectives.control_group): they never pair
# with a collective that carries data, and need no device synchronization under NCCL. Under a
# subgroup they run on the subgroup itself. What is not caught: a rank that waits in a collective
# of its own (a dist.barrier(), a loss all-reduce for logging) while the others enter an operation
# of ours, ranks that differ in which outputs reach the loss (the end-of-backward check catches part
# of it), and ranks that pass process groups of different members; these fail at the process
# group's timeout, with TIMEOUT_HINT.
_MAGIC = 0x46534450  # "FSDP": the first value of every handshake
_OPS: dict[int, str] = {}  # operation code -> its name in messages (every name a handshake used)


def _op_code(op: str) -> int:
    code = digest_of_text(op)
    _OPS.setdefault(code, op)
    return code


def _operation(op: str) -> str:
    """``op``, registered at import: a rank names what the others entered even before it did so itself."""
    _op_code(op)
    return op


CONSTRUCTION = _operation("the construction of a wrapper")
FIRST_USE = _operation("the first use of the root (its lazy init)")
FORWARD = _operation("the forward of the root")
BACKWARD = _operation("the backward of the root")
SCALER_CHECK = _operation("ShardedGradScaler's inf/nan check (unscale_() or step())")
UNIT_FORWARD = _operation("the forward of a wrapped unit")
FORWARD_END = _operation("the end of the forward of the root")


def agree_on_entry(
    group: dist.ProcessGroup | None,
    op: str,
    digest: int = 0,
    explain: Callable[[dist.ProcessGroup], NoReturn] | None = None,
    activity: tuple[str, str] | None = None,
) -> None:
    """Every rank of ``group`` says that it enters ``op`` with ``digest`` (a fixed-size all-gather on
    the group's control group); raise on every rank if some rank entered another operation, or the
    same one with another digest (``explain(control_group)`` then raises the precise error: every
    rank calls it, so it may exchange details). ``activity`` (phase, unit) is what a rank waiting here
    says it was doing when a peer stops (default: ``op``). Collective. See [Note: agreement before communication]."""
    if group is None or dist.get_world_size(group) == 1 or is_simulating():
        return
    control, device = control_group(group)
    note_siblings()  # (until every rank of this host is known: a rank may stop before this handshake)
    set_activity(*(activity or (op, "")))  # what a rank that waits here says it was doing
    rows = all_gather_ints([_MAGIC, _op_code(op), digest, os.getpid(), host_code()], control, device)
    ranks = dist.get_process_group_ranks(group)
    strangers = [r for r, row in zip(ranks, rows, strict=True) if row[0] != _MAGIC]
    if strangers:
        raise RuntimeError(
            f"FullyShardedDataParallel: while rank {dist.get_rank()} entered {op}, rank(s) {strangers} were in "
            "another collective (one of their own, not a call into FSDP): the ranks are out of step. Every rank "
            "must make the same calls in the same order"
        )
    note_processes(ranks, [(row[3], row[4]) for row in rows])
    codes = [row[1] for row in rows]
    if len(set(codes)) > 1:
        by_op: dict[str, list[int]] = {}
        for r, code in zip(ranks, codes, strict=True):
            by_op.setdefault(_OPS.get(code, "an operation this rank does not know"), []).append(r)
        entered = "; ".join(f"{name} on {_ranks_text(rs)}" for name, rs in by_op.items())
        if CONSTRUCTION in by_op:
            entered += " (ranks that build a different number of wrappers meet here: an auto_wrap_policy "
            entered += "that decides differently on some ranks, say)"
        if UNIT_FORWARD in by_op:
            entered += (
                " (inside the root's forward some ranks run a wrapped module that others skip: a branch "
            )
            entered += (
                "taken on some ranks only; every rank must run the same wrapped modules, in training and "
            )
            entered += "in evaluation alike)"
        raise RuntimeError(
            f"FullyShardedDataParallel: the ranks are not making the same call: {entered}. Every rank must "
            "construct the same wrappers, run the root's forward and backward, and call its collective "
            "methods (state_dict(), summon_full_params(), clip_grad_norm_(), the optimizer-state methods, "
            "save_checkpoint(), load_checkpoint(), ...) in the same order. To keep a result on one rank, call "
            "the method on every rank (state_dict_on_rank_0_only=True, rank0_only, recipient_rank) and save "
            "on that rank only"
        )
    if len({row[2] for row in rows}) > 1:
        if explain is not None:
            explain(control)
        raise RuntimeError(f"FullyShardedDataParallel: the ranks entered {op} with different arguments")


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(str(r) for r in ranks)}"


def _differences(control: dist.ProcessGroup, mine: Mapping[str, str]) -> list[str]:
    """Each entry of ``mine`` that differs between the ranks, with every rank's value. Collective."""
    everyone: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(everyone, dict(mine), group=control)
    ranks = dist.get_process_group_ranks(control)
    lines = []
    for key in dict.fromkeys(k for e in everyone for k in e):
        values = [e.get(key, "(not given)") for e in everyone]
        if len(set(values)) > 1:
            by_value: dict[str, list[int]] = {}
            for r, v in zip(ranks, values, strict=True):
                by_value.setdefault(v, []).append(r)
            lines.append(f"{key}: " + "; ".join(f"{v} on {_ranks_text(rs)}" for v, rs in by_value.items()))
    return lines


def _shown(value: Any) -> str:
    """An option's value as the messages show it (the same text on every rank for the same value)."""
    if isinstance(value, dist.ProcessGroup):
        return f"a group of {dist.get_world_size(value)} ranks"
    if isinstance(value, tuple) and value and all(isinstance(v, dist.ProcessGroup) for v in value):
        return "(" + ", ".join(_shown(v) for v in value) + ")"
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, torch.device):  # (its type: each rank has its own index)
        return value.type
    return repr(value)


def agreement_group(hybrid: bool, process_group: Any) -> dist.ProcessGroup | None:
    """The group a wrapper's construction agrees over: its data-parallel group (the world for hybrid
    sharding and by default), known before any group is made; None for a ``process_group`` the
    constructor refuses anyway (it raises on that rank)."""
    if hybrid or process_group is None or isinstance(process_group, tuple):
        return dist.group.WORLD
    if isinstance(process_group, dist.ProcessGroup) and dist.get_rank(process_group) >= 0:
        return process_group
    return None


# The constructor's options that decide which collectives a rank issues, with what, and when (or,
# like the gradient factors, what they compute). Left out: those that only change what stays on a
# rank (state_dict_device, state_dict_on_rank_0_only, move_grads_to_cpu, which must equal
# move_params_to_cpu), limit_all_gathers (it only holds the host back on CUDA), param_init_fn,
# device_id (each rank its own device), verbose, allow_reset_parameters and the casts of inputs.
_DECIDING = (
    "sharding_strategy", "reshard_after_forward", "disable_reshard_on_root", "process_group",
    "process_group_reduce_scatter", "mixed_precision", "compute_dtype", "buffer_dtype", "fp32_reduce_scatter",
    "flatten_parameters", "move_params_to_cpu", "compute_device", "bucket_cap_mb", "backward_prefetch",
    "forward_prefetch", "gradient_predivide_factor", "sync_module_states", "no_broadcast_optim_state",
)  # fmt: skip


def agree_on_construction(module: nn.Module, options: Mapping[str, Any]) -> None:
    """The constructor's handshake over the wrapper's data-parallel group (:func:`agreement_group`):
    every rank wraps a module of the same class and parameter count with the same options (those of
    ``options``, the constructor's arguments with the resolved ones, that decide which collectives
    run), else a ``ValueError`` on every rank names each option that differs and every rank's value."""
    hybrid = options.get("sharding_strategy") is ShardingStrategy.HYBRID_SHARD
    group = agreement_group(hybrid, options.get("process_group"))
    if group is None or dist.get_world_size(group) == 1:
        return
    mine = {name: _shown(options.get(name)) for name in _DECIDING}
    if options.get("process_group", 0) is None:  # the world, or per node under hybrid sharding
        mine["process_group"] = (
            f"per node (LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')})"
            if hybrid
            else _shown(dist.group.WORLD)
        )
    params = list(module.parameters())
    mine["the wrapped module"] = (
        f"{type(module).__name__} with {len(params)} parameters ({sum(p.numel() for p in params)} elements)"
    )

    def explain(control: dist.ProcessGroup) -> NoReturn:
        lines = _differences(control, mine)
        raise ValueError(
            "FullyShardedDataParallel: the ranks construct wrappers with different options, or around "
            "different modules (every rank must build the same wrappers in the same order, with the same "
            "options: they decide which collectives each rank issues):\n  " + "\n  ".join(lines)
        )

    text = "\n".join(f"{k}={v}" for k, v in mine.items())
    agree_on_entry(group, CONSTRUCTION, digest_of_text(text), explain)


def agree_on_step(root: Any, op: str) -> None:
    """The handshake of each forward or backward of the root: the same wrapper tree (the digest of
    its fingerprint, taken at the root's first use), grad mode and ``no_sync()`` on every rank.
    Collective over the root's data-parallel group."""
    ctx = root._ctx
    flags = {"torch.is_grad_enabled()": torch.is_grad_enabled(), "inside no_sync()": not ctx.sync}
    digest = ctx.fingerprint ^ (int(flags["torch.is_grad_enabled()"]) + 2 * int(flags["inside no_sync()"]))
    # which flat parameters require a gradient decides which reduce in backward (and the size of the
    # end-of-backward check): requires_grad may change between steps, on one rank only by mistake
    needs_grad = "".join("1" if h.requires_grad else "0" for w in ctx.wrappers for h in w.handles)
    digest ^= digest_of_text(needs_grad) << 2

    def explain(control: dist.ProcessGroup) -> NoReturn:
        frozen = [f for w in ctx.wrappers for h in w.handles if not h.requires_grad for f in h.meta.fqns]
        shown = {k: str(v) for k, v in flags.items()}
        shown["the parameters that require no gradient"] = str(frozen) if frozen else "none"
        lines = _differences(control, shown)
        if lines:
            raise RuntimeError(
                f"FullyShardedDataParallel: the ranks run {op} differently (every rank must run it in the same "
                "mode, since the mode decides what is gathered, kept and reduced):\n  " + "\n  ".join(lines)
            )
        what = f"in {op}, the ranks run different wrapped models (every rank must run the same model)"
        _raise_different_wrappers(control, fingerprint(root, ctx.wrappers), what)

    agree_on_entry(root.fsdp_config.comm.dp_group, op, digest, explain)


def agree_on_unit(root: Any, wrapper: Any) -> None:
    """The handshake of each forward of a wrapper under the root, before it gathers anything: every
    rank runs the same unit (its place in the root's tree) in the same mode. Ranks that take a branch
    on some ranks only would otherwise meet in all-gathers of different units (of different sizes: a
    process abort in gloo; of the same size: the wrong parameters). Collective over the root's
    data-parallel group. See [Note: agreement before communication]."""
    ctx = root._ctx
    index = ctx.wrappers.index(wrapper)
    digest = (index << 2) + int(torch.is_grad_enabled())

    def explain(control: dist.ProcessGroup) -> NoReturn:
        shown = {"the unit it runs": wrapper._path, "torch.is_grad_enabled()": str(torch.is_grad_enabled())}
        lines = _differences(control, shown)
        raise RuntimeError(  # (torch's first sentence, which its tests match, then ours)
            "Forward order differs across ranks: FullyShardedDataParallel: inside the forward of the root the ranks "
            "run different wrapped units (a "
            "branch taken on some ranks only, or a module skipped on some): every rank must run the same "
            "wrapped modules in the same order, in training and in evaluation alike:\n  " + "\n  ".join(lines)
        )

    agree_on_entry(
        root.fsdp_config.comm.dp_group, UNIT_FORWARD, digest, explain, ("the forward", wrapper._path)
    )


_inside = threading.local()  # .depth: how many agreed collective calls this thread is inside


def collective(
    op: str,
    agreed: Sequence[str] = (),
    when: Callable[[Any], bool] | None = None,
    owner: str = "self",
) -> Callable[[F], F]:
    """Make a collective method (or a function of a wrapper, the argument named ``owner``) agree on
    entry: the handshake of ``op`` over the wrapper's data-parallel group, with the arguments named in
    ``agreed`` (a ``ValueError`` on every rank names those that differ). Only the outermost agreed
    call on a thread agrees (the calls it makes are the same on every rank); with ``when``, only
    calls for which ``when(wrapper)`` holds (a state dict type that communicates, say)."""

    _operation(op)

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(_inside, "depth", 0):
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            wrapper = bound.arguments.get(owner)
            if isinstance(wrapper, nn.Module) and not hasattr(wrapper, "fsdp_config"):
                # a plain module holding wrappers (torch's whole-model functions): its first wrapper's group
                wrapper = next((m for m in wrapper.modules() if hasattr(m, "fsdp_config")), None)
            group = getattr(getattr(getattr(wrapper, "fsdp_config", None), "comm", None), "dp_group", None)
            if group is not None and (when is None or when(wrapper)):
                given = {
                    name: _shown(bound.arguments.get(name, signature.parameters[name].default))
                    for name in agreed
                }

                def explain(control: dist.ProcessGroup) -> NoReturn:
                    lines = _differences(control, given)
                    raise ValueError(
                        f"FullyShardedDataParallel: the ranks called {op} with different arguments (every rank "
                        "must pass the same):\n  " + "\n  ".join(lines)
                    )

                text = "\n".join(f"{k}={v}" for k, v in given.items())
                agree_on_entry(group, op, digest_of_text(text), explain)
            _inside.depth = getattr(_inside, "depth", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                _inside.depth -= 1

        return call  # type: ignore[return-value]

    return decorate
