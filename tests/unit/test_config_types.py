"""The wrapper's resolved-option records are keyword-only: a field can be added or moved without
silently shifting the values of a positional call."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp.api import (
    CommConfig,
    FSDPConfig,
    OffloadConfig,
    PrecisionConfig,
    ScheduleConfig,
    ShardingConfig,
    StateDictConfig,
    TorchOptions,
)
from fsdp.comm.buckets import BucketConfig
from fsdp.offload.engine import OffloadModelConfig

CONFIGS = [
    ShardingConfig,
    PrecisionConfig,
    CommConfig,
    StateDictConfig,
    OffloadConfig,
    ScheduleConfig,
    FSDPConfig,
    TorchOptions,
    BucketConfig,
    OffloadModelConfig,
]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_configs_refuse_positional_arguments(cls: type) -> None:
    fields = dataclasses.fields(cls)
    assert all(f.kw_only for f in fields), [f.name for f in fields if not f.kw_only]
    first = fields[0]
    value = first.default if first.default is not dataclasses.MISSING else None
    with pytest.raises(TypeError, match="positional"):
        cls(value)


def test_keywords_build_the_same_record_whatever_their_order() -> None:
    a = ScheduleConfig(backward_prefetch=False, limit_all_gathers=True, forward_prefetch=True)
    b = ScheduleConfig(forward_prefetch=True, backward_prefetch=False)
    assert a == b and a.backward_prefetch is False and a.forward_prefetch is True
    assert OffloadConfig.from_flags(True, False, None) == OffloadConfig(params_to_cpu=True, grads_to_cpu=True)
    precision = PrecisionConfig(buffer_dtype=torch.float16)
    assert precision.param_dtype is None and precision.buffer_dtype == torch.float16
