"""Every public path a program uses today imports, and version 0.1.0's module paths still resolve.

The public paths: the package's names (``from fsdp import ...``), ``fsdp.api``, ``fsdp.wrap``,
``fsdp.dcp_state``, ``fsdp.checkpoint_wrapper`` and ``python -m fsdp.consolidate``. The old paths are
the 53 flat modules of 0.1.0 (see [Note: legacy module paths] in fsdp/_legacy_paths.py).
"""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp
from fsdp._legacy_paths import MOVED

ROOT = Path(__file__).resolve().parents[2]

PUBLIC_MODULES = {
    "fsdp.api": ["ShardingStrategy", "MixedPrecision", "CPUOffload", "StateDictType", "BackwardPrefetch"],
    "fsdp.wrap": [
        "enable_wrap", "wrap", "auto_wrap", "wrap_children", "is_torch_style", "default_auto_wrap_policy",
        "config_auto_wrap_policy", "transformer_auto_wrap_policy", "lambda_auto_wrap_policy",
        "size_based_auto_wrap_policy", "always_wrap_policy", "ModuleWrapPolicy", "CustomPolicy",
        "no_split_modules_auto_wrap_policy",
    ],
    "fsdp.dcp_state": [
        "get_state_dict", "set_state_dict", "get_model_state_dict", "set_model_state_dict",
        "get_optimizer_state_dict", "set_optimizer_state_dict",
    ],
    "fsdp.consolidate": ["consolidate_checkpoint", "main"],
}  # fmt: skip


@pytest.mark.parametrize("name", fsdp.__all__)
def test_every_name_of_the_package_imports(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from fsdp import {name}", namespace)
    assert namespace[name] is getattr(fsdp, name) and namespace[name] is not None


@pytest.mark.parametrize("module", sorted(PUBLIC_MODULES))
def test_every_public_module_gives_its_names(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in PUBLIC_MODULES[module] if getattr(mod, n, None) is None]
    assert not missing, f"{module} lacks {missing}"
    assert set(getattr(mod, "__all__", PUBLIC_MODULES[module])) >= set(PUBLIC_MODULES[module]) - {"main"}


def test_the_package_names_are_those_of_the_wrap_package_and_the_checkpoint_wrapper() -> None:
    wrap = importlib.import_module("fsdp.wrap")
    assert fsdp.auto_wrap is wrap.auto_wrap and fsdp.wrap is wrap.wrap  # fsdp.wrap: the function, as 0.1.0
    assert fsdp.checkpoint_wrapper.__module__ == "fsdp.training.activation_checkpoint"


def test_python_m_fsdp_consolidate_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp.consolidate", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint" in proc.stdout


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_module_that_holds_the_code(old: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_old_paths_resolve_in_a_fresh_interpreter_and_in_pickles() -> None:
    """The first import of a program may be an old path (nothing imported ``fsdp`` before), and a pickle
    of 0.1.0 names classes by old paths."""
    code = (
        "from fsdp.checkpoint import checkpoint_wrapper\n"
        "import fsdp.fully_sharded, fsdp.training.activation_checkpoint as new\n"
        "assert checkpoint_wrapper is new.checkpoint_wrapper\n"
        "print(fsdp.fully_sharded.FullyShardedDataParallel.__module__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "fsdp.wrapper.fully_sharded"
    for old, name in [
        ("fsdp.handle", "FlatParamHandle"),
        ("fsdp.sharding", "ShardSpec"),
        ("fsdp._module_ops", "DetachedGroup"),
    ]:
        blob = b"\x80\x02c" + f"{old}\n{name}\n".encode() + b"q\x00."  # protocol 2: GLOBAL old.name
        assert pickle.loads(blob) is getattr(importlib.import_module(MOVED[old]), name)


def test_an_unknown_module_path_still_fails_to_import() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fsdp.no_such_module")
