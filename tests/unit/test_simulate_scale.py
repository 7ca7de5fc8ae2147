"""benchmarks/simulate_scale.py at its --quick size: per-rank bytes follow P x 16 / N plus padding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdp.core.sharding import chunk_numel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``main(["--quick", ...])`` of the script, in a fresh process: the fake process group must be
    the default group, and this process may already hold one (the session's one-rank gloo group)."""
    out = tmp_path_factory.mktemp("simulate_scale") / "out.json"
    code = (
        "from benchmarks import simulate_scale as m; "
        f"r = m.main(['--quick', '--out', {str(out)!r}]); "
        "import torch.distributed as dist; assert not dist.is_initialized(), 'fake group left behind'; "
        "assert r['memory'] and r['steps'] and r['bookkeeping']['rows']"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| N | params/rank |" in proc.stdout
    res: dict[str, Any] = json.loads(out.read_text())
    res["numels"] = _unit_numels(res["config"])
    return res


def _unit_numels(cfg: dict[str, int]) -> list[int]:
    """The units of the example GPT, counted by hand: each block, then the root (tied head once)."""
    c = cfg["n_embd"]
    block = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    root = cfg["vocab"] * c + cfg["block_size"] * c + 2 * c
    return [block] * cfg["n_layer"] + [root]


def test_memory_follows_formula(result: dict[str, Any]) -> None:
    numels = result["numels"]
    p = sum(numels)
    assert [r["world_size"] for r in result["memory"]] == [2, 8]
    for r in result["memory"]:
        n = r["world_size"]
        assert r["num_params"] == p and r["units"] == len(numels)
        shard = sum(chunk_numel(k, n) for k in numels)
        assert r["measured_param_bytes"] == r["param_storage_bytes"] == 4 * shard
        assert r["total_bytes"] == 16 * shard
        # P x (4 + 4 + 8) / N plus less than one padding element per unit
        assert 16 * p / n <= r["total_bytes"] < 16 * p / n + 16 * len(numels)
        assert r["largest_unit_bytes"] == 4 * max(chunk_numel(k, n) * n for k in numels)
        # deferred init: the shards plus the transients of one unit (its materialized parameters
        # and the padded flat copy they are written into), never the full model
        assert r["wrap_peak_tracked_bytes"] <= r["measured_param_bytes"] + 2 * r["largest_unit_bytes"]
    excess = [r["total_bytes"] - r["formula_bytes"] for r in result["memory"]]
    assert any(e > 0 for e in excess), "the quick model is meant to need padding somewhere"


def test_step_materializes_shards(result: dict[str, Any]) -> None:
    numels = result["numels"]
    p = sum(numels)
    by_n = {s["world_size"]: s for s in result["steps"]}
    assert sorted(by_n) == [2, 8]
    for n, s in by_n.items():
        shard = sum(chunk_numel(k, n) for k in numels)
        assert s["measured_param_bytes"] == s["measured_grad_bytes"] == 4 * shard
        assert s["measured_optim_bytes"] == 8 * shard  # exp_avg + exp_avg_sq
        assert 16 * p / n <= s["total_bytes"] < 16 * p / n + 16 * len(numels)
        assert s["total_bytes"] <= s["peak_tracked_bytes"]
        assert s["calls"]["all_gather"] >= len(numels) and s["calls"]["reduce_scatter"] >= 1
    # four times the ranks, a quarter of the state (up to padding)
    assert abs(4 * by_n[8]["total_bytes"] - by_n[2]["total_bytes"]) < 4 * 16 * len(numels)


def test_bookkeeping_rows(result: dict[str, Any]) -> None:
    rows = result["bookkeeping"]["rows"]
    assert [r["blocks"] for r in rows] == [2, 4]
    for r in rows:
        assert r["units"] == r["blocks"] + 1
        assert r["fsdp_s"] > 0 and r["plain_s"] > 0
        assert r["calls"]["all_gather"] >= r["units"]
