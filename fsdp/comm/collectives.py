"""Typed, asynchronous wrappers around the torch.distributed collectives the library uses.

Every function launches its collective with ``async_op=True`` and returns a :class:`Pending`
that the caller waits on. Size and offset math lives in :mod:`fsdp.core.sharding`; this module only
checks shapes and talks to torch.distributed. It is also the one place that picks between the
torch 2.13 names (``all_gather_single`` / ``reduce_scatter_single``) and the older ones
(``all_gather_into_tensor`` / ``reduce_scatter_tensor``), and that counts calls and bytes.
"""

from __future__ import annotations

import atexit
import datetime
import enum
import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fsdp.comm.lost_ranks import is_connection_loss, lost_rank_message
from fsdp.comm.simulation import device_type, is_simulating
from fsdp.common.device import default_compute_device

log = logging.getLogger(__name__)

__all__ = [
    "TIMEOUT_HINT",
    "CollectiveKind",
    "CommStats",
    "Pending",
    "activity",
    "all_gather",
    "all_reduce",
    "broadcast",
    "broadcast_from_first_rank",
    "control_group",
    "forget_world",
    "get_process_group_cached",
    "hybrid_groups",
    "reduce_scatter",
    "set_activity",
]

_all_gather_fn: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_fn: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


class CollectiveKind(str, enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"


@dataclass
class CommStats:
    """Calls, elements and bytes per collective kind since the last :meth:`reset`.

    ``numel`` and ``bytes`` count the collective's full (unsharded) tensor: the all-gather output,
    the reduce-scatter input, the all-reduced or broadcast tensor. ``dtypes`` records which element
    types went over the wire.
    """

    calls: dict[CollectiveKind, int] = field(default_factory=dict)
    numel: dict[CollectiveKind, int] = field(default_factory=dict)
    bytes: dict[CollectiveKind, int] = field(default_factory=dict)
    dtypes: dict[CollectiveKind, set[torch.dtype]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, kind: CollectiveKind, tensor: torch.Tensor) -> None:
        with self._lock:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.numel[kind] = self.numel.get(kind, 0) + tensor.numel()
            self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()
            self.dtypes.setdefault(kind, set()).add(tensor.dtype)

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.numel.clear()
            self.bytes.clear()
            self.dtypes.clear()

    def as_dict(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {
                kind.value: {
                    "calls": self.calls.get(kind, 0),
                    "numel": self.numel.get(kind, 0),
                    "bytes": self.bytes.get(kind, 0),
                    "dtypes": sorted(str(d) for d in self.dtypes.get(kind, set())),
                }
                for kind in CollectiveKind
            }


# Appended to a collective's timeout error: ranks that wait in different collectives are the usual cause.
TIMEOUT_HINT = (
    "fsdp: a collective did not complete within the process group's timeout, so the ranks are most likely "
    "not running the same collectives. Every rank must run the same wrappers in the same order in forward and "
    "use the outputs of the same wrappers in its loss; call the collective methods (state_dict(), "
    "summon_full_params(), gather_full_optim_state_dict(), save_checkpoint()) on every rank; and, under "
    "DistributedDataParallel, change which parameters require grad in the same step on every rank. A rank that "
    "stopped or raised earlier leaves the others waiting too"
)


# What this process is doing, for the message when a peer is lost: (phase, unit path), set by the
# wrapper at each phase and by the handshakes (see fsdp/comm/lost_ranks.py). A plain module global: one
# assignment per phase, read only on an error.
_activity: tuple[str, str] = ("", "")


def set_activity(phase: str, unit: str = "") -> None:
    """Record that this process now runs ``phase`` (of the wrapper at ``unit``)."""
    global _activity
    _activity = (phase, unit)


def activity() -> str:
    """What :func:`set_activity` last recorded, in words ("" if nothing)."""
    return _describe(_activity)


def _describe(what: tuple[str, str]) -> str:
    phase, unit = what
    return f"{phase} of unit {unit!r}" if unit else phase


@dataclass
class Pending:
    """A launched collective. ``wait()`` blocks (CPU) or orders the current stream (CUDA) after it.

    ``keep_alive`` holds tensors the collective reads or writes, so that their memory cannot be
    reused before the collective finished (no reliance on ``record_stream``). ``kind``, ``group``
    and ``launched_in`` (what the process did at the launch) only serve the error message when a
    peer is lost during the wait.
    """

    work: Any
    output: torch.Tensor
    keep_alive: tuple[torch.Tensor, ...] = ()
    then: Callable[[], torch.Tensor] | None = None  # runs once inside wait(); returns the output
    kind: str = ""
    group: Any = None
    launched_in: tuple[str, str] = ("", "")
    handed: tuple[torch.Tensor, ...] = ()  # the CPU aliases the backend holds (see _handed)

    @property
    def launched(self) -> bool:
        """The collective has been issued (a queued bucket is not, until it is sent)."""
        return True

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as e:
                explained = _explained(e, self.kind, self.group, self.launched_in)
                if explained is e:
                    raise
                raise explained from e
            self.work = None
            _retire(self.handed)
            self.handed = ()
        if self.then is not None:
            self.output = self.then()
            self.then = None
        self.keep_alive = ()
        return self.output


# [Note: gloo works at exit]
# gloo runs each collective on a worker thread of its process group, and that thread drops its
# reference to the work, and with it to the work's tensors, a moment after wait() has returned.
# Dropping a tensor that has a Python object takes the GIL. A worker that gets there only after the
# interpreter began finalizing (the program's last collective, on a loaded machine) is ended inside
# a C++ destructor, and the process aborts ("terminate called without an active exception") after
# the program itself finished: under torchrun the other ranks then wait at the exit barrier. So on
# the CPU every tensor handed to a collective is an alias of its own (``detach()``: the same storage,
# a tensor nothing else holds). Once the collective was waited for, a weak reference to each alias
# is kept: an alias still alive is still held by a worker. At exit, before finalization, the
# interpreter waits (GIL released, at most _EXIT_DRAIN_S) until none is.
_EXIT_DRAIN_S = 2.0
_retired: dict[int, weakref.ref[torch.Tensor]] = {}


def _handed(tensor: torch.Tensor, handed: list[torch.Tensor]) -> torch.Tensor:
    """What to give the backend instead of ``tensor``: on the CPU an alias, noted in ``handed``."""
    if tensor.device.type != "cpu":
        return tensor
    alias = tensor.detach()
    handed.append(alias)
    return alias


def _retire(handed: tuple[torch.Tensor, ...]) -> None:
    for alias in handed:
        key = id(alias)  # (unique while the alias lives; the callback runs before it is freed)
        _retired[key] = weakref.ref(alias, _forget(key))


def _forget(key: int) -> Callable[[weakref.ref[torch.Tensor]], None]:
    def forget(_: weakref.ref[torch.Tensor]) -> None:
        _retired.pop(key, None)

    return forget


def drain_worker_references(timeout: float = _EXIT_DRAIN_S) -> bool:
    """Wait, GIL released, until no backend worker thread still holds a tensor of a collective this
    process waited for (see [Note: gloo works at exit]). True when none does; run at exit."""
    deadline = time.monotonic() + timeout
    while _retired:
        if time.monotonic() >= deadline:
            log.warning(
                "%d tensors of finished collectives are still held by a backend thread at exit", len(_retired)
            )
            return False
        time.sleep(0.001)
    return True


atexit.register(drain_worker_references)


def _explained(e: RuntimeError, kind: str, group: Any, launched_in: tuple[str, str]) -> RuntimeError:
    """The backend's error with what it means: a timeout (ranks in different collectives, most
    likely) or a lost peer (which rank, and where this rank was)."""
    text = str(e).lower()
    if is_connection_loss(e) and group is not None:
        try:
            ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):  # (a group torch no longer knows)
            return e
        what = f"a{'n' if kind[:1] in 'aeiou' else ''} {kind.replace('_', '-')}" if kind else "a collective"
        return RuntimeError(f"{lost_rank_message(ranks, what, _describe(launched_in), activity())}\n({e})")
    if "timed out" in text or "timeout" in text:
        return RuntimeError(f"{e}\n{TIMEOUT_HINT}")
    return e


_REDUCE_SCATTER = CollectiveKind.REDUCE_SCATTER.value


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None = None
) -> Pending:
    """Gather every rank's ``shard`` into ``output`` (rank order). ``output.numel() == N * shard.numel()``."""
    n = _size(group)
    if output.numel() != n * shard.numel() or output.dtype != shard.dtype:
        raise AssertionError(
            f"all_gather: output {tuple(output.shape)}/{output.dtype} does not hold {n} x "
            f"{tuple(shard.shape)}/{shard.dtype}"
        )
    if stats is not None:
        stats.record(CollectiveKind.ALL_GATHER, output)
    if n == 1:
        output.copy_(shard.view_as(output))
        return Pending(None, output)
    handed: list[torch.Tensor] = []
    if device_type(output.device) == "cpu" and n <= _BROADCAST_GATHER_MAX_RANKS:
        work: Any = _broadcast_gather(output, shard, group, n, handed)
    else:
        work = _all_gather_fn(_handed(output, handed), _handed(shard, handed), group=group, async_op=True)
    return Pending(
        work,
        output,
        (shard,),
        kind=CollectiveKind.ALL_GATHER.value,
        group=group,
        launched_in=_activity,
        handed=tuple(handed),
    )


# On the CPU, gloo's all-gather receives into a fresh temporary and copies every chunk out of it.
# For a few ranks, one in-place broadcast per rank (each from its own chunk of ``output``) moves
# the same bytes without either. Measured at world size 2, 3.5 MB shards: 2.3 ms of CPU time per
# gather against 3.6 to 6.7 ms. Each broadcast is a call of its own, so larger groups use gloo's
# all-gather (N calls of latency would cost more than the copy saves).
_BROADCAST_GATHER_MAX_RANKS = 4


class _Works:
    """Several launched works, waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _broadcast_gather(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, n: int, handed: list[torch.Tensor]
) -> _Works:
    chunks = output.view(n, -1)
    chunks[dist.get_rank(group)].copy_(shard.view(-1))
    return _Works(
        [
            dist.broadcast(
                _handed(chunks[i], handed), src=dist.get_global_rank(group, i), group=group, async_op=True
            )
            for i in range(n)
        ]
    )


def reduce_scatter(
    output: torch.Tensor | None,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    stats: CommStats | None = None,
) -> Pending:
    """Sum ``full`` over ranks and leave chunk ``rank`` of the sum in ``output`` (``wait()``'s result).

    ``full`` is consumed: its values are undefined afterwards. With ``output=None`` a chunk is
    allocated. On the CPU gloo's reduce-scatter is not used (see the comment below).
    """
    n = _size(group)
    fits = output is None or (output.numel() * n == full.numel() and output.dtype == full.dtype)
    if full.numel() % n or not fits:
        what = "" if output is None else f"{tuple(output.shape)}/{output.dtype}"
        raise AssertionError(
            f"reduce_scatter: input {tuple(full.shape)}/{full.dtype} is not {n} x an output {what}"
        )
    if stats is not None:
        stats.record(CollectiveKind.REDUCE_SCATTER, full)
    if device_type(full.device) == "cpu" and 1 < n <= _EXCHANGE_MAX_RANKS:
        return _exchange_reduce_scatter(output, full, group, n)
    if device_type(full.device) == "cpu" and n > 1:
        handed: list[torch.Tensor] = []
        work = dist.all_reduce(_handed(full, handed), op=dist.ReduceOp.SUM, group=group, async_op=True)
        mine = full.view(n, -1)[dist.get_rank(group)]

        def copy_out() -> torch.Tensor:
            return mine.clone() if output is None else output.copy_(mine.view_as(output))

        return Pending(work, mine, (full,), copy_out, _REDUCE_SCATTER, group, _activity, tuple(handed))
    if output is None:
        output = full.new_empty(full.numel() // n)
    if n == 1:
        output.copy_(full.view_as(output))
        return Pending(None, output)
    work = _reduce_scatter_fn(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Pending(work, output, (full,), None, _REDUCE_SCATTER, group, _activity)


# On the CPU, gloo's reduce-scatter is an all-reduce of a full-size copy it allocates (and holds
# until the wait), after which each rank keeps its chunk. A ring all-reduce sends every byte twice
# (reduce, then share the result), so even done in place on ``full`` it moves twice the bytes a
# reduce-scatter needs. For a few ranks each rank instead sends chunk k of ``full`` straight to rank
# k and sums what it receives into its own chunk: (N-1)/N of ``full`` sent per rank, the minimum.
# Measured at world size 2, 24 MB: 16.6 ms against 24.1 ms for the in-place all-reduce and 42.6 ms
# for gloo's reduce-scatter; 3 to 5% off a training step of the benchmark's GPT. The receive buffers
# ((N-1)/N of ``full``; at world size 2 the output itself) exist from the launch, so larger groups
# keep the in-place all-reduce. gloo's point-to-point works never report completion before
# ``wait()``; see [Note: finishing reductions early] in fsdp/core/handle_grads.py.
_EXCHANGE_MAX_RANKS = 4
# gloo matches the sends and receives of one tag between two ranks first-posted to first-posted, and
# every rank launches its reductions in the same order, so exchanges in flight together on one group
# cannot mix. The tag only keeps them apart from a user's own point-to-point traffic.
_EXCHANGE_TAG = 0x0F5D9


def _exchange_reduce_scatter(
    output: torch.Tensor | None, full: torch.Tensor, group: dist.ProcessGroup, n: int
) -> Pending:
    me = dist.get_rank(group)
    chunks = full.view(n, -1)
    peers = [k for k in range(n) if k != me]
    received = {k: chunks.new_empty(chunks.shape[1]) for k in peers}
    works = []
    if not is_simulating():  # (a simulated step keeps the buffers and sends nothing)
        works = [
            dist.isend(chunks[k], dst=dist.get_global_rank(group, k), group=group, tag=_EXCHANGE_TAG)
            for k in peers
        ]
        works += [
            dist.irecv(received[k], src=dist.get_global_rank(group, k), group=group, tag=_EXCHANGE_TAG)
            for k in peers
        ]
    mine = chunks[me]

    def total() -> torch.Tensor:
        parts = [mine if k == me else received[k] for k in range(n)]  # summed in rank order
        out = received[peers[0]] if output is None else output.view(-1)
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)
        received.clear()
        return out if output is None else output

    return Pending(_Works(works), mine, (full,), total, _REDUCE_SCATTER, group, _activity)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    op: Any = dist.ReduceOp.SUM,
    stats: CommStats | None = None,
) -> Pending:
    """Reduce ``tensor`` in place over the group."""
    if stats is not None:
        stats.record(CollectiveKind.ALL_REDUCE, tensor)
    if _size(group) == 1:
        return Pending(None, tensor)
    handed: list[torch.Tensor] = []
    work = dist.all_reduce(_handed(tensor, handed), op=op, group=group, async_op=True)
    return _in_place(work, tensor, CollectiveKind.ALL_REDUCE, group, handed)


def broadcast(
    tensor: torch.Tensor, src_group_rank: int, group: dist.ProcessGroup, stats: CommStats | None = None
) -> Pending:
    """Copy ``tensor`` from the group rank ``src_group_rank`` to every rank, in place."""
    if stats is not None:
        stats.record(CollectiveKind.BROADCAST, tensor)
    if _size(group) == 1:
        return Pending(None, tensor)
    src = dist.get_global_rank(group, src_group_rank)
    handed: list[torch.Tensor] = []
    work = dist.broadcast(_handed(tensor, handed), src=src, group=group, async_op=True)
    return _in_place(work, tensor, CollectiveKind.BROADCAST, group, handed)


def _in_place(
    work: Any, tensor: torch.Tensor, kind: CollectiveKind, group: Any, handed: list[torch.Tensor]
) -> Pending:
    """The :class:`Pending` of a collective launched on ``tensor`` in place."""
    return Pending(work, tensor, kind=kind.value, group=group, launched_in=_activity, handed=tuple(handed))


_group_cache: dict[tuple[str, int, tuple[int, ...]], dist.ProcessGroup] = {}
_hybrid_cache: dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def hybrid_groups(shard_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard group, replicate group) of this rank for hybrid sharding with ``shard_size`` ranks per shard.

    Ranks ``[k * shard_size, (k + 1) * shard_size)`` form shard group k (a node under torchrun, where
    ``shard_size`` is LOCAL_WORLD_SIZE); the ranks with the same index in every shard group form a
    replicate group. Collective over the world on first use; cached afterwards. The shard groups'
    twins for reduce-scatters (see :func:`get_process_group_cached`) are created with them.
    """
    world = dist.get_world_size()
    if shard_size < 1 or world % shard_size:
        raise ValueError(
            f"hybrid sharding: the world size {world} is not a multiple of the shard group size {shard_size}"
        )
    key = (id(dist.group.WORLD), shard_size)
    if key not in _hybrid_cache:
        shards = [list(range(k * shard_size, (k + 1) * shard_size)) for k in range(world // shard_size)]
        replicas = [list(range(i, world, shard_size)) for i in range(shard_size)]
        shard, _ = dist.new_subgroups_by_enumeration(shards)  # type: ignore[no-untyped-call]
        replicate, _ = dist.new_subgroups_by_enumeration(replicas)  # type: ignore[no-untyped-call]
        twin, _ = dist.new_subgroups_by_enumeration(shards)  # type: ignore[no-untyped-call]
        assert shard is not None and replicate is not None and twin is not None
        _hybrid_cache[key] = (shard, replicate)
        ranks = tuple(dist.get_process_group_ranks(shard))
        if len(ranks) > 1:
            _group_cache[("reduce_scatter", id(dist.group.WORLD), ranks)] = twin
    return _hybrid_cache[key]


def get_process_group_cached(group: dist.ProcessGroup, purpose: str) -> dist.ProcessGroup:
    """A second process group with the same ranks as ``group``, created once per (purpose, ranks).

    For a group of the whole world it is a new group, which every rank creates (all are here). A
    subgroup gets one only where it was made beside it (the shard groups of :func:`hybrid_groups`);
    otherwise the subgroup itself is returned. See [Note: creating groups].
    """
    ranks = tuple(dist.get_process_group_ranks(group))
    # The default group's identity is part of the key: a re-initialized world needs new groups.
    key = (purpose, id(dist.group.WORLD), ranks)
    if key not in _group_cache:
        if len(ranks) == dist.get_world_size() > 1:
            local = _registered_groups_agree()
            _group_cache[key] = dist.new_group(list(ranks), use_local_synchronization=local)
        else:
            if len(ranks) > 1:
                log.info(
                    "%s: ranks %s share their own group (no second group for a subgroup)", purpose, ranks
                )
            _group_cache[key] = group
    return _group_cache[key]


_control_cache: dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup, torch.device]] = {}


def forget_world(world: Any) -> None:
    """Drop the groups cached for the default group ``world`` (before it is destroyed): its id may be
    a later default group's, which must not find them (a simulated world's, say)."""
    for key in [k for k in _group_cache if k[1] == id(world)]:  # (purpose, id(world), ranks)
        del _group_cache[key]
    for control_key in [k for k in _control_cache if k[0] == id(world)]:  # (id(world), id(group))
        del _control_cache[control_key]


def control_group(group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, torch.device]:
    """The group and device for the fixed-size handshakes among ``group``'s ranks
    (:func:`fsdp.comm.consistency.agree_on_entry`).

    For a group of the whole world (the default one, or one a user made of every rank), a gloo
    group of its own, made once per group (collective over the world on first use, as in
    :func:`get_process_group_cached`): a handshake then never pairs with a collective that carries
    data, whatever a rank does in between (gloo aborts the process when a larger message arrives
    than was expected), and it needs no device synchronization under NCCL. Its timeout is
    ``group``'s. For a subgroup, ``group`` itself (see [Note: creating groups]), on the CPU when its
    backend takes CPU tensors, else on the current CUDA device. One control group per group object,
    not per rank set: a group whose collective timed out has its connections closed by gloo, and
    must not take another group's control group down with it.
    """
    key = (id(dist.group.WORLD), id(group))
    if key not in _control_cache:
        backend = str(dist.get_backend(group)).lower()
        ranks = dist.get_process_group_ranks(group)
        cpu = torch.device("cpu")
        if len(ranks) == dist.get_world_size() > 1 and ("gloo" in backend or "nccl" in backend):
            local = _registered_groups_agree()
            timeout = datetime.timedelta(seconds=_timeout_seconds(group))
            made = dist.new_group(ranks, timeout=timeout, backend="gloo", use_local_synchronization=local)
            _control_cache[key] = (group, made, cpu)  # (the group is held: its id stays unique)
        else:
            cuda_only = "nccl" in backend and "gloo" not in backend  # NCCL sends device tensors only
            _control_cache[key] = (group, group, default_compute_device(set()) if cuda_only else cpu)
    _, control, device = _control_cache[key]
    return control, device


def _timeout_seconds(group: dist.ProcessGroup) -> float:
    """``group``'s collective timeout (torch's default where it cannot be read)."""
    for device in ("cpu", "cuda"):
        try:
            return float(group._get_backend(torch.device(device)).options._timeout.total_seconds())
        except (RuntimeError, AttributeError):
            continue
    return float(dist.default_pg_timeout.total_seconds())


# [Note: creating groups]
# torch names a group made with ``use_local_synchronization=True`` after its ranks and the number of
# groups the calling rank has registered; a rank registers only the groups it is a member of. After
# a subgroup that leaves some ranks out (``new_group([0, 1])`` on three ranks), the counts differ, the
# ranks of a new group look for each other under different names and wait forever. Without it the
# name is a counter that every rank advances, members or not, so every rank must make the call.
# That is always the case for a group of the whole world, but such groups made the benchmarks' gloo
# ranks abort now and then at exit ("terminate called without an active exception", 3 runs in 32,
# against none in 34 with named groups). So a group of the world is made with local synchronization
# when every rank has registered as many groups (one small all-gather says), else without it. A
# second group of a subgroup is only made where every rank takes part (hybrid_groups); elsewhere
# the subgroup itself serves. The handshakes' control group (control_group) follows the same rule;
# the first wrapper construction makes it before any other group. (Under a device-bound default group NCCL
# splits every new group from the world's communicator, which again needs every rank.)
def _registered_groups_agree() -> bool:
    """Whether every rank has registered as many process groups (collective over the world)."""
    backend = str(dist.get_backend())
    device = torch.device("cpu")
    if "nccl" in backend and "gloo" not in backend:  # NCCL sends device tensors only
        device = default_compute_device(set())  # the current CUDA device
    counts = all_gather_ints([len(dist.distributed_c10d._world.pg_names)], dist.group.WORLD, device)  # type: ignore[arg-type]
    return len(set(counts)) == 1


def digest_of_text(text: str) -> int:
    """A 56-bit digest of ``text``: fits an int64 tensor element."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little")


def all_gather_ints(
    values: Sequence[int], group: dist.ProcessGroup, device: torch.device, stats: CommStats | None = None
) -> list[tuple[int, ...]]:
    """Every rank's ``values`` (as many on every rank), in rank order: a tensor collective on
    ``device``, not an object one (those run on the current CUDA device, which need not be the
    compute device). Collective."""
    world = dist.get_world_size(group)
    if is_simulating():  # (no peers to hear from: every simulated rank says the same)
        return [tuple(values)] * world
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    everyone = mine.repeat(world)  # (filled by the all-gather; torch's fake group leaves it)
    if world == 1:
        return [tuple(values)]
    if stats is not None:
        stats.record(CollectiveKind.ALL_GATHER, everyone)
    # one collective: for a few bytes the latency of a call is all there is (all_gather's broadcasts
    # for a few ranks pay it once per rank)
    handed: list[torch.Tensor] = []
    work = _all_gather_fn(_handed(everyone, handed), _handed(mine, handed), group=group, async_op=True)
    kind = CollectiveKind.ALL_GATHER.value
    Pending(work, everyone, (mine,), None, kind, group, _activity, tuple(handed)).wait()
    return [tuple(row) for row in everyone.view(world, len(values)).tolist()]


def broadcast_from_first_rank(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, device: torch.device, what: str
) -> None:
    """Overwrite ``tensors`` in place on every rank with group rank 0's values (torch FSDP's
    ``sync_module_states``). Collective: a fixed-size exchange of a digest of the shapes and dtypes
    first, so ranks that hold different tensors raise (on every rank) instead of pairing mismatched
    broadcasts; then one broadcast per dtype, staged on ``device``."""
    if _size(group) == 1 or is_simulating():
        return
    distinct = list({id(t): t for t in tensors}.values())  # (tied tensors once)
    layout = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in distinct)
    digests = all_gather_ints([digest_of_text(layout)], group, device)
    if len(set(digests)) > 1:
        raise RuntimeError(
            f"sync_module_states: the ranks hold {what} of different shapes or dtypes, so rank 0's values "
            "cannot be copied to the others; every rank must build the same model"
        )
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in distinct:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for group_tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).to(device) for t in group_tensors])
            broadcast(flat, 0, group).wait()
            offset = 0
            for t in group_tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
