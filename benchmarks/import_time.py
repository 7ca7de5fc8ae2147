"""What ``import fsdp`` costs beyond ``import torch``, from paired, interleaved runs.

    python benchmarks/import_time.py [--pairs 9] [--also DIR ...]

Each round starts one fresh interpreter with ``python -X importtime -c "import torch"`` and one with
``-c "import torch, fsdp"`` (in alternating order), and sums the self times that ``-X importtime``
reports (every module imported, in microseconds). The extra cost of a round is the difference of the
pair; the report is the median over rounds, with the median totals beside it. ``--also DIR`` adds
``import torch, fsdp`` with ``DIR`` first on ``PYTHONPATH`` to every round (another checkout's
package, e.g. an older commit's, measured on the same load). The ``fsdp`` measured otherwise is the
one that ``python -c "import fsdp"`` finds from the repository root.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_seconds(code: str, pythonpath: str) -> float:
    """Total import time of ``code`` in a fresh interpreter: the sum of ``-X importtime``'s self times."""
    env = dict(os.environ, PYTHONPATH=pythonpath)
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        env=env,
        cwd=pythonpath,
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    total = 0
    for line in err.splitlines():
        if line.startswith("import time:") and "self [us]" not in line:
            total += int(line[len("import time:") :].split("|")[0])
    return total / 1e6


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=9, help="rounds of paired runs (default 9)")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="DIR",
        help="another checkout's fsdp to time in each round",
    )
    args = parser.parse_args(argv)
    variants = {"torch": ("import torch", str(ROOT)), "torch+fsdp": ("import torch, fsdp", str(ROOT))}
    for d in args.also:
        variants[f"torch+fsdp@{d}"] = ("import torch, fsdp", str(Path(d).resolve()))
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.pairs):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(import_seconds(*variants[name]))
    result = {f"median {name} s": statistics.median(t) for name, t in times.items()}
    for name in names[1:]:
        extra = [a - b for a, b in zip(times[name], times["torch"])]
        result[f"median extra of {name} s"] = statistics.median(extra)
    for key, value in result.items():
        print(f"{key:>40}: {value:.3f}")
    return result


if __name__ == "__main__":
    main()
