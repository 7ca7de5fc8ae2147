"""Wrapping policies with the real FSDP wrapper: auto-wrapped models train exactly like a plain model,
and layers wrapped while the model is built are sharded as soon as they are created."""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch
from torch import nn

from fsdp import (
    FullyShardedDataParallel,
    auto_wrap,
    default_auto_wrap_policy,
    enable_wrap,
    transformer_auto_wrap_policy,
    wrap,
)
from tests.parity import compare_training
from tests.rank_pool import RankPool

TOL = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)  # 72 elements
        self.norm = nn.LayerNorm(8)  # 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.fc(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)  # 56
        self.blocks = nn.ModuleList([Block() for _ in range(3)])  # 88 each
        self.out = nn.Linear(8, 3)  # 27

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class BuiltWithWrap(nn.Module):
    """Marks layers for wrapping as it creates them; records each one's local size right after."""

    def __init__(self) -> None:
        super().__init__()
        self.numel_at_creation: list[int] = []
        self.a = self._made(wrap(nn.Linear(6, 7)))  # 49 elements: padded on 2 and 3 ranks
        self.b = nn.Linear(7, 7)
        self.c = self._made(wrap(nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))))  # 58

    def _made(self, layer: nn.Module) -> nn.Module:
        self.numel_at_creation.append(sum(p.numel() for p in layer.parameters()))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(self.a(x))))


def _vec(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(n, 6, generator=g)


def _mean_sq(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _wrapped_paths(model: nn.Module) -> list[str]:
    paths = []
    for name, m in model.named_modules():
        if isinstance(m, FullyShardedDataParallel):
            parts = [p for p in name.split(".") if p and p != "_fsdp_wrapped_module"]
            paths.append(".".join(parts) or "<root>")
    return sorted(paths)


def _auto_wrap_parity(policy_name: str) -> tuple[bool, list[str], dict[str, float]]:
    torch.manual_seed(0)
    ref = Stack()
    policy = {
        "transformer": transformer_auto_wrap_policy({Block}),
        # each block's fc (72) passes 70, the rest of a block (16) does not; inp (56) and out (27)
        # do not either, so the root's remainder (131) is wrapped by auto_wrap itself
        "size": functools.partial(default_auto_wrap_policy, min_num_params=70),
    }[policy_name]
    with enable_wrap(wrapper_cls=FullyShardedDataParallel):
        model = auto_wrap(copy.deepcopy(ref), policy)
    root_wrapped = isinstance(model, FullyShardedDataParallel)
    if not root_wrapped:
        model = FullyShardedDataParallel(model)
    return root_wrapped, _wrapped_paths(model), compare_training(ref, model, _vec, _mean_sq, steps=3)


def _built_inside_enable_wrap() -> tuple[list[int], list[int], dict[str, float]]:
    torch.manual_seed(0)
    ref = BuiltWithWrap()  # outside enable_wrap: plain layers, same initial weights
    torch.manual_seed(0)
    with enable_wrap(wrapper_cls=FullyShardedDataParallel):
        model = BuiltWithWrap()
    assert isinstance(model.a, FullyShardedDataParallel) and isinstance(model.c, FullyShardedDataParallel)
    assert not isinstance(model.b, FullyShardedDataParallel) and not isinstance(
        ref.a, FullyShardedDataParallel
    )
    full = [sum(p.numel() for p in m.parameters()) for m in (ref.a, ref.c)]
    at_creation = model.numel_at_creation
    model = FullyShardedDataParallel(model)
    return full, at_creation, compare_training(ref, model, _vec, _mean_sq, steps=3)


def _check(diffs: dict[str, float], rank: int) -> None:
    for what, value in diffs.items():
        assert value <= TOL, f"rank {rank}: {what} differs by {value:.3g}: {diffs}"


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize(
    ("policy", "root_by_policy", "expected"),
    [
        ("transformer", False, ["<root>", "blocks.0", "blocks.1", "blocks.2"]),
        ("size", True, ["<root>", "blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]),
    ],
)
def test_auto_wrap_trains_like_a_local_model(
    pool: RankPool, policy: str, root_by_policy: bool, expected: list[str]
) -> None:
    for rank, (root_wrapped, paths, diffs) in enumerate(pool.run(_auto_wrap_parity, policy)):
        assert (root_wrapped, paths) == (root_by_policy, expected)
        _check(diffs, rank)


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_layers_wrapped_while_building_are_sharded_as_created(pool: RankPool) -> None:
    for rank, (full, at_creation, diffs) in enumerate(pool.run(_built_inside_enable_wrap)):
        assert full == [49, 58]
        # each layer held its 1/N shard (padded up) as soon as wrap() returned inside __init__
        assert at_creation == [math.ceil(n / pool.world_size) for n in full]
        _check(diffs, rank)


def _constructor_policy(policy_name: str) -> tuple[list[str], set[str], dict[str, float]]:
    """torch FSDP's form: ``FSDP(model, auto_wrap_policy=...)`` wraps the picked submodules with the
    same options, then the model itself."""
    import torch.distributed.fsdp.wrap as torch_wrap

    torch.manual_seed(0)
    ref = Stack()
    policy = {
        "ours": transformer_auto_wrap_policy({Block}),
        "torch_function": functools.partial(
            torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        "torch_module_policy": torch_wrap.ModuleWrapPolicy({Block}),
        "torch_custom": torch_wrap.CustomPolicy(lambda m: isinstance(m, Block)),
        # a CustomPolicy's dict overrides the constructor's options for the module it picks
        "torch_custom_overrides": torch_wrap.CustomPolicy(
            lambda m: {"reshard_after_forward": True} if isinstance(m, Block) else False
        ),
        # passes the root's 395 elements and each fc's 72: those are wrapped; the root by the constructor only
        "torch_size": functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=70),
    }[policy_name]
    model = FullyShardedDataParallel(copy.deepcopy(ref), auto_wrap_policy=policy, reshard_after_forward=False)
    options = {
        path: m.fsdp_config.sharding.reshard_after_forward
        for path, m in zip(
            _wrapped_paths(model), [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
        )
    }
    return (
        _wrapped_paths(model),
        {path: str(v) for path, v in options.items()},
        compare_training(ref, model, _vec, _mean_sq, steps=3),
    )


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("ours", ["<root>", "blocks.0", "blocks.1", "blocks.2"]),
        ("torch_function", ["<root>", "blocks.0", "blocks.1", "blocks.2"]),
        ("torch_module_policy", ["<root>", "blocks.0", "blocks.1", "blocks.2"]),
        ("torch_custom", ["<root>", "blocks.0", "blocks.1", "blocks.2"]),
        ("torch_custom_overrides", ["<root>", "blocks.0", "blocks.1", "blocks.2"]),
        ("torch_size", ["<root>", "blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]),
    ],
)
def test_the_constructor_takes_an_auto_wrap_policy(pool: RankPool, policy: str, expected: list[str]) -> None:
    for rank, (paths, reshard, diffs) in enumerate(pool.run(_constructor_policy, policy)):
        assert paths == expected, "the picked submodules are wrapped, the root once"
        if policy == "torch_custom_overrides":
            assert reshard == {p: str(p != "<root>") for p in paths}, "the picked modules take the overrides"
        else:
            assert set(reshard.values()) == {"False"}, "every wrapper got the constructor's options"
        _check(diffs, rank)


def _rank_seeded_net(rank: int, deferred: bool) -> nn.Sequential:
    """Rank ``rank``'s draws; a deferred net initialized in the order the wrappers use (the inner
    unit first, then the root's modules in module order)."""
    torch.manual_seed(rank)
    with torch.device("meta" if deferred else "cpu"):
        net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 3))
    if not deferred:
        net[1].running_mean.fill_(float(rank))  # a buffer that differs too
    return net


def _synced(sync: bool, deferred: bool) -> dict[str, float]:
    import torch.distributed as dist

    rank = dist.get_rank()
    net = _rank_seeded_net(rank, deferred)
    kwargs: dict[str, Any] = {}
    if deferred:
        kwargs["param_init_fn"] = lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None
    net[2] = FullyShardedDataParallel(net[2], sync_module_states=sync, **kwargs)
    model = FullyShardedDataParallel(net, sync_module_states=sync, **kwargs)
    full = model.state_dict()  # the shards of every rank, and this rank's buffers
    first = _rank_seeded_net(0, deferred)  # what rank 0 drew
    if deferred:
        first.to_empty(device="cpu")
        for i in (2, 0, 1, 3):
            first[i].reset_parameters()
    expected = first.state_dict()
    return {k: (v.float() - expected[k].float()).abs().max().item() for k, v in full.items()}


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("deferred", [False, True])
def test_sync_module_states_gives_every_rank_the_first_ranks_values(pool: RankPool, deferred: bool) -> None:
    for synced, unsynced in zip(pool.run(_synced, True, deferred), pool.run(_synced, False, deferred)):
        assert max(synced.values()) == 0.0, f"parameters and buffers are rank 0's on every rank: {synced}"
        assert max(unsynced.values()) > 0.0, "without the option the other ranks keep their own draws"


def _sync_different_shapes() -> str:
    import torch.distributed as dist

    # the same class and number of elements (the construction's handshake compares those): 4x2 or 2x4
    shape = (4, 2) if dist.get_rank() == 0 else (2, 4)
    try:
        FullyShardedDataParallel(nn.Linear(*shape, bias=False), sync_module_states=True)
    except RuntimeError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_sync_module_states_refuses_ranks_with_different_shapes(pool: RankPool) -> None:
    for message in pool.run(_sync_different_shapes):
        assert "sync_module_states: the ranks hold parameters of different shapes" in message


class _TaggedFSDP(FullyShardedDataParallel):
    def __init__(self, module: nn.Module, tag: str, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self.tag = tag


def _subclass_root_with_policy() -> list[str]:
    torch.manual_seed(0)
    net = Stack()
    net.blocks[0] = FullyShardedDataParallel(net.blocks[0])  # wrapped by hand before
    model = _TaggedFSDP(net, tag="root", auto_wrap_policy=transformer_auto_wrap_policy({Block}))
    assert model.tag == "root"
    return [type(m).__name__ for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_a_subclass_root_wraps_its_children_with_the_base_class(pool: RankPool) -> None:
    (types,) = pool.run(_subclass_root_with_policy)
    assert types == ["_TaggedFSDP"] + ["FullyShardedDataParallel"] * 3, "the hand-wrapped block is kept as is"
