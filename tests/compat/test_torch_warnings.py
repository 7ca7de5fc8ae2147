"""Warnings torch FSDP1 emits and its own tests assert (``assertWarnsRegex``), emitted here in the same
category with words their patterns match, where the same situation arises in this library.

Follows ``test_fsdp_clip_grad_norm.py`` (``test_no_gradients``). The other warnings those tests
check are covered beside their topics: the full-precision units of ``MixedPrecision`` under an
``auto_wrap_policy`` (``tests/compat/test_torch_misc.py``), ignoring the wrapped module itself
(``tests/compat/test_torch_ignored_modules.py``), torch's deprecated ``optim_input``
(``tests/compat/test_torch_optim_state.py``).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from tests.rank_pool import RankPool


def _clip_without_gradients() -> dict[str, Any]:
    """torch's ``test_no_gradients``: a forward and no backward, then ``clip_grad_norm_``."""
    model = FSDP(
        nn.Linear(24, 24),
        sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=torch_fsdp.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32
        ),
    )
    model(torch.randn(32, 24))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm = model.clip_grad_norm_(1)
    pattern = f"on rank {dist.get_rank()} with no gradients -- returning the total norm in the default dtype torch.float32"
    return {
        "warned": [w.category.__name__ for w in caught if re.search(pattern, str(w.message))],
        "norm": (norm.dtype, norm.item()),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_clip_grad_norm_without_gradients_warns_and_returns_a_zero(pool: RankPool) -> None:
    for r in pool.run(_clip_without_gradients):
        assert r["warned"] == ["UserWarning"], r
        assert r["norm"] == (torch.float32, 0.0), r


def test_full_precision_units_are_announced_in_torchs_words(single_rank_group: None) -> None:
    """torch's ``test_mp_batchnorm``: mixed precision with an ``auto_wrap_policy`` over batch norm."""
    net = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    mp = torch_fsdp.MixedPrecision(param_dtype=torch.float16, _module_classes_to_ignore=[nn.BatchNorm1d])
    with pytest.warns(UserWarning, match="These modules will be wrapped as separate FSDP"):
        model = FSDP(net, mixed_precision=mp, auto_wrap_policy=lambda *args, **kwargs: False)
    assert (
        isinstance(model.module[1], FSDP) and model.module[1].mixed_precision == torch_fsdp.MixedPrecision()
    )


def test_one_rank_switches_to_no_shard_with_torchs_warning(single_rank_group: None) -> None:
    """torch's ``test_world_size_1_sharding_strategy_warning``: at one rank every strategy is
    ``NO_SHARD``, warned in torch's words; ``NO_SHARD`` itself, and a stand-in group (fairseq's
    one-rank experts), are not warned about."""
    prefix = "FSDP is switching to use `NO_SHARD` instead of"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(nn.Linear(3, 3), sharding_strategy=torch_fsdp.ShardingStrategy.NO_SHARD)
        FSDP(nn.Linear(3, 3), process_group=_OneRank())
    assert not [w for w in caught if prefix in str(w.message)]
    for given, name in [
        ({"sharding_strategy": torch_fsdp.ShardingStrategy.FULL_SHARD}, "FULL_SHARD"),
        ({}, "FULL_SHARD"),
        ({"sharding_strategy": torch_fsdp.ShardingStrategy.SHARD_GRAD_OP}, "SHARD_GRAD_OP"),
    ]:
        pattern = f"{prefix} {torch_fsdp.ShardingStrategy[name]} since the world size is 1."
        with pytest.warns(UserWarning, match=pattern):
            model = FSDP(nn.Linear(3, 3), **given)
        assert model.sharding_strategy == torch_fsdp.ShardingStrategy.NO_SHARD


class _OneRank:
    """fairscale's ``DummyProcessGroup(rank=0, size=1)``."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1
