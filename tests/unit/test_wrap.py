"""Wrapping logic (fsdp.wrap) with a dummy wrapper class: which modules each policy wraps, and how.

Where fairscale 0.4.13 defines the behaviour, the wrapped set is compared with fairscale's own
``auto_wrap`` on the same model.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fairscale.nn.wrap import auto_wrap as fs_auto_wrap
from fairscale.nn.wrap import config_auto_wrap_policy as fs_config_policy
from fairscale.nn.wrap import default_auto_wrap_policy as fs_default_policy
from fairscale.nn.wrap import enable_wrap as fs_enable_wrap
from torch import nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_size_policy

import fsdp
from fsdp.wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

wrap_module = importlib.import_module("fsdp.wrap")  # `fsdp.wrap` itself is the wrap() function
BUILT: list[str] = []  # class names of the modules Wrapper wrapped, in construction order


class Wrapper(nn.Module):
    """Stands in for FSDP: records what it wraps and with which kwargs."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.inner = module
        self.kwargs = kwargs
        BUILT.append(type(module).__name__)

    def forward(self, *args: Any) -> Any:
        return self.inner(*args)


class OtherWrapper(Wrapper):
    pass


@pytest.fixture(autouse=True)
def _clear_built() -> None:
    BUILT.clear()


def wrapped_paths(model: nn.Module, cls: type[nn.Module] = Wrapper) -> list[str]:
    """Paths (in the unwrapped model's names) of the modules that sit inside a ``cls``."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, cls):
            parts = [p for p in name.split(".") if p and p != "inner"]
            out.append(".".join(parts) or "<root>")
    return sorted(out)


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)  # 72 elements at d=8
        self.norm = nn.LayerNorm(d)  # 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.fc(x)))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)  # 40
        self.blocks = nn.ModuleList([Block(), Block()])  # 88 each
        self.attn = nn.MultiheadAttention(8, 2)  # 288 (out_proj: 72)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))  # 72 + 18

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        h = self.attn(h, h, h, need_weights=False)[0]
        return self.head(h)


def sizes() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(2, 2))  # 110, 110, 6


def _ours(model: nn.Module, policy: Any, **kwargs: Any) -> nn.Module:
    with enable_wrap(wrapper_cls=Wrapper):
        return auto_wrap(model, policy, **kwargs)


def _fairscale(model: nn.Module, policy: Any) -> nn.Module:
    with fs_enable_wrap(wrapper_cls=Wrapper):
        return fs_auto_wrap(model, policy)  # type: ignore[no-any-return]


# --- wrap / enable_wrap ------------------------------------------------------------------------


def test_wrap_outside_enable_wrap_returns_the_module_unchanged() -> None:
    lin = nn.Linear(3, 3)
    assert wrap(lin) is lin
    assert wrap(lin, flag=1) is lin
    assert auto_wrap(lin, functools.partial(default_auto_wrap_policy, min_num_params=1)) is lin
    assert BUILT == []


def test_wrap_inside_enable_wrap_merges_kwargs_context_then_config_then_overrides() -> None:
    lin = nn.Linear(3, 3)
    lin.wrapper_config = {"b": "config", "c": "config"}
    with enable_wrap(wrapper_cls=Wrapper, a="ctx", b="ctx", c="ctx"):
        w = wrap(lin, c="override")
        plain = wrap(nn.Linear(2, 2))
        other = wrap(nn.Linear(2, 2), wrapper_cls=OtherWrapper, a="o")
    assert isinstance(w, Wrapper) and w.inner is lin
    assert w.kwargs == {"a": "ctx", "b": "config", "c": "override"}
    assert isinstance(plain, Wrapper) and plain.kwargs == {"a": "ctx", "b": "ctx", "c": "ctx"}
    assert type(other) is OtherWrapper and other.kwargs == {"a": "o", "b": "ctx", "c": "ctx"}
    assert wrap(lin) is lin  # the context is gone


def test_wrapper_config_must_be_a_dict() -> None:
    lin = nn.Linear(3, 3)
    lin.wrapper_config = ["not", "a", "dict"]
    with enable_wrap(wrapper_cls=Wrapper), pytest.raises(TypeError, match="wrapper_config must be a dict"):
        wrap(lin)


def test_enable_wrap_needs_a_wrapper_cls() -> None:
    with pytest.raises(TypeError, match="wrapper_cls"), enable_wrap(flag=1):
        pass
    with pytest.raises(TypeError, match="wrapper_cls"), enable_wrap(wrapper_cls=3):
        pass
    assert wrap(nn.Linear(1, 1)).__class__ is nn.Linear


def test_nested_enable_wrap_raises_like_fairscale_and_leaves_the_outer_context() -> None:
    with (
        fs_enable_wrap(wrapper_cls=Wrapper),
        pytest.raises(NotImplementedError),
        fs_enable_wrap(wrapper_cls=Wrapper),
    ):
        pass  # fairscale's behaviour, for reference
    with enable_wrap(wrapper_cls=Wrapper, a=1):
        with (
            pytest.raises(NotImplementedError, match="cannot be nested"),
            enable_wrap(wrapper_cls=OtherWrapper),
        ):
            pass
        w = wrap(nn.Linear(1, 1))
        assert type(w) is Wrapper and w.kwargs == {"a": 1}
    assert isinstance(wrap(nn.Linear(1, 1)), nn.Linear)


def test_context_is_cleared_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), enable_wrap(wrapper_cls=Wrapper):
        raise RuntimeError("boom")
    assert isinstance(wrap(nn.Linear(1, 1)), nn.Linear)
    with enable_wrap(wrapper_cls=Wrapper):  # and a new one can be opened
        assert isinstance(wrap(nn.Linear(1, 1)), Wrapper)


class _RecordsMoves(nn.Linear):
    moves: list[str]

    def cuda(self, device: Any = None) -> _RecordsMoves:  # type: ignore[override]
        self.moves.append("cuda")
        return self

    def half(self) -> _RecordsMoves:  # type: ignore[override]
        self.moves.append("half")
        return self


def test_move_module_cuda_half_moves_before_wrapping_and_is_not_a_wrapper_kwarg() -> None:
    lin = _RecordsMoves(2, 2)
    lin.moves = []
    with enable_wrap(wrapper_cls=Wrapper, move_module_cuda_half=True, a=1):
        w = wrap(lin)
    assert lin.moves == ["cuda", "half"]
    assert isinstance(w, Wrapper) and w.kwargs == {"a": 1}
    lin.moves = []
    with enable_wrap(wrapper_cls=Wrapper):
        wrap(lin)
    assert lin.moves == []


class BuiltWithWrap(nn.Module):
    """A model that marks its layers for wrapping as it creates them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = wrap(nn.Linear(4, 4))
        self.b = nn.Linear(4, 4)
        self.c = wrap(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), tag="c")


def test_building_inside_enable_wrap_wraps_layers_as_they_are_created() -> None:
    assert wrapped_paths(BuiltWithWrap()) == []
    with enable_wrap(wrapper_cls=Wrapper, tag="ctx"):
        model = BuiltWithWrap()
    assert wrapped_paths(model) == ["a", "c"]
    assert BUILT == ["Linear", "Sequential"]  # in creation order, before the model was finished
    assert model.a.kwargs == {"tag": "ctx"} and model.c.kwargs == {"tag": "c"}


# --- auto_wrap and the size policy -------------------------------------------------------------


def test_default_policy_wraps_by_size_bottom_up() -> None:
    policy = functools.partial(default_auto_wrap_policy, min_num_params=100)
    model = _ours(sizes(), policy)
    assert wrapped_paths(model) == ["0", "1"]  # "2" (6 elements) is left to the root, whose remainder is 6
    assert isinstance(model, nn.Sequential)  # the root is not wrapped
    assert BUILT == ["Linear", "Linear"]


def test_default_policy_wraps_the_root_for_its_remainder() -> None:
    # Each child is below the threshold, together they pass it: only the root is wrapped.
    model = _ours(
        nn.Sequential(*[nn.Linear(5, 5) for _ in range(3)]),
        functools.partial(default_auto_wrap_policy, min_num_params=50),
    )
    assert isinstance(model, Wrapper) and wrapped_paths(model) == ["<root>"]


def test_default_policy_defaults_wrap_nothing_small() -> None:
    assert wrapped_paths(_ours(Transformer(), None)) == []  # min_num_params=1e8; the context's default


def test_skip_params_check_for_root_wraps_the_root_whatever_its_remainder() -> None:
    forced = functools.partial(default_auto_wrap_policy, min_num_params=100, skip_params_check_for_root=True)
    model = _ours(sizes(), forced)
    assert isinstance(model, Wrapper) and wrapped_paths(model) == ["0", "1", "<root>"]  # remainder 6


def test_default_policy_defaults_are_fairscales() -> None:
    assert default_auto_wrap_policy.FORCE_LEAF_MODULES == {nn.MultiheadAttention}  # type: ignore[attr-defined]
    assert default_auto_wrap_policy.EXCLUDE_WRAP_MODULES == {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
    m = nn.MultiheadAttention(8, 2)
    assert default_auto_wrap_policy(m, recurse=True, unwrapped_params=10**9, module_is_root=False) is False
    assert default_auto_wrap_policy(m, recurse=False, unwrapped_params=10**9, module_is_root=False) is True
    ml = nn.ModuleList()
    assert default_auto_wrap_policy(ml, recurse=True, unwrapped_params=10**9, module_is_root=False) is True
    assert default_auto_wrap_policy(ml, recurse=False, unwrapped_params=10**9, module_is_root=False) is False


def test_force_leaf_modules_keep_multihead_attention_whole() -> None:
    policy = functools.partial(default_auto_wrap_policy, min_num_params=60)
    model = _ours(Transformer(), policy)  # attn (288) is neither entered nor wrapped: the root takes it
    assert wrapped_paths(model) == ["<root>", "blocks.0.fc", "blocks.1.fc", "head.0"]
    no_leaves = functools.partial(default_auto_wrap_policy, min_num_params=60, force_leaf_modules=set())
    model = _ours(Transformer(), no_leaves)
    assert {"attn", "attn.out_proj"} <= set(wrapped_paths(model))  # out_proj (72) now wrapped on its own


def test_exclude_wrap_modules_skip_module_list_by_default() -> None:
    # blocks (176) passes 150 and each Block (88) does not: the ModuleList would take the remainder.
    policy = functools.partial(default_auto_wrap_policy, min_num_params=150, force_leaf_modules=set())
    assert "blocks" not in wrapped_paths(_ours(Transformer(), policy))
    include = functools.partial(policy, exclude_wrap_modules=set())
    assert "blocks" in wrapped_paths(_ours(Transformer(), include))


def _tagged() -> nn.Module:
    model = Transformer()
    model.blocks[1].wrapper_config = {"tag": "b1"}
    model.head[0].wrapper_config = {}
    return model


POLICIES: dict[str, Callable[[], tuple[Callable[[], nn.Module], Any, Any]]] = {
    "size-60": lambda: (
        Transformer,
        functools.partial(default_auto_wrap_policy, min_num_params=60),
        functools.partial(fs_default_policy, min_num_params=60),
    ),
    "size-100": lambda: (
        Transformer,
        functools.partial(default_auto_wrap_policy, min_num_params=100),
        functools.partial(fs_default_policy, min_num_params=100),
    ),
    "size-150-no-leaves": lambda: (
        Transformer,
        functools.partial(default_auto_wrap_policy, min_num_params=150, force_leaf_modules=set()),
        functools.partial(fs_default_policy, min_num_params=150, force_leaf_modules=set()),
    ),
    "size-sequential": lambda: (
        sizes,
        functools.partial(default_auto_wrap_policy, min_num_params=100),
        functools.partial(fs_default_policy, min_num_params=100),
    ),
    "root-forced": lambda: (
        sizes,
        functools.partial(default_auto_wrap_policy, min_num_params=100, skip_params_check_for_root=True),
        functools.partial(fs_default_policy, min_num_params=100, skip_params_check_for_root=True),
    ),
    "config": lambda: (_tagged, config_auto_wrap_policy, fs_config_policy),
}


@pytest.mark.parametrize("case", list(POLICIES))
def test_same_wrapped_modules_as_fairscale(case: str) -> None:
    build, ours, theirs = POLICIES[case]()
    torch.manual_seed(0)
    expected = wrapped_paths(_fairscale(build(), theirs))
    assert wrapped_paths(_ours(build(), ours)) == expected
    assert expected  # every case wraps something


def test_config_policy_wraps_exactly_the_tagged_modules_with_their_config() -> None:
    model = _ours(_tagged(), config_auto_wrap_policy)
    assert wrapped_paths(model) == ["blocks.1", "head.0"]
    assert model.blocks[1].kwargs == {"tag": "b1"}


# --- class-based and lambda policies -----------------------------------------------------------


def test_transformer_policy_wraps_every_block_and_nothing_else() -> None:
    model = _ours(Transformer(), transformer_auto_wrap_policy({Block}))
    assert wrapped_paths(model) == ["blocks.0", "blocks.1"]
    model = _ours(Transformer(), transformer_auto_wrap_policy(nn.Linear))  # a single class works too
    # MultiheadAttention's out_proj is a Linear subclass (a policy can reach inside a leaf module)
    assert wrapped_paths(model) == ["attn.out_proj", "blocks.0.fc", "blocks.1.fc", "head.0", "head.2", "inp"]
    model = _ours(Transformer(), transformer_auto_wrap_policy({Block, nn.Linear}))
    assert "blocks.0" in wrapped_paths(model) and "blocks.0.fc" in wrapped_paths(model)  # nested too


def test_transformer_policy_wraps_a_root_of_the_class() -> None:
    assert wrapped_paths(_ours(Block(), transformer_auto_wrap_policy({Block}))) == ["<root>"]


def test_transformer_policy_rejects_non_module_classes() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module subclasses"):
        transformer_auto_wrap_policy({int})
    with pytest.raises(TypeError, match=r"nn\.Module subclasses"):
        transformer_auto_wrap_policy([Block()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one"):
        transformer_auto_wrap_policy(set())


def test_lambda_policy_wraps_what_the_function_picks() -> None:
    policy = lambda_auto_wrap_policy(lambda m: type(m) is nn.Linear and m.out_features == 8)
    model = _ours(Transformer(), policy)
    assert wrapped_paths(model) == ["blocks.0.fc", "blocks.1.fc", "head.0", "inp"]
    with pytest.raises(TypeError, match="callable"):
        lambda_auto_wrap_policy(3)  # type: ignore[arg-type]


def test_policy_calling_convention_and_bottom_up_order() -> None:
    calls: list[tuple[str, bool, int, bool]] = []

    def policy(*, module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
        calls.append((type(module).__name__, recurse, unwrapped_params, module_is_root))
        return recurse or (isinstance(module, nn.Linear) and module.in_features == 10)

    model = _ours(sizes(), policy)
    assert wrapped_paths(model) == ["0", "1"]
    assert calls == [
        ("Sequential", True, 226, True),
        ("Linear", True, 110, False),
        ("Linear", False, 110, False),
        ("Linear", True, 110, False),
        ("Linear", False, 110, False),
        ("Linear", True, 6, False),
        ("Linear", False, 6, False),
        ("Sequential", False, 6, True),  # what is left after the children were wrapped
    ]


def test_tied_parameters_are_counted_once() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    model[1].weight = model[0].weight
    seen: list[int] = []

    def policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
        if module_is_root and recurse:
            seen.append(unwrapped_params)
        return False

    _ours(model, policy)
    assert seen == [120]


def test_auto_wrap_uses_the_context_policy_and_passes_kwargs_to_wrappers() -> None:
    policy = functools.partial(default_auto_wrap_policy, min_num_params=100)
    with enable_wrap(policy, wrapper_cls=Wrapper, a="ctx"):
        model = auto_wrap(sizes(), b="call")
    assert wrapped_paths(model) == ["0", "1"]
    assert model[0].kwargs == {"a": "ctx", "b": "call"}


def test_auto_wrap_accepts_torch_fsdp1_policies() -> None:
    policy = functools.partial(torch_size_policy, min_num_params=100)
    assert wrapped_paths(_ours(sizes(), policy)) == ["0", "1"]


# --- already-wrapped modules -------------------------------------------------------------------


def test_already_wrapped_modules_are_skipped_and_count_as_wrapped() -> None:
    model = sizes()
    model[0] = Wrapper(model[0])
    BUILT.clear()
    # Unwrapped: 110 + 6 at the root. Counting the pre-wrapped 110 too would pass 200 and wrap the root.
    policy = functools.partial(default_auto_wrap_policy, min_num_params=100)
    model = _ours(model, policy)
    assert wrapped_paths(model) == ["0", "1"]
    assert isinstance(model, nn.Sequential) and BUILT == ["Linear"]
    assert not isinstance(model[0].inner, Wrapper)  # never wrapped twice
    strict = functools.partial(default_auto_wrap_policy, min_num_params=200)
    assert not isinstance(_ours(model, strict), Wrapper)  # 116 unwrapped elements left


def test_already_wrapped_blocks_are_not_wrapped_again_by_a_second_pass() -> None:
    policy = transformer_auto_wrap_policy({Block})
    model = _ours(Transformer(), policy)
    BUILT.clear()
    model = _ours(model, policy)
    assert BUILT == [] and wrapped_paths(model) == ["blocks.0", "blocks.1"]
    root = Wrapper(Block())
    assert _ours(root, policy) is root and isinstance(root.inner.fc, nn.Linear)


def test_public_names_are_exported() -> None:
    for name in [
        "enable_wrap",
        "wrap",
        "auto_wrap",
        "default_auto_wrap_policy",
        "config_auto_wrap_policy",
        "transformer_auto_wrap_policy",
        "lambda_auto_wrap_policy",
    ]:
        assert getattr(fsdp, name) is getattr(wrap_module, name)
        assert name in fsdp.__all__
