"""Naming the rank whose connection closed, from the process table the handshakes keep: a peer on
this host that exited, or was killed and not yet reaped, is named; peers on other hosts are named as
the candidates; timeouts are not mistaken for lost peers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from fsdp.comm import lost_ranks
from fsdp.comm.lost_ranks import host_code, is_connection_loss, lost_rank_message, note_processes


@pytest.fixture
def table(single_rank_group: None) -> Iterator[None]:
    saved = dict(lost_ranks._processes)
    yield None
    lost_ranks._processes.clear()
    lost_ranks._processes.update(saved)


def _exited_process(reap: bool) -> tuple[int, subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    if reap:
        proc.wait()
    else:  # exited, not reaped: a zombie, as a killed rank is until its parent waits for it
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
    return proc.pid, proc


@pytest.mark.parametrize("reap", [True, False], ids=["gone", "zombie"])
def test_a_stopped_peer_on_this_host_is_named(table: None, reap: bool) -> None:
    pid, proc = _exited_process(reap)
    try:
        here = host_code()
        note_processes([0, 1, 2], [(os.getpid(), here), (pid, here), (os.getpid(), here)])
        msg = lost_rank_message(
            [0, 1, 2], "an all-gather", "the forward of unit '1'", "the forward of unit '2'"
        )
    finally:
        proc.wait()
    assert msg.startswith(f"fsdp: rank 1 (process {pid}) stopped: its connection closed while rank 0 waited")
    assert (
        "an all-gather over ranks [0, 1, 2] (launched in the forward of unit '1'), in the forward of unit '2'"
        in msg
    )
    assert "rank 2" not in msg  # (alive)


def test_peers_on_other_hosts_are_the_candidates(table: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lost_ranks, "_LOOKS", 0)  # (nothing on this host to look at again)
    note_processes([0, 1, 2, 3], [(os.getpid(), host_code()), (os.getpid(), host_code()), (1, 7), (2, 7)])
    msg = lost_rank_message([0, 1, 2, 3], "a reduce-scatter", "", "the end of backward")
    assert (
        "the connection to one of ranks [2, 3] closed (the ranks on this host known here, [0, 1], are running; "
        "ranks [2, 3] on other hosts" in msg
    ), msg
    assert "a reduce-scatter over ranks [0, 1, 2, 3], in the end of backward" in msg, msg


def test_peers_not_yet_known_are_not_said_to_run_elsewhere(
    table: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the first handshake (and not under torchrun) nothing says where a rank runs: the message
    must not claim another host for it."""
    monkeypatch.setattr(lost_ranks, "_LOOKS", 0)
    monkeypatch.setattr(lost_ranks, "_siblings", {})
    lost_ranks._processes.clear()
    msg = lost_rank_message([0, 1], "an all-gather", "", "the construction of a wrapper")
    assert "other hosts" not in msg, msg
    assert "rank 1 not yet known here (no handshake with this library before this point" in msg, msg


def test_only_a_closed_connection_is_a_lost_peer() -> None:
    assert is_connection_loss(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:58056"))
    assert is_connection_loss(
        RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1425: Connection reset by peer")
    )
    assert not is_connection_loss(RuntimeError("Application timeout caused pair closure"))
    assert not is_connection_loss(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    assert not is_connection_loss(RuntimeError("CUDA out of memory"))
