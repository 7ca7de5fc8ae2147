"""``FSDP.summon_full_params(model, ...)`` in torch's static form, as torch's ``test_fsdp_unshard_params.py`` uses it.

``model`` may be a plain module holding several root wrappers (torch's ``NestedWrappedModule`` with
``FSDPInitMode.RECURSIVE`` applied below a plain root); torch's positional order (``recurse``,
``writeback``) and keywords hold through the class and through ``model.summon_full_params(model)``,
while ``model.summon_full_params(recurse, volatile)`` keeps fairscale's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from tests.rank_pool import RankPool


def _nested_wrapped(**fsdp_kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """A plain root holding two root wrappers (one with a wrapper inside), and its plain copy."""
    torch.manual_seed(0)
    local = nn.Sequential(
        nn.Linear(8, 4), nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)), nn.Linear(16, 4), nn.Linear(4, 8)
    )
    model = copy.deepcopy(local)
    model[1][0] = FSDP(model[1][0], **fsdp_kwargs)
    model[1] = FSDP(model[1], **fsdp_kwargs)
    model[2] = FSDP(model[2], **fsdp_kwargs)
    return local, model


def _param_data(rank0_only: bool, mixed: bool, use_orig_params: bool) -> dict[str, Any]:
    """torch's ``_test_unshard_params_param_data``: inside the context the plain root's parameters are
    the local model's, full size, in their own dtype even under mixed precision; with ``rank0_only``
    the other ranks keep their shards."""
    mp = torch_fsdp.MixedPrecision(param_dtype=torch.float16) if mixed else None
    local, model = _nested_wrapped(mixed_precision=mp, use_orig_params=use_orig_params)
    with FSDP.summon_full_params(model, rank0_only=rank0_only, writeback=not rank0_only):
        pairs = list(zip(local.parameters(), model.parameters()))
        same = all(
            p1.shape == p2.shape
            and p1.dtype == p2.dtype
            and torch.equal(p1, p2)
            and isinstance(p2, nn.Parameter)
            for p1, p2 in pairs
        )
        shapes = [tuple(p.shape) for p in model.parameters()]
    roots = sum(1 for w in FSDP.fsdp_modules(model, root_only=True))
    return {"same": same, "count": len(pairs), "shapes": shapes, "roots": roots, "rank": dist.get_rank()}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("rank0_only", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_plain_root_shows_every_wrappers_full_parameters(
    pool: RankPool, rank0_only: bool, mixed: bool, use_orig_params: bool
) -> None:
    for r in pool.run(_param_data, rank0_only, mixed, use_orig_params):
        assert r["roots"] == 2
        if rank0_only and r["rank"] != 0:
            assert (16, 4) not in r["shapes"], "the other ranks keep their shards"
            continue
        assert r["same"] and r["count"] == 10, r


def _writeback(writeback: bool, check_outer: bool) -> tuple[float, float]:
    """torch's ``_test_unshard_params_writeback``: write a known value into a shard, zero the full
    parameters inside the context, and see whether the zeros reached the shard."""
    model = nn.Sequential(nn.Linear(5, 5, bias=False), nn.Linear(5, 3, bias=False))
    model[0] = FSDP(model[0])
    model = FSDP(model)
    outer, inner = next(model.parameters()), next(model[0].parameters())
    param = outer if check_outer else inner
    with torch.no_grad():
        param.fill_(dist.get_rank() + 2.0)
    with FSDP.summon_full_params(model, True, writeback), torch.no_grad():  # torch's positional order
        for p in model.parameters():
            p.zero_()
    return param[0].item(), float(dist.get_rank() + 2)


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("writeback", [False, True])
@pytest.mark.parametrize("check_outer", [False, True])
def test_writeback_in_torchs_positional_order(pool: RankPool, writeback: bool, check_outer: bool) -> None:
    for value, written in pool.run(_writeback, writeback, check_outer):
        assert value == (0.0 if writeback else written)


def _recurse(recurse: bool, unshard_outer: bool) -> tuple[int, int]:
    """torch's ``_test_unshard_params_recurse``: which flat parameters are full inside the context."""
    model = FSDP(nn.Sequential(FSDP(nn.Linear(5, 5, bias=False)), nn.Linear(5, 3, bias=False)))
    outer, inner = model.params[0], model[0].params[0]
    target = model if unshard_outer else model[0]
    with FSDP.summon_full_params(target, recurse=recurse):
        return outer.numel(), inner.numel()


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("recurse", [False, True])
@pytest.mark.parametrize("unshard_outer", [False, True])
def test_recurse(pool: RankPool, recurse: bool, unshard_outer: bool) -> None:
    # a full flat parameter shows its original elements only (15, 25), as torch's does (with
    # use_orig_params=True padded to the world size: test_torch_flat_param_attrs.py)
    outer = 15 if unshard_outer else 8
    inner = 25 if recurse or not unshard_outer else 13
    assert pool.run(_recurse, recurse, unshard_outer) == [(outer, inner)] * 2


def test_the_instance_forms(single_rank_group: None) -> None:
    """``model.summon_full_params(model, ...)`` is torch's static call; ``model.summon_full_params()``
    fairscale's, whose second positional argument is ``volatile``."""
    model = FSDP(nn.Linear(2, 2, bias=False))
    before = model.state_dict()["weight"].clone()
    with model.summon_full_params(model, writeback=False), torch.no_grad():
        model.module.weight.add_(1.0)
    assert torch.equal(model.state_dict()["weight"], before)
    with model.summon_full_params(model, True, True), torch.no_grad():  # torch: (module, recurse, writeback)
        model.module.weight.add_(1.0)
    before = before + 1
    assert torch.equal(model.state_dict()["weight"], before), (
        "the third positional argument is torch's writeback"
    )
    with model.summon_full_params(True, True), torch.no_grad():  # fairscale: volatile=True
        model.module.weight.add_(1.0)
    assert torch.equal(model.state_dict()["weight"], before)
    with model.summon_full_params(True, False), torch.no_grad():  # fairscale: volatile=False
        model.module.weight.add_(1.0)
    assert torch.equal(model.state_dict()["weight"], before + 1)
    with pytest.raises(
        NotImplementedError, match="pass writeback=False"
    ):  # torch's test_rank0_only_with_writeback_raises
        with FSDP.summon_full_params(nn.Sequential(model), rank0_only=True, writeback=True):
            pass


def _grad_edits(strategy: str, writeback: bool) -> bool:
    """torch's ``_test_with_grads_core``: whether ``p.grad *= 2`` inside ``summon_full_params(with_grads=True)``
    stays in the gradients after the context."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    kwargs: dict[str, Any] = {
        "use_orig_params": True,
        "sharding_strategy": getattr(torch_fsdp.ShardingStrategy, strategy),
    }
    model = FSDP(nn.Sequential(FSDP(inner, **kwargs), nn.Linear(8, 4)), **kwargs)
    model(torch.randn(3, 8, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with FSDP.summon_full_params(model, writeback=writeback, with_grads=True):
        for p in model.parameters():
            p.grad *= 2  # type: ignore[operator]
    after = [p.grad for p in model.parameters()]
    assert all(torch.equal(b, a) for b, a in zip(before, after)) or all(
        torch.equal(b * 2, a) for b, a in zip(before, after)
    ), "all kept or all dropped"
    return all(torch.equal(b * 2, a) for b, a in zip(before, after))


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("writeback", [False, True])
def test_gradient_edits_inside_summon_stay_as_in_torch(
    pool: RankPool, strategy: str, writeback: bool
) -> None:
    """With writeback they stay; without, they stay only under NO_SHARD (torch shows the gradient's own
    storage there; they were dropped)."""
    assert pool.run(_grad_edits, strategy, writeback) == [writeback or strategy == "NO_SHARD"] * 2


def _summon_during_a_step() -> dict[str, Any]:
    """torch's test_unshard_params_from_forward_raises / _from_backward_raises."""

    class Summoning(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.zeros(5))

        def forward(self, fsdp_module: nn.Module) -> None:
            with FSDP.summon_full_params(fsdp_module):
                pass

    errors = []
    model = FSDP(Summoning())
    try:
        model(model)
    except AssertionError as e:
        errors.append((isinstance(e, RuntimeError), str(e)))
    with FSDP.summon_full_params(model):  # between steps again
        summoned = model.a.shape
    linear = FSDP(nn.Linear(2, 1))
    out = linear(torch.ones(2))

    def hook(*args: Any) -> None:
        with FSDP.summon_full_params(linear):
            pass

    out.register_hook(hook)
    try:
        out.sum().backward()
    except AssertionError as e:
        errors.append((isinstance(e, RuntimeError), str(e)))
    return {"errors": errors, "summoned": tuple(summoned)}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_summon_during_forward_or_backward_raises_torchs_assertion(pool: RankPool) -> None:
    for r in pool.run(_summon_during_a_step):
        assert len(r["errors"]) == 2, r
        for is_runtime_error, text in r["errors"]:
            assert is_runtime_error and "Cannot manually unshard parameters during forward/backward" in text
        assert r["summoned"] == (5,), "the wrapper is usable after the refusal in forward"
