"""torch FSDP1's wrapping policies, in torch's calling style, imported from ``fsdp.wrap``.

Follows the scenarios of torch's ``test/distributed/fsdp/test_wrap.py``: a script that imported
its policies from ``torch.distributed.fsdp.wrap`` imports them from ``fsdp.wrap`` and wraps the same
modules, through the constructor's ``auto_wrap_policy`` or through ``enable_wrap`` / ``wrap``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    is_torch_style,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)
from tests.parity import compare_training
from tests.rank_pool import RankPool


def _nested_sequential() -> nn.Sequential:
    """torch's NestedSequentialModel: two Linear(5, 5) (30 elements each) and a Sequential of two more."""
    return nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5)))


def _wrapped(model: nn.Module) -> list[str]:
    """The module paths that are wrappers, in the unwrapped model's terms."""
    return [
        n.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
        for n, m in model.named_modules()
        if isinstance(m, FSDP)
    ]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


_BLOCK_POLICIES = {
    "partial(transformer_auto_wrap_policy)": functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}
    ),
    "ModuleWrapPolicy": ModuleWrapPolicy({Block}),
    "partial(lambda_auto_wrap_policy)": functools.partial(
        lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block)
    ),
    "CustomPolicy": CustomPolicy(lambda m: isinstance(m, Block)),
    "ours: transformer_auto_wrap_policy({Block})": transformer_auto_wrap_policy({Block}),
}


@pytest.mark.parametrize("name", list(_BLOCK_POLICIES))
def test_torchs_calling_style_wraps_every_block(single_rank_group: None, name: str) -> None:
    """torch's ``test_transformer_auto_wrap_policy`` / ``test_module_wrap_policy``: the policy wraps
    the block instances and nothing else below the root (the partial used to fail with "unexpected
    keyword argument 'module'")."""
    model = FSDP(Net(), auto_wrap_policy=_BLOCK_POLICIES[name])
    assert _wrapped(model) == ["", "blocks.0", "blocks.1"]


def test_a_policy_call_in_torchs_form_returns_the_decision() -> None:
    """Called as torch calls its functions (``policy(module, recurse, nonwrapped_numel, ...)``)."""
    block, linear = Block(), nn.Linear(2, 2)
    assert transformer_auto_wrap_policy(block, False, 0, {Block}) is True
    assert transformer_auto_wrap_policy(linear, False, 0, transformer_layer_cls={Block}) is False
    assert transformer_auto_wrap_policy(linear, True, 0, transformer_layer_cls={Block}) is True
    assert lambda_auto_wrap_policy(linear, False, 0, lambda m: isinstance(m, nn.Linear)) is True
    assert size_based_auto_wrap_policy(linear, False, 6, min_num_params=6) is True
    assert size_based_auto_wrap_policy(linear, False, 5, min_num_params=6) is False
    assert always_wrap_policy(linear, False, 0) is True
    with pytest.raises(TypeError, match="transformer_layer_cls"):
        transformer_auto_wrap_policy(linear, False, 0)


def test_always_wrap_policy_wraps_every_submodule(single_rank_group: None) -> None:
    """torch's ``test_always_wrap``."""
    model = FSDP(_nested_sequential(), auto_wrap_policy=always_wrap_policy)
    assert _wrapped(model) == ["", "0", "1", "2", "2.0", "2.1"]


def test_size_based_policy_with_torchs_keywords(single_rank_group: None) -> None:
    """torch's ``test_auto_wrap_api``: 60 elements in the inner Sequential reach 40, a 30-element
    Linear does not; ``min_num_params=0`` (``test_main_wrap_api``) wraps every module."""
    at_40 = functools.partial(size_based_auto_wrap_policy, min_num_params=40)
    assert _wrapped(FSDP(_nested_sequential(), auto_wrap_policy=at_40)) == ["", "2"]
    at_0 = functools.partial(size_based_auto_wrap_policy, min_num_params=0)
    assert _wrapped(FSDP(_nested_sequential(), auto_wrap_policy=at_0)) == ["", "0", "1", "2", "2.0", "2.1"]


def test_size_based_policy_excludes_containers_and_keeps_leaves(single_rank_group: None) -> None:
    """torch's ``test_auto_wrap_preset_exclude_wrap(_include_children)`` and ``_force_leaf(_custom)``."""
    at_40 = functools.partial(size_based_auto_wrap_policy, min_num_params=40)
    small = FSDP(nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]), auto_wrap_policy=at_40)
    assert _wrapped(small) == [""], "a ModuleList is never wrapped itself; its 30-element children stay"
    big = FSDP(nn.ModuleList([nn.Linear(10, 10)]), auto_wrap_policy=at_40)
    assert _wrapped(big) == ["", "0"], "the 110-element child of the excluded container is wrapped"
    attention = FSDP(nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1)), auto_wrap_policy=at_40)
    assert _wrapped(attention) == ["", "0"], (
        "MultiheadAttention is a leaf: neither it nor out_proj is wrapped"
    )
    leaves = size_based_auto_wrap_policy.FORCE_LEAF_MODULES.union({nn.Linear})  # type: ignore[attr-defined]
    custom = functools.partial(size_based_auto_wrap_policy, min_num_params=40, force_leaf_modules=leaves)
    model = FSDP(
        nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)])), auto_wrap_policy=custom
    )
    assert _wrapped(model) == [""]


def _nested_ignoring(**kwargs: Any) -> tuple[nn.Sequential, dict[str, Any]]:
    seq = _nested_sequential()
    return seq, {"ignored_modules": [seq[1], seq[2][0]], **kwargs}


@pytest.mark.parametrize("how", ["constructor", "enable_wrap"])
@pytest.mark.parametrize("policy", ["always", "size_40"])
def test_policies_leave_ignored_modules_unwrapped(single_rank_group: None, how: str, policy: str) -> None:
    """torch's ``test_always_wrap_with_ignored_modules`` and ``test_auto_wrap_with_ignored_modules``,
    through the constructor and through ``enable_wrap(auto_wrap_policy=...)`` + ``wrap``: a policy in
    torch's style given to ``enable_wrap`` is passed on to the wrapper, as torch's ``wrap`` does."""
    chosen = (
        always_wrap_policy
        if policy == "always"
        else functools.partial(size_based_auto_wrap_policy, min_num_params=40)
    )
    seq, kwargs = _nested_ignoring(auto_wrap_policy=chosen)
    if how == "constructor":
        model = FSDP(seq, **kwargs)
    else:
        with enable_wrap(wrapper_cls=FSDP, **kwargs):
            model = wrap(seq)
    # without seq[1] (ignored), the inner Sequential no longer reaches 40 elements
    assert _wrapped(model) == (["", "0", "2", "2.1"] if policy == "always" else [""])
    assert isinstance(model.module[1], nn.Linear) and isinstance(model.module[2][0], nn.Linear)


def test_enable_wrap_keeps_fairscales_meaning_for_fairscale_policies(single_rank_group: None) -> None:
    """fairscale's ``enable_wrap(auto_wrap_policy=p)`` is ``auto_wrap``'s default policy, which its
    ``wrap()`` does not apply; only policies written in torch's style are passed on by ``wrap``."""
    from fsdp.wrap import default_auto_wrap_policy

    fairscale_policy = functools.partial(default_auto_wrap_policy, min_num_params=1)
    assert not is_torch_style(fairscale_policy) and not is_torch_style(transformer_auto_wrap_policy({Block}))
    assert is_torch_style(always_wrap_policy) and is_torch_style(ModuleWrapPolicy({Block}))
    assert is_torch_style(functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    assert is_torch_style(functools.partial(torch_fsdp.wrap.size_based_auto_wrap_policy, min_num_params=1))
    with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=fairscale_policy):
        model = wrap(_nested_sequential())
    assert _wrapped(model) == [""]


def test_wrap_outside_the_context_is_a_no_op() -> None:
    """torch's ``test_wrap_disabled_outside_context``."""
    layer = nn.Linear(5, 5)
    assert wrap(layer) is layer


def _policy_options(case: str) -> dict[str, Any]:
    lib: Any = torch_fsdp if case == "torch objects" else __import__("fsdp")
    return {
        "auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=0),
        "cpu_offload": lib.CPUOffload(offload_params=False),
        "backward_prefetch": lib.BackwardPrefetch.BACKWARD_POST,
        "forward_prefetch": True,
    }


def _main_wrap_api(case: str) -> tuple[list[tuple[bool, bool, bool]], list[str], float]:
    """torch's ``test_main_wrap_api``: every module wrapped, each wrapper showing the options it was
    built with; then a few training steps beside the plain model."""
    torch.manual_seed(0)
    ref = Net()
    model = FSDP(Net(), **_policy_options(case))
    model.load_state_dict(ref.state_dict())
    given = torch_fsdp.CPUOffload(offload_params=False)
    attrs = [
        (
            w.cpu_offload == given and not w.cpu_offload.offload_params,
            w.backward_prefetch == torch_fsdp.BackwardPrefetch.BACKWARD_POST,
            w.forward_prefetch is True,
        )
        for w in FSDP.fsdp_modules(model)
    ]
    diffs = compare_training(
        ref, model, lambda g, n: torch.randn(n, 3, generator=g), lambda o: o.pow(2).mean(), steps=3
    )
    return attrs, _wrapped(model), max(diffs.values())


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("case", ["torch objects", "ours"])
def test_main_wrap_api_wraps_every_module_with_its_options(pool: RankPool, case: str) -> None:
    for attrs, paths, diff in pool.run(_main_wrap_api, case):
        assert paths == [
            "",
            "inp",
            "blocks",
            "blocks.0",
            "blocks.0.fc",
            "blocks.0.norm",
            "blocks.1",
            "blocks.1.fc",
            "blocks.1.norm",
            "out",
        ]
        assert attrs and all(all(a) for a in attrs), attrs
        assert diff < 1e-5, diff


class _StandIn:
    """A process group stand-in of two ranks (torch's ``DummyProcessGroup(rank=0, size=2)``): sharded
    wrappers are built for rank 0 without communicating."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


class _EncoderDecoder(nn.Module):
    """Two kinds of layer and a batch norm, as in torch's ``TransformerWithSharedParams``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(Block(), Block())
        self.decoder = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.bn = nn.BatchNorm1d(4)


@pytest.mark.parametrize("uniform", [True, False])
def test_custom_policy_arguments_reach_the_full_precision_units(
    single_rank_group: None, uniform: bool
) -> None:
    """torch's ``test_custom_policy``: under the root's fp16 ``MixedPrecision``, the batch norm gets a
    full-precision unit of its own, and the arguments the policy returns for it (``NO_SHARD``) apply
    there too (they were dropped: it came out ``FULL_SHARD``); the other layers get theirs."""
    model = _EncoderDecoder()
    decoder_layers = set(model.decoder)

    def pick(m: nn.Module) -> bool | dict[str, Any]:
        if m is model.bn:
            return True if uniform else {"sharding_strategy": torch_fsdp.ShardingStrategy.NO_SHARD}
        if isinstance(m, Block):
            return True
        if m in decoder_layers and not uniform:
            return {
                "sharding_strategy": torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
                "backward_prefetch": torch_fsdp.BackwardPrefetch.BACKWARD_POST,
            }
        return m in decoder_layers

    fp16 = torch_fsdp.MixedPrecision(param_dtype=torch.float16)
    wrapped = FSDP(model, process_group=_StandIn(), auto_wrap_policy=CustomPolicy(pick), mixed_precision=fp16)
    strategy, prefetch = torch_fsdp.ShardingStrategy, torch_fsdp.BackwardPrefetch
    expected = {
        "": (strategy.FULL_SHARD, prefetch.BACKWARD_PRE, fp16),
        "bn": (
            strategy.FULL_SHARD if uniform else strategy.NO_SHARD,
            prefetch.BACKWARD_PRE,
            torch_fsdp.MixedPrecision(),
        ),
        **{f"encoder.{i}": (strategy.FULL_SHARD, prefetch.BACKWARD_PRE, fp16) for i in range(2)},
        **{
            f"decoder.{i}": (
                (strategy.FULL_SHARD, prefetch.BACKWARD_PRE)
                if uniform
                else (strategy.SHARD_GRAD_OP, prefetch.BACKWARD_POST)
            )
            + (fp16,)
            for i in range(2)
        },
    }
    found = {
        path: (w.sharding_strategy, w.backward_prefetch, w.mixed_precision)
        for path, w in zip(_wrapped(wrapped), FSDP.fsdp_modules(wrapped))
    }
    assert found == expected
