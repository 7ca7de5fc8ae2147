"""fsdp.optimizer_in_backward: each unit's shard steps in backward and its gradient is freed; the
results equal the usual backward(); optimizer.step() bit for bit (SGD, Adam, AdamW on the CPU), under
every sharding strategy, mixed precision, gradient accumulation, LR schedules, CPU offload and
checkpoints; what needs every gradient before the step refuses to run beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy
from fsdp.comm.collectives import hybrid_groups
from tests.rank_pool import RankPool

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 3),
    )


def _wrapped(**kwargs: Any) -> FSDP:
    net = _net()
    for i in (0, 2, 4):
        net[i] = FSDP(net[i], **kwargs)
    return FSDP(net, **kwargs)


def _batch(step: int, micro: int = 0) -> torch.Tensor:
    seed = 1000 * step + 10 * dist.get_rank() + micro
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _train(
    model: FSDP, optim: torch.optim.Optimizer, steps: int, accumulate: int = 1, sched: Any = None
) -> list[float]:
    losses = []
    for step in range(steps):
        for micro in range(accumulate - 1):
            with model.no_sync():
                _loss(model, _batch(step, micro)).backward()
        loss = _loss(model, _batch(step, accumulate - 1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def _parity(opt: str, config: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    accumulate, scheduled = 1, False
    if config == "FULL_SHARD":  # one reduce-scatter per unit (small gradients otherwise share a bucket,
        kwargs["bucket_cap_mb"] = 0  # reduced at the end of backward: the other configurations cover that)
    elif config in ("SHARD_GRAD_OP", "NO_SHARD"):
        kwargs["sharding_strategy"] = ShardingStrategy[config]
    elif config == "HYBRID_SHARD":
        kwargs.update(sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=hybrid_groups(2))
    elif config == "bf16":
        kwargs.update(mixed_precision=True, compute_dtype=torch.bfloat16)
    elif config == "offload":
        kwargs["move_params_to_cpu"] = True
    elif config == "no_sync":
        accumulate = 3
    elif config == "scheduler":
        scheduled = True
    cls, opt_kwargs = OPTIMIZERS[opt]
    usual, inside = _wrapped(**kwargs), _wrapped(**kwargs)
    usual_opt = cls(usual.parameters(), **opt_kwargs)
    inside_opt = fsdp.optimizer_in_backward(inside, cls, **opt_kwargs)
    scheds = [
        torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) if scheduled else None
        for o in (usual_opt, inside_opt)
    ]
    # the gradients are gone after the backward that steps: check during the first step, and count
    # the flat parameters that stepped while backward still ran (before its end-of-backward callback)
    during: list[bool] = []
    step_one = inside_opt._step_one

    def recorded(p: nn.Parameter) -> None:
        ctx = inside._ctx
        during.append(ctx is not None and ctx.callback_queued)
        step_one(p)

    inside_opt._step_one = recorded  # type: ignore[method-assign]
    loss = _loss(inside, _batch(0, accumulate - 1))
    loss.backward()
    inside_opt._step_one = step_one  # type: ignore[method-assign]
    freed = all(p.grad is None for p in inside.parameters())
    moved = not _same(inside, usual)
    inside_opt.zero_grad()
    fresh = _wrapped(**kwargs)  # restart both from the same weights, now in lockstep
    inside.load_state_dict(fresh.state_dict())
    inside_opt.state.clear()
    a = _train(usual, usual_opt, 3, accumulate, scheds[0])
    b = _train(inside, inside_opt, 3, accumulate, scheds[1])
    return {
        "stepped_during_backward": sum(during) if config == "FULL_SHARD" else None,
        "stepped": len(during),
        "freed": freed,
        "moved_in_backward": moved,
        "losses": a == b,
        "params": _same(usual, inside),
        "lr": [g["lr"] for g in inside_opt.param_groups] == [g["lr"] for g in usual_opt.param_groups],
    }


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_stepping_in_backward_equals_the_usual_step(pool: RankPool, opt: str) -> None:
    for r in pool.run(_parity, opt, "FULL_SHARD"):
        # four flat parameters (three units and the root); the inner units' step while backward runs
        assert r.pop("stepped") == 4 and r.pop("stepped_during_backward") >= 2, r
        assert r == {"freed": True, "moved_in_backward": True, "losses": True, "params": True, "lr": True}, r


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("config", ["SHARD_GRAD_OP", "NO_SHARD", "bf16", "offload", "no_sync", "scheduler"])
def test_stepping_in_backward_composes(pool: RankPool, config: str) -> None:
    for r in pool.run(_parity, "adamw", config):
        assert r.pop("stepped") == 4 and r.pop("stepped_during_backward") is None, r
        assert r == {"freed": True, "moved_in_backward": True, "losses": True, "params": True, "lr": True}, r


@pytest.mark.parametrize("pool", [4], indirect=True)
def test_stepping_in_backward_under_hybrid_shard(pool: RankPool) -> None:
    for r in pool.run(_parity, "adam", "HYBRID_SHARD"):
        assert r["params"] and r["losses"] and r["freed"], r


def _checkpoint(tmp: str) -> dict[str, Any]:
    """Save an in-backward optimizer with fsdp.save_checkpoint, load it into a fresh one and go on:
    the same as a usual optimizer trained, saved and loaded alike; and its gathered state is the
    usual one's."""
    cls, kw = OPTIMIZERS["adamw"]
    usual, inside = _wrapped(), _wrapped()
    usual_opt, inside_opt = cls(usual.parameters(), **kw), fsdp.optimizer_in_backward(inside, cls, **kw)
    _train(usual, usual_opt, 2)
    _train(inside, inside_opt, 2)
    full_usual = usual.gather_full_optim_state_dict(usual_opt)
    full_inside = inside.gather_full_optim_state_dict(inside_opt)
    same_state = full_usual is None or all(
        torch.equal(torch.as_tensor(full_usual["state"][i][k]), torch.as_tensor(full_inside["state"][i][k]))
        for i in full_usual["state"]
        for k in full_usual["state"][i]
    )
    fsdp.save_checkpoint(Path(tmp) / "ckpt", inside, inside_opt)
    resumed = _wrapped()
    resumed_opt = fsdp.optimizer_in_backward(resumed, cls, **kw)
    fsdp.load_checkpoint(Path(tmp) / "ckpt", resumed, resumed_opt)
    _train(usual, usual_opt, 2)
    _train(resumed, resumed_opt, 2)
    return {"gathered": same_state, "resumed": _same(usual, resumed)}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_checkpoints_and_optimizer_state_of_an_in_backward_optimizer(pool: RankPool, tmp_path: Path) -> None:
    for r in pool.run(_checkpoint, str(tmp_path)):
        assert r == {"gathered": True, "resumed": True}, r


def _refusals() -> dict[str, str]:
    model = _wrapped()
    optim = fsdp.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    _train(model, optim, 1)
    out: dict[str, str] = {}
    try:
        model.clip_grad_norm_(1.0)
        out["clip"] = "no error"
    except RuntimeError as e:
        out["clip"] = str(e)
    try:
        fsdp.ShardedGradScaler(device="cpu").scale(torch.ones(()))
        out["scaler"] = "no error"
    except RuntimeError as e:
        out["scaler"] = str(e)
    try:
        fsdp.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
        out["twice"] = "no error"
    except ValueError as e:
        out["twice"] = str(e)
    optim.detach_()  # after which the usual way works again
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, _batch(0)).backward()
    out["kept_grads"] = str(all(p.grad is not None for p in model.parameters()))
    optim.step()
    out["stepped_after_detach"] = str(
        any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    )
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_what_needs_every_gradient_first_is_refused(pool: RankPool) -> None:
    for r in pool.run(_refusals):
        assert "clip_grad_norm_() with an optimizer in backward" in r["clip"], r
        assert "ShardedGradScaler with fsdp.optimizer_in_backward" in r["scaler"], r
        assert "already step in backward" in r["twice"], r
        assert r["kept_grads"] == "True" and r["stepped_after_detach"] == "True", r


def _argument_checks() -> list[str]:
    out = []
    for args in [
        (_wrapped(), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)),  # an instance, not a class
        (_net(), torch.optim.SGD),  # no wrapper
    ]:
        try:
            fsdp.optimizer_in_backward(*args, lr=0.1)  # type: ignore[arg-type]
            out.append("no error")
        except (TypeError, ValueError) as e:
            out.append(f"{type(e).__name__}: {e}")
    out.append(type(fsdp.optimizer_in_backward(_wrapped(), torch.optim.SGD, lr=0.1)).__mro__[1].__name__)
    return out


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_optimizer_in_backward_checks_its_arguments(pool: RankPool) -> None:
    instance, plain, base = pool.run(_argument_checks)[0]
    assert instance.startswith("TypeError: optimizer_in_backward takes an optimizer class"), instance
    assert plain.startswith(
        "ValueError: optimizer_in_backward: the model holds no FullyShardedDataParallel"
    ), plain
    assert base == "Optimizer"  # a torch.optim.Optimizer: schedulers and checkpoint code take it
