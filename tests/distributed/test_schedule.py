"""Prefetching launches the next unit's all-gather early; profiler ranges name the phases."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import fsdp.core.handle
import fsdp.core.handle_grads
from fsdp import FullyShardedDataParallel as FSDP
from tests.models import CASES, build, wrap
from tests.parity import compare_training
from tests.rank_pool import RankPool


class _Chain(nn.Module):
    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.swap = swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        return self.c(torch.tanh(second(torch.tanh(first(x)))))


def _events(schedule: dict[str, bool]) -> list[list[str]]:
    """The order of all-gather launches, module forwards and gradient reductions, per iteration."""
    torch.manual_seed(0)
    net = _Chain()
    schedule = {**schedule, "bucket_cap_mb": 0}  # one reduce-scatter per unit, visible to the log
    for name in ("a", "b", "c"):
        setattr(net, name, FSDP(getattr(net, name), **schedule))
    model = FSDP(net, **schedule)
    names = {id(h): n for n in ("a", "b", "c") for h in getattr(net, n).handles}
    log: list[str] = []
    real_gather, real_reduce = fsdp.core.handle.all_gather, fsdp.core.handle_grads.reduce_scatter

    def gather(out: torch.Tensor, shard: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        owner = next((n for hid, n in names.items() if _handle(hid)._full is out), "root")
        log.append(f"gather:{owner}")
        return real_gather(out, shard, *args, **kwargs)

    def reduce(out: torch.Tensor, full: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        log.append("reduce")
        return real_reduce(out, full, *args, **kwargs)

    handles = {id(h): h for w in (net.a, net.b, net.c) for h in w.handles}

    def _handle(hid: int) -> Any:
        return handles[hid]

    for n in ("a", "b", "c"):
        getattr(net, n).module.register_forward_hook(lambda m, i, o, n=n: log.append(f"forward:{n}"))
        unit = getattr(net, n)

        def pre_backward(
            grad: torch.Tensor, n: str = n, unit: Any = unit, real: Any = unit._pre_backward_hook
        ) -> Any:
            if not unit._pre_backward_done:
                log.append(f"backward:{n}")  # this unit's backward begins
            return real(grad)

        unit._pre_backward_hook = pre_backward
    fsdp.core.handle.all_gather, fsdp.core.handle_grads.reduce_scatter = gather, reduce
    runs = []
    try:
        for _ in range(2):
            log.clear()
            model(torch.randn(2, 8)).sum().backward()
            runs.append(list(log))
    finally:
        fsdp.core.handle.all_gather, fsdp.core.handle_grads.reduce_scatter = real_gather, real_reduce
    return runs


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_backward_prefetch_gathers_the_next_unit_before_this_one_is_reduced(pool: RankPool) -> None:
    on = pool.run(_events, {})[0][1]
    off = pool.run(_events, {"backward_prefetch": False})[0][1]
    for log in (on, off):
        assert log.count("gather:b") == 2 and log.count("reduce") == 3, log  # the root owns nothing
    # backward runs c, b, a. With prefetch b is gathered before c's gradient is reduced.
    back_on = on[on.index("forward:c") :]
    assert back_on.index("gather:b") < back_on.index("reduce"), back_on
    back_off = off[off.index("forward:c") :]
    assert back_off.index("gather:b") > back_off.index("reduce"), back_off


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_backward_post_gathers_the_next_unit_once_this_one_is_reduced(pool: RankPool) -> None:
    post = pool.run(_events, {"backward_prefetch": fsdp.BackwardPrefetch.BACKWARD_POST})[0][1]
    off = pool.run(_events, {"backward_prefetch": False})[0][1]
    pre = pool.run(_events, {})[0][1]
    for log in (post, off, pre):
        back = log[log.index("backward:c") :]
        assert back.count("reduce") == 3 and back.count("gather:b") == 1, back
        c_reduced, b_gathered, b_starts = (
            back.index("reduce"),
            back.index("gather:b"),
            back.index("backward:b"),
        )
        if log is post:  # after c's reduction, before b's backward begins
            assert c_reduced < b_gathered < b_starts, back
        elif log is off:  # when b's backward begins
            assert c_reduced < b_starts < b_gathered, back
        else:  # BACKWARD_PRE: while c's gradient is computed
            assert b_gathered < c_reduced < b_starts, back


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("forward_prefetch", [True, None])  # None: the default, on for CPU compute
def test_forward_prefetch_gathers_the_next_unit_during_this_ones_forward(
    pool: RankPool, forward_prefetch: bool | None
) -> None:
    kwargs = {} if forward_prefetch is None else {"forward_prefetch": forward_prefetch}
    first, second = pool.run(_events, kwargs)[0]
    # the first iteration records the order; from the second, b's gather precedes a's forward
    assert first.index("gather:b") > first.index("forward:a"), first
    assert second.index("gather:b") < second.index("forward:a"), second


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_forward_prefetch_off_gathers_each_unit_when_it_starts(pool: RankPool) -> None:
    for log in pool.run(_events, {"forward_prefetch": False})[0]:
        assert log.index("gather:b") > log.index("forward:a"), log


def _order_change(kwargs: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = _Chain()
    net = copy.deepcopy(ref)
    for name in ("a", "b", "c"):
        setattr(net, name, FSDP(getattr(net, name), **kwargs))
    model = FSDP(net, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        diffs = []
        for step in range(4):
            ref.swap = net.swap = step >= 2  # units run in another order from the third iteration
            diffs.append(
                compare_training(
                    ref,
                    model,
                    lambda g, n: torch.randn(n, 8, generator=g),
                    lambda y: y.pow(2).mean(),
                    steps=1,
                )
            )
    messages = [str(w.message) for w in caught if "forward prefetch is disabled" in str(w.message)]
    scheduler = model._ctx.scheduler
    return {
        "diff": max(max(d.values()) for d in diffs),
        "warnings": len(messages),
        "on": scheduler.forward,
        "stopped": not scheduler.forward_ok,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_forward_prefetch_falls_back_with_one_warning_when_the_order_changes(pool: RankPool) -> None:
    for r in pool.run(_order_change, {"forward_prefetch": True}):
        assert r["diff"] <= 1e-5 and r["warnings"] == 1 and r["on"] and r["stopped"], r


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_default_forward_prefetch_falls_back_silently(pool: RankPool) -> None:
    for r in pool.run(_order_change, {}):
        assert r["diff"] <= 1e-5 and r["warnings"] == 0 and r["on"] and r["stopped"], r


def _profiled() -> list[str]:
    model = wrap(build("nested"), CASES["nested"].wrap)
    x = torch.randn(4, 6)
    model(x).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("FSDP::")})


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_profiler_ranges_name_every_phase(pool: RankPool) -> None:
    names = pool.run(_profiled)[0]
    for phase in ("forward", "all_gather", "pre_backward", "post_backward", "finalize_backward"):
        assert f"FSDP::{phase}" in names, names


def _parity(schedule: dict[str, bool], case: str) -> float:
    spec = CASES[case]
    ref = build(case)
    model = wrap(copy.deepcopy(ref), spec.wrap, **schedule)
    return max(compare_training(ref, model, spec.make_input, spec.loss, steps=3).values())


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize(
    "schedule",
    [
        {"forward_prefetch": True},
        {"backward_prefetch": False},
        {"backward_prefetch": fsdp.BackwardPrefetch.BACKWARD_POST},
        {"limit_all_gathers": False},
    ],
    ids=lambda s: "_".join(f"{k}={getattr(v, 'name', v)}" for k, v in s.items()),
)
@pytest.mark.parametrize("case", ["nested", "called_twice", "structured_outputs"])
def test_parity_with_every_schedule(pool: RankPool, schedule: dict[str, Any], case: str) -> None:
    assert max(pool.run(_parity, schedule, case)) <= 1e-5


def _early_finish_order() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    net = copy.deepcopy(ref)
    net[0], net[2] = FSDP(net[0], bucket_cap_mb=0), FSDP(net[2], bucket_cap_mb=0)
    model = FSDP(net, bucket_cap_mb=0)
    (first,), (last,) = net[0].handles, net[2].handles
    log: list[str] = []
    real_finalize, real_reduce = last.finalize_gradient, first.reduce_grad

    def finalize(asynchronous: bool = False) -> None:
        if last.reduction_pending:  # the end-of-backward callback calls it again, with nothing to do
            log.append("finalize:last")
        real_finalize(asynchronous)

    def reduce(*args: Any, **kwargs: Any) -> None:
        log.append("reduce:first")
        real_reduce(*args, **kwargs)

    last.finalize_gradient, first.reduce_grad = finalize, reduce  # type: ignore[method-assign]
    diffs = compare_training(
        ref, model, lambda g, n: torch.randn(n, 8, generator=g), lambda y: y.pow(2).mean(), steps=2
    )
    return {"log": log, "diff": max(diffs.values())}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_reductions_finish_during_the_next_units_backward(pool: RankPool) -> None:
    # the last unit's reduction is sent at its post-backward; the hook on the first unit's split
    # backward finishes it before the first unit builds (and reduces) its own flat gradient. Without
    # the hook it would be finished after, in the first unit's post-backward hook.
    for r in pool.run(_early_finish_order):
        assert r["diff"] <= 1e-5, r
        assert r["log"] == ["finalize:last", "reduce:first"] * 2, r["log"]


class _MaybeShort(nn.Module):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.a = FSDP(nn.Linear(8, 8), **kwargs)
        self.b = FSDP(nn.Linear(8, 8), **kwargs)
        self.short = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        return x if self.short else self.b(x)


def _skipped_unit(grad_enabled: bool) -> dict[str, Any]:
    # forward prefetch gathers b (in bf16) while a runs; a forward that then skips b leaves that
    # gather unused. It must not leak into the state dict, nor stay allocated after an eval forward.
    kwargs: dict[str, Any] = {
        "mixed_precision": True,
        "compute_dtype": torch.bfloat16,
        "forward_prefetch": True,
    }
    torch.manual_seed(0)
    net = _MaybeShort(**kwargs)
    model = FSDP(net, **kwargs)
    model(torch.randn(2, 8)).float().sum().backward()
    before = model.state_dict()  # no optimizer step: the parameters do not change below
    net.short = True
    with torch.set_grad_enabled(grad_enabled):
        model(torch.randn(2, 8))
    dangling = net.b.handles[0].prefetched
    after = model.state_dict()
    return {
        "dangling_after_forward": dangling,
        "dtypes": sorted({str(v.dtype) for v in after.values()}),
        "unchanged": all(torch.equal(after[k], v) for k, v in before.items()),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("grad_enabled", [False, True], ids=["eval", "train"])
def test_a_prefetched_unit_that_is_skipped_leaves_no_trace(pool: RankPool, grad_enabled: bool) -> None:
    for r in pool.run(_skipped_unit, grad_enabled):
        assert r["dtypes"] == ["torch.float32"] and r["unchanged"], r
        # an eval forward frees it at the root's end; after a training forward the next use takes it
        assert r["dangling_after_forward"] is grad_enabled, r


def _memory(options: dict[str, Any]) -> dict[str, Any]:
    """memory_stats() before, inside and after steps of three 16x16 units under a root."""
    torch.manual_seed(0)
    net = nn.Sequential(*[FSDP(nn.Linear(16, 16), **options) for _ in range(3)], nn.Linear(16, 2))
    model = FSDP(net, **options)
    seen: dict[str, Any] = {"before": model.memory_stats()}
    inside: list[int] = []
    net[1].module.register_forward_hook(lambda *_: inside.append(model.memory_stats()["unsharded"]))
    x = torch.randn(4, 16)
    for i in range(2):
        model(x).sum().backward()
        seen[f"step{i}"] = model.memory_stats()
        model.reset_memory_stats()
    seen["reset"] = model.memory_stats()
    with model.summon_full_params():
        seen["summon"] = model.memory_stats()
    seen["inside_forward"] = inside
    return seen


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_memory_stats_count_the_unsharded_buffers(pool: RankPool) -> None:
    unit, root = 16 * 17 * 4, 2 * 17 * 4  # fp32 bytes of a 16x16 unit and of the root's 16x2 layer
    full = 3 * unit + root
    for r in pool.run(_memory, {}):
        before = r["before"]
        assert before == {
            "sharded_params": full // 2,
            "sharded_grads": 0,
            "full_params": full,
            "largest_unit": unit,
            "unsharded": 0,
            "unsharded_peak": 0,
        }
        # the root keeps its parameters through the forward; at most two inner units are gathered at
        # once (the one computing and the prefetched next one), then all are freed. The first forward
        # prefetches nothing (no order known yet), and backward frees the root's parameters once its
        # layer's backward used them, before the units' (See [Note: releasing kept full parameters])
        assert r["step0"]["unsharded_peak"] == 2 * unit, r["step0"]
        assert r["step1"]["unsharded_peak"] == root + 2 * unit, r["step1"]
        for step in ("step0", "step1"):
            assert r[step]["unsharded"] == 0 and r[step]["sharded_grads"] == full // 2, r[step]
        assert r["reset"]["unsharded_peak"] == 0, "the peak starts over from the current value"
        assert r["summon"]["unsharded"] == full, "summon gathers every unit in full precision"
        assert all(root + unit <= b <= root + 2 * unit for b in r["inside_forward"]), r["inside_forward"]
    for r in pool.run(_memory, {"reshard_after_forward": False}):
        assert r["step0"]["unsharded_peak"] == full, (
            "without resharding every unit stays gathered until backward"
        )
        assert r["inside_forward"] == [root + 2 * unit, root + 3 * unit], "the earlier units are kept"
    for r in pool.run(_memory, {"reshard_after_forward": False, "mixed_precision": True}):
        assert r["before"]["full_params"] == full // 2, "the compute-dtype full parameters are bf16"
        assert full // 2 <= r["step0"]["unsharded_peak"] < full, r["step0"]
        assert r["summon"]["unsharded"] == full, "summon gathers the fp32 masters"


def _limiter_events(mixed: bool) -> dict[str, Any]:
    """CUDA's events simulated at world size 2: each free of a gathered unit records one, and a gather
    waits on the second-to-last free; the limiter keeps no older events."""
    from fsdp.common.device import DeviceHandle

    recorded: list[int] = []
    waits: list[tuple[int, int]] = []  # (the event waited on, the newest event at that moment)
    real = DeviceHandle.record_event, DeviceHandle.synchronize_event

    def record_event(self: DeviceHandle, stream: object) -> int:
        recorded.append(len(recorded))
        return recorded[-1]

    DeviceHandle.record_event = record_event  # type: ignore[method-assign, assignment]
    DeviceHandle.synchronize_event = lambda self, event: waits.append((event, recorded[-1]))  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        kwargs = {"mixed_precision": True, "compute_dtype": torch.bfloat16} if mixed else {}
        model = FSDP(nn.Sequential(*[FSDP(nn.Linear(8, 8), **kwargs) for _ in range(4)]), **kwargs)
        for _ in range(3):
            model(torch.randn(2, 8)).float().sum().backward()
        left = len(model._ctx.scheduler._free_events)
    finally:
        DeviceHandle.record_event, DeviceHandle.synchronize_event = real  # type: ignore[method-assign]
    return {"recorded": len(recorded), "waits": waits, "left": left}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("mixed", [False, True])
def test_the_gather_limiter_waits_on_the_second_to_last_free(pool: RankPool, mixed: bool) -> None:
    for r in pool.run(_limiter_events, mixed):
        # the 4 inner units free after forward and after backward (the root owns no parameters), 3 times
        assert r["recorded"] == 3 * (4 + 4)
        assert r["waits"], "gathers wait on earlier frees"
        assert all(newest - event == 1 for event, newest in r["waits"]), r["waits"]
        assert r["left"] <= 2
