"""examples/finetune_hf.py, short, on two gloo ranks: it trains, writes its plot, model and samples,
and a run resumed from its checkpoint continues exactly as an uninterrupted run (weights, AdamW
state, learning-rate schedule, batches and dropout). Skipped without ``transformers``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs Hugging Face transformers: pip install -e '.[hf]'")

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "2"]
TINY += ["--eval-interval", "2", "--eval-iters", "1", "--save-interval", "2", "--corpus-chars", "50000"]
TINY += ["--samples", "1", "--sample-tokens", "6"]


def _run(out: Path, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [*cmd, "examples.finetune_hf", *TINY, "--out-dir", str(out), *args],  # as the docs start it
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (
        f"finetune_hf.py {args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def test_the_hf_example_trains_and_resumes_exactly(tmp_path: Path) -> None:
    _run(tmp_path / "a", "--max-iters", "4")
    printed = _run(tmp_path / "a", "--max-iters", "6", "--resume")
    assert "at step 4" in printed
    _run(tmp_path / "b", "--max-iters", "6")  # the same six steps without a stop
    resumed, straight = (json.loads((tmp_path / r / "loss_curve.json").read_text()) for r in "ab")
    for key in ("iter", "train", "val", "step_loss", "samples"):
        assert resumed[key] == straight[key], key
    assert resumed["iter"] == [0, 2, 4, 6] and resumed["units"] == 3  # the root and one unit per block
    assert resumed["samples"][0].startswith("def ") and len(resumed["samples"][0].encode()) >= 6
    for out in ("a", "b"):
        assert (tmp_path / out / "loss_curve.png").is_file()
        assert (tmp_path / out / "model" / "config.json").is_file()  # save_pretrained's form
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000004",
        "step_000006",
    ]  # none deleted
