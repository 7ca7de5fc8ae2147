"""no_sync, clip_grad_norm_, activation checkpointing and frozen adapters, against a plain model."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy, get_fsdp_instances
from fsdp.training.activation_checkpoint import checkpoint_wrapper
from tests.models import build, wrap
from tests.parity import compare_training, handles_with_ref_names, reference_flat, shard_of
from tests.rank_pool import RankPool

TOL = 1e-5


def _grad_error(model: nn.Module, ref: nn.Module) -> float:
    err = 0.0
    for h, names in handles_with_ref_names(model):
        expected = reference_flat(ref, names, "grad")
        if expected is not None:
            err = max(err, (h.flat_param.grad - shard_of(expected, h)).abs().max().item())
    return err


def _no_sync(strategy: str, micro: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build("nested")
    model = wrap(copy.deepcopy(ref), ("body", "inp"), sharding_strategy=ShardingStrategy[strategy])
    early_inner = ""
    try:  # an inner wrapper, before the first forward: it must not make itself a root
        with model.module.body.no_sync():
            pass
    except RuntimeError as e:
        early_inner = str(e)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    per_step: list[dict[str, int]] = []
    clip_inside = ""
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        batches = [torch.randn(2 * world, 6, generator=g) for _ in range(micro)]
        with model.no_sync(keep_full_params=True):  # (the default follows reshard_after_forward)
            for b in batches[:-1]:
                model.reset_comm_stats()
                model(b[2 * rank : 2 * rank + 2]).pow(2).mean().backward()
                per_step.append({k: v["calls"] for k, v in model.comm_stats().items()})
            try:
                model.clip_grad_norm_(1.0)
            except RuntimeError as e:
                clip_inside = str(e)
        model.reset_comm_stats()
        model(batches[-1][2 * rank : 2 * rank + 2]).pow(2).mean().backward()
        per_step.append({k: v["calls"] for k, v in model.comm_stats().items()})
        for b in batches:
            ref(b).pow(2).mean().backward()
        grad_err = _grad_error(model, ref)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    sd = model.state_dict()
    param_err = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    inner_error = ""
    try:
        with model.module.body.no_sync():
            pass
    except RuntimeError as e:
        inner_error = str(e)
    return {
        "grad": grad_err,
        "param": param_err,
        "calls": per_step,
        "inner": inner_error,
        "early_inner": early_inner,
        "clip_inside": clip_inside,
    }


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_no_sync_accumulates_without_communication(pool: RankPool, strategy: str) -> None:
    micro = 3
    for r in pool.run(_no_sync, strategy, micro):
        assert r["grad"] <= TOL and r["param"] <= TOL, r
        assert (
            "should only be called on the root FSDP instance" in r["inner"]
            and "should only be called on the root" in r["early_inner"]
        )
        assert "clip_grad_norm_() inside no_sync()" in r["clip_inside"]
        calls = r["calls"]
        for step in (0, 1):
            first, second, synced = calls[step * micro : (step + 1) * micro]
            assert first.get("reduce_scatter", 0) == first.get("all_reduce", 0) == 0
            # after the first micro-batch the full parameters are kept: nothing at all is sent
            assert all(v == 0 for v in second.values()), second
            # the synced micro-batch's forward reuses the kept parameters; FULL_SHARD frees the two
            # inner units after it, so its backward gathers them again. NO_SHARD's first reducing
            # backward learns its buckets, first checking in one all-gather that every rank reduces
            # the same parameters
            learning = strategy == "NO_SHARD" and step == 0
            assert synced.get("all_gather", 0) == (2 if strategy == "FULL_SHARD" else int(learning)), synced
            if strategy == "NO_SHARD":
                assert synced["all_reduce"] == 1 + 1  # one bucket and the consistency check
            else:
                assert synced["reduce_scatter"] == 1  # the three units share one bucket


def _no_sync_reduces_in_the_wire_dtype() -> dict[str, Any]:
    rank = dist.get_rank()
    model = wrap(build("nested"), ("body", "inp"), mixed_precision=True, compute_dtype=torch.bfloat16)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
    model(x).float().pow(2).mean().backward()  # first step: every lazy exchange is behind us
    model.zero_grad()
    model.reset_comm_stats()
    model(x).float().pow(2).mean().backward()
    plain = model.comm_stats()["reduce_scatter"]["bytes"]
    model.zero_grad()
    with model.no_sync():
        model(x).float().pow(2).mean().backward()
    model.reset_comm_stats()
    model(x).float().pow(2).mean().backward()
    accumulated = model.comm_stats()["reduce_scatter"]["bytes"]
    return {"plain": plain, "accumulated": accumulated}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_no_sync_under_bf16_reduces_as_many_bytes_as_a_plain_step(pool: RankPool) -> None:
    for r in pool.run(_no_sync_reduces_in_the_wire_dtype):
        assert r["plain"] > 0 and r["accumulated"] == r["plain"], r


def _zero_grad_after_no_sync(strategy: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build("nested")
    model = wrap(copy.deepcopy(ref), ("body", "inp"), sharding_strategy=ShardingStrategy[strategy])
    g = torch.Generator().manual_seed(5)
    dropped, kept = torch.randn(2 * world, 6, generator=g), torch.randn(2 * world, 6, generator=g)
    with model.no_sync():
        model(dropped[2 * rank : 2 * rank + 2]).pow(2).mean().backward()
    model.zero_grad()  # a plain model forgets the accumulated gradients here, and so must the wrapper
    model(kept[2 * rank : 2 * rank + 2]).pow(2).mean().backward()
    ref(dropped).pow(2).mean().backward()
    ref.zero_grad()
    ref(kept).pow(2).mean().backward()
    return {"grad": _grad_error(model, ref)}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])  # NO_SHARD's .grad is autograd's own
def test_zero_grad_drops_what_no_sync_accumulated(pool: RankPool, strategy: str) -> None:
    for r in pool.run(_zero_grad_after_no_sync, strategy):
        assert r["grad"] <= TOL, r


def _clip(norm_type: float, strategy: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build("tied")
    model = wrap(copy.deepcopy(ref), ("mix",), sharding_strategy=ShardingStrategy[strategy])
    idx = torch.randint(0, 11, (2 * world, 5), generator=torch.Generator().manual_seed(0))
    (model(idx[2 * rank : 2 * rank + 2]).pow(2).mean() * 50).backward()
    (ref(idx).pow(2).mean() * 50).backward()
    norm = model.clip_grad_norm_(0.05, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
    # below max_norm (now about 0.05, against 1.0) the gradients are left exactly as they are
    clipped = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    below_norm = model.clip_grad_norm_(1.0, norm_type).item()
    after = [p.grad for p in model.parameters() if p.grad is not None]
    unchanged = len(after) == len(clipped) > 0 and all(torch.equal(a, b) for a, b in zip(after, clipped))
    inner = ""
    try:
        model.module.mix.clip_grad_norm_(1.0)
    except RuntimeError as e:
        inner = str(e)
    not_norms = []
    for bad in (0.0, -1.0, -math.inf, math.nan):  # no norm of the concatenated gradients: refused
        try:
            model.clip_grad_norm_(1.0, bad)
        except ValueError as e:
            not_norms.append(str(e))
    return {
        "norm": norm.item(),
        "ref_norm": ref_norm.item(),
        "grad": _grad_error(model, ref),
        "below_norm": below_norm,
        "unchanged": unchanged,
        "inner": inner,
        "not_norms": not_norms,
    }


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_clip_grad_norm_matches_torch_on_the_plain_model(
    pool: RankPool, norm_type: float, strategy: str
) -> None:
    results = pool.run(_clip, norm_type, strategy)
    for r in results:
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5)
        assert r["norm"] > 0.05, "the test must actually clip"
        assert r["grad"] <= TOL, "clipped gradients equal the plain model's clipped gradients"
        assert r["below_norm"] == pytest.approx(0.05, rel=1e-4)
        assert r["unchanged"], "a norm below max_norm leaves the gradients alone (never scales them up)"
        assert "should only be called on the root FSDP instance" in r["inner"]
        assert len(r["not_norms"]) == 4 and all("norm_type must be > 0" in m for m in r["not_norms"])
    assert len({r["norm"] for r in results}) == 1, "identical on every rank"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block() for _ in range(3)], nn.Linear(16, 1))


def _saved_bytes(fn: Any) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return total


def _checkpointing(order: str) -> dict[str, Any]:
    ref = _stack()
    net = copy.deepcopy(ref)
    for i in range(3):
        if order == "fsdp_outside":  # FSDP(checkpoint_wrapper(block))
            net[i] = FSDP(checkpoint_wrapper(net[i]))
        elif order == "fsdp_inside":  # checkpoint_wrapper(FSDP(block))
            net[i] = checkpoint_wrapper(FSDP(net[i]))
        else:
            net[i] = FSDP(net[i])
    model = FSDP(net)
    diffs = compare_training(
        ref,
        model,
        lambda g, n: torch.randn(n, 16, generator=g),
        lambda y: y.pow(2).mean(),
        steps=3,
        per_rank=8,
    )
    x = torch.randn(8, 16)
    saved = _saved_bytes(lambda: model(x).pow(2).mean())
    return {
        "diff": max(diffs.values()),
        "saved": saved,
        "keys": list(model.state_dict()) == list(ref.state_dict()),
    }


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_activation_checkpointing_composes_with_fsdp_both_ways(pool: RankPool) -> None:
    plain = pool.run(_checkpointing, "none")
    for order in ("fsdp_outside", "fsdp_inside"):
        for r, p in zip(pool.run(_checkpointing, order), plain):
            assert r["diff"] <= TOL and r["keys"], (order, r)
            # only the blocks' inputs are saved instead of their activations
            assert r["saved"] < 0.5 * p["saved"], (order, r["saved"], p["saved"])


class _Lora(nn.Module):
    """A frozen base linear with a trainable low-rank adapter in the same module."""

    def __init__(self, d: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.down = nn.Linear(d, rank, bias=False)
        self.up = nn.Linear(rank, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class _Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.trunk.requires_grad_(False)  # a whole wrapper that never gets a gradient
        self.l1 = _Lora(8)
        self.l2 = _Lora(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(self.trunk(x))))))


def _lora() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = _Adapted()
    model = wrap(copy.deepcopy(ref), ("trunk", "l1", "l2"))
    diffs = compare_training(
        ref, model, lambda g, n: torch.randn(n, 6, generator=g), lambda y: y.pow(2).mean()
    )
    states = {w.training_state.name for w in get_fsdp_instances(model)}
    trunk_grads = [p.grad for p in model.module.trunk.parameters()]
    return {"diff": max(diffs.values()), "states": states, "trunk_grads_none": all(g is None for g in trunk_grads),
            "n_wrappers": len(get_fsdp_instances(model))}  # fmt: skip


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
def test_frozen_trunk_and_lora_adapters(pool: RankPool) -> None:
    for r in pool.run(_lora):
        assert r["diff"] <= TOL, r
        assert r["states"] == {"IDLE"} and r["trunk_grads_none"] and r["n_wrappers"] == 4
