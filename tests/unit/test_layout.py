"""The package's layering: a module imports only from modules above it; one module names torch.cuda."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# Lint, not behaviour: these read the source text. Counted apart (-m lint selects them, -m "not lint" skips them).
pytestmark = pytest.mark.lint

PKG = Path(__file__).resolve().parents[2] / "fsdp"

# Top to bottom: each module may import only from modules listed above it.
ORDER = [
    "api", "_device", "_compile", "nest", "deferred_init", "flat_param", "sharding", "collectives", "consistency", "topology", "schedule", "buckets", "grad_hooks", "handle",
    "mixed_precision",
    "clip_grad", "no_shard_buckets",
    "sharded_grad_scaler", "state_layout", "state_local", "state_dict", "optim_fairscale", "optim_state", "shared_params", "_recompute", "checkpoint", "wrap", "data_parallel",
    "_offload_slice", "_offload_engine", "offload_model", "_state_methods", "_stats_methods", "_fairscale_attrs", "_summon_methods", "_torch_compat", "_torch_methods", "_module_ops", "fully_sharded", "dcp_state", "norm_wrap", "checkpoint_files", "_app_state", "checkpoint_io", "consolidate",
]  # fmt: skip


def _fsdp_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("fsdp."))
    return names


MODULES = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", MODULES)
def test_imports_only_from_modules_above(module: str) -> None:
    assert module in ORDER, (
        f"fsdp/{module}.py is not placed in the layering; add it to ORDER and docs/design.md"
    )
    above = set(ORDER[: ORDER.index(module)])
    assert _fsdp_imports(PKG / f"{module}.py") <= above, f"fsdp/{module}.py imports from below it"


@pytest.mark.parametrize("module", MODULES)
def test_only_the_device_module_names_torch_cuda(module: str) -> None:
    if module != "_device":
        assert "torch.cuda" not in (PKG / f"{module}.py").read_text()


@pytest.mark.parametrize("module", ["wrap", "checkpoint"])
def test_wrap_and_checkpoint_never_import_the_wrapper(module: str) -> None:
    path = PKG / f"{module}.py"
    if path.exists():
        assert "fully_sharded" not in _fsdp_imports(path)


def test_library_never_prints() -> None:
    for path in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "print", f"{path.name}: use logging or warnings, not print"
