"""The GPT example, as the docs start it: ``python3 examples/train_gpt.py`` without torchrun runs one
rank, with every ``--strategy`` the docs list; a second run resumes from the first one's checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "4"]
TINY += ["--eval-interval", "2", "--eval-iters", "1", "--corpus-chars", "20000", "--save-interval", "2"]


def _train(out: Path, *args: str) -> tuple[dict, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    env["LOCAL_WORLD_SIZE"] = "2"  # left over in a shell: one plain python process is one rank all the same
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), *TINY, "--out-dir", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"train_gpt.py {args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert (out / "model.pt").is_file() and (out / "loss_curve.png").is_file()
    return json.loads((out / "loss_curve.json").read_text()), proc.stdout


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "NO_SHARD"])
def test_the_example_runs_on_one_rank_without_torchrun(tmp_path: Path, strategy: str) -> None:
    curve, _ = _train(tmp_path, "--max-iters", "4", "--strategy", strategy)
    assert curve["config"]["strategy"] == strategy and curve["world_size"] == 1
    assert curve["iter"][-1] == 4 and all(0 < loss < 10 for loss in curve["train"])
    memory = curve["memory_bytes"]  # one rank: the shards are the whole model, nothing is gathered
    assert memory["sharded_params"] == memory["full_params"] > 0 and memory["peak_gathered_in_a_step"] == 0
    resumed, printed = _train(tmp_path, "--max-iters", "6", "--strategy", strategy, "--resume")
    assert "at step 4" in printed, "the second run starts where the first one's checkpoint left off"
    assert resumed["iter"][: len(curve["iter"])] == curve["iter"] and resumed["iter"][-1] == 6
