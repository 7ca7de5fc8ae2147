"""FSDP trains exactly like a plain model on the concatenated batch (SGD with momentum, 1e-5), and
bit for bit like the plain model (1 rank) and torch DDP (2 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy
from tests.parity import run_parity
from tests.rank_pool import RankPool

TOL = 1e-5

ALL_CASES = [
    "nested",
    "root_only",
    "tiny",
    "frozen_mixed",
    "called_twice",
    "structured_outputs",
    "tied",
    "buffers",
]


def _parity(case: str, kwargs: dict) -> dict[str, float]:
    return run_parity(case, steps=3, **kwargs)


def _check(results: list[dict[str, float]]) -> None:
    for rank, diffs in enumerate(results):
        for what, value in diffs.items():
            assert value <= TOL, f"rank {rank}: {what} differs by {value:.3g}: {diffs}"


@pytest.mark.parametrize("pool", [1, 2, 3, 4], indirect=True)
@pytest.mark.parametrize("case", ALL_CASES)
def test_parity_default_options(pool: RankPool, case: str) -> None:
    _check(pool.run(_parity, case, {}))


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"flatten_parameters": False},
        {"reshard_after_forward": False},
        {"disable_reshard_on_root": False},
        {"process_group_reduce_scatter": "default"},
        {"gradient_predivide_factor": 1.0},
        # compute stays on the CPU even where CUDA exists (offload alone would pick the GPU)
        {"move_params_to_cpu": True, "compute_device": "cpu"},
        {"cpu_offload": True, "move_grads_to_cpu": True, "compute_device": "cpu"},
    ],
    ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()),
)
@pytest.mark.parametrize("case", ["nested", "tiny", "frozen_mixed", "tied"])
def test_parity_options(pool: RankPool, case: str, kwargs: dict) -> None:
    if kwargs.get("process_group_reduce_scatter") == "default":
        from fsdp import ProcessGroupName

        kwargs = {"process_group_reduce_scatter": ProcessGroupName.default}
    _check(pool.run(_parity, case, kwargs))


def _bitwise(strategy: str) -> dict[str, object]:
    """FSDP against the reference that sums in the same order: the plain model at world size 1,
    torch's DDP at 2 (a + b is exact and commutative, and halving is exact), with Adam. Both flat
    parameters have an odd number of elements, so the shards are padded."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Linear(15, 33),
        nn.GELU(),
        nn.Sequential(nn.Linear(33, 7, bias=False), nn.Tanh()),
        nn.Linear(7, 3, bias=False),
    )
    kw = {"sharding_strategy": ShardingStrategy[strategy]}
    model = copy.deepcopy(ref)
    model[2] = FSDP(model[2], **kw)
    model = FSDP(model, **kw)
    peer = nn.parallel.DistributedDataParallel(ref) if world > 1 else ref
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, peer)]
    losses: list[tuple[float, float]] = []
    for step in range(4):
        x = torch.randn(6, 15, generator=torch.Generator().manual_seed(10 * step + rank))
        pair = []
        for m, opt in zip((model, peer), opts):
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        losses.append((pair[0], pair[1]))
    ours, theirs = model.state_dict(), ref.state_dict()
    return {
        "losses_equal": all(a == b for a, b in losses),
        "params_equal": list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs),
    }


@pytest.mark.parametrize("pool", [1, 2], indirect=True)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_bit_for_bit_with_the_plain_model_and_ddp(pool: RankPool, strategy: str) -> None:
    for r in pool.run(_bitwise, strategy):
        assert r["losses_equal"] and r["params_equal"], r


class _Branchy(nn.Module):
    """``side`` runs only when asked: a parameter used in one step and not in the next."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.side, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.inp(x)
        return self.head(h + self.side(h) if use_side else h)


def _unused_after_zeroed_grads(layout: str, accumulate: bool) -> float:
    """``optimizer.zero_grad(set_to_none=False)`` leaves zero gradients; a parameter alone in its flat
    parameter (``flatten_parameters=False``) and unused in the next step keeps its zeros, as plain
    training does, and training goes on equal to the plain model's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _Branchy()
    kwargs = {"use_orig_params": True} if layout == "orig" else {"flatten_parameters": layout == "flat"}
    model = FSDP(copy.deepcopy(ref), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step, use_side in enumerate([True, False, True, False]):
        for micro in range(2 if accumulate else 1):
            x = torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(10 * step + micro))
            mine = x[4 * rank : 4 * rank + 4]
            if accumulate and micro == 0:
                with model.no_sync():
                    model(mine, use_side).pow(2).mean().backward()
            else:
                model(mine, use_side).pow(2).mean().backward()
            (ref(x, use_side).pow(2).mean() / (2 if accumulate else 1)).backward()
        if accumulate:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(2)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad(set_to_none=False)
    full = model.state_dict()
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("layout", ["flat", "unflat", "orig"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "no_sync"])
def test_a_parameter_unused_after_zeroed_gradients(pool: RankPool, layout: str, accumulate: bool) -> None:
    assert max(pool.run(_unused_after_zeroed_grads, layout, accumulate)) <= 1e-5


def _skipped_window(strategy: str, zero: str) -> dict[str, object]:
    """A gradient-accumulation loop that drops a window (a bad loss, say) with the optimizer's
    ``zero_grad()`` between two backwards inside ``no_sync()``: what the window accumulated is gone, as
    in torch DDP, bit for bit. Before the fix the wrapper's accumulator, which the optimizer could not
    see, was added to the next window's gradients."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Linear(15, 33), nn.GELU(), nn.Sequential(nn.Linear(33, 7), nn.Tanh()), nn.Linear(7, 3)
    )
    kw = {"sharding_strategy": ShardingStrategy[strategy]}
    model = copy.deepcopy(ref)
    model[2] = FSDP(model[2], **kw)
    model = FSDP(model, **kw)
    peer = nn.parallel.DistributedDataParallel(ref)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, peer)]
    shown = []
    for step in range(3):
        for micro in range(3):
            x = torch.randn(6, 15, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
            for m, opt in zip((model, peer), opts):
                if micro < 2:
                    with m.no_sync():
                        m(x).pow(2).mean().backward()
                    if m is model:
                        shown.append(
                            all(p.grad is not None and p.grad.shape == p.shape for p in m.parameters())
                        )
                    if step == 1 and micro == 0:  # the window is dropped here
                        opt.zero_grad(set_to_none=zero == "none")
                else:
                    m(x).pow(2).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=zero == "none")
    ours, theirs = model.state_dict(), ref.state_dict()
    with model.no_sync():
        model(torch.randn(6, 15)).sum().backward()
    for p in model.parameters():
        p.grad.mul_(2)  # (sharded: scaling a part of what was accumulated cannot reach the rest, refused)
    try:
        model(torch.randn(6, 15)).sum().backward()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return {
        "params_equal": list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs),
        "shown": shown,
        "refused": refused,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("zero", ["none", "zeros"])
def test_zero_grad_inside_no_sync_drops_what_was_accumulated(
    pool: RankPool, strategy: str, zero: str
) -> None:
    for r in pool.run(_skipped_window, strategy, zero):
        assert r["params_equal"], r
        assert r["shown"] and all(r["shown"]), "between backwards inside no_sync .grad shows the accumulation"
        if (
            strategy == "NO_SHARD"
        ):  # (the full gradient is the shard's: autograd accumulates on .grad, as DDP)
            assert r["refused"] == "", r["refused"]
        else:
            assert "changed inside no_sync() between two backwards" in r["refused"], r["refused"]
