"""``python -m benchmarks.memory`` at its tiny size: every variant runs in its own pair of ranks and
the report gives each one's peak with the tracker's categories. Peaks are not asserted against each
other here (the figures are the benchmark's, docs/performance.md); what the script promises is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_memory_benchmark_reports_every_variant_and_regime(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--size", "tiny", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "memory.json").read_text())
    assert sorted(report) == ["batch4", "ckpt1"]
    for by in report.values():
        assert sorted(by) == ["fsdp2", "ours", "ours_in_backward", "ours_in_backward_pp", "ours_pp"]
        for r in by.values():
            assert len(r["peak_bytes_per_rank"]) == 2 and r["peak_bytes"] == max(r["peak_bytes_per_rank"]) > 0
            assert r["categories"].get("OPT", 0) > 0  # the optimizer state is counted (warm-up step first)
            assert r["categories"].get("SHARDED_PARAM", 0) > 0  # the categories of FSDP2's tracker
    table = (tmp_path / "memory.md").read_text()
    assert "| ckpt1 | ours_in_backward |" in table and "/ fsdp2" in table
