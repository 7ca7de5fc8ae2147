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

# Top to bottom: each module may import only from modules listed above it. A dotted name is a module of
# a subpackage; a plain name a module at the top of the package.
ORDER = [
    "api",
    "common.device", "common.torch_compile", "common.nest", "common.guards", "common.memory_tags",
    "comm.simulation", "comm.lost_ranks", "comm.collectives", "comm.consistency", "comm.topology", "comm.schedule", "comm.buckets", "comm.rs_buckets",
    "core.sharding", "core.deferred_init", "core.placeholders", "core.param_attrs", "core.flat_param", "core.grad_hooks", "core.handle_grads", "core.saved_views", "core.handle",
    "core.no_shard_buckets", "core.layout", "core.wrapper_protocol",
    "state.local", "state.state_dict", "state.optim_fairscale", "state.optim_state", "state.optim_sharded", "state.optim_given",
    "wrap.policies", "wrap.context",
    "wrapper.mixed_precision", "wrapper.clip_grad", "wrapper.shared_params", "wrapper.state_methods",
    "wrapper.stats_methods", "wrapper.grad_methods", "wrapper.fairscale_attrs", "wrapper.summon_methods",
    "wrapper.direct_call", "wrapper.torch_compat", "wrapper.torch_methods", "wrapper.module_ops",
    "wrapper.construct", "wrapper.root_context", "wrapper.base", "wrapper.fully_sharded", "wrapper.norm_wrap",
    "training.recompute", "training.activation_checkpoint", "training.optim_in_backward", "training.memory_tracker",
    "training.memory_estimate",
    "training.sharded_grad_scaler",
    "ddp.data_parallel",
    "offload.layer_slice", "offload.engine", "offload.model",
    "dcp_state",
    "checkpoints.files", "checkpoints.app_state", "checkpoints.save_load",
    "consolidate",
    "_legacy_paths",
]  # fmt: skip

PACKAGES = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PKG).with_suffix("").parts)


def _fsdp_imports(path: Path) -> set[str]:
    """The package's modules that ``path`` imports at run time, as ORDER names (``from fsdp.comm import collectives``
    is ``comm.collectives``; ``from fsdp.wrap import wrap`` is the package ``wrap``)."""
    names = set()
    tree = ast.parse(path.read_text())
    for block in [
        n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]:
        block.body = []  # imports for annotations only (``from __future__ import annotations``): no layering
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp."):
            name = node.module.removeprefix("fsdp.")
            if name in PACKAGES:
                names.update(
                    f"{name}.{a.name}" if (PKG / name / f"{a.name}.py").exists() else name for a in node.names
                )
            else:
                names.add(name)
        elif isinstance(node, ast.ImportFrom) and node.module == "fsdp":
            names.update(a.name for a in node.names if (PKG / f"{a.name}.py").exists() or a.name in PACKAGES)
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("fsdp.") for a in node.names if a.name.startswith("fsdp."))
    return names


MODULE_PATHS = sorted(p for p in PKG.rglob("*.py") if p.name != "__init__.py")
MODULES = [_module_name(p) for p in MODULE_PATHS]


@pytest.mark.parametrize("module", MODULES)
def test_imports_only_from_modules_above(module: str) -> None:
    assert module in ORDER, (
        f"fsdp/{module.replace('.', '/')}.py is not placed in the layering; add it to ORDER"
    )
    above = set(ORDER[: ORDER.index(module)])
    path = PKG / f"{module.replace('.', '/')}.py"
    below = _fsdp_imports(path) - above
    assert not below, f"fsdp/{module.replace('.', '/')}.py imports from below it: {sorted(below)}"


def _allowed_packages(package: str) -> set[str]:
    """What a package's ``__init__`` docstring says it may import: its line ``Imports from: ...``."""
    doc = ast.get_docstring(ast.parse((PKG / package / "__init__.py").read_text())) or ""
    lines = [line for line in doc.splitlines() if line.startswith("Imports from:")]
    assert len(lines) == 1, (
        f"fsdp/{package}/__init__.py must say once what it may import ('Imports from: ...')"
    )
    said = lines[0].removeprefix("Imports from:").strip().rstrip(".")
    return set() if said.startswith("nothing") else {n.strip().removeprefix("fsdp.") for n in said.split(",")}


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_what_its_docstring_allows(package: str) -> None:
    allowed = _allowed_packages(package) | {package}
    for path in sorted((PKG / package).glob("*.py")):
        used = {m.split(".")[0] for m in _fsdp_imports(path)}
        assert used <= allowed, (
            f"fsdp/{package}/{path.name} imports {sorted(used - allowed)}, which fsdp/{package}/__init__.py "
            f"does not allow (Imports from: {sorted(allowed - {package})})"
        )


def test_the_packages_form_layers() -> None:
    """No two packages may import each other (through what their docstrings allow)."""
    allowed = {p: _allowed_packages(p) for p in PACKAGES}
    cycles = [(a, b) for a in PACKAGES for b in allowed[a] if b in allowed and a in allowed[b]]
    assert not cycles, f"packages allowed to import each other: {cycles}"


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_init_says_what_it_owns(package: str) -> None:
    doc = ast.get_docstring(ast.parse((PKG / package / "__init__.py").read_text())) or ""
    assert len(doc.split()) >= 12, f"fsdp/{package}/__init__.py needs a docstring saying what it owns"


def test_no_module_is_over_the_size_the_design_brief_asks_for() -> None:
    big = {p.name: n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 650}
    assert not big, f"split by concern (the brief asks for about 600 lines at most): {big}"


@pytest.mark.parametrize("module", MODULES)
def test_only_the_device_module_names_torch_cuda(module: str) -> None:
    if module != "common.device":
        assert "torch.cuda" not in (PKG / f"{module.replace('.', '/')}.py").read_text()


@pytest.mark.parametrize(
    "module", ["wrap.policies", "wrap.context", "training.activation_checkpoint", "training.recompute"]
)
def test_wrap_and_checkpoint_never_import_the_wrapper(module: str) -> None:
    path = PKG / f"{module.replace('.', '/')}.py"
    assert path.exists(), path
    assert not {m for m in _fsdp_imports(path) if m.startswith("wrapper")}


def test_library_never_prints() -> None:
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "print", f"{path.name}: use logging or warnings, not print"


def test_one_class_per_name() -> None:
    """No two classes of the package share a name (a reader, or an import, would take one for the other)."""
    defined: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(_module_name(path))
    twice = {name: files for name, files in defined.items() if len(files) > 1}
    assert not twice, f"classes defined more than once: {twice}"


def _mixins() -> list[type]:
    from fsdp import FullyShardedDataParallel

    mro = FullyShardedDataParallel.__mro__  # (the class, its base WrapperBase, the mixins, nn.Module)
    return [c for c in mro[2 : mro.index(nn.Module)] if c.__module__.startswith("fsdp.")]


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
    """A mixin reaches the wrapper through the typed ``fsdp.core.wrapper_protocol.Wrapper``, never through
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
