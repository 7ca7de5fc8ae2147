"""A rank killed in the middle of a step: the survivor's error comes within seconds (not at the
timeout), names the dead rank and says where the survivor was (which collective, which unit and
phase), instead of gloo's bare "Connection closed by peer"."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from tests.rank_pool import RankFailure, RankPool


@pytest.fixture
def fresh_pair() -> Iterator[RankPool]:
    """Two ranks of their own (the one that dies takes its pool down with it)."""
    pool = RankPool(2, timeout=60.0)
    try:
        yield pool
    finally:
        pool.close()


def _die(tmp: str) -> None:
    with open(os.path.join(tmp, "death.json"), "w") as f:
        json.dump({"time": time.time(), "pid": os.getpid()}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_mid_step(phase: str, tmp: str) -> None:
    """Rank 1 kills itself in the forward of unit 1 (of 4), or in the backward of unit 2; rank 0
    records its error and when it came."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    for i in range(4):
        model[i] = FSDP(model[i])
    model = FSDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # a good step first: each unit's schedule and prefetch are set
    if dist.get_rank() == 1:
        inner = model.module[1].module if phase == "forward" else model.module[2].module
        if phase == "forward":
            inner.register_forward_pre_hook(lambda *_: _die(tmp))
        else:
            inner.register_full_backward_hook(lambda *_: _die(tmp))
    try:
        step()
    except RuntimeError as e:
        with open(os.path.join(tmp, f"error{dist.get_rank()}.json"), "w") as f:
            json.dump({"time": time.time(), "message": str(e)}, f)
        raise


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_rank_killed_mid_step_is_named_in_seconds(fresh_pair: RankPool, phase: str, tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as failure:
        fresh_pair.run(_killed_mid_step, phase, str(tmp_path))
    assert failure.value.errors[1].type_name == "WorkerDied", failure.value
    death = json.loads((tmp_path / "death.json").read_text())
    error = json.loads((tmp_path / "error0.json").read_text())
    msg = error["message"]
    seconds = error["time"] - death["time"]
    assert f"rank 1 (process {death['pid']}) stopped: its connection closed while rank 0 waited for" in msg, (
        msg
    )
    assert "over ranks [0, 1]" in msg, msg
    if phase == "forward":  # rank 1 died before unit 2 (or 3) was gathered: rank 0 waits for that gather
        assert "an all-gather" in msg and "in the forward of unit '" in msg, msg
    else:  # rank 1 died in unit 2's backward: rank 0 waits for a gather or a reduction of the backward
        assert any(f"in the {p} of unit '" in msg for p in ("backward", "gradient reduction")), msg
    assert "by peer" in msg, msg  # gloo's own words stay, after ours ("Connection closed/reset by peer")
    assert seconds < 5, f"{seconds:.2f} s from the death to the survivor's error"
    print(f"\n{phase}: rank 0's error {seconds:.3f} s after rank 1's death:\n{msg}")


def _one_rank_saves_the_other_leaves(tmp: str) -> None:
    """``if rank == 0: model.state_dict()`` while rank 1 leaves the job: rank 0, alone in the
    handshake of state_dict(), learns that rank 1 stopped."""
    model = FSDP(nn.Sequential(FSDP(nn.Linear(8, 8)), nn.Linear(8, 2)))
    model(torch.randn(2, 8)).sum().backward()
    if dist.get_rank() == 1:
        _die(tmp)
    try:
        model.state_dict()
    except RuntimeError as e:
        with open(os.path.join(tmp, "error0.json"), "w") as f:
            json.dump({"time": time.time(), "message": str(e)}, f)
        raise


def test_a_collective_method_on_one_rank_while_the_other_leaves(fresh_pair: RankPool, tmp_path: Path) -> None:
    with pytest.raises(RankFailure):
        fresh_pair.run(_one_rank_saves_the_other_leaves, str(tmp_path))
    death = json.loads((tmp_path / "death.json").read_text())
    error = json.loads((tmp_path / "error0.json").read_text())
    assert f"rank 1 (process {death['pid']}) stopped" in error["message"], error["message"]
    assert "in state_dict()" in error["message"], error["message"]
    assert error["time"] - death["time"] < 5


def test_a_rank_killed_before_any_wrapper_is_named_by_its_process_id(tmp_path: Path) -> None:
    """Before the first handshake no process id was exchanged: under torchrun the survivor finds the
    ranks of its host among the agent's children (it used to say that the rank ran on another host)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--monitor-interval", "5"]
    cmd += ["--nproc_per_node=2", "-m", "tests.kill_before_wrapping", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0  # (rank 1 was killed)
    death = json.loads((tmp_path / "death.json").read_text())
    assert (tmp_path / "error0.json").exists(), proc.stderr[-3000:]
    msg = json.loads((tmp_path / "error0.json").read_text())["message"]
    assert f"rank 1 (process {death['pid']}) stopped: its connection closed" in msg, msg
    assert "other hosts" not in msg, msg
