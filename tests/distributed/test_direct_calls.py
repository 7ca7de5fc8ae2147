"""Calls into a wrapped module that bypass its wrapper gather what they need and train.

See [Note: calls past the wrapper] in fsdp/wrapper/direct_call.py: ``model.module(x)``, a method of the
wrapped module that calls ``self(...)`` or submodules (reached through the wrapper's attribute
forwarding), a submodule called on its own. Each gathers only the units it runs, frees them after,
and hooks its outputs for backward, as the wrapper's own forward does.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import MixedPrecision, ShardingStrategy
from fsdp.api import MemoryState
from tests.parity import handles_with_ref_names, reference_flat, shard_of
from tests.rank_pool import RankPool


class Net(nn.Module):
    """Root-owned layers around a block that gets a wrapper of its own, and methods that call it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8))  # a container of root-owned layers
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(x))))

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """A method that calls the module itself."""
        return self(x).logsumexp(-1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """A method that calls submodules (two root-owned ones and the wrapped block), not ``self``."""
        return self.head(self.body(self.embed(x)) * 2)


def _wrapped(ref: Net, **kw: Any) -> FSDP:
    net = copy.deepcopy(ref)
    net.body = FSDP(net.body, **kw)
    return FSDP(net, **kw)


CALLS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    # ``m`` is the wrapper or the plain reference; attributes reach the wrapped module through the wrapper
    "module": lambda m, x: (m.module if isinstance(m, FSDP) else m)(x),
    "method_calling_self": lambda m, x: m.score(x),
    "method_calling_submodules": lambda m, x: m.features(x),
    "submodules_one_by_one": lambda m, x: m.head(torch.tanh(m.body(m.embed(x)))),
}


def _train_through(call: str, strategy: str) -> dict[str, float]:
    """Train the wrapped model through ``call`` beside the plain model on the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Net()
    model = _wrapped(ref, sharding_strategy=ShardingStrategy[strategy])
    fn = CALLS[call]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    handles = handles_with_ref_names(model)
    diffs = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(3):
        batch = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(step))
        loss = fn(model, batch[4 * rank : 4 * (rank + 1)]).pow(2).mean()
        loss.backward()
        ref_loss = fn(ref, batch).pow(2).mean()
        ref_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        diffs["loss"] = max(diffs["loss"], (total / world - ref_loss).abs().item())
        for h, names in handles:
            expected = reference_flat(ref, names, "grad")
            assert h.flat_param.grad is not None and expected is not None, names
            diffs["grad"] = max(diffs["grad"], (h.flat_param.grad - shard_of(expected, h)).abs().max().item())
        assert all(w.training_state.name == "IDLE" for w in model._wrappers())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for h, names in handles:
        expected = reference_flat(ref, names, "param")
        assert expected is not None
        diffs["param"] = max(
            diffs["param"], (h.flat_param.detach() - shard_of(expected, h)).abs().max().item()
        )
    return diffs


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_calls_past_the_wrapper_train_as_the_plain_model(pool: RankPool, call: str, strategy: str) -> None:
    for diffs in pool.run(_train_through, call, strategy, timeout=120):
        assert max(diffs.values()) < 1e-6, diffs


def _module_call_equals_wrapper_call(mixed: bool) -> list[bool]:
    """Two copies trained side by side, one through ``model(x)``, one through ``model.module(x)``."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = Net()
    kw: dict[str, Any] = {}
    if mixed:
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = [_wrapped(ref, **kw), _wrapped(ref, **kw)]
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    same = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        outs = [models[0](x), models[1].module(x)]
        same.append(
            torch.equal(outs[0], outs[1]) and outs[0].dtype == (torch.bfloat16 if mixed else torch.float32)
        )
        for out, opt in zip(outs, opts):
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    flats = [[p.detach() for p in m.parameters()] for m in models]
    same.append(all(torch.equal(a, b) for a, b in zip(*flats, strict=True)))
    return same


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_the_inner_module_called_directly_trains_bit_for_bit_as_the_wrapper(
    pool: RankPool, mixed: bool
) -> None:
    for same in pool.run(_module_call_equals_wrapper_call, mixed, timeout=120):
        assert all(same), same


def _only_the_units_called_are_gathered() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _wrapped(Net())
    root, body = model, model.module.body
    seen: dict[str, Any] = {}

    def look(module: nn.Module, args: Any, output: Any) -> None:  # runs inside the call
        seen["states"] = [[h.state for h in w.handles] for w in (root, body)]

    model.module.head.register_forward_hook(look)
    model.reset_comm_stats()
    with torch.no_grad():
        out = model.module.head(torch.ones(2, 8))  # the root's unit only; the first call of all (lazy init)
    seen["gathers"] = model.comm_stats()["all_gather"]["calls"]
    with torch.no_grad():
        model.module.embed(torch.ones(2, 6))  # a container: one gather for its call, not one per layer
    seen["container_gathers"] = model.comm_stats()["all_gather"]["calls"] - seen["gathers"]
    seen["after"] = [h.state for w in (root, body) for h in w.handles]
    seen["unsharded"] = model.memory_stats()["unsharded"]
    seen["is_root"] = [root.is_root, body.is_root]
    with torch.no_grad():
        expected = model(torch.ones(2, 6))  # the wrapper's forward still works after
        got = model.module(torch.ones(2, 6))
    seen["equal"] = torch.equal(expected, got) and out.shape == (2, 3)
    try:  # a read outside any call still meets the sharded placeholder
        _ = model.module.head.weight + 1
        seen["read"] = "no error"
    except RuntimeError as e:
        seen["read"] = str(e)
    return seen


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_direct_call_gathers_only_the_units_it_runs_and_frees_them(pool: RankPool) -> None:
    for seen in pool.run(_only_the_units_called_are_gathered, timeout=60):
        assert seen["states"] == [[MemoryState.UNSHARDED], [MemoryState.SHARDED]], seen
        assert seen["gathers"] == 1, seen  # the root's flat parameter, not the block's
        assert seen["container_gathers"] == 1, seen
        assert seen["after"] == [MemoryState.SHARDED, MemoryState.SHARDED] and seen["unsharded"] == 0, seen
        assert seen["is_root"] == [True, False], seen  # the call ran the root's lazy init
        assert seen["equal"], seen
        assert "add() on 'head.weight', which is sharded" in seen["read"], seen


class Recursive(nn.Module):
    """A module that calls itself: only the outermost call ends the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        # (the parameters are used again after the inner call)
        return self.lin(self(y, depth - 1)) + y if depth > 0 else y


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.shape[0] == 3:
            raise ValueError("bad batch")
        return y


def _recursion_and_errors() -> list[Any]:
    torch.manual_seed(0)
    plain = Recursive()
    model = FSDP(copy.deepcopy(plain))
    x = torch.randn(2, 4)
    with torch.no_grad():
        model.module(x)
    results: list[Any] = [model.comm_stats()["all_gather"]["calls"]]  # one gather for the whole recursion
    results.append(torch.allclose(model.module(x), plain(x), atol=1e-6))
    model.module(x).sum().backward()  # backward through the recursive direct call
    plain(x).sum().backward()
    handle = model.handles[0]
    expected = reference_flat(plain, [i.fqn for i in handle.meta.params], "grad")
    assert expected is not None
    results.append(torch.allclose(handle.flat_param.grad, shard_of(expected, handle), atol=1e-6))
    failing = FSDP(Fails())
    try:
        failing.module(torch.ones(3, 4))
    except ValueError as e:
        results.append(str(e))
    results.append([failing.training_state.name, failing.handles[0].state.name, failing._direct_call])
    results.append(failing.module(torch.ones(2, 4)).shape)  # the next call works
    return results


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_module_calling_itself_and_a_call_that_raises(pool: RankPool) -> None:
    for results in pool.run(_recursion_and_errors, timeout=60):
        assert results[:3] == [1, True, True], results
        assert results[3] == "bad batch"
        # nothing left gathered or half-entered; the root keeps its gather, as after any forward with
        # gradients (MemoryState.FULL_KEPT: flat_param.data is the shard)
        assert results[4] == ["IDLE", "FULL_KEPT", None], results
        assert results[5] == (2, 4)


def _forward_inside_summon() -> list[Any]:
    """fairscale's and torch FSDP1's way to generate: a forward inside summon_full_params()."""
    torch.manual_seed(0)
    model = _wrapped(Net())
    x = torch.randn(2, 6)
    with torch.no_grad():
        expected = model(x)
    model.reset_comm_stats()
    with model.summon_full_params(), torch.no_grad():
        inside = [model(x), model.module(x), model.score(x)]
    gathers = model.comm_stats()["all_gather"]["calls"]  # the summon's, none for the forwards
    try:
        with model.summon_full_params():
            model(x)  # gradients enabled: they would reach the shown parameters and be lost
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return [
        torch.equal(inside[0], expected) and torch.equal(inside[1], expected),
        torch.equal(inside[2], expected.logsumexp(-1)),
        gathers,
        refused,
        [w.training_state.name for w in model._wrappers()],
    ]


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_forward_inside_summon_full_params_runs_on_the_full_parameters(pool: RankPool) -> None:
    for r in pool.run(_forward_inside_summon, timeout=60):
        assert r[0] and r[1], r
        assert r[2] == 2, r  # one per wrapper, by the summon
        assert "inside summon_full_params() with gradients enabled" in r[3], r
        assert r[4] == ["IDLE", "IDLE"], r


def _copies_gather_their_own() -> list[bool]:
    """A deep copy's (and an unpickled model's) modules gather the copy's shards, not the original's."""
    torch.manual_seed(0)
    model = _wrapped(Net())
    x = torch.randn(2, 6)
    model(x).sum().backward()
    twin = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    optim.step()  # only the original changes
    with torch.no_grad():
        results = [
            torch.equal(twin.module(x), twin(x)),
            not torch.equal(twin.module(x), model.module(x)),
            torch.equal(twin.module.body.module(torch.ones(1, 8)), twin.module.body(torch.ones(1, 8))),
        ]
        again = pickle.loads(pickle.dumps(model))
        results.append(torch.equal(again.module(x), model(x)))
    return results


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_the_modules_of_a_copy_gather_the_copys_parameters(pool: RankPool) -> None:
    for r in pool.run(_copies_gather_their_own, timeout=60):
        assert all(r), r
