"""Optimizer state per original parameter: gathered it equals a plain optimizer's state dict over the
unwrapped model; sharded back (at any world size) training continues exactly."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from tests.checkpointing import GLOBAL_BATCH, make, optim_diff, state_diff, train, train_ref
from tests.models import wrap
from tests.parity import handles_with_ref_names
from tests.rank_pool import RankPool


class TwoHeads(nn.Module):
    """``aux`` is never used, so its unit gets no gradient and its parameters no optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 7)
        self.aux = nn.Linear(7, 2)
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.tanh(self.trunk(x)))))


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
}


def _two_groups(model: nn.Module, ref: nn.Module) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The root unit's parameters (lr x1) and the inner units' (lr x0.5), for FSDP and for the reference."""
    names = {h: set(n) for h, n in handles_with_ref_names(model)}
    root = [h for h in model.handles]
    groups = [[h.flat_param for h in root], [h.flat_param for h in names if h not in root]]
    ref_params = dict(ref.named_parameters())
    ref_groups = [
        [p for n, p in ref_params.items() if any(n in names[h] for h in root)],
        [p for n, p in ref_params.items() if not any(n in names[h] for h in root)],
    ]
    return (
        [{"params": groups[0]}, {"params": groups[1], "lr_scale": 0.5}],
        [{"params": ref_groups[0]}, {"params": ref_groups[1], "lr_scale": 0.5}],
    )


def _scaled(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in opt.param_groups:
        group["lr"] *= group.get("lr_scale", 1.0)
    return opt


def _gather_and_shard(name: str, recipient: int) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = TwoHeads()
    model = wrap(copy.deepcopy(ref), ("mid", "aux"))
    groups, ref_groups = _two_groups(model, ref)
    opt, ref_opt = _scaled(OPTIMIZERS[name](groups)), _scaled(OPTIMIZERS[name](ref_groups))
    empty = model.gather_full_optim_state_dict(opt, recipient_rank=recipient)  # before any step: no state
    per = GLOBAL_BATCH // dist.get_world_size()
    for step in range(2):
        x = torch.randn(GLOBAL_BATCH, 6, generator=torch.Generator().manual_seed(step))
        model(x[rank * per : (rank + 1) * per]).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = model.gather_full_optim_state_dict(opt, recipient_rank=recipient)
    out: dict[str, Any] = {
        "is_none": full is None,
        "empty_state": None if empty is None else empty["state"],
        "diff": optim_diff(full, ref_opt.state_dict()) if full is not None else None,
        "names": None if full is None else full["param_names"],
    }
    # shard it back into a fresh model and optimizer: the flat state is identical, training continues alike
    box = [full]
    dist.broadcast_object_list(box, src=recipient)
    fresh = wrap(TwoHeads(), ("mid", "aux"))
    fresh.load_state_dict(model.state_dict())
    fresh_opt = OPTIMIZERS[name](_two_groups(fresh, ref)[0])
    fresh_opt.load_state_dict(fresh.get_shard_from_optim_state_dict(box[0], fresh_opt))
    out["same_state"] = all(
        set(fresh_opt.state[q]) == set(opt.state[p])
        and all(torch.equal(fresh_opt.state[q][k], v) for k, v in opt.state[p].items())
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    out["same_groups"] = [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    x = torch.randn(per, 6, generator=torch.Generator().manual_seed(10 + rank))
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).pow(2).mean().backward()
        o.step()
    out["same_after_step"] = state_diff(fresh.state_dict(), model.state_dict())
    return out


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_gathered_state_equals_plain_optimizer(pool: RankPool, name: str) -> None:
    recipient = pool.world_size - 1 if name == "sgd" else 0
    results = pool.run(_gather_and_shard, name, recipient)
    for rank, r in enumerate(results):
        assert r["is_none"] == (rank != recipient), "the full state is returned on the recipient only"
        if rank == recipient:
            assert r["empty_state"] == {}, "no state before the first step"
            assert r["diff"] < 1e-5, f"gathered state differs from the plain optimizer's: {r['diff']}"
            root, inner = ["trunk", "head"], ["mid", "aux"]  # group 0, then group 1
            assert r["names"] == [f"{m}.{p}" for m in root + inner for p in ("weight", "bias")]
        assert r["same_state"] and r["same_groups"] and r["same_after_step"] == 0.0


def _from_plain_optimizer() -> dict[str, float]:
    """A plain single-process optimizer's state dict (no names) loads into FSDP at this world size."""
    case = "nested"
    ref, model = make(case, seed=3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    train_ref(ref, ref_opt, case, range(3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.load_state_dict(ref.state_dict())
    opt.load_state_dict(model.get_shard_from_optim_state_dict(ref_opt.state_dict()))
    losses, ref_losses = train(model, opt, case, range(3, 6)), train_ref(ref, ref_opt, case, range(3, 6))
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param": state_diff(model.state_dict(), ref.state_dict()),
    }


@pytest.mark.parametrize("pool", [3], indirect=True)
def test_plain_optimizer_state_loads_at_any_world_size(pool: RankPool) -> None:
    for r in pool.run(_from_plain_optimizer):
        assert r["loss"] < 1e-5 and r["param"] < 1e-5, r


def _mismatched_groups() -> str:
    torch.manual_seed(0)
    ref = TwoHeads()
    model = wrap(copy.deepcopy(ref), ("mid", "aux"))
    groups, _ = _two_groups(model, ref)
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    full = model.gather_full_optim_state_dict(opt)
    box = [full]
    dist.broadcast_object_list(box, src=0)
    single = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        model.get_shard_from_optim_state_dict(box[0], single)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_other_param_groups_are_refused(pool: RankPool) -> None:
    for msg in pool.run(_mismatched_groups):
        assert "other parameters than the saved ones" in msg and "1 groups here, 2 saved" in msg


def _not_flat() -> str:
    model = FSDP(nn.Linear(4, 4))
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    try:
        model.gather_full_optim_state_dict(opt)
    except RuntimeError as e:
        return str(e)
    return ""


def _agree_cases() -> dict[str, str]:
    from fsdp.core.layout import agree

    rank = dist.get_rank()
    layout = FSDP(nn.Linear(4, 4))._state_layout()
    out = {}
    for case, error, digest in (
        ("one_rank", "disk full" if rank == 1 else None, "same"),
        ("digests", None, f"keys of rank {rank}"),
        ("fine", None, "same"),
    ):
        try:
            agree(layout, error, "saving", digest)
            out[case] = ""
        except RuntimeError as e:
            out[case] = str(e)
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_agreement_raises_on_every_rank(pool: RankPool) -> None:
    for r in pool.run(_agree_cases):
        assert "saving failed on rank(s) [1]" in r["one_rank"] and "disk full" in r["one_rank"]
        assert "differently structured" in r["digests"]
        assert r["fine"] == ""


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_foreign_optimizer_fails_on_every_rank(pool: RankPool) -> None:
    for msg in pool.run(_not_flat):
        assert "failed on rank(s) [0, 1]" in msg and "not a flat parameter of this model" in msg


# ---------------------------------------------------------------------- fairscale's and wrappers' formats
def _square_net() -> nn.Sequential:
    torch.manual_seed(0)  # every Linear 4x4: a parameter given another's state loads without a shape error
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def _fairscale_format() -> dict[str, Any]:
    """A dict in the layout of fairscale's gather_full_optim_state_dict: parameters numbered wrapper
    by wrapper (the root's own 0.* and 4.*, then the inner wrapper's 2.*), a param_id_map (global id
    -> the wrapper's flat id) and 0-dim state as one tensor per saving rank."""
    ref = _square_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        ref_opt.zero_grad()
        ref(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        ref_opt.step()
    plain = dict(ref.named_parameters())
    order = ["0.weight", "0.bias", "4.weight", "4.bias", "2.weight", "2.bias"]
    saved = {
        "state": {
            i: {
                "momentum_buffer": ref_opt.state[plain[n]]["momentum_buffer"].clone(),
                "tag": [torch.tensor(7.0)] * 2,
            }
            for i, n in enumerate(order)
        },
        "param_groups": [
            {**{k: v for k, v in ref_opt.param_groups[0].items() if k != "params"}, "params": list(range(6))}
        ],
        "param_id_map": {i: 0 if i < 4 else 1 for i in range(6)},
        "uncollected_local_ids": [],
    }
    model = _square_net()
    model[2] = FSDP(model[2])
    model = FSDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(model.get_shard_from_optim_state_dict(saved))
    back = model.gather_full_optim_state_dict(opt)
    assert back is not None or dist.get_rank() != 0
    if back is None:
        return {}
    got = {n: back["state"][i]["momentum_buffer"] for i, n in enumerate(back["param_names"])}
    return {
        "wrong": [n for n in order if not torch.allclose(got[n], ref_opt.state[plain[n]]["momentum_buffer"])],
        "tag": float(back["state"][0]["tag"]),
        "keys": sorted(back),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_fairscale_numbering_puts_each_state_on_its_parameter(pool: RankPool) -> None:
    r = pool.run(_fairscale_format)[0]
    assert r["wrong"] == [], "a parameter got another parameter's state"
    assert r["tag"] == 7.0, "fairscale's per-rank 0-dim state becomes this rank's value"
    assert r["keys"] == ["param_groups", "param_id_map", "param_names", "state", "uncollected_local_ids"]


class _WrappedOptimizer:
    """An optimizer wrapper in fairseq's style: param_groups and state_dict(), no ``state``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return {**self.optimizer.state_dict(), "loss_scale": 128.0}


def _wrapper_and_steps() -> dict[str, Any]:
    model = FSDP(_square_net())
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    full = model.gather_full_optim_state_dict(_WrappedOptimizer(opt))  # type: ignore[arg-type]
    net = _square_net()
    plain = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.ones(2, 4)).sum().backward()
    plain.step()
    net[0].weight.grad = torch.ones_like(net[0].weight)
    plain.param_groups[0]["params"] = [net[0].weight]
    plain.step()  # 0.weight has taken two steps, 0.bias one: they share a flat parameter in FSDP
    plain.param_groups[0]["params"] = list(net.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.get_shard_from_optim_state_dict(plain.state_dict())
    return {
        "loss_scale": None if full is None else full.get("loss_scale"),
        "has_state": None if full is None else len(full["state"]),
        "warnings": [str(w.message) for w in caught],
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_optimizer_wrappers_and_differing_scalar_state(pool: RankPool) -> None:
    r0, r1 = pool.run(_wrapper_and_steps)
    assert r0["loss_scale"] == 128.0 and r0["has_state"] == 6, "a wrapper's own keys are kept, its state read"
    assert r1["loss_scale"] is None
    for r in (r0, r1):
        assert any("'step' differs between parameters flattened together" in w for w in r["warnings"]), r
