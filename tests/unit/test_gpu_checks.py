"""benchmarks/gpu_checks.sh in its CPU dry run: every step runs (tiny sizes, gloo, the GPU tests
collected and skipped), carried wheels are installed without a package index, and the one summary
file says what passed and holds the figures; a step with no time left in the budget is skipped and
fails the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"
STEPS = ["gpu-tests", "gpu-compile-test", "offload-model-tests", "offload-memory", "peers"]
PROBE = "gpu_checks_probe"


def _probe_wheel(directory: Path) -> Path:
    """A minimal pure-Python wheel (what ``pip wheel`` makes), built without a package index."""
    files = {
        f"{PROBE}/__init__.py": "VALUE = 7\n",
        f"{PROBE}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {PROBE}\nVersion: 0.1\n",
        f"{PROBE}-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = f"{PROBE}-0.1.dist-info/RECORD"
    path = directory / f"{PROBE}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(record, "".join(f"{name},,\n" for name in [*files, record]))
    return path


def _run(
    *args: str, budget: int | None = None, timeout: float = 330, path_first: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The script in its dry run, given this test's interpreter as ``PYTHON`` (the suite may run under a
    virtual environment's interpreter that is not on the PATH); ``path_first`` goes first on the PATH."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHON": sys.executable}
    env.pop("FSDP_GPU_WHEELS", None)
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', '')}"
    if budget is not None:
        env["FSDP_GPU_CHECKS_BUDGET_S"] = str(budget)
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(360)
def test_dry_run_runs_every_step_and_writes_one_summary(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _probe_wheel(wheels)
    out = tmp_path / "out"
    # a python3 on the PATH without torch (a virtual environment's interpreter runs the suite, not
    # activated): the script must run the interpreter it is given, never this one
    shadow = tmp_path / "bin"
    shadow.mkdir()
    (shadow / "python3").write_text("#!/bin/sh\necho 'the python3 on the PATH ran' >&2\nexit 3\n")
    (shadow / "python3").chmod(0o755)
    proc = _run("--wheels", str(wheels), str(out), path_first=shadow)
    assert "the python3 on the PATH ran" not in proc.stderr + proc.stdout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["all_passed"] and summary["dry_run"]
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [(name, "passed") for name in STEPS]
    assert summary["wall_s"] <= summary["budget_s"] == 270
    # the carried wheel was installed and is importable in the steps' environment
    assert summary["env"]["wheels_installed"] == [f"{PROBE}-0.1-py3-none-any.whl"]
    assert summary["env"]["packages"][PROBE] == "0.1" and summary["env"]["cuda"] is False
    # the GPU tests were collected (and skipped on the CPU), each under its name
    gpu_tests = {k: v for k, v in summary["tests"].items() if k.startswith("tests/gpu/")}
    assert len(gpu_tests) >= 6 and set(gpu_tests.values()) == {"skipped"}
    assert any("test_cuda_parity_and_peak_memory" in k for k in summary["tests"])
    # the figures of both benchmarks, read from their own files
    figures = summary["figures"]
    rows = figures["offload_memory"]["rows"]
    assert "plain" in rows and rows["plain"]["step_vs_plain"] == 1.0
    assert any(name.startswith("offload") for name in rows)
    (size,) = figures["peers"]["sizes"].values()
    assert size["ratios"]["ours_full/ddp"] > 0 and size["first_step_loss_max_diff_fp32"] < 1e-5
    # one summary beside the log and the benchmarks' own files: few enough to bring back
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [
        "gpu_checks.log",
        "offload_memory.json",
        "peers/peers.json",
        "peers/peers.md",
        "peers/peers.png",
        "summary.json",
    ], files
    assert "gpu_checks: all parts passed" in proc.stdout


def test_steps_without_time_left_are_skipped_and_fail_the_run(tmp_path: Path) -> None:
    proc = _run(str(tmp_path), budget=5, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["all_passed"]
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [(name, "skipped") for name in STEPS]
    assert all("no time left in the 5 s budget" in s["note"] for s in summary["steps"])
    assert "NOT all parts passed" in proc.stdout
