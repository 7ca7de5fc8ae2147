"""The GPT example, as the docs start it (``python3 -m examples.train_gpt`` from the repository root):
its options parse before torch loads; one rank runs every ``--strategy`` without torchrun; a second
run never deletes the first one's results unasked; its sampler resumes mid-epoch; and a two-rank run
killed while saving resumes bit for bit where the uninterrupted run would be."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from benchmarks.exact_resume import compare, launch
from examples.data import CharWindows, ResumableSampler, endless_batches
from examples.train_gpt import STRATEGIES, build_parser
from fsdp import ShardingStrategy

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "4"]
TINY += ["--eval-interval", "2", "--eval-iters", "1", "--corpus-chars", "20000", "--save-interval", "2"]


def _run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    env["LOCAL_WORLD_SIZE"] = "2"  # left over in a shell: one plain python process is one rank all the same
    cmd = [sys.executable, "-m", "examples.train_gpt", *TINY, "--out-dir", str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _train(out: Path, *args: str) -> tuple[dict, str]:
    proc = _run(out, *args)
    assert proc.returncode == 0, f"train_gpt {args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert (out / "model.pt").is_file() and (out / "loss_curve.png").is_file()
    return json.loads((out / "loss_curve.json").read_text()), proc.stdout


def _files(out: Path) -> dict[str, str]:
    """Every file under ``out`` with a hash of its content."""
    return {
        str(p.relative_to(out)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in out.rglob("*")
        if p.is_file()
    }


def test_options_parse_before_torch_loads_and_each_has_help() -> None:
    check = (
        "import sys; from examples.train_gpt import parse_args; args = parse_args(['--max-iters', '3']); "
        "assert args.max_iters == 3; assert 'torch' not in sys.modules, 'torch loaded before the options parsed'"
    )
    proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    actions = [a for a in build_parser()._actions if a.dest != "help"]
    assert len(actions) >= 20 and all(a.help for a in actions), [a.dest for a in actions if not a.help]
    assert STRATEGIES == [s.name for s in ShardingStrategy if not s.name.startswith("_")]
    with pytest.raises(SystemExit):  # a mistake in the options stops before anything is built
        build_parser().parse_args(["--resume", "--overwrite"])


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "NO_SHARD"])
def test_the_example_runs_on_one_rank_without_torchrun(tmp_path: Path, strategy: str) -> None:
    curve, _ = _train(tmp_path, "--max-iters", "4", "--strategy", strategy)
    assert curve["config"]["strategy"] == strategy and curve["world_size"] == 1
    assert curve["iter"][-1] == 4 and all(0 < loss < 10 for loss in curve["train"])
    assert len(curve["step_loss"]) == 4
    memory = curve["memory_bytes"]  # one rank: the shards are the whole model, nothing is gathered
    assert memory["sharded_params"] == memory["full_params"] > 0 and memory["peak_gathered_in_a_step"] == 0
    resumed, printed = _train(tmp_path, "--max-iters", "6", "--strategy", strategy, "--resume")
    assert "at step 4" in printed, "the second run starts where the first one's checkpoint left off"
    assert resumed["iter"] == [0, 2, 4, 6] and resumed["step_loss"][:4] == curve["step_loss"]
    assert resumed["steps_this_run"] == 2


def test_a_run_never_deletes_an_earlier_runs_results(tmp_path: Path) -> None:
    _train(tmp_path, "--max-iters", "4")
    before = _files(tmp_path)
    assert {"checkpoints/step_000002/COMMITTED", "checkpoints/step_000004/COMMITTED"} <= set(before)
    again = _run(tmp_path, "--max-iters", "4")  # neither --resume nor --overwrite
    assert again.returncode == 2 and "--resume" in again.stderr and "--overwrite" in again.stderr, (
        again.stderr
    )
    assert _files(tmp_path) == before, "a refused run changes nothing"
    finished = _run(tmp_path, "--max-iters", "4", "--resume")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "is finished" in finished.stdout and "ms/step" not in finished.stdout, finished.stdout
    assert _files(tmp_path) == before, "resuming a finished run leaves its outputs as they are"
    _train(tmp_path, "--max-iters", "2", "--overwrite")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000002"], "--overwrite starts afresh"


def _global_batches(world: int, batch: int, steps: int, state: dict | None = None) -> tuple[list, dict]:
    """The windows (first ids) of each step's global batch, taking ``steps`` steps from ``state``."""
    windows = CharWindows(torch.arange(50), block_size=4)  # 46 windows: an epoch is 7 or 8 steps
    per_rank = []
    samplers = []
    for rank in range(world):
        sampler = ResumableSampler(windows, num_replicas=world, rank=rank, shuffle=True, seed=3)
        if state is not None:
            sampler.load_state_dict(state)
        loader = DataLoader(windows, batch, sampler=sampler, drop_last=True, generator=torch.Generator())
        it = endless_batches(loader, sampler)
        per_rank.append([next(it)[0][:, 0].tolist() for _ in range(steps)])
        samplers.append(sampler)
    assert len({str(s.state_dict()) for s in samplers}) == 1, "every rank counts the same position"
    return [sorted(i for r in per_rank for i in r[k]) for k in range(steps)], samplers[0].state_dict()


def test_the_sampler_resumes_exactly_mid_epoch_and_at_another_world_size() -> None:
    whole, _ = _global_batches(2, 3, 20)  # crosses two epoch boundaries
    assert len({tuple(b) for b in whole[:7]}) == 7 and whole[:7] != whole[7:14], "a new permutation per epoch"
    first, state = _global_batches(2, 3, 5)
    rest, _ = _global_batches(2, 3, 15, state)
    assert first + rest == whole, "resumed mid-epoch: the same batches as without the interruption"
    one_rank, _ = _global_batches(1, 6, 2, state)  # the same global batch on one rank
    assert one_rank == whole[5:7], "at another world size the global batches are the same windows"


def test_a_run_killed_while_saving_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Two ranks, dropout on (so the RNG streams matter); rank 0 is killed as it commits the step-6
    checkpoint; the resumed run starts from step 4 and must end exactly as the uninterrupted one."""
    args = [*TINY, "--max-iters", "8", "--dropout", "0.1", "--sample-chars", "0", "--warmup-iters", "2"]
    ref = launch([*args, "--out-dir", str(tmp_path / "ref")], 2)
    assert ref["codes"] == [0, 0], ref["output"][-3000:]
    out = tmp_path / "killed"
    killed = launch([*args, "--out-dir", str(out)], 2, kill="commit:3")
    assert killed["killed"], killed["output"][-3000:]
    checkpoints = {p.name: (p / "COMMITTED").exists() for p in (out / "checkpoints").iterdir()}
    assert checkpoints == {"step_000002": True, "step_000004": True, "step_000006": False}
    resumed = launch([*args, "--out-dir", str(out), "--resume"], 2)
    assert resumed["codes"] == [0, 0], resumed["output"][-3000:]
    assert "resumed from" in resumed["output"] and "step_000004 at step 4" in resumed["output"]
    result = compare(tmp_path / "ref", out)
    assert result["bit_identical"], result
