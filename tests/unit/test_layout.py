"""The package's layering: a module imports only from modules above it; one module names torch.cuda."""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
from pathlib import Path

import pytest
from torch import nn

# Lint, not behaviour: these read the source text. Counted apart (-m lint selects them, -m "not lint" skips them).
pytestmark = pytest.mark.lint

PKG = Path(__file__).resolve().parents[2] / "fsdp"

# Top to bottom: each module may import only from modules listed above it.
ORDER = [
    "api", "_device", "_compile", "nest", "deferred_init", "guards", "flat_param", "sharding", "lost_ranks", "collectives", "consistency", "topology", "schedule", "buckets", "grad_hooks", "handle",
    "mixed_precision",
    "clip_grad", "no_shard_buckets",
    "sharded_grad_scaler", "state_layout", "_wrapper_protocol", "state_local", "state_dict", "optim_fairscale", "optim_state", "shared_params", "_recompute", "checkpoint", "wrap", "data_parallel",
    "_offload_slice", "_offload_engine", "offload_model", "_state_methods", "_stats_methods", "_grad_methods", "_fairscale_attrs", "_summon_methods", "_direct_call", "_torch_compat", "_torch_methods", "_module_ops", "_construct", "_root_context", "fully_sharded", "dcp_state", "norm_wrap", "checkpoint_files", "_app_state", "checkpoint_io", "consolidate",
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


def test_one_class_per_name() -> None:
    """No two classes of the package share a name (a reader, or an import, would take one for the other)."""
    defined: dict[str, list[str]] = {}
    for path in sorted(PKG.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(path.name)
    twice = {name: files for name, files in defined.items() if len(files) > 1}
    assert not twice, f"classes defined more than once: {twice}"


def _mixins() -> list[type]:
    from fsdp import FullyShardedDataParallel

    mro = FullyShardedDataParallel.__mro__
    return [c for c in mro[1 : mro.index(nn.Module)] if c.__module__.startswith("fsdp.")]


# what Python puts in every class's namespace
_CLASS_ATTRIBUTES = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__"}
_CLASS_ATTRIBUTES |= {"__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__"}


def _is_stub(value: object) -> bool:
    """A function or property whose body only raises a bare ``NotImplementedError`` (or is ``...`` / ``pass``)."""
    function = value.fget if isinstance(value, property) else value
    if not inspect.isfunction(function):
        return False
    node = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    assert isinstance(node, ast.FunctionDef)
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    if len(body) != 1:
        return not body
    only = body[0]
    if isinstance(only, ast.Raise):
        exc = only.exc.func if isinstance(only.exc, ast.Call) and not only.exc.args else only.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return isinstance(only, ast.Pass) or (isinstance(only, ast.Expr) and isinstance(only.value, ast.Constant))


def test_no_mixin_of_the_wrapper_holds_a_stub() -> None:
    """A mixin reaches the wrapper through the typed ``fsdp._wrapper_protocol.Wrapper``, never through
    stand-ins that the order of the bases could make the wrapper resolve to."""
    stubs = [
        f"{cls.__name__}.{name}" for cls in _mixins() for name, value in vars(cls).items() if _is_stub(value)
    ]
    assert not stubs, f"stand-ins in the wrapper's mixins: {stubs}"


def test_any_order_of_the_mixins_resolves_every_name_alike() -> None:
    """No two mixins define one name, so reordering the wrapper's bases cannot change what a name
    (``rank``, ``compute_device``, ...) resolves to; checked on every order of the mixins."""
    mixins = _mixins()
    defined: dict[str, list[str]] = {}
    for cls in mixins:
        for name in set(vars(cls)) - _CLASS_ATTRIBUTES:
            defined.setdefault(name, []).append(cls.__name__)
    twice = {name: owners for name, owners in defined.items() if len(owners) > 1}
    assert not twice, f"names defined by more than one of the wrapper's mixins: {twice}"
    expected = {name: next(vars(c)[name] for c in mixins if name in vars(c)) for name in defined}
    for order in itertools.permutations(mixins):
        reordered = type("Reordered", (*order, nn.Module), {})
        for name, value in expected.items():
            assert inspect.getattr_static(reordered, name) is value, (name, [c.__name__ for c in order])
