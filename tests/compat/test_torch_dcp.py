"""``torch.distributed.checkpoint.state_dict``'s functions and this library's models.

torch's ``get_state_dict(model, optim)`` recognizes only torch's own wrappers, and given this
library's model would key the optimizer state by internal flat-parameter names with this world
size's shards: it is refused with an error naming ``fsdp.dcp_state``, whose functions take the same
arguments and give the state keyed by parameter name, the same as ``model.sharded_optim_state_dict``,
which DCP reshards: saved at 2 ranks, loaded at 3 (torch's ``test_distributed_checkpoint.py`` flow).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_dcp_state
from torch.distributed.tensor import DTensor

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import dcp_state
from fsdp.wrap import ModuleWrapPolicy
from tests.rank_pool import RankPool


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def _model(plain_root: bool) -> nn.Module:
    """A wrapper with a block policy, or torch's non-FSDP root: a plain module holding wrapped blocks."""
    if plain_root:
        net = Net()
        for i, block in enumerate(net.blocks):
            net.blocks[i] = FSDP(block)
        return net
    return FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}))


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    # the same batch on every rank: a plain root's own parameters get no synchronized gradient, so
    # only equal inputs keep them equal across ranks (as torch's non-FSDP root needs too)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(4, 5, generator=g)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def _dense(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _torch_refuses(plain_root: bool) -> dict[str, str]:
    model = _model(plain_root)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optim, 1)
    out = {}
    for name, call in {
        "get_state_dict": lambda: torch_dcp_state.get_state_dict(model, optim),
        "get_optimizer_state_dict": lambda: torch_dcp_state.get_optimizer_state_dict(model, optim),
        "set_optimizer_state_dict": lambda: torch_dcp_state.set_optimizer_state_dict(model, optim, {}),
    }.items():
        try:
            call()
            out[name] = "no error"
        except NotImplementedError as e:
            out[name] = str(e)
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("plain_root", [False, True])
def test_torchs_functions_refuse_the_optimizer_state(pool: RankPool, plain_root: bool) -> None:
    for r in pool.run(_torch_refuses, plain_root):
        for message in r.values():
            assert "fsdp.dcp_state" in message and "internal flat-parameter names" in message, r


def _same_as_sharded(plain_root: bool) -> dict[str, Any]:
    model = _model(plain_root)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optim, 2)
    model_sd, optim_sd = dcp_state.get_state_dict(model, optim)
    ours = FSDP.sharded_optim_state_dict(model, optim)
    same_state = optim_sd["state"].keys() == ours["state"].keys() and all(
        torch.equal(_dense(v), _dense(ours["state"][n][k]))
        for n, e in optim_sd["state"].items()
        for k, v in e.items()
    )
    return {
        "model_keys": sorted(model_sd) == sorted(Net().state_dict()),
        "optim_keys": sorted(optim_sd["state"]) == sorted(n for n, _ in Net().named_parameters()),
        "groups": optim_sd["param_groups"] == ours["param_groups"],
        "same_state": same_state,
        "sharded": any(isinstance(v, DTensor) for e in optim_sd["state"].values() for v in e.values()),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("plain_root", [False, True])
def test_fsdp_dcp_state_gives_the_name_keyed_sharded_state(pool: RankPool, plain_root: bool) -> None:
    for r in pool.run(_same_as_sharded, plain_root):
        assert all(r.values()), r


def _save(path: str, plain_root: bool) -> None:
    model = _model(plain_root)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optim, 3)
    model_sd, optim_sd = dcp_state.get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    full_model = dcp_state.get_model_state_dict(
        model, options=torch_dcp_state.StateDictOptions(full_state_dict=True)
    )
    full_optim = FSDP.full_optim_state_dict(model, optim)
    if dist.get_rank() == 0:
        torch.save({"model": full_model, "optim": full_optim}, os.path.join(path, "expected.pt"))


def _load(path: str, plain_root: bool) -> dict[str, float]:
    model = _model(plain_root)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model_sd, optim_sd = dcp_state.get_state_dict(
        model, optim
    )  # the template: every entry, this world size's
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dcp_state.set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    expected = torch.load(os.path.join(path, "expected.pt"), weights_only=False)
    got_model = dcp_state.get_model_state_dict(
        model, options=torch_dcp_state.StateDictOptions(full_state_dict=True)
    )
    got_optim = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    return {
        "model": max((got_model[k] - v).abs().max().item() for k, v in expected["model"].items()),
        "optim": max(
            (torch.as_tensor(got_optim["state"][n][k]) - torch.as_tensor(v)).abs().max().item()
            for n, e in expected["optim"]["state"].items()
            for k, v in e.items()
        ),
        "names": float(got_optim["state"].keys() != expected["optim"]["state"].keys()),
    }


@pytest.mark.parametrize("plain_root", [False, True])
def test_saved_at_two_ranks_loads_at_three(rank_pools: Any, tmp_path: Path, plain_root: bool) -> None:
    path = str(tmp_path / "ckpt")
    rank_pools(2).run(_save, path, plain_root)
    for r in rank_pools(3).run(_load, path, plain_root):
        assert r == {"model": 0.0, "optim": 0.0, "names": 0.0}, r


def _full_and_two_optimizers() -> dict[str, Any]:
    """``full_state_dict=True, cpu_offload=True``: full tensors on rank 0 alone, on the CPU; and two
    optimizers over parts of the model, merged on save and split on load."""
    model = _model(plain_root=False)
    inner = [p for n, p in model.named_parameters() if "blocks" in n]
    outer = [p for n, p in model.named_parameters() if "blocks" not in n]
    optims = [torch.optim.Adam(inner, lr=0.01), torch.optim.SGD(outer, lr=0.1, momentum=0.9)]
    for step in range(2):
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(step))).sum().backward()
        for o in optims:
            o.step()
            o.zero_grad()
    options = torch_dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_model, full_optim = dcp_state.get_state_dict(model, optims, options=options)
    sharded_model, sharded_optim = dcp_state.get_state_dict(model, optims)
    before = [{id(p): {k: v.clone() for k, v in s.items()} for p, s in o.state.items()} for o in optims]
    for o in optims:
        o.state.clear()
    dcp_state.set_state_dict(model, optims, model_state_dict=sharded_model, optim_state_dict=sharded_optim)
    restored = all(
        torch.equal(b[id(p)][k], o.state[p][k])
        for b, o in zip(before, optims)
        for p in o.state
        for k in b[id(p)]
    )
    return {
        "rank": dist.get_rank(),
        "full_model": {k: (tuple(v.shape), v.device.type) for k, v in full_model.items()},
        "full_optim_names": sorted(full_optim.get("state", {})),
        "groups": [len(g["params"]) for g in sharded_optim["param_groups"]],
        "restored": restored,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_full_options_and_several_optimizers(pool: RankPool) -> None:
    for r in pool.run(_full_and_two_optimizers):
        assert r["restored"] and r["groups"] == [4, 4]
        if r["rank"] == 0:
            assert r["full_model"]["blocks.0.fc.weight"] == ((6, 6), "cpu")
            assert len(r["full_optim_names"]) == 8
        else:
            assert r["full_model"] == {} and r["full_optim_names"] == []


def _state_of_a_fresh_optimizer(which: str) -> dict[str, Any]:
    """torch initialises an optimizer that never stepped with a step at learning rate 0, then puts the
    learning rate back; ours must put it back too, or the training that follows silently stops."""
    model = _model(plain_root=False)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    if which == "get_state_dict":
        dcp_state.get_state_dict(model, optim)
    else:
        dcp_state.get_optimizer_state_dict(model, optim)
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, optim, 1)
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    return {"lr": [g["lr"] for g in optim.param_groups], "moved": moved}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("which", ["get_state_dict", "get_optimizer_state_dict"])
def test_getting_the_state_of_a_fresh_optimizer_keeps_its_learning_rate(pool: RankPool, which: str) -> None:
    for r in pool.run(_state_of_a_fresh_optimizer, which):
        assert r == {"lr": [0.05], "moved": True}, r
