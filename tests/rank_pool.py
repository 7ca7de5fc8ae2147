"""A pool of gloo rank processes, started once and reused by many tests (importing torch is slow).

Each spawned worker joins one gloo group (``file://`` rendezvous, one thread), then runs tasks;
``fn`` must be picklable, i.e. defined at module level. In tests, use the ``pool`` fixture::

    def _rank_and_sum() -> tuple[int, float]:
        t = torch.ones(1)
        dist.all_reduce(t)
        return dist.get_rank(), t.item()

    assert RankPool(world_size=2).run(_rank_and_sum) == [(0, 2.0), (1, 2.0)]

If a rank raises, ``run`` waits up to ``grace`` s for the others and raises :class:`RankFailure`;
the pool stays up if every rank reported. A rank that died or is still busy (stuck in a
collective), or a task over ``timeout`` (:class:`RankTimeout`), gets the pool SIGKILLed; it
restarts lazily on the next ``run``.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

_STARTUP = 0  # task id of the start-up handshake; real tasks count from 1
# CPU ranks by design, also on a GPU machine: hidden GPUs keep defaults (the compute device of a
# model built on the meta device, say) on the CPU. tests/gpu runs the CUDA checks.
_CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
    _CHILD_ENV["GLOO_SOCKET_IFNAME"] = "lo"  # all ranks are local: never depend on the hostname


@dataclass(frozen=True)
class RankError:
    """What one rank raised: exception type name, ``str(exception)`` and formatted traceback."""

    type_name: str
    message: str
    traceback: str


class RankFailure(AssertionError):
    """One or more ranks raised (or died); ``errors`` maps rank -> :class:`RankError`."""

    def __init__(self, errors: dict[int, RankError], unfinished: list[int], what: str) -> None:
        self.errors = dict(sorted(errors.items()))
        self.unfinished = unfinished  # ranks that had not reported when the pool was killed
        lines = [f"{what} failed on rank(s) {sorted(errors)}"]
        if unfinished:
            lines.append(f"rank(s) {unfinished} had not finished; the pool was killed")
        for rank, err in self.errors.items():
            lines.append(f"--- rank {rank}: {err.type_name}: {err.message}\n{err.traceback.rstrip()}")
        super().__init__("\n".join(lines))


class RankTimeout(AssertionError):
    """A task did not finish on every rank within its timeout; the pool was killed."""

    def __init__(self, unfinished: list[int], timeout: float, what: str) -> None:
        self.unfinished = unfinished
        self.timeout = timeout
        super().__init__(f"{what} did not finish within {timeout:g}s on rank(s) {unfinished}; pool killed")


def _current_error() -> RankError:
    exc = sys.exc_info()[1]
    return RankError(type(exc).__name__, str(exc), traceback.format_exc())


def _worker(rank: int, world: int, init: str, path: list[str], parent: int, tasks: Any, out: Any) -> None:
    """Body of one rank: join the gloo group, then run tasks until told (or orphaned) to stop."""
    sys.path[:] = path
    os.environ.update(_CHILD_ENV)  # before torch is imported
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # own process group: a kill also takes anything this rank started
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        timeout = timedelta(seconds=60)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
    except BaseException:
        out.put((_STARTUP, rank, False, _current_error()))
        return
    out.put((_STARTUP, rank, True, None))
    while True:
        try:
            msg = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the parent died without closing us
                return
            continue
        if msg is None:  # close(): flush and skip torch's slow interpreter teardown
            sys.stdout.flush()
            sys.stderr.flush()
            out.close()
            out.join_thread()
            os._exit(0)
        task_id, blob = msg
        try:
            fn, args, kwargs = pickle.loads(blob)
            reply: tuple[bool, Any] = (True, pickle.dumps(fn(*args, **kwargs), pickle.HIGHEST_PROTOCOL))
        except BaseException:
            reply = (False, _current_error())
        out.put((task_id, rank, *reply))


class RankPool:
    """``world_size`` gloo ranks, spawned on first use. ``timeout``: default limit of a task (and of
    start-up), in seconds; ``grace``: how long the other ranks may take once one rank failed."""

    def __init__(self, world_size: int, timeout: float = 120.0, grace: float = 10.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout, self.grace = world_size, timeout, grace
        self._procs: list[BaseProcess] = []
        self._tasks: list[Any] = []  # one spawn-context Queue per rank
        self._results: Any = None  # the Queue every rank answers on
        self._tmpdir: str | None = None
        self._task_id = _STARTUP
        _live_pools.add(self)

    def run(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kw: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kw)`` on every rank at once; return the results in rank order."""
        try:
            blob = pickle.dumps((fn, args, kw), pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(f"RankPool.run needs a picklable module-level fn and arguments: {e}") from e
        self._ensure_started()
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, blob))
        what = f"{getattr(fn, '__qualname__', fn)} on {self.world_size} rank(s)"
        replies = self._collect(self._task_id, self.timeout if timeout is None else timeout, what)
        return [pickle.loads(replies[rank]) for rank in range(self.world_size)]

    def pids(self) -> list[int]:
        """Process ids of the running workers (empty when the pool is not started)."""
        return [p.pid for p in self._procs if p.pid is not None]

    def close(self) -> None:
        """Stop the workers (politely, then by force). The pool may be used again afterwards."""
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(5.0)
        self._kill()

    def _ensure_started(self) -> None:
        if self._procs and all(p.is_alive() for p in self._procs):
            return
        self._kill()
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="rank-pool-")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        common = (self.world_size, f"file://{self._tmpdir}/rendezvous", list(sys.path), os.getpid())
        for rank in range(self.world_size):
            args = (rank, *common, self._tasks[rank], self._results)
            self._procs.append(ctx.Process(target=_worker, args=args, name=f"rank-{rank}", daemon=True))
            self._procs[-1].start()
        self._collect(_STARTUP, self.timeout, f"start-up of {self.world_size} rank(s)")

    def _collect(self, task_id: int, timeout: float, what: str) -> dict[int, Any]:
        """Wait for every rank's reply to ``task_id``; kill the pool and raise on failure or timeout."""
        deadline = time.monotonic() + timeout
        give_up = math.inf  # end of the grace period, once some rank has failed
        done: dict[int, Any] = {}
        errors: dict[int, RankError] = {}
        try:
            while len(done) + len(errors) < self.world_size:
                now = time.monotonic()
                if now >= min(deadline, give_up):
                    break
                try:
                    tid, rank, ok, payload = self._results.get(timeout=min(0.1, deadline - now))
                except queue.Empty:
                    tid = None
                if tid == task_id and rank not in errors:  # else: a late reply to an abandoned task
                    if ok:
                        done[rank] = payload
                    else:
                        errors[rank] = payload
                        give_up = min(give_up, time.monotonic() + self.grace)
                for rank, proc in enumerate(self._procs):
                    if rank not in done and rank not in errors and not proc.is_alive():
                        code = proc.exitcode or 0
                        how = f"killed by {signal.strsignal(-code)}" if code < 0 else f"exited with {code}"
                        errors[rank] = RankError("WorkerDied", f"worker process {how}", "")
                        give_up = min(give_up, time.monotonic() + self.grace)
        except BaseException:  # KeyboardInterrupt, pytest-timeout, ...: never leave a task in flight
            self._kill()
            raise
        unfinished = [r for r in range(self.world_size) if r not in done and r not in errors]
        if unfinished or any(e.type_name == "WorkerDied" for e in errors.values()):
            self._kill()
        if errors:
            raise RankFailure(errors, unfinished, what)
        if unfinished:
            raise RankTimeout(unfinished, timeout, what)
        return done

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(OSError, AttributeError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the worker's own group (see _worker)
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for q in [*self._tasks, self._results]:
            if q is not None:
                q.cancel_join_thread()  # a dead reader must not block interpreter exit
                q.close()
        self._procs, self._tasks, self._results = [], [], None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


_live_pools: weakref.WeakSet[RankPool] = weakref.WeakSet()


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_live_pools):
        pool.close()
