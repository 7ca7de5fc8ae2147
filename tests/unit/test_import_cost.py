"""``import fsdp`` costs little beyond ``import torch``: the heavy torch packages load where they are used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each costs about 0.5 s to import (sympy, DTensor's op tables); only checkpoints and sharded state need them.
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "sympy")


def _modules_after(code: str) -> set[str]:
    """The names in ``sys.modules`` after running ``code`` in a fresh interpreter that imports this checkout."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_import_fsdp_leaves_the_heavy_torch_packages_unimported() -> None:
    modules = _modules_after("import fsdp, fsdp.wrapper.fully_sharded, fsdp.checkpoints.save_load")
    assert "fsdp.checkpoints.save_load" in modules
    heavy = sorted(m for m in modules for h in HEAVY if m == h or m.startswith(h + "."))
    assert not heavy, f"import fsdp imported {heavy[:5]}: import them inside the functions that use them"


def test_is_dtensor_recognizes_a_dtensor_without_importing_its_module() -> None:
    code = """
import sys, torch, fsdp
from fsdp.core.layout import is_dtensor
assert not is_dtensor(torch.zeros(2)) and "torch.distributed.tensor" not in sys.modules
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
d = DTensor.from_local(torch.zeros(2), DeviceMesh("cpu", [0]), [Shard(0)])
assert is_dtensor(d) and not is_dtensor(d.to_local())
dist.destroy_process_group()
"""
    assert "torch.distributed.tensor" in _modules_after(code)


def test_import_time_benchmark_reports_the_paired_extra() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "import_time.py"), "--pairs", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    result = {k.strip(): float(v) for k, v in (line.split(": ") for line in proc.stdout.splitlines())}
    assert set(result) == {"median torch s", "median torch+fsdp s", "median extra of torch+fsdp s"}
    extra = result["median torch+fsdp s"] - result["median torch s"]
    assert abs(result["median extra of torch+fsdp s"] - extra) < 2e-3 and result["median torch s"] > 0
