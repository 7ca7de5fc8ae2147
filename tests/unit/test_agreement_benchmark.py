"""`python -m benchmarks.agreement` at its smallest size, on two gloo ranks: it runs both variants in every
round and reports the handshake's cost. Timings are not asserted (a shared machine says nothing
about speed); what is asserted is what the script promises whatever the machine."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_agreement_benchmark_pairs_every_round(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    args = ["--size", "1M", "--rounds", "2", "--handshakes", "3", "--clip", "--out", str(tmp_path)]
    proc = subprocess.run(
        [*cmd, "-m", "benchmarks.agreement", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads((tmp_path / "agreement.json").read_text())
    assert len(report["step_s"]["on"]) == len(report["step_s"]["off"]) == 2
    assert len(report["per_round_s"]["handshake"]) == 2 and report["handshake_s"] > 0
    # forward, its end, backward, one per unit (a block each), clip_grad_norm_()
    assert report["units"] >= 1 and report["handshakes_per_step"] == 4 + report["units"]
    share = report["handshakes_per_step"] * report["handshake_s"] / statistics.median(report["step_s"]["off"])
    assert report["handshake_share_of_step"] == pytest.approx(share) and share > 0
