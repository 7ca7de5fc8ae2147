"""torch FSDP1's flat parameter attributes and buffer names, from the scenarios of its mixed precision
tests: a module checks in its own forward whether its unit is gathered (``flat_param.data`` is not
``flat_param._local_shard``) and that the compute-dtype shard ``_mp_shard`` is freed; the names
``named_buffers()`` gives inside ``summon_full_params`` are those of ``state_dict()``.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision

from fsdp import FullyShardedDataParallel as FSDP
from tests.rank_pool import RankPool

F16 = torch.float16


class _Checking(nn.Module):
    """A linear layer that records, in its forward, what torch's ``LinearMixedPrecision`` checks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(10, 10, bias=False)
        self.register_buffer("buffer", torch.randn(1, 2, dtype=torch.float64))
        self.root: FSDP | None = None
        self.seen: list[dict[str, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.root is not None
        for p in self.root.params:
            self.seen.append(
                {
                    "active": p.data.data_ptr() != p._local_shard.data_ptr(),
                    "dtype": p.dtype,
                    "mp_freed": p._mp_shard.untyped_storage().size() == 0
                    if hasattr(p, "_mp_shard")
                    else None,
                }
            )
        return self.lin(x)  # type: ignore[no-any-return]


def _attributes(param_dtype: torch.dtype | None) -> dict[str, Any]:
    module = _Checking()
    model = FSDP(module, mixed_precision=MixedPrecision(param_dtype=param_dtype, reduce_dtype=F16))
    module.root = model
    optim = torch.optim.Adam(model.parameters())
    idle = []
    for _ in range(2):
        model(torch.randn(3, 10)).float().sum().backward()
        optim.step()
        idle += [
            {
                "at_shard": p.data.data_ptr() == p._local_shard.data_ptr(),
                "dtype": p.dtype,
                "mp": None if not hasattr(p, "_mp_shard") else p._mp_shard.untyped_storage().size(),
            }
            for p in model.params
        ]
    buffer = io.BytesIO()
    module.root = None
    torch.save(model, buffer)  # (a freed _mp_shard is left out: the file loads)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    return {
        "seen": module.seen,
        "idle": idle,
        "loaded": [
            (p.data.data_ptr() == p._local_shard.data_ptr(), hasattr(p, "_mp_shard")) for p in loaded.params
        ],
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("param_dtype", [F16, None])
def test_flat_parameters_carry_torchs_shard_attributes(
    pool: RankPool, param_dtype: torch.dtype | None
) -> None:
    mixed = param_dtype is not None
    for r in pool.run(_attributes, param_dtype):
        assert r["seen"] and all(s["active"] for s in r["seen"]), (
            "in forward the flat parameter is the full one"
        )
        assert {s["dtype"] for s in r["seen"]} == {F16 if mixed else torch.float32}, r["seen"]
        assert {s["mp_freed"] for s in r["seen"]} == ({True} if mixed else {None}), r["seen"]
        assert r["idle"] and all(i["at_shard"] and i["dtype"] == torch.float32 for i in r["idle"]), r["idle"]
        assert {i["mp"] for i in r["idle"]} == ({0} if mixed else {None}), r["idle"]
        assert r["loaded"] == [(True, mixed)], r["loaded"]


def test_named_buffers_inside_summon_have_the_state_dict_names(single_rank_group: Any) -> None:
    model = FSDP(nn.Sequential(FSDP(_Checking()), _Checking()))
    outside = [name for name, _ in model.named_buffers()]
    assert all(name.startswith("_fsdp_wrapped_module.") for name in outside), outside
    with model.summon_full_params(model):
        inside = dict(model.named_buffers())
    assert (
        sorted(inside)
        == sorted(k for k in model.state_dict() if k.endswith("buffer"))
        == ["0.buffer", "1.buffer"]
    )
    assert [name for name, _ in model.named_buffers()] == outside, "outside again: the wrapper's names"


def _handles_and_full_buffer() -> dict[str, Any]:
    """torch's test_fsdp_module_no_compute_grad (``_handles[0].flat_param.grad``) and the first half of
    test_unshard_params_respects_reshard (``_handle.flat_param._full_param_padded``'s storage)."""
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(FSDP(nn.Linear(5, 5, bias=False)), nn.Linear(5, 3, bias=False)))
    outer, inner = model._handle.flat_param, model.module[0]._handle.flat_param

    def held() -> tuple[int, int]:
        return tuple(p._full_param_padded.untyped_storage().size() // 4 for p in (outer, inner))  # type: ignore[return-value]

    out = model(torch.zeros(5))
    after_forward = held()
    out.sum().backward()
    frozen = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    frozen[0].requires_grad_(False)
    two = FSDP(frozen)
    try:
        two._handle  # noqa: B018
        refusal = ""
    except RuntimeError as e:
        refusal = str(e)
    return {
        "same": outer is model.params[0] and model._handles == [model._handle],
        "numel": outer.numel(),
        "after_forward": after_forward,
        "after_backward": held(),
        "grads": [p.grad is not None for p in (outer, inner)],
        "empty": FSDP(nn.ReLU())._handle is None,
        "two": len(two._handles),
        "refusal": refusal,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_torchs_private_handles_lead_to_the_flat_parameters(pool: RankPool) -> None:
    for r in pool.run(_handles_and_full_buffer):
        assert r["same"], r
        # the root keeps its full parameter after forward (torch's default), the inner unit frees it;
        # both are freed after backward
        assert r["after_forward"] == (2 * r["numel"], 0), r
        assert r["after_backward"] == (0, 0) and r["grads"] == [True, True], r
        assert r["empty"] and r["two"] == 2 and "holds 2 flat parameters" in r["refusal"], r


def _shown_flat_parameters(use_orig_params: bool, strategy: str) -> dict[str, Any]:
    """torch's test_unshard_params_recurse and test_unshard_singleton_param_writeback (the flat parameter's
    numel inside ``summon_full_params``) and test_fsdp_not_all_outputs_used_in_loss
    (``handle.uses_sharded_strategy``)."""
    from torch.distributed.fsdp import ShardingStrategy

    kwargs = {"use_orig_params": use_orig_params, "sharding_strategy": getattr(ShardingStrategy, strategy)}
    model = FSDP(
        nn.Sequential(FSDP(nn.Linear(5, 5, bias=False), **kwargs), nn.Linear(5, 3, bias=False)), **kwargs
    )
    outer, inner = model._handle.flat_param, model.module[0]._handle.flat_param
    sharded = (outer.numel(), inner.numel())
    with FSDP.summon_full_params(model):
        shown = (outer.numel(), inner.numel())
        written = outer.data_ptr()
        with torch.no_grad():
            outer.fill_(1.5)  # (the whole flat parameter shown: written back below)
    with FSDP.summon_full_params(model):
        after = [bool((p == 1.5).all()) for p in model.module[1].parameters()]
    singleton = FSDP(nn.Linear(1, 1, bias=False), use_orig_params=use_orig_params)
    with FSDP.summon_full_params(singleton):
        single = singleton._handle.flat_param.numel()
    model(torch.zeros(2, 5)).sum().backward()
    return {
        "sharded": sharded,
        "shown": shown,
        "written": written != 0,
        "after": after,
        "single": single,
        "uses_sharded": model._handle.uses_sharded_strategy,
        "grad_is_shard_grad": model._handle.sharded_grad is outer.grad and outer.grad is not None,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    ("use_orig_params", "strategy"), [(False, "FULL_SHARD"), (True, "FULL_SHARD"), (False, "NO_SHARD")]
)
def test_a_shown_flat_parameter_has_torchs_numel(
    pool: RankPool, use_orig_params: bool, strategy: str
) -> None:
    """Inside ``summon_full_params`` a flat parameter is torch's: unpadded (15 elements, 25, 1) where it
    holds the originals flattened; with ``use_orig_params=True`` padded to the world size (16, 26, 2), as
    torch pads each original of its flat parameter."""
    for r in pool.run(_shown_flat_parameters, use_orig_params, strategy):
        if strategy == "NO_SHARD":
            assert r["sharded"] == r["shown"] == (15, 25) and r["single"] == 1, r
        elif use_orig_params:
            assert r["sharded"] == (8, 13) and r["shown"] == (16, 26) and r["single"] == 2, r
        else:
            assert r["sharded"] == (8, 13) and r["shown"] == (15, 25) and r["single"] == 1, r
        assert r["written"] and r["after"] == [True], r
        assert r["uses_sharded"] is (strategy != "NO_SHARD"), r
        assert r["grad_is_shard_grad"], r


def _kept_through_summon(mixed: bool) -> dict[str, Any]:
    """torch's test_unshard_params_respects_reshard: a summon between the root's forward and backward
    keeps the full parameter the root holds (freed under mixed precision, where the summon shows the fp32
    masters); the gradients are those of a run without the summon, and the buffer is freed after backward."""
    mp = MixedPrecision(param_dtype=F16) if mixed else None

    def build() -> FSDP:
        torch.manual_seed(0)
        inner = FSDP(nn.Linear(5, 5, bias=False), mixed_precision=mp)
        return FSDP(nn.Sequential(inner, nn.Linear(5, 3, bias=False)), mixed_precision=mp)

    model, reference = build(), build()
    outer = model._handle.flat_param

    def held() -> int:
        return outer._full_param_padded.untyped_storage().size()

    x = torch.randn(4, 5)
    out = model(x)
    before = held()
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        pass
    with FSDP.summon_full_params(model, writeback=True):
        pass
    during = held()
    out.float().sum().backward()
    reference(x).float().sum().backward()
    same_grads = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    return {"before": before, "during": during, "same_grads": same_grads, "after": held()}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("mixed", [False, True])
def test_a_summon_keeps_the_full_parameter_a_forward_kept(pool: RankPool, mixed: bool) -> None:
    for r in pool.run(_kept_through_summon, mixed):
        assert r["before"] > 0, r
        assert r["during"] == (0 if mixed else r["before"]), r
        assert r["same_grads"] and r["after"] == 0, r
