"""Which rank stopped, when a connection to it closes in the middle of a collective.

gloo reports a peer that died as "Connection closed by peer [address]:port" (or "reset"): nothing
says which rank it was or what this rank was doing. Every cross-rank handshake
(:func:`fsdp.comm.consistency.agree_on_entry`) carries each rank's process id and a code of its host,
kept here per global rank; when a collective fails with a lost connection, the ranks of the group
that ran on this host are looked up by process id, so the message names the ones that are gone
(ranks on other hosts cannot be looked at from here: the message names them as the candidates).
Nothing here communicates: a survivor's error comes as soon as gloo notices the closed connection
(if no peer on this host is seen gone yet, they are looked at again for up to a second).

Before the first handshake (a rank that stops before any wrapper is built) no process id has been
exchanged yet. Under ``torchrun`` the ranks of one host are the children of one agent, each with its
``RANK`` in its environment: when this module is imported, and again before each handshake until
every local rank is seen, the processes of this job beside this one are read from ``/proc``, so a
rank of this host that stops at any point of the program is named by its process id too.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["host_code", "is_connection_loss", "lost_rank_message", "note_processes", "note_siblings"]


# gloo's words for a connection its peer closed (a process that exited or was killed)
_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "econnreset", "epipe")

_LOOKS, _LOOK_EVERY = 10, 0.1  # while no peer of this host is seen stopped: look again for up to 1 s
_processes: dict[int, tuple[int, int]] = {}  # global rank -> (process id, host code), from handshakes
_world: list[int] = [0]  # id() of the default group the table belongs to
_host: list[int] = []  # this host's code, computed once
_siblings: dict[int, int] = {}  # global rank -> process id of this job's processes beside this one (torchrun)


def host_code() -> int:
    """A 56-bit code of this host: its name and boot id (containers on one machine have other
    names; machines that share a name have other boot ids)."""
    if not _host:
        boot = ""
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            pass
        text = f"{socket.gethostname()}|{boot}"
        _host.append(int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little"))
    return _host[0]


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def note_siblings() -> None:
    """Under torchrun, record the process id of every rank of this job on this host (the agent's other
    children with the same run id), until all ``LOCAL_WORLD_SIZE`` of them are known. Reads ``/proc``
    only; does nothing elsewhere (another launcher, another system)."""
    run_id, parent = os.environ.get("TORCHELASTIC_RUN_ID"), os.getppid()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if run_id is None or "RANK" not in os.environ or len(_siblings) >= local - 1:
        return
    try:
        with open(f"/proc/{parent}/task/{parent}/children") as f:
            children = [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return
    for pid in children:
        if pid != os.getpid() and pid not in _siblings.values():
            env = _environ(pid)
            if env.get("TORCHELASTIC_RUN_ID") == run_id and env.get("RANK", "").isdigit():
                _siblings[int(env["RANK"])] = pid


def note_processes(global_ranks: Sequence[int], processes: Sequence[tuple[int, int]]) -> None:
    """Record ``(process id, host code)`` of each of ``global_ranks`` (as a handshake saw them)."""
    world = id(dist.group.WORLD)
    if _world[0] != world:  # a new default group: the old table describes other processes
        _processes.clear()
        _world[0] = world
    for rank, proc in zip(global_ranks, processes, strict=True):
        _processes[rank] = proc


def is_connection_loss(error: BaseException) -> bool:
    """Whether ``error`` says that a peer's connection closed (not a timeout: after an
    application timeout gloo closes the pair too, with "timeout" in the message)."""
    text = str(error).lower()
    return "timeout" not in text and "timed out" not in text and any(word in text for word in _LOST)


_PF_EXITING = 0x4  # the kernel's flag of a task inside exit(): its sockets close before it is a zombie


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (one that is exiting, or a zombie killed but
    not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # (state, ppid, ..., flags: the 7th after the name)
        return fields[0] not in ("Z", "X", "x") and not int(fields[6]) & _PF_EXITING
    except FileNotFoundError:
        return False
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (exists, owned by someone else)
        return True
    return True


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {sorted(ranks)}"


def lost_rank_message(group_ranks: Sequence[int], collective: str, launched_in: str, waited_in: str) -> str:
    """What to say when a connection closed while this rank waited for ``collective`` over
    ``group_ranks`` (global ranks): which of them stopped, and where this rank was."""
    me = dist.get_rank()
    here = host_code()
    local: list[int] = []
    remote: list[int] = []
    unknown: list[int] = []
    for r in group_ranks:
        proc = _processes.get(r)
        if proc is None and r in _siblings:  # (no handshake yet: the launcher's children)
            proc = _processes[r] = (_siblings[r], here)
        if r == me:
            continue
        if proc is None:
            unknown.append(r)
        else:
            (local if proc[1] == here else remote).append(r)
    stopped = [r for r in local if not _alive(_processes[r][0])]
    for _ in range(_LOOKS if local and not stopped else 0):  # (a peer still on its way out)
        time.sleep(_LOOK_EVERY)
        stopped = [r for r in local if not _alive(_processes[r][0])]
        if stopped:
            break
    where = f"{collective} over ranks {list(group_ranks)}"
    if launched_in and launched_in != waited_in:
        where += f" (launched in {launched_in})"
    if waited_in:
        where += f", in {waited_in}"
    if stopped:
        who = ", ".join(f"rank {r} (process {_processes[r][0]})" for r in stopped)
        head = f"{who} stopped: {'its' if len(stopped) == 1 else 'their'} connection closed"
    elif remote or unknown:
        where_they_are = []
        if remote:
            where_they_are.append(f"{_ranks(remote)} on other hosts, which cannot be looked at from here")
        if unknown:  # (no handshake with them yet, and no launcher that says where they run)
            where_they_are.append(
                f"{_ranks(unknown)} not yet known here (no handshake with this library before this point; "
                "under torchrun the ranks of this host are known from the start)"
            )
        head = (
            f"the connection to one of ranks {sorted(remote + unknown)} closed (the ranks on this host known "
            f"here, {sorted([*local, me])}, are running; " + "; ".join(where_they_are) + ")"
        )
    else:  # every peer runs: one of them closed its side (it left the process group, say)
        head = f"a connection to one of ranks {sorted(local)} closed, although every one of them still runs"
    return (
        f"fsdp: {head} while rank {me} waited for {where}. The other ranks cannot go on without it; its own "
        "output says why it stopped. Restart the job (from the last checkpoint: fsdp.latest_checkpoint and "
        "fsdp.load_checkpoint)"
    )


note_siblings()  # at import: the other ranks of this host are running now
