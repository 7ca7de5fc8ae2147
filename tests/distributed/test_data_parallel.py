"""fsdp.DistributedDataParallel: parity with torch DDP and a local reference for every option, real
overlap, one bucket layout on every rank, unused and frozen parameters, dtypes, no_sync."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fsdp.comm.collectives
from fsdp import DistributedDataParallel as DDP
from fsdp import FullyShardedDataParallel as FSDP
from fsdp.comm.buckets import MissingGradientError
from fsdp.comm.collectives import CollectiveKind
from tests.rank_pool import RankPool

PER_RANK = 2  # samples per rank per step


class Net(nn.Module):
    """Two parallel branches (their backward order follows the order they ran), then c and a head."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(6, 8)
        self.c = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.extra = nn.Linear(3, 3) if extra else None  # never used in forward

    def forward(self, x: torch.Tensor, swap: bool = False, use_c: bool = True) -> torch.Tensor:
        if swap:  # b runs first, so its gradients become ready last
            yb = self.b(x)
            ya = self.a(x)
        else:
            ya = self.a(x)
            yb = self.b(x)
        h = torch.relu(ya + yb)
        if use_c:
            h = torch.relu(self.c(h))
        return self.head(h)


def _net(seed: int = 0, **kw: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def _global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(PER_RANK * dist.get_world_size(), 6, generator=g)


def _mine(batch: torch.Tensor) -> torch.Tensor:
    r = dist.get_rank()
    return batch[r * PER_RANK : (r + 1) * PER_RANK]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _max_diff(xs: list[torch.Tensor | None], ys: list[torch.Tensor | None], scale: float = 1.0) -> float:
    worst = 0.0
    for x, y in zip(xs, ys):
        assert (x is None) == (y is None), "gradient presence differs"
        if x is not None and y is not None:
            worst = max(worst, (x.float() - scale * y.float()).abs().max().item())
    return worst


def _grads(m: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in m.parameters()]


def _expect(exc: type[BaseException], fn: Callable[..., Any], *args: Any, **kw: Any) -> str:
    try:
        fn(*args, **kw)
    except exc as e:
        return str(e)
    raise AssertionError(f"{exc.__name__} was not raised")


# ---- parity, one configuration per apex option --------------------------------------------------


def _parity(options: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    """Train ours beside torch DDP (same slices) and a local model (whole batch); largest differences.

    Gradients are compared after every backward; ours are then divided by the expected factor
    (world size without averaging, ...) so that the three models keep identical parameters.
    """
    world = dist.get_world_size()
    opts = dict(options)
    ref = _net()
    torch_ddp = TorchDDP(copy.deepcopy(ref))
    inner = copy.deepcopy(ref)
    if "triggers" in opts:
        opts["allreduce_trigger_params"] = [inner.get_parameter(n) for n in opts.pop("triggers")]
    ours = DDP(inner, **opts)
    factor = 1.0
    if not opts.get("gradient_average", True):
        factor = world / opts.get("gradient_predivide_factor", 1.0)
    models = (ours, torch_ddp, ref)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    out: dict[str, Any] = {"vs_torch": 0.0, "vs_ref": 0.0, "param": 0.0, "calls": []}
    for step in range(steps):
        batch = _global_batch(step)
        before = ours.comm_stats.calls.get(CollectiveKind.ALL_REDUCE, 0)
        _loss(ours(_mine(batch))).backward()
        out["calls"].append(ours.comm_stats.calls.get(CollectiveKind.ALL_REDUCE, 0) - before)
        _loss(torch_ddp(_mine(batch))).backward()
        _loss(ref(batch)).backward()
        out["vs_torch"] = max(out["vs_torch"], _max_diff(_grads(ours), _grads(torch_ddp), factor))
        out["vs_ref"] = max(out["vs_ref"], _max_diff(_grads(ours), _grads(ref), factor))
        if opts.get("retain_allreduce_buffers"):
            buffers = ours.allreduce_buffers
            for p in ours.parameters():
                assert p.grad is not None
                assert any(
                    p.grad.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers
                ), "with retain_allreduce_buffers every gradient is a view of a retained buffer"
        for p in ours.parameters():
            assert p.grad is not None
            p.grad.div_(factor)
        for opt in optims:
            opt.step()
            opt.zero_grad()
    for p, q in zip(ours.parameters(), ref.parameters()):
        out["param"] = max(out["param"], (p - q).abs().max().item())
    out["layout"] = ours.bucket_layout
    return out


CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "small_buckets": {"message_size": 40},
    "delay_allreduce": {"delay_allreduce": True, "message_size": 40},
    "triggers": {"triggers": ["c.weight", "b.bias"]},
    "retain_buffers": {"retain_allreduce_buffers": True, "message_size": 100},
    "no_average": {"gradient_average": False, "message_size": 100},
    "predivide_no_average": {"gradient_average": False, "gradient_predivide_factor": 2.0},
    "predivide_average": {"gradient_predivide_factor": 4.0, "message_size": 100},
    "streams": {"num_allreduce_streams": 2, "message_size": 100},
    "always_fp32_on_fp32": {"allreduce_always_fp32": True},
}


def _parity_all() -> dict[str, dict[str, Any]]:
    return {name: _parity(cfg) for name, cfg in CONFIGS.items()}


@pytest.mark.parametrize("pool", [2, 3, 4], indirect=True)
def test_parity_with_torch_ddp_and_local_for_each_option(pool: RankPool) -> None:
    results = pool.run(_parity_all)
    for rank_result in results:
        for name, r in rank_result.items():
            assert r["vs_torch"] < 1e-5, (name, r)
            assert r["vs_ref"] < 1e-5, (name, r)
            assert r["param"] < 1e-5, (name, r)
    r0 = results[0]
    assert all(r["layout"] == results[-1][name]["layout"] for name, r in r0.items())
    # Net has 8 tensors, 163 elements: the default message size makes one bucket
    assert len(r0["default"]["layout"]) == 1 and r0["default"]["calls"] == [1] * 4
    small = r0["small_buckets"]
    assert len(small["layout"]) > 2, "message_size=40 must split the gradients into several buckets"
    assert small["calls"] == [len(small["layout"])] * 4, "one all-reduce per bucket and step"
    assert r0["delay_allreduce"]["layout"] is not None and len(r0["delay_allreduce"]["layout"]) == 1
    assert r0["delay_allreduce"]["calls"] == [1] * 4, "delay_allreduce: one flat all-reduce per dtype"
    triggers = r0["triggers"]["layout"]
    # a bucket closes exactly at a trigger parameter (message_size is ignored); the rest is one bucket
    assert (
        len(triggers) == 3
        and triggers[0][-1] in ("c.weight", "b.bias")
        and triggers[1][-1]
        in (
            "c.weight",
            "b.bias",
        )
    )
    assert "c.weight" not in triggers[2] and "b.bias" not in triggers[2]


# ---- overlap: a bucket is launched while backward is still computing gradients -------------------


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _launch_order(delay: bool) -> list[list[str]]:
    """Per iteration, the sequence of 'hook' (a gradient became ready) and 'launch' events."""
    torch.manual_seed(0)
    ddp = DDP(Deep(), message_size=200, delay_allreduce=delay)  # one layer (272 elements) per bucket
    events: list[str] = []
    for p in ddp.parameters():  # registered after the wrapper's hooks: these run after them
        p.register_post_accumulate_grad_hook(lambda p: events.append("hook"))
    original = fsdp.comm.collectives.all_reduce

    def recording(*args: Any, **kw: Any) -> Any:
        events.append("launch")
        return original(*args, **kw)

    fsdp.comm.collectives.all_reduce = recording
    try:
        per_iteration = []
        for _ in range(3):
            events.clear()
            ddp(torch.randn(4, 16)).sum().backward()
            per_iteration.append(list(events))
    finally:
        fsdp.comm.collectives.all_reduce = original
    return per_iteration


def _overlap() -> dict[str, list[list[str]]]:
    return {"overlap": _launch_order(delay=False), "delay": _launch_order(delay=True)}


@pytest.mark.parametrize("pool", [2, 3, 4], indirect=True)
def test_first_bucket_launches_before_the_last_gradient(pool: RankPool) -> None:
    for r in pool.run(_overlap):
        first, *later = r["overlap"]
        last_hook = len(first) - 1 - first[::-1].index("hook")
        assert first.index("launch") > last_hook, "the first backward learns the buckets: no overlap yet"
        for events in later:
            last_hook = len(events) - 1 - events[::-1].index("hook")
            assert events.index("launch") < last_hook, f"no overlap from iteration 2: {events}"
            assert events.count("launch") == 6
        for events in r["delay"]:
            last_hook = len(events) - 1 - events[::-1].index("hook")
            assert events.index("launch") > last_hook and events.count("launch") == 1


# ---- one layout everywhere, even when ranks see gradients in different orders ------------------------


def _different_orders() -> dict[str, Any]:
    swap = dist.get_rank() % 2 == 1  # odd ranks run branch b first: a different gradient-ready order
    ref = _net()
    ours = DDP(copy.deepcopy(ref), message_size=1)  # one parameter per bucket: the layout is the order
    names = {id(p): n for n, p in ours.module.named_parameters()}
    order: list[str] = []
    for p in ours.parameters():
        p.register_post_accumulate_grad_hook(lambda p: order.append(names[id(p)]))
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    worst, orders = 0.0, []
    for step in range(4):
        order.clear()
        batch = _global_batch(step)
        _loss(ours(_mine(batch), swap=swap)).backward()
        _loss(ref(batch)).backward()
        orders.append(list(order))
        worst = max(worst, _max_diff(_grads(ours), _grads(ref)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return {"layout": ours.bucket_layout, "orders": orders, "grad_diff": worst}


@pytest.mark.parametrize("pool", [2, 3, 4], indirect=True)
def test_layout_is_rank_zeros_even_when_orders_differ(pool: RankPool) -> None:
    results = pool.run(_different_orders)
    assert results[0]["orders"][0] != results[1]["orders"][0], "precondition: rank 1's order differs"
    layout = results[0]["layout"]
    assert [n for (n,) in layout] == results[0]["orders"][0], "rank 0's ready order is the layout"
    for r in results:
        assert r["layout"] == layout
        assert r["grad_diff"] < 1e-5, "buckets completed out of order must still pair up correctly"


# ---- parameters without a gradient; changes of the trainable set -----------------------------------


def _unused() -> dict[str, str]:
    rank = dist.get_rank()
    out: dict[str, str] = {}
    # a parameter that never takes part: the first (learning) backward already names it
    ddp = DDP(_net(extra=True))
    out["never"] = _expect(MissingGradientError, lambda: _loss(ddp(torch.randn(2, 6))).backward())
    # steady state: c is skipped in the third step on rank 1 only; every rank raises, none hangs
    ddp = DDP(_net(), message_size=30)
    for _ in range(2):
        _loss(ddp(torch.randn(2, 6))).backward()
    out["rank1_only"] = _expect(
        MissingGradientError, lambda: _loss(ddp(torch.randn(2, 6), use_c=rank != 1)).backward()
    )
    # the wrapper is still usable: the next full step reduces normally and ranks agree
    ddp.zero_grad()
    _loss(ddp(torch.randn(2, 6))).backward()
    g = torch.cat([p.grad.reshape(-1) for p in ddp.parameters() if p.grad is not None])
    everyone = [torch.empty_like(g) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, g)
    out["agree_after"] = str(all(torch.equal(e, everyone[0]) for e in everyone))
    # a backward that raises part-way (after some buckets were launched): the next forward warns,
    # waits for what was launched, and the step after reduces normally
    ddp.zero_grad()

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    def arm(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        output.register_hook(fail)

    handle = ddp.module.a.register_forward_hook(arm)
    launched = ddp.comm_stats.calls.get(CollectiveKind.ALL_REDUCE, 0)
    out["boom"] = _expect(ValueError, lambda: _loss(ddp(torch.randn(2, 6))).backward())
    out["launched_before_boom"] = str(ddp.comm_stats.calls.get(CollectiveKind.ALL_REDUCE, 0) - launched)
    handle.remove()
    ddp.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = _loss(ddp(torch.randn(2, 6)))
    loss.backward()
    out["abort_warning"] = " ".join(str(w.message) for w in caught)
    g = torch.cat([p.grad.reshape(-1) for p in ddp.parameters() if p.grad is not None])
    dist.all_gather(everyone, g)
    out["agree_after_abort"] = str(all(torch.equal(e, everyone[0]) for e in everyone))
    return out


@pytest.mark.parametrize("pool", [2, 3, 4], indirect=True)
def test_parameters_without_gradient_raise_on_every_rank(pool: RankPool) -> None:
    for rank, r in enumerate(pool.run(_unused)):
        assert (
            "extra.weight" in r["never"]
            and "extra.bias" in r["never"]
            and "requires_grad_(False)" in r["never"]
        )
        if rank == 1:
            assert "on this rank: c." in r["rank1_only"] and "c.weight" in r["rank1_only"]
        else:
            assert "none on this rank" in r["rank1_only"]
        assert r["agree_after"] == "True"
        assert r["boom"] == "boom" and int(r["launched_before_boom"]) >= 1
        assert "did not finish" in r["abort_warning"] and r["agree_after_abort"] == "True"


def _trainable_changes() -> dict[str, Any]:
    ref = _net()
    ours = DDP(copy.deepcopy(ref), message_size=50)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    layouts, broadcasts, worst = [], [], 0.0
    for step in range(7):
        frozen = step in (2, 3, 4)  # c frozen for three steps (and unused in one of them)
        for m in (ours.module, ref):
            m.c.requires_grad_(not frozen)
        batch = _global_batch(step)
        use_c = step != 3
        _loss(ours(_mine(batch), use_c=use_c)).backward()
        _loss(ref(batch, use_c=use_c)).backward()
        worst = max(worst, _max_diff(_grads(ours), _grads(ref)))
        layouts.append(ours.bucket_layout)
        broadcasts.append(ours.comm_stats.calls.get(CollectiveKind.BROADCAST, 0))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    param = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), ref.parameters()))
    return {"layouts": layouts, "broadcasts": broadcasts, "grad": worst, "param": param}


@pytest.mark.parametrize("pool", [2, 3, 4], indirect=True)
def test_trainable_set_change_rebuilds_buckets(pool: RankPool) -> None:
    results = pool.run(_trainable_changes)
    for r in results:
        assert r["grad"] < 1e-5 and r["param"] < 1e-5, r
        names = [{n for bucket in layout for n in bucket} for layout in r["layouts"]]
        assert "c.weight" in names[0] and "c.weight" not in names[2] and "c.weight" in names[6]
        assert r["layouts"][:2] == [r["layouts"][0]] * 2 and r["layouts"][2:5] == [r["layouts"][2]] * 3
        assert r["layouts"][5] == r["layouts"][0], (
            "returning to a trainable set seen before reuses its layout"
        )
        # construction broadcasts once (one dtype); each newly learned layout adds one broadcast;
        # the return to the first trainable set reuses its layout without a broadcast
        assert r["broadcasts"] == [2, 2, 3, 3, 3, 3, 3]
    assert results[0]["layouts"] == results[-1]["layouts"]


def _differently_frozen() -> str:
    # rank 1 freezes c from the start: its buckets would cover other tensors than rank 0's, so the
    # layout exchange of the first backward would not pair up; every rank raises instead
    ddp = DDP(_net())
    if dist.get_rank() == 1:
        ddp.module.c.requires_grad_(False)
    return _expect(RuntimeError, lambda: _loss(ddp(torch.randn(2, 6))).backward())


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_ranks_with_different_trainable_sets_raise_on_every_rank(pool: RankPool) -> None:
    for msg in pool.run(_differently_frozen, timeout=60):
        assert "rank(s) [1] reduce other parameters than rank 0" in msg and "requires_grad" in msg, msg


# ---- dtypes ----------------------------------------------------------------------------------------


class Mixed(nn.Module):
    """fp32, bf16 and fp16 layers in one model."""

    def __init__(self) -> None:
        super().__init__()
        self.f32 = nn.Linear(6, 8)
        self.bf16 = nn.Linear(8, 8).to(torch.bfloat16)
        self.f16 = nn.Linear(8, 8).to(torch.float16)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.f32(x))
        x = torch.tanh(self.bf16(x.to(torch.bfloat16)))
        x = torch.tanh(self.f16(x.to(torch.float16)))
        return self.out(x.float())


def _dtypes(always_fp32: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    base = Mixed()
    ours = DDP(copy.deepcopy(base), message_size=60, allreduce_always_fp32=always_fp32)
    torch_ddp = TorchDDP(copy.deepcopy(base))
    worst: dict[str, float] = {}
    for step in range(3):
        batch = _global_batch(step)
        for m in (ours, torch_ddp):
            m.zero_grad()
            _loss(m(_mine(batch))).backward()
        for p, q in zip(ours.module.parameters(), torch_ddp.parameters()):
            assert p.grad is not None and q.grad is not None and p.grad.dtype == p.dtype
            rel = (
                (p.grad.float() - q.grad.float()).abs().max() / q.grad.float().abs().max().clamp_min(1e-6)
            ).item()
            worst[str(p.dtype)] = max(worst.get(str(p.dtype), 0.0), rel)
    dtypes = dict(ours.module.named_parameters())
    layout = ours.bucket_layout
    assert layout is not None
    return {
        "bucket_dtypes": [sorted({str(dtypes[n].dtype) for n in b}) for b in layout],
        "wire_dtypes": sorted(map(str, ours.comm_stats.dtypes[CollectiveKind.ALL_REDUCE])),
        "worst_rel": worst,
    }


def _dtypes_both() -> dict[str, Any]:
    return {"native": _dtypes(False), "fp32": _dtypes(True)}


@pytest.mark.parametrize("pool", [2, 3, 4], indirect=True)
def test_each_dtype_has_its_own_buckets(pool: RankPool) -> None:
    for r in pool.run(_dtypes_both):
        native, fp32 = r["native"], r["fp32"]
        assert all(len(d) == 1 for d in native["bucket_dtypes"]), native["bucket_dtypes"]
        assert {d for (d,) in native["bucket_dtypes"]} == {"torch.float32", "torch.bfloat16", "torch.float16"}
        assert native["wire_dtypes"] == ["torch.bfloat16", "torch.float16", "torch.float32"]
        assert fp32["wire_dtypes"] == ["torch.float32"], "allreduce_always_fp32 sends fp32 only"
        for result in (native, fp32):
            assert result["worst_rel"]["torch.float32"] < 1e-5
            assert result["worst_rel"]["torch.bfloat16"] < 2e-2
            assert result["worst_rel"]["torch.float16"] < 2e-3


# ---- gradient accumulation: no_sync() and need_reduction ---------------------------------------------


def _accumulate() -> dict[str, Any]:
    ref = _net()
    ours = DDP(copy.deepcopy(ref), message_size=50)
    torch_ddp = TorchDDP(copy.deepcopy(ref))
    out: dict[str, Any] = {"diff": 0.0, "local_calls": [], "locally_different": []}
    for it in range(3):  # the first micro-batch of iteration 0 precedes any reduced backward
        batches = [_global_batch(10 * it + k) for k in range(3)]
        for k, batch in enumerate(batches[:2]):
            before = ours.comm_stats.calls.get(CollectiveKind.ALL_REDUCE, 0)
            if k == 0:
                with ours.no_sync():  # the context around the forward only is enough
                    loss = _loss(ours(_mine(batch)))
                loss.backward()
            else:
                ours.need_reduction = False  # the BERT-fork switch, set between forward and backward
                loss = _loss(ours(_mine(batch)))
                loss.backward()
                ours.need_reduction = True
            out["local_calls"].append(ours.comm_stats.calls.get(CollectiveKind.ALL_REDUCE, 0) - before)
            with torch_ddp.no_sync():
                _loss(torch_ddp(_mine(batch))).backward()
        g = ours.module.head.weight.grad.clone()
        everyone = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, g)
        out["locally_different"].append(not torch.equal(everyone[0], everyone[1]))
        _loss(ours(_mine(batches[2]))).backward()
        _loss(torch_ddp(_mine(batches[2]))).backward()
        out["diff"] = max(out["diff"], _max_diff(_grads(ours), _grads(torch_ddp)))
        ours.zero_grad()
        torch_ddp.zero_grad()
    out["layout"] = ours.bucket_layout
    return out


@pytest.mark.parametrize("pool", [2, 3, 4], indirect=True)
def test_no_sync_and_need_reduction_accumulate_locally(pool: RankPool) -> None:
    for r in pool.run(_accumulate):
        assert r["local_calls"] == [0] * 6, "no all-reduce in a micro-batch that skips reduction"
        assert all(r["locally_different"]), "skipped micro-batches keep rank-local gradients"
        assert r["diff"] < 1e-5, "the reduced backward averages the accumulated gradients"
        assert r["layout"] is not None


# ---- construction ------------------------------------------------------------------------------------


def _torch_semantics() -> dict[str, Any]:
    from torch.utils.checkpoint import checkpoint

    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def seq() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))

    # reentrant checkpointing around the last layer: its gradients arrive in a nested backward
    class Ckpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = seq()

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            h = self.net[1](self.net[0](t))
            return checkpoint(self.net[2], h, use_reentrant=True)

    ours, theirs = DDP(Ckpt()), TorchDDP(Ckpt())
    for m in (ours, theirs):
        for _ in range(2):
            m(x).pow(2).sum().backward()
    out["reentrant_equal"] = all(
        torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
    )

    # a backward through the wrapped module itself, bypassing the wrapper, stays local (torch's rule)
    model, local = DDP(seq()), seq()
    model.module(x).pow(2).sum().backward()
    local(x).pow(2).sum().backward()
    out["direct_is_local"] = all(
        torch.equal(a.grad, b.grad)
        for a, b in zip(model.module.parameters(), local.parameters(), strict=True)
    )

    # a forward outside no_sync, then one inside: the backward of the first loss still reduces
    model, reference = DDP(seq()), TorchDDP(seq())
    for m in (model, reference):
        loss = m(x).pow(2).sum()
        with m.no_sync():
            m(x)
        loss.backward()
    out["forward_outside_wins"] = all(
        torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )

    # two forwards, then two backwards: both reduce (the mean of the ranks' summed gradients)
    model, local = DDP(seq()), seq()
    for m in (model, local):
        first, second = m(x), m(2 * x)
        first.pow(2).sum().backward()
        second.pow(2).sum().backward()
    for p in local.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    out["two_backwards"] = all(
        torch.allclose(a.grad, b.grad, atol=1e-6)
        for a, b in zip(model.module.parameters(), local.parameters(), strict=True)
    )

    # a gradient penalty: torch.autograd.grad to the input first, then the backward that reduces
    model, reference = DDP(seq()), TorchDDP(seq())
    for m in (model, reference):
        inp = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(m(inp).sum(), inp, create_graph=True)
        (m(x).pow(2).sum() + g.pow(2).sum()).backward()
    out["penalty"] = all(
        torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )

    # non-reentrant checkpointing around the wrapper: its recomputation is not a new step
    model, reference = DDP(seq()), TorchDDP(seq())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (model, reference):
            checkpoint(m, x, use_reentrant=False).pow(2).sum().backward()
    out["recompute"] = not any("did not finish" in str(w.message) for w in caught) and all(
        torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )

    # a newer wrapper of the same module takes over: the old one reduces nothing and refuses forward
    module = seq()
    old = DDP(module)
    new = DDP(module)
    new(x).pow(2).sum().backward()
    out["reduced_once"] = new.comm_stats.as_dict()["all_reduce"]["calls"] >= 1 and (
        old.comm_stats.as_dict()["all_reduce"]["calls"] == 0
    )
    try:
        old(x)
        out["old_refused"] = ""
    except RuntimeError as e:
        out["old_refused"] = str(e)

    # delay_allreduce: ranks that train different parameters of equal size fail on every rank
    net = seq()
    (net[0].bias if rank == 0 else net[2].bias).requires_grad_(False)
    try:
        DDP(net, delay_allreduce=True)(x).pow(2).sum().backward()
        out["delay_sets"] = ""
    except RuntimeError as e:
        out["delay_sets"] = str(e)

    # fp64 gradients stay fp64 under allreduce_always_fp32 (it widens fp16/bf16 only)
    wide = DDP(seq().double(), allreduce_always_fp32=True)
    wide(x.double()).pow(2).sum().backward()
    out["fp64_dtypes"] = sorted(str(d) for d in wide.comm_stats.as_dict()["all_reduce"]["dtypes"])

    # sparse gradients are refused with the fix
    emb = DDP(nn.Embedding(5, 2, sparse=True))
    try:
        emb(torch.tensor([1, 2])).sum().backward()
        out["sparse"] = ""
    except RuntimeError as e:
        out["sparse"] = str(e)
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_torch_ddp_semantics(pool: RankPool) -> None:
    for r in pool.run(_torch_semantics):
        assert r["reentrant_equal"] and r["direct_is_local"] and r["forward_outside_wins"], r
        assert (r["two_backwards"], r["penalty"], r["recompute"]) == (True, True, True)
        assert r["reduced_once"] and "a newer DistributedDataParallel wraps this module" in r["old_refused"]
        assert "reduce other parameters than rank 0" in r["delay_sets"]
        assert r["fp64_dtypes"] == ["torch.float64"], r["fp64_dtypes"]
        assert "sparse gradient" in r["sparse"] and "sparse=False" in r["sparse"]


def _construction() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different weights on every rank
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DDP(model, shared_param=True)
    state = torch.cat([t.reshape(-1).float() for t in ddp.state_dict().values()])
    everyone = [torch.empty_like(state) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, state)
    errors = {
        "delay+triggers": _expect(
            ValueError, DDP, nn.Linear(2, 2), delay_allreduce=True, allreduce_trigger_params=[]
        ),
        "delay+streams": _expect(
            ValueError, DDP, nn.Linear(2, 2), delay_allreduce=True, num_allreduce_streams=2
        ),
        "message_size": _expect(ValueError, DDP, nn.Linear(2, 2), message_size=0),
        "predivide": _expect(ValueError, DDP, nn.Linear(2, 2), gradient_predivide_factor=0.0),
        "foreign_trigger": _expect(
            ValueError, DDP, nn.Linear(2, 2), allreduce_trigger_params=[nn.Parameter(torch.ones(1))]
        ),
        "different_model": _expect(ValueError, DDP, nn.Linear(2, 2 + (rank == 1))),
        "frozen": _expect(ValueError, DDP, nn.Linear(2, 2).requires_grad_(False)),
        "of_fsdp": _expect(ValueError, DDP, nn.Sequential(FSDP(nn.Linear(2, 2)), nn.Linear(2, 2))),
        "frozen_on_one_rank": _expect(ValueError, DDP, nn.Linear(2, 2).requires_grad_(rank != 1)),
    }
    return {
        "same_state": all(torch.equal(e, everyone[0]) for e in everyone),
        "deprecation": [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)],
        "errors": errors,
        "keys": list(ddp.state_dict()),
    }


@pytest.mark.parametrize("pool", [2, 3, 4], indirect=True)
def test_construction_broadcasts_and_validates(pool: RankPool) -> None:
    for r in pool.run(_construction):
        assert r["same_state"], "parameters and buffers are rank 0's on every rank after construction"
        assert len(r["deprecation"]) == 1 and "shared_param" in r["deprecation"][0]
        assert "delay_allreduce" in r["errors"]["delay+triggers"]
        assert "delay_allreduce" in r["errors"]["delay+streams"]
        assert "message_size" in r["errors"]["message_size"]
        assert "gradient_predivide_factor" in r["errors"]["predivide"]
        assert "not parameters of the wrapped module" in r["errors"]["foreign_trigger"]
        assert "rank(s) [1] wrap a different model" in r["errors"]["different_model"]
        assert "no parameter that requires a gradient" in r["errors"]["frozen"]
        assert "sharded (FullyShardedDataParallel) parts at ['0']" in r["errors"]["of_fsdp"]
        assert "rank(s) [1] wrap a different model" in r["errors"]["frozen_on_one_rank"]
        assert r["keys"][0] == "module.0.weight", "state dict keys carry the 'module.' prefix like torch DDP"


def test_signature_is_apex_with_process_group() -> None:
    import inspect

    params = inspect.signature(DDP.__init__).parameters
    expected = {
        "module": inspect.Parameter.empty,
        "message_size": 10_000_000,
        "delay_allreduce": False,
        "shared_param": None,
        "allreduce_trigger_params": None,
        "retain_allreduce_buffers": False,
        "allreduce_always_fp32": False,
        "num_allreduce_streams": 1,
        "allreduce_communicators": None,
        "gradient_average": True,
        "gradient_predivide_factor": 1.0,
        "process_group": None,
    }
    assert {n: p.default for n, p in params.items() if n != "self"} == expected
    assert list(params)[1:] == list(expected), "apex's argument order"
