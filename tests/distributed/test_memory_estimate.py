"""fsdp.estimate_memory: a rank's peak over a training step, simulated on the meta device under
torch's fake process group, against the peak measured on two gloo ranks (torch's MemTracker); it
falls as 1/N with the world size, and refuses to run inside a job."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp
from tests.rank_pool import RankPool

ROOT = Path(__file__).resolve().parents[2]
VOCAB, CONTEXT = 512, 32


def build(checkpointed: bool = True) -> nn.Module:
    from examples.gpt import GPT

    torch.manual_seed(0)
    model = GPT(VOCAB, CONTEXT, 4, 64, 4, 0.0)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = fsdp.FullyShardedDataParallel(
            fsdp.checkpoint_wrapper(block) if checkpointed else block
        )
    return fsdp.FullyShardedDataParallel(model)


def step(model: nn.Module) -> torch.Tensor:
    x = torch.randint(0, VOCAB, (2, CONTEXT))
    return model(x, x)[1]  # type: ignore[no-any-return]


def _after_a_step(checkpointed: bool, in_backward: bool) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The model and optimizer after one step (its state made), and the step to measure."""
    model = build(checkpointed)
    if in_backward:
        optim: torch.optim.Optimizer = fsdp.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step() -> None:
        step(model).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    train_step()
    return model, optim, train_step


def _measured(checkpointed: bool, in_backward: bool) -> int:
    """The peak of a step as torch's MemTracker measures it (the reference, not the library's code)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, optim, train_step = _after_a_step(checkpointed, in_backward)
    gc.collect()
    warnings.filterwarnings("ignore", category=UserWarning)
    tracker = MemTracker()
    tracker.track_external(model, optim)
    with tracker:
        train_step()
    peak = tracker.get_tracker_snapshot("peak")
    return int(next(c for d, c in peak.items() if torch.device(d).type == "cpu")["Total"])


def _measured_by_the_library() -> dict[str, Any]:
    """fsdp.measure_memory on a real step: the tracker's total and categories, as torch's own."""
    m = fsdp.measure_memory(*_after_a_step(True, False))
    return {
        "peak": m.peak_bytes,
        "sum": sum(m.breakdown.values()),
        "world": m.world_size,
        "opt": m.breakdown["OPT"],
        "in_reduction": m.breakdown.get("REDUCE_SCATTER", 0),  # (the wrapper told the tracker what it is)
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_measure_memory_gives_the_peak_of_a_real_step_by_category(
    pool: RankPool, estimates: dict[str, Any]
) -> None:
    raw = max(pool.run(_measured, True, False))
    for r in pool.run(_measured_by_the_library):
        assert r["world"] == 2 and r["opt"] > 0 and r["sum"] == r["peak"], r  # the categories add up
        # the peak is the end of backward, the root's gradient in reduction: named so, not a temporary
        assert r["in_reduction"] > 0, r
        assert abs(r["peak"] - raw) <= 0.02 * raw, (r, raw)
        assert abs(r["peak"] - estimates["2/True/False"][0]) <= 0.10 * raw, (r, estimates["2/True/False"])


_ESTIMATE = """
import json, sys, torch, fsdp
from tests.distributed.test_memory_estimate import build, step
out = {}
for world in (1, 2, 4, 64):
    for checkpointed in (True, False):
        for in_backward in (False, True):
            e = fsdp.estimate_memory(lambda: build(checkpointed), step, world, torch.optim.AdamW, {"lr": 1e-3},
                                     optimizer_in_backward=in_backward)
            out[f"{world}/{checkpointed}/{in_backward}"] = [e.peak_bytes, e.breakdown]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def estimates() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _ESTIMATE], cwd=ROOT, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("checkpointed", [True, False])
@pytest.mark.parametrize("in_backward", [False, True])
def test_the_estimate_is_within_ten_percent_of_the_measured_peak(
    pool: RankPool, estimates: dict[str, Any], checkpointed: bool, in_backward: bool
) -> None:
    measured = max(pool.run(_measured, checkpointed, in_backward))
    estimated, breakdown = estimates[f"2/{checkpointed}/{in_backward}"]
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured, breakdown)
    assert breakdown["OPT"] > 0 and breakdown["SHARDED_PARAM"] > 0


def test_the_estimate_falls_with_the_world_size(estimates: dict[str, Any]) -> None:
    for checkpointed in (True, False):
        peaks = [estimates[f"{n}/{checkpointed}/False"][0] for n in (1, 2, 4, 64)]
        # (at world size 1 no reduction buffers exist: from 2 ranks on, the peak falls)
        assert peaks[1] > peaks[2] > peaks[3] and peaks[3] < 0.6 * peaks[0], peaks
        param = [estimates[f"{n}/{checkpointed}/False"][1]["SHARDED_PARAM"] for n in (1, 2, 4, 64)]
        assert param[1] < 0.55 * param[0] and param[3] < 0.05 * param[0], param  # shards: about 1/N


def _inside_a_job() -> str:
    try:
        fsdp.estimate_memory(build, step, 4)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_the_estimate_refuses_to_run_inside_a_job(pool: RankPool) -> None:
    for msg in pool.run(_inside_a_job):
        assert "before init_process_group()" in msg, msg
        assert dist.is_available()


def test_a_job_started_after_an_estimate_in_the_same_process_trains(tmp_path: Path) -> None:
    """estimate_memory, then init_process_group and training in the same processes (torchrun, two
    ranks): nothing of the simulated world (its cached groups) is found by the job's."""
    out = tmp_path / "peak.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "tests.estimate_then_train", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(out.read_text()) > 0


_CACHES = """
import torch, fsdp
from fsdp.comm import collectives
from tests.distributed.test_memory_estimate import build, step
fsdp.estimate_memory(lambda: build(True), step, 4, device="cpu")
print(len(collectives._group_cache), len(collectives._control_cache))
"""


def test_an_estimate_leaves_no_group_of_its_simulated_world_cached() -> None:
    """The groups made for the simulated world are dropped with it: a later default group may be
    given the same id, and must not find them."""
    proc = subprocess.run(
        [sys.executable, "-c", _CACHES], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "0"], proc.stdout
