"""The one summary file of ``benchmarks/gpu_checks.sh``: what passed, and the figures.

    python benchmarks/gpu_checks_summary.py --out OUT_DIR --work WORK_DIR

Reads what the script left in ``WORK_DIR`` (``env.json``: the machine and the packages found;
``steps.tsv``: one line per step, ``name status exit seconds budget note``; ``<step>.out``: each
step's output; ``gpu_reports.jsonl``: the JSON report of each GPU test script) and the benchmarks'
files in ``OUT_DIR`` (``offload_memory.json``, ``peers/peers.json``), and writes
``OUT_DIR/summary.json``:

- ``all_passed``, ``dry_run``, ``wall_s``, ``budget_s``, ``env``: the verdict and the machine;
- ``steps``: per step its status (``passed``, ``failed``, ``timeout``, ``skipped``), exit code,
  seconds, budget and a note (why it was skipped, what was left out);
- ``tests``: every test the test steps ran, ``nodeid -> passed|failed|skipped|error``, and
  ``failures``: the first line of each failure's message;
- ``figures``: the GPU tests' reports, the offload benchmark's rows (peak memory and step time
  against the plain model) and the peer benchmark's median ratios and peak CUDA memory per size.

It prints the verdict and one line per step. Standard library only: it runs wherever the script does.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

# "tests/gpu/test_cuda.py::test_x PASSED   [ 16%]" (pytest -v), and "FAILED nodeid - message" (-rfE)
_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_SHORT = re.compile(r"^(FAILED|ERROR) (\S+::\S+)(?: - (.*))?$")


def read_steps(work: Path) -> list[dict[str, Any]]:
    steps = []
    path = work / "steps.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, code, seconds, budget, note = (line.split("\t") + [""] * 6)[:6]
        steps.append(
            {
                "name": name,
                "status": status,
                "exit": int(code),
                "seconds": int(seconds),
                "budget_s": int(budget),
                "note": note,
            }
        )
    return steps


def read_tests(work: Path, steps: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str]]:
    """Each test's outcome, and each failure's first message line, from the steps' pytest output."""
    tests: dict[str, str] = {}
    failures: dict[str, str] = {}
    for step in steps:
        out = work / f"{step['name']}.out"
        if not out.exists():
            continue
        for line in out.read_text(errors="replace").splitlines():
            if m := _VERBOSE.match(line):
                tests[m.group(1)] = m.group(2).lower()
            elif m := _SHORT.match(line):
                tests.setdefault(m.group(2), m.group(1).lower())
                failures[m.group(2)] = (m.group(3) or "")[:300]
    return tests, failures


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def offload_figures(report: Any) -> dict[str, Any] | None:
    if not isinstance(report, dict):
        return None
    keep = {
        "peak_mib": 1,
        "peak_vs_plain": 3,
        "step_ms": 2,
        "step_vs_plain": 3,
        "max_abs_diff_vs_plain": None,
    }
    return {
        "device": report.get("device"),
        "config": report.get("config"),
        "rows": {
            row["name"]: {k: _round(row.get(k), digits) for k, digits in keep.items()}
            for row in report.get("rows", [])
        },
    }


def _round(value: Any, digits: int | None) -> Any:
    return round(value, digits) if isinstance(value, float) and digits is not None else value


def peers_figures(report: Any) -> dict[str, Any] | None:
    if not isinstance(report, dict):
        return None
    sizes = {}
    for s in report.get("sizes", []):
        sizes[s["size"]] = {
            "params": s.get("params"),
            "median_step_ms": {k: round(v, 2) for k, v in s.get("median_step_ms", {}).items()},
            "ratios": {k: round(r["median"], 4) for k, r in s.get("ratios", {}).items()},
            "cuda_peak_mib": {
                k: round(m["cuda_peak_bytes"] / 2**20, 1)
                for k, m in s.get("memory", {}).items()
                if m.get("cuda_peak_bytes") is not None
            },
            "left_out": s.get("left_out"),
            "first_step_loss_max_diff_fp32": s.get("first_step_loss_max_diff_fp32"),
        }
    return {"machine": report.get("machine"), "wall_s": _round(report.get("wall_s"), 1), "sizes": sizes}


def gpu_reports(work: Path) -> list[Any]:
    path = work / "gpu_reports.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def summarize(out: Path, work: Path, wall_s: int, budget_s: int, dry_run: bool) -> dict[str, Any]:
    steps = read_steps(work)
    tests, failures = read_tests(work, steps)
    summary = {
        "all_passed": bool(steps) and all(s["status"] == "passed" for s in steps),
        "dry_run": dry_run,
        "wall_s": wall_s,
        "budget_s": budget_s,
        "env": read_json(work / "env.json"),
        "steps": steps,
        "tests": tests,
        "failures": failures,
        "figures": {
            "gpu_tests": gpu_reports(work),
            "offload_memory": offload_figures(read_json(out / "offload_memory.json")),
            "peers": peers_figures(read_json(out / "peers" / "peers.json")),
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the script's output directory")
    p.add_argument("--work", type=Path, required=True, help="the script's working directory")
    p.add_argument("--wall-s", type=int, default=0)
    p.add_argument("--budget-s", type=int, default=0)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    s = summarize(args.out, args.work, args.wall_s, args.budget_s, args.dry_run)
    verdict = "all parts passed" if s["all_passed"] else "NOT all parts passed"
    print(f"gpu_checks: {verdict} in {s['wall_s']} s (budget {s['budget_s']} s); {args.out / 'summary.json'}")
    for step in s["steps"]:
        note = f" ({step['note']})" if step["note"] else ""
        print(f"  {step['name']:<22} {step['status']:<8} {step['seconds']:>4} s of {step['budget_s']}{note}")
    counts: dict[str, int] = {}
    for outcome in s["tests"].values():
        counts[outcome] = counts.get(outcome, 0) + 1
    print("  tests: " + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none ran"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
