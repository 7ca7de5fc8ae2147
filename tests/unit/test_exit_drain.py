"""At exit the interpreter waits until no backend thread holds a tensor of a finished collective
(see [Note: gloo works at exit] in fsdp/comm/collectives.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from fsdp.comm import collectives
from fsdp.comm.collectives import Pending, drain_worker_references

ROOT = Path(__file__).resolve().parents[2]


class _Work:
    def wait(self) -> bool:
        return True


def test_a_finished_collective_counts_until_its_last_holder_lets_go() -> None:
    out = torch.zeros(4)
    worker: list[torch.Tensor] = []  # stands for the backend's worker thread
    alias = collectives._handed(out, worker)
    assert alias is not out and alias.data_ptr() == out.data_ptr()  # the same storage, another tensor
    pending = Pending(_Work(), out, handed=(alias,))
    del alias
    pending.wait()
    assert pending.handed == ()
    assert not drain_worker_references(timeout=0.05)  # the "worker" still holds it
    worker.clear()
    assert drain_worker_references(timeout=0.05)
    assert not collectives._retired


def test_device_tensors_are_handed_as_they_are() -> None:
    t = torch.zeros(2, device="meta")
    handed: list[torch.Tensor] = []
    assert collectives._handed(t, handed) is t and not handed


_SCRIPT = """
import sys, threading, time, torch
from fsdp.comm import collectives

marker = sys.argv[1]
worker = []
alias = collectives._handed(torch.zeros(3), worker)
pending = collectives.Pending(type("W", (), {"wait": lambda self: True})(), torch.zeros(3), handed=(alias,))
del alias
pending.wait()

def let_go():
    time.sleep(0.3)
    open(marker, "w").write("released")  # before the last reference goes
    worker.clear()

threading.Thread(target=let_go, daemon=True).start()
"""


def test_the_interpreter_waits_for_the_last_holder_before_finalizing(tmp_path: Path) -> None:
    # a daemon thread is stopped at finalization: it writes the marker only if exit waited for it
    marker = tmp_path / "marker"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", _SCRIPT, str(marker)], cwd=ROOT, env=env, check=True, timeout=60)
    assert marker.read_text() == "released"
