"""The peer benchmark and the phase breakdown at their smallest size, on two gloo ranks.

Timings are not asserted (a shared CI machine says nothing about speed); what is asserted is what
the scripts promise whatever the machine: every variant ran, our communication equals what the
padded flat sizes predict, every fp32 variant computed the same first loss, and the reports exist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def torchrun(module: str, *args: str, timeout: float = 240) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    # gloo ranks on the CPU even on a GPU machine (there the scripts would pick NCCL, one GPU per rank)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [*cmd, "-m", f"benchmarks.{module}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"benchmarks.{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def peers_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("peers")
    # fairscale's FSDP runs only on CUDA: asked for on the CPU, it fails and must be left out of the
    # run (reported), while every other variant is still measured
    torchrun("peers", "--sizes", "1M", "--rounds", "2", "--fairscale", "yes", "--no-plot", "--out", str(out))
    assert (out / "peers.md").read_text().strip()
    return json.loads((out / "peers.json").read_text())


def test_peers_runs_every_variant_with_exact_bytes_and_one_loss(peers_report: dict) -> None:
    (size,) = peers_report["sizes"]
    expected = set("ours_full ours_grad_op ours_no_shard ours_full_bf16 fsdp2 fsdp2_bf16 ddp local".split())
    assert set(size["variants"]) == expected
    for name in expected:
        assert len(size["per_round_step_s"][name]) == 2 and min(size["per_round_step_s"][name]) > 0
        assert size["memory"][name]["tracked_peak_bytes_per_rank"][0] > 0
    ours = [n for n in expected if n.startswith("ours_")]
    assert all(size["comm"][n]["counted_matches_expected"] for n in ours), size["comm"]
    # same weights, same batches: every fp32 variant's first loss is the same number (up to the
    # rounding of matrix kernels, which may differ with the alignment of the flat parameters' views)
    assert size["first_step_loss_max_diff_fp32"] < 1e-5
    assert {"ours_full/fsdp2", "ours_full/ddp", "ours_full/local"} <= set(size["ratios"])


def test_peers_leaves_out_a_peer_that_fails(peers_report: dict) -> None:
    (size,) = peers_report["sizes"]
    assert set(size["left_out"]) == {"fairscale", "fairscale_bf16"}, size["left_out"]
    assert not any(k.endswith("/fairscale") or k.endswith("/fairscale_bf16") for k in size["ratios"])


def test_phases_reports_every_phase_of_every_variant(tmp_path: Path) -> None:
    variants = "ours_full,ours_full_nofp,ddp,local"
    torchrun("phases", *"--size 1M --rounds 2 --warm 1 --variants".split(), variants, "--out", str(tmp_path))
    median = json.loads((tmp_path / "phases.json").read_text())["median"]
    assert set(median) == set(variants.split(","))
    for row in median.values():
        for phase in ("forward", "backward", "optimizer"):
            assert row[f"{phase}_wall"] > 0 and row[f"{phase}_cpu"] >= 0
        assert row["step_wall"] >= row["forward_wall"]
    table = (tmp_path / "phases.md").read_text()
    assert all(f"| {v} |" in table for v in variants.split(","))


def test_checkpoint_cost_times_both_variants_of_each_operation(tmp_path: Path) -> None:
    torchrun("checkpoint_cost", *"--size 1M --rounds 2 --dir".split(), str(tmp_path))
    report = json.loads((tmp_path / "checkpoint_cost.json").read_text())
    for op in ("save", "load", "latest"):
        for variant in ("with", "without"):
            assert len(report["times_s"][op][variant]) == 2 and min(report["times_s"][op][variant]) > 0
        assert report[f"{op}_ratio_median"] > 0
    recorded = report["files_with_checksums"]
    assert (
        ".metadata" in recorded["with"] and "__1_0.distcp" in recorded["with"] and recorded["without"] == []
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_cost.json"], (
        "each round's files are removed"
    )


def test_versions_times_an_earlier_commit_beside_this_checkout(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.versions", "--commits", "HEAD", "--size", "1M", "--rounds", "2"]
    cmd += ["--extra", "in_backward_pp", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "versions.json").read_text())
    assert set(report) == {"this", "HEAD", "this_in_backward_pp", "local"}
    for row in report.values():
        assert len(row["per_round_s"]) == 2 and row["median_step_s"] > 0 and row["over_local"] > 0
    assert report["this"]["over_this"] == 1.0 and report["local"]["over_local"] == 1.0
