"""CUDA/NCCL checks; skipped (with the reason) where there is no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script: str) -> dict:
    """Run tests/gpu/<script> under torchrun at world size 1; it prints a JSON report line."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        os.path.join(ROOT, "tests", "gpu", script),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the last JSON line: torch or NCCL may print after it
    report: dict = json.loads(next(s for s in reversed(proc.stdout.splitlines()) if s.startswith("{")))
    reports = os.environ.get("FSDP_GPU_REPORTS")  # benchmarks/gpu_checks.sh puts them in its summary
    if reports:
        with open(reports, "a") as f:
            f.write(json.dumps({"script": script, **report}) + "\n")
    return report


@pytest.mark.gpu
def test_nccl_world_size_1_parity_on_cuda() -> None:
    report = _run("cuda_parity.py")
    assert all(v <= 1e-4 for v in report["max_diff"].values()), report


@pytest.mark.gpu
def test_offload_copies_run_on_a_side_stream() -> None:
    report = _run("offload_streams.py")
    assert report["copies_on_a_side_stream"], report
    for precision in ("fp32", "fp16"):
        assert report[f"{precision}_grads_on_cpu"], report
        assert report[f"{precision}_max_diff"] <= 1e-6, report


@pytest.mark.gpu
def test_offloaded_sharded_checkpoint_stays_on_the_host() -> None:
    report = _run("offload_checkpoint.py")
    assert report["sharded_state_devices"] == ["cpu"], report
    assert report["save_growth_bytes"] <= report["bound_bytes"], report
    assert report["load_growth_bytes"] <= report["bound_bytes"], report
    assert report["restored_on_host"], report
    assert report["losses"][0] == report["losses"][1] and report["max_param_diff_after_step"] == 0.0, report


@pytest.mark.gpu
def test_data_parallel_clipping_and_grad_scaler_on_cuda() -> None:
    report = _run("cuda_training.py")
    assert report["ddp_max_diff"] <= 1e-6 and report["ddp_two_streams_max_diff"] <= 1e-6, report
    ours, theirs, after = report["clip_norm_ours_theirs_after"]
    assert abs(ours - theirs) <= 1e-4 * theirs and abs(after - 1.0) <= 1e-3, report
    for key, home in (("scaler", "cuda"), ("scaler_offload", "cpu")):
        r = report[key]
        assert r["skipped_overflow"] and r["scale_after_overflow"] == 2.0**9, report
        assert r["trained_after"] and r["grad_devices"] == [home], report
    assert "after wrapping would make the flat parameters" in report["move_refused"], report
    assert report["checkpoint_dropout_max_diff"] == 0.0, report


@pytest.mark.gpu
def test_a_wrapped_model_compiles_with_inductor_on_cuda() -> None:
    report = _run("cuda_compile.py")
    assert report["fp32"]["max_param_diff"] <= 1e-4, report
    for precision in ("fp32", "bf16"):
        first, last = report[precision]["graphs_after_first_and_last_step"]
        assert first >= 1 and first == last, report  # compiled, and no recompilation


@pytest.mark.gpu
def test_a_torch_fsdp1_script_trains_like_torch_fsdp1() -> None:
    report = _run("cuda_torch_style.py")
    assert report["param_devices"] == ["cuda:0"] and report["grad_dtypes"] == ["torch.float32"], report
    assert report["same_keys"], report
    # both compute in bf16 with fp32 reductions: the same model within bf16 rounding
    assert report["loss_max_rel_diff"] <= 0.02 and report["state_max_diff"] <= 0.02, report
