"""torch FSDP1's ``MixedPrecision(keep_low_precision_grads=True)``, from the scenarios of its mixed
precision and ``clip_grad_norm_`` tests: the gradients stay in the reduction dtype after backward.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy

from fsdp import FullyShardedDataParallel as FSDP
from tests.rank_pool import RankPool

F16 = torch.float16


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(10, 10)
        self.lin2 = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.lin1(x))  # type: ignore[no-any-return]


def _wrapped(keep_low: bool, **kwargs: Any) -> FSDP:
    mp = MixedPrecision(
        param_dtype=F16, reduce_dtype=F16, buffer_dtype=F16, keep_low_precision_grads=keep_low
    )
    m = _Two()
    m.lin1 = FSDP(m.lin1, mixed_precision=mp, **kwargs)  # type: ignore[assignment]
    return FSDP(m, mixed_precision=mp, **kwargs)


def _grads_in_low_precision(offload: bool, use_orig_params: bool) -> dict[str, Any]:
    """torch's _test_grads_reduced_precision: six backwards without zero_grad, each leaving fp16
    gradients. The same steps with fp32 gradients rounded to fp16 after each backward give the same
    SGD step: between backwards the gradient is fp16, the sums are taken in fp32."""
    kwargs = {"cpu_offload": CPUOffload(offload_params=offload), "use_orig_params": use_orig_params}
    low, full = _wrapped(True, **kwargs), _wrapped(False, **kwargs)
    dtypes = []
    x = torch.rand(2, 10, generator=torch.Generator().manual_seed(1))
    for _ in range(6):
        for m in (low, full):
            m(x).sum().backward()
        dtypes.append({p.grad.dtype for p in low.parameters() if p.grad is not None})
        with torch.no_grad():
            for p in full.parameters():
                p.grad = p.grad.to(F16).float()  # type: ignore[union-attr]
    with low.summon_full_params(with_grads=True), full.summon_full_params(with_grads=True):
        summoned = all(
            torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
            for a, b in zip(low.parameters(), full.parameters(), strict=True)
        )
    for m in (low, full):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    return {
        "dtypes": dtypes,
        "params": {p.dtype for p in low.parameters()},
        "summoned": summoned,
        "same": all(torch.equal(a, b) for a, b in zip(low.parameters(), full.parameters(), strict=True)),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_gradients_stay_in_the_reduction_dtype(pool: RankPool, offload: bool, use_orig_params: bool) -> None:
    for r in pool.run(_grads_in_low_precision, offload, use_orig_params):
        assert r["dtypes"] == [{F16}] * 6, r["dtypes"]  # (fp32 before: the refusal is gone)
        assert r["params"] == {torch.float32}, "the master shards stay fp32"
        assert r["summoned"], "summon_full_params(with_grads=True) shows the fp16 gradients' values"
        assert r["same"], "the step uses the fp16 gradients, summed in fp32 between backwards"


def _clipped(max_norm: float, norm_type: float, strategy: ShardingStrategy) -> dict[str, Any]:
    """torch's _test_low_precision_grads for clip_grad_norm_."""
    model = _wrapped(True, sharding_strategy=strategy)
    model(torch.rand(3, 10, generator=torch.Generator().manual_seed(2))).sum().backward()
    grads_before = [p.grad.dtype for p in model.parameters() if p.grad is not None]
    total = model.clip_grad_norm_(max_norm=max_norm, norm_type=norm_type)
    norms = [
        torch.linalg.vector_norm(p.grad, norm_type).item() for p in model.parameters() if p.grad is not None
    ]
    return {"grads": grads_before, "total": total.dtype, "norms": norms}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("norm_type", [1, 2, math.inf])
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD])
def test_clip_grad_norm_of_low_precision_gradients(
    pool: RankPool, norm_type: float, strategy: ShardingStrategy
) -> None:
    for r in pool.run(_clipped, 2.5, norm_type, strategy):
        assert r["grads"] and set(r["grads"]) == {F16}, r
        assert r["total"] == F16, "the total norm in the gradients' dtype, as torch returns it"
        assert all(n <= 2.5 for n in r["norms"]), r["norms"]
