"""A handle's gradient state through real steps, on the paths that need more than one rank or a
copier: reduce-scatter, NO_SHARD's bucket engine, the offloaded shard's host copy, and a backward
that raises before its end. See [Note: gradient state] in fsdp/core/handle.py."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy, TrainingState
from fsdp.common.device import DeviceHandle, SideCopies
from fsdp.core.handle import FlatParamHandle, GradState
from tests.rank_pool import RankPool


def _record(handles: list[FlatParamHandle]) -> list[list[str]]:
    """Each handle's gradient-state changes, as "OLD>NEW", recorded where they are made."""
    seen: list[list[str]] = [[] for _ in handles]
    for h, log in zip(handles, seen, strict=True):
        real = h._set_grad_state

        def record(
            state: GradState, _h: FlatParamHandle = h, _log: list[str] = log, _real: Any = real
        ) -> None:
            _log.append(f"{_h.grad_state.name}>{state.name}")
            _real(state)

        h._set_grad_state = record  # type: ignore[method-assign]
    return seen


def _states_of_two_steps(kind: str) -> list[list[str]]:
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {}
    if kind == "no_shard":
        kwargs = {"sharding_strategy": ShardingStrategy.NO_SHARD}
    elif kind == "host_copies":
        kwargs = {"mixed_precision": True, "compute_dtype": torch.bfloat16}
    model = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4), **kwargs), nn.Linear(4, 2)), **kwargs)
    handles = [h for w in model.modules() if isinstance(w, FSDP) for h in w.handles]
    if kind == "host_copies":  # what CPU offload on CUDA uses; on the CPU its streams are no-ops
        for h in handles:
            h.copies = SideCopies(DeviceHandle(torch.device("cpu")))
    seen = _record(handles)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        assert all(h.grad_state is GradState.IDLE and h.flat_param.grad is not None for h in handles)
    return seen


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    ("kind", "step"),
    [
        ("full_shard", ["IDLE>REDUCING", "REDUCING>REDUCED", "REDUCED>IDLE"]),
        ("no_shard", ["IDLE>BUCKETED", "BUCKETED>REDUCED", "REDUCED>IDLE"]),
        ("host_copies", ["IDLE>REDUCING", "REDUCING>COPYING", "COPYING>REDUCED", "REDUCED>IDLE"]),
    ],
)
def test_each_reduction_path_follows_the_grad_table(pool: RankPool, kind: str, step: list[str]) -> None:
    for per_handle in pool.run(_states_of_two_steps, kind):
        assert per_handle == [step * 2, step * 2], per_handle


class _TwoUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # full parameters kept from forward: the backward gathers nothing, so a rank may skip a unit
        self.a = FSDP(nn.Linear(4, 4), reshard_after_forward=False)
        self.b = FSDP(nn.Linear(4, 4), reshard_after_forward=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _disagreeing_backward() -> dict[str, Any]:
    torch.manual_seed(0)
    root = FSDP(_TwoUnits())
    wrappers = [w for w in root.modules() if isinstance(w, FSDP)]
    handles = [h for w in wrappers for h in w.handles]
    seen = _record(handles)
    ya, yb = root(torch.randn(2, 4))
    # rank 1 leaves unit `a` out of its loss: rank 0 sends a reduction that the end-of-backward
    # check then refuses, before waiting for anything it left in flight
    loss = (ya.sum() if dist.get_rank() == 0 else 0) + yb.sum()
    with pytest.raises(RuntimeError, match="ranks disagree"):
        loss.backward()
    return {
        "changes": [change for log in seen for change in log],
        "grad_states": {h.grad_state.name for h in handles},
        "left_in_flight": any(h._pending is not None for h in handles),
        "training_states": {w.training_state.name for w in wrappers},
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_backward_that_raises_before_its_end_leaves_every_state_idle(pool: RankPool) -> None:
    try:
        results = pool.run(_disagreeing_backward, timeout=60)
    finally:
        pool.close()  # a reduce-scatter was left unmatched: start the next test on fresh ranks
    for r in results:
        assert "REDUCING>IDLE" in r["changes"], r  # a reduction still in flight was dropped
        assert r["grad_states"] == {"IDLE"} and not r["left_in_flight"], r
        assert r["training_states"] == {TrainingState.IDLE.name}, r


# ---------------------------------------------------------------------- a backward that raised
def _aborted_backward(where: str, strategy: str, accumulate: bool = False) -> dict[str, Any]:
    """A backward that a tensor hook stops (as a caught out-of-memory error in backward would): after
    zero_grad() the next steps train exactly as if that step had not happened; with ``accumulate``,
    the stopped backward is inside ``no_sync()``, after one that finished there."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        kwargs = {"sharding_strategy": ShardingStrategy[strategy]}
        m[0] = FSDP(m[0], **kwargs)
        m[2] = FSDP(m[2], **kwargs)
        model = FSDP(m, **kwargs)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    rank = dist.get_rank()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    failed, opt = build()
    stop = {}

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("stopped in backward")

    window = failed.no_sync() if accumulate else contextlib.nullcontext()
    with window:
        if accumulate:
            failed(x).sum().backward()
        hidden = failed.module[1](failed.module[0](x))  # (the first unit's output: its backward comes last)
        out = failed.module[4](failed.module[3](failed.module[2](hidden)))
        (out if where == "output" else hidden).register_hook(boom)
        try:
            out.sum().backward()
        except ValueError as e:
            stop["error"] = str(e)
    opt.zero_grad()
    reference, ref_opt = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for model, optim in ((failed, opt), (reference, ref_opt)):
            for _ in range(2):
                model(x).sum().backward()
                optim.step()
                optim.zero_grad()
    return {
        "stopped": stop.get("error", ""),
        "warned": any("the previous backward did not finish" in str(w.message) for w in caught),
        "same": all(
            torch.equal(a, b) for a, b in zip(failed.state_dict().values(), reference.state_dict().values())
        ),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("where", ["output", "between units"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["", "no_sync"])
def test_training_goes_on_exactly_after_a_backward_that_raised(
    pool: RankPool, where: str, strategy: str, accumulate: bool
) -> None:
    for r in pool.run(_aborted_backward, where, strategy, accumulate):
        assert r["stopped"] == "stopped in backward"
        assert r["warned"] and r["same"], r
