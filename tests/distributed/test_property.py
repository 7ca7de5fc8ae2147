"""Property: for any module tree, wrap plan and world size, FSDP training equals the plain model's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.models import wrap
from tests.parity import compare_training
from tests.rank_pool import RankPool

# A node is ("lin", out_features, bias, frozen, wrap) or ("seq", [nodes], wrap).
_leaf = st.tuples(st.just("lin"), st.integers(1, 7), st.booleans(), st.booleans(), st.booleans())


def _tree(depth: int) -> st.SearchStrategy[Any]:
    if depth == 0:
        return _leaf
    return st.one_of(
        _leaf, st.tuples(st.just("seq"), st.lists(_tree(depth - 1), min_size=1, max_size=3), st.booleans())
    )


def _build(node: Any, in_dim: int, path: str, paths: list[str]) -> tuple[nn.Module, int]:
    if node[0] == "lin":
        _, out, bias, frozen, wrap_it = node
        lin = nn.Linear(in_dim, out, bias=bias)
        lin.requires_grad_(not frozen)
        module: nn.Module = nn.Sequential(lin, nn.Tanh())
        dim = out
    else:
        _, children, wrap_it = node
        layers = []
        dim = in_dim
        for i, child in enumerate(children):
            layer, dim = _build(child, dim, f"{path}.{i}" if path else str(i), paths)
            layers.append(layer)
        module = nn.Sequential(*layers)
    if wrap_it and path:
        paths.append(path)
    return module, dim


def _random_tree_parity(tree: Any, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    paths: list[str] = []
    body, dim = _build(tree, 4, "0", paths)
    ref = nn.Sequential(body, nn.Linear(dim, 2))  # a trainable head, so every tree has a gradient
    model = wrap(copy.deepcopy(ref), tuple(paths))
    return compare_training(
        ref,
        model,
        lambda g, n: torch.randn(n, 4, generator=g),
        lambda y: y.pow(2).mean(),
        steps=2,
        per_rank=3,
    )


@pytest.mark.parametrize("pool", [1, 2, 3, 4], indirect=True)
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(tree=_tree(3), seed=st.integers(0, 2**16))
def test_random_trees_and_wrap_plans_train_like_the_plain_model(pool: RankPool, tree: Any, seed: int) -> None:
    for rank, diffs in enumerate(pool.run(_random_tree_parity, tree, seed)):
        assert max(diffs.values()) <= 1e-5, f"rank {rank}: {diffs} for {tree}"
