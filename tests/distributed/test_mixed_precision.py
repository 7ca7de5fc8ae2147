"""Mixed precision: the dtype contract, bytes on the wire, numerics, autocast and the grad scaler."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import MixedPrecision, ShardedGradScaler, ShardingStrategy
from tests.rank_pool import RankPool

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


class Probe(nn.Module):
    """Records the dtypes it sees inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("shift", torch.zeros(6))
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = {"input": x.dtype, "weight": self.lin.weight.dtype, "buffer": self.shift.dtype}
        return self.lin(x) + self.shift.to(x.dtype)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Probe(), nn.Tanh(), nn.Linear(6, 3))


def _dtype_contract(
    kwargs: dict[str, Any], model_dtype: torch.dtype, input_dtype: torch.dtype
) -> dict[str, Any]:
    net = _net().to(model_dtype)
    net[0] = FSDP(net[0], **kwargs)
    model = FSDP(net, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = model(torch.randn(4, 6).to(input_dtype))
    out.float().pow(2).mean().backward()
    opt.step()
    stats = model.comm_stats()
    probe = model.module[0].module
    sd = model.state_dict()
    return {
        **probe.seen,
        "output": out.dtype,
        "all_gather": stats["all_gather"]["dtypes"],
        "reduce_scatter": stats["reduce_scatter"]["dtypes"],
        "master": sorted({str(p.dtype) for p in model.parameters()}),
        "grad": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "state_dict": sorted({str(v.dtype) for v in sd.values()}),
    }


S16, SB16, S32 = "torch.float16", "torch.bfloat16", "torch.float32"
# config id: (fsdp kwargs, model dtype, input dtype) -> what must be seen
CONTRACT = {
    "fp32": (
        {}, F32, F32,
        dict(input=F32, weight=F32, buffer=F32, output=F32, all_gather=[S32], reduce_scatter=[S32],
             master=[S32], grad=[S32], state_dict=[S32]),
    ),
    "fairscale_fp16": (
        {"mixed_precision": True}, F32, F32,
        dict(input=F16, weight=F16, buffer=F16, output=F16, all_gather=[S16], reduce_scatter=[S16],
             master=[S32], grad=[S32], state_dict=[S32]),
    ),
    "fairscale_bf16": (
        {"mixed_precision": True, "compute_dtype": BF16}, F32, F32,
        dict(input=BF16, weight=BF16, buffer=BF16, output=BF16, all_gather=[SB16], reduce_scatter=[SB16],
             master=[S32], grad=[S32], state_dict=[S32]),
    ),
    "bf16_fp32_reduce_scatter": (
        {"mixed_precision": True, "compute_dtype": BF16, "fp32_reduce_scatter": True}, F32, F32,
        dict(input=BF16, weight=BF16, buffer=BF16, output=BF16, all_gather=[SB16], reduce_scatter=[S32],
             master=[S32], grad=[S32], state_dict=[S32]),
    ),
    "bf16_buffers_fp32": (
        {"mixed_precision": True, "compute_dtype": BF16, "buffer_dtype": F32}, F32, F32,
        dict(input=BF16, weight=BF16, buffer=F32, output=BF16, all_gather=[SB16], reduce_scatter=[SB16],
             master=[S32], grad=[S32], state_dict=[S32]),
    ),
    "MixedPrecision": (
        {"mixed_precision": MixedPrecision(param_dtype=BF16, reduce_dtype=F32, buffer_dtype=F32)}, F32, F32,
        dict(input=BF16, weight=BF16, buffer=F32, output=BF16, all_gather=[SB16], reduce_scatter=[S32],
             master=[S32], grad=[S32], state_dict=[S32]),
    ),
    "MixedPrecision_reduce_only": (
        {"mixed_precision": MixedPrecision(reduce_dtype=BF16)}, F32, F32,
        dict(input=F32, weight=F32, buffer=F32, output=F32, all_gather=[S32], reduce_scatter=[SB16],
             master=[S32], grad=[S32], state_dict=[S32]),
    ),
    "pure_fp16": (
        {"compute_dtype": F16}, F16, F16,
        dict(input=F16, weight=F16, buffer=F16, output=F16, all_gather=[S16], reduce_scatter=[S16],
             master=[S16], grad=[S16], state_dict=[S16]),
    ),
    "force_input_to_fp32": (
        {"force_input_to_fp32": True}, F32, F16,
        dict(input=F32, weight=F32, buffer=F32, output=F32, all_gather=[S32], reduce_scatter=[S32],
             master=[S32], grad=[S32], state_dict=[S32]),
    ),
}  # fmt: skip


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("config", list(CONTRACT))
def test_dtype_contract(pool: RankPool, config: str) -> None:
    kwargs, model_dtype, input_dtype, expected = CONTRACT[config]
    for seen in pool.run(_dtype_contract, kwargs, model_dtype, input_dtype):
        assert seen == expected


def _bn_local_state_round_trip() -> dict[str, Any]:
    """A batch-norm model under fairscale's mixed precision (buffers kept in fp16): the local state dict's
    dtypes, and training after loading it (as saved now, and as earlier versions saved it: buffers in
    fp16) against training on without a reload."""
    import io

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    net[1] = FSDP(net[1], mixed_precision=True, compute_dtype=F16)
    model = FSDP(net, mixed_precision=True, compute_dtype=F16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank = dist.get_rank()

    def steps(first: int) -> list[float]:
        losses = []
        for step in range(first, first + 2):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def saved(obj: Any) -> Any:
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    steps(0)
    local = model.local_state_dict()
    dtypes = {k: v.dtype for k, v in local.items() if isinstance(v, torch.Tensor)}
    kept_vars = {
        k: v.dtype for k, v in model.local_state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)
    }
    kept = model.module[1].module.running_mean.dtype  # the dtype the wrapper computes with
    checkpoint = saved({"model": local})
    optim_state = saved(opt.state_dict())  # loaded fresh each time: load_state_dict keeps its tensors
    earlier = {k: v.to(kept) if k.endswith(("running_mean", "running_var")) else v for k, v in local.items()}
    earlier = saved(earlier)  # what earlier versions saved: the buffers in the compute dtype
    expected_losses, expected_state = steps(2), model.state_dict()
    out: dict[str, Any] = {"dtypes": dtypes, "keep_vars": kept_vars, "kept": kept, "diffs": []}
    for local_sd in (checkpoint["model"], earlier):
        model.load_local_state_dict(local_sd)
        opt.load_state_dict(saved(optim_state))
        losses, state = steps(2), model.state_dict()
        out["diffs"].append(
            {
                "losses_equal": losses == expected_losses,
                "state_equal": list(state) == list(expected_state)
                and all(
                    torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in expected_state.items()
                ),
                "buffer_dtype": model.module[1].module.running_var.dtype,
            }
        )
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_local_state_dict_holds_buffers_in_their_original_dtype(pool: RankPool) -> None:
    """As in fairscale (and our full state_dict()), the local state dict holds fp32 batch-norm statistics
    under mixed precision; loading casts them back to the fp16 the wrapper keeps, and training goes on
    exactly, from such a dict and from one with fp16 buffers (as earlier versions saved)."""
    for r in pool.run(_bn_local_state_round_trip):
        assert r["kept"] == F16
        for dtypes in (r["dtypes"], r["keep_vars"]):
            assert dtypes["1.running_mean"] == F32 and dtypes["1.running_var"] == F32, dtypes
            assert dtypes["1.num_batches_tracked"] == torch.int64, dtypes
            assert all(v == F32 for k, v in dtypes.items() if "flat_param" in k), dtypes
        for d in r["diffs"]:
            assert d == {"losses_equal": True, "state_equal": True, "buffer_dtype": F16}, d


def _all_gather_bytes(kwargs: dict[str, Any]) -> int:
    model = FSDP(nn.Sequential(FSDP(nn.Linear(16, 16), **kwargs), nn.Linear(16, 4)), **kwargs)
    model(torch.randn(2, 16)).float().sum().backward()
    model.reset_comm_stats()
    model(torch.randn(2, 16)).float().sum().backward()
    return int(model.comm_stats()["all_gather"]["bytes"])


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_low_precision_all_gather_moves_half_the_bytes(pool: RankPool) -> None:
    fp32 = pool.run(_all_gather_bytes, {})
    for kwargs in ({"mixed_precision": True}, {"mixed_precision": True, "compute_dtype": BF16}):
        low = pool.run(_all_gather_bytes, kwargs)
        assert all(2 * lo == hi for lo, hi in zip(low, fp32)), (low, fp32)


def _numerics(
    fp32_reduce_scatter: bool, forwards: int = 1, master_dtype: torch.dtype = F32
) -> dict[str, float]:
    """FSDP bf16 vs a hand-made reference: fp32 master copy, bf16 compute on each rank's slice,
    gradient sum (in bf16, or fp32) with the same pre/post division, SGD on the fp32 master. With
    ``forwards=2`` each rank's slice goes through the model in two forwards before one backward
    (see [Note: gradient accumulators] in fsdp/core/grad_hooks.py). With fp64 masters (kept as torch's
    MixedPrecision keeps them, which also casts the fp64 inputs) the reference's master is fp64."""

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return sum((m(part).float().pow(2).mean() for part in x.chunk(forwards)), torch.zeros(()))

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    base = base.to(master_dtype)
    master, fp32 = copy.deepcopy(base), copy.deepcopy(base)
    net = copy.deepcopy(base)
    kwargs: dict[str, Any] = {
        "mixed_precision": True,
        "compute_dtype": BF16,
        "fp32_reduce_scatter": fp32_reduce_scatter,
    }
    if master_dtype != F32:
        kwargs = {"mixed_precision": MixedPrecision(BF16, F32 if fp32_reduce_scatter else None)}
    net[2] = FSDP(net[2], **kwargs)
    model = FSDP(net, **kwargs)
    pre = model.fsdp_config.comm.gradient_predivide_factor
    post = model.fsdp_config.comm.gradient_postdivide_factor
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    master_opt = torch.optim.SGD(master.parameters(), lr=0.5)
    fp32_opt = torch.optim.SGD(fp32.parameters(), lr=0.5)
    per = 4
    for step in range(4):
        x = torch.randn(per * world, 8, generator=torch.Generator().manual_seed(step)).to(master_dtype)
        loss(model, x[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
        # reference: every rank's slice in bf16, summed in bf16 as the reduce-scatter does
        total: list[torch.Tensor] | None = None
        for r in range(world):
            low = copy.deepcopy(master).to(BF16)
            loss(low, x[r * per : (r + 1) * per].to(BF16)).backward()
            grads = [(p.grad.float() if fp32_reduce_scatter else p.grad) / pre for p in low.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        assert total is not None
        for p, g in zip(master.parameters(), total):
            p.grad = (g / post).to(master_dtype)
        master_opt.step()
        sum(loss(fp32, x[r * per : (r + 1) * per]) for r in range(world)).div(world).backward()
        fp32_opt.step()
        fp32_opt.zero_grad()
    sd = model.state_dict()
    return {
        "dtypes": sorted({str(v.dtype) for v in sd.values()} | {str(p.dtype) for p in model.parameters()}),
        "vs_reference": max((sd[k] - v).abs().max().item() for k, v in master.state_dict().items()),
        "vs_fp32": max((sd[k] - v).abs().max().item() for k, v in fp32.state_dict().items()),
    }


@pytest.mark.parametrize(
    ("pool", "fp32_reduce_scatter", "forwards", "master_dtype"),
    # in bf16 the sum's rounding depends on the order gloo adds in: unambiguous only for 2 ranks
    [
        (2, False, 1, F32),
        (2, True, 1, F32),
        (3, True, 1, F32),
        (2, False, 2, F32),
        (2, False, 1, torch.float64),
        (2, True, 1, torch.float64),
    ],
    indirect=["pool"],
)
def test_bf16_numerics_match_a_hand_made_mixed_precision_reference(
    pool: RankPool, fp32_reduce_scatter: bool, forwards: int, master_dtype: torch.dtype
) -> None:
    for r in pool.run(_numerics, fp32_reduce_scatter, forwards, master_dtype):
        assert r["dtypes"] == [str(master_dtype)], "the masters and the state dict keep their dtype"
        assert r["vs_reference"] <= 1e-3, r
        assert r["vs_fp32"] >= 1e-4, f"low precision was not really used: {r}"
        assert r["vs_reference"] * 10 <= r["vs_fp32"], r


def _autocast_parity() -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    net = copy.deepcopy(ref)
    net[0] = FSDP(net[0], clear_autocast_cache=True)
    model = FSDP(net, clear_autocast_cache=True)
    x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=BF16):
        out = model(x[2 * rank : 2 * rank + 2])
        ref_out = ref(x)
    assert out.dtype == BF16, "autocast ran the wrapped Linear layers in bf16"
    out.float().pow(2).mean().backward()
    ref_out.float().pow(2).mean().backward()
    err = (out.float() - ref_out[2 * rank : 2 * rank + 2].float()).abs().max().item()
    from tests.parity import handles_with_ref_names, reference_flat, shard_of

    for h, names in handles_with_ref_names(model):
        expected = reference_flat(ref, names, "grad")
        err = max(err, (h.flat_param.grad - shard_of(expected, h)).abs().max().item())
        assert h.flat_param.grad.dtype == F32
    return err


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_under_torch_autocast(pool: RankPool) -> None:
    assert max(pool.run(_autocast_parity)) < 2e-2  # bf16 autocast on both sides; reduction order differs


def _scaler_run(fused: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    net = copy.deepcopy(ref)
    net[0] = FSDP(net[0])
    model = FSDP(net)
    if fused:  # unscales inside its step: the scaler only checks, through _check_inf_per_device
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
        ref_opt: torch.optim.Optimizer = torch.optim.Adam(ref.parameters(), lr=0.01, fused=True)
        assert getattr(opt, "_step_supports_amp_scaling", False)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=1000)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    scales, skipped = [], []
    for step in range(5):
        x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(step))
        scaler.scale(model(x[2 * rank : 2 * rank + 2]).pow(2).mean()).backward()
        ref_scaler.scale(ref(x).pow(2).mean()).backward()
        if step == 2:
            if rank == world - 1:  # an overflow that only the last rank can see in its shard
                next(iter(model.parameters())).grad[0] = float("inf")
            next(iter(ref.parameters())).grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        ref_scaler.step(ref_opt)
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        scaler.update()
        ref_scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
        ref_opt.zero_grad()
    sd = model.state_dict()
    err = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {"scales": scales, "skipped": skipped, "ref_scale": ref_scaler.get_scale(), "err": err,
            "state": scaler.state_dict()["scale"]}  # fmt: skip


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adam"])
def test_sharded_grad_scaler_skips_the_same_step_on_every_rank(pool: RankPool, fused: bool) -> None:
    results = pool.run(_scaler_run, fused)
    for r in results:
        assert r["skipped"] == [False, False, True, False, False], r
        assert r["scales"] == [256.0, 256.0, 128.0, 128.0, 128.0]
        assert r["ref_scale"] == 128.0 and r["state"] == 128.0
        assert r["err"] < 1e-5, "training recovers and matches a reference that skipped the same step"
    assert len({tuple(r["scales"]) for r in results}) == 1


def _invalid(kwargs: dict[str, Any], dtype: torch.dtype) -> str:
    try:
        FSDP(nn.Linear(2, 2).to(dtype), **kwargs)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("pool", [1], indirect=True)
@pytest.mark.parametrize(
    ("kwargs", "dtype", "match"),
    [
        (
            {"fp32_reduce_scatter": True},
            F32,
            "ValueError: .*fp32_reduce_scatter=True only applies with mixed_precision",
        ),
        (
            {"mixed_precision": True},
            F16,
            "ValueError: .*fp32 \\(or fp64\\) master weights.*float16.*\\.float\\(\\)",
        ),
        (
            {"compute_dtype": BF16},
            F32,
            "ValueError: .*compute_dtype=torch.bfloat16 with mixed_precision=False",
        ),
        ({"mixed_precision": MixedPrecision(BF16), "compute_dtype": BF16}, F32, "ValueError: .*not both"),
        ({"mixed_precision": True, "force_input_to_fp32": True}, F32, "ValueError: .*force_input_to_fp32"),
        ({"mixed_precision": "yes"}, F32, "TypeError: .*mixed_precision"),
        ({"buffer_dtype": torch.int32}, F32, "ValueError: .*`buffer_dtype`.*floating-point dtype"),
        (
            {"mixed_precision": True, "buffer_dtype": torch.bool},
            F32,
            "ValueError: .*`buffer_dtype`.*floating",
        ),
        (
            {"mixed_precision": True, "compute_dtype": torch.float64},
            F32,
            "ValueError: .*`compute_dtype` with mixed",
        ),
    ],
)
def test_invalid_combinations_say_what_to_change(
    pool: RankPool, kwargs: dict, dtype: torch.dtype, match: str
) -> None:
    import re

    (msg,) = pool.run(_invalid, kwargs, dtype)
    assert re.search(match, msg), msg


def _integer_params_under_mp() -> str:
    m = nn.Linear(2, 2)
    m.register_parameter("idx", nn.Parameter(torch.arange(3), requires_grad=False))
    try:
        FSDP(m, mixed_precision=True)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_integer_parameters_are_refused_under_mixed_precision(pool: RankPool) -> None:
    (msg,) = pool.run(_integer_params_under_mp)
    assert "'idx'" in msg and "torch.int64" in msg and "buffers" in msg


def test_mixed_precision_config_validates_itself() -> None:
    with pytest.raises(ValueError, match="param_dtype"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="cast_forward_inputs"):
        MixedPrecision(cast_forward_inputs="no")  # type: ignore[arg-type]
    with pytest.raises(Exception, match="cannot assign"):
        MixedPrecision().param_dtype = F32  # type: ignore[misc]


def _fp16_sum_overflow(pre: float | None) -> float:
    # d(40000 * w * x)/dw = 40000 on every rank: fits fp16 (max 65504), but two of them summed do not
    model = FSDP(nn.Linear(1, 1, bias=False), mixed_precision=True)  # fp16 compute and reduction
    if pre is not None:
        model.set_gradient_divide_factors(pre, dist.get_world_size() / pre, recursive=True)
    (model(torch.ones(1, 1)).float() * 40000).sum().backward()
    grad = model.params[0].grad
    return float(grad[0]) if grad.numel() else 40000.0  # a rank holding only padding


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_gradient_predivide_factor_keeps_fp16_sums_finite(pool: RankPool) -> None:
    default = pool.run(_fp16_sum_overflow, None)  # fairscale's default: pre=2 at world size 2
    assert default[0] == pytest.approx(40000.0, rel=1e-3)
    no_predivide = pool.run(_fp16_sum_overflow, 1.0)
    assert no_predivide[0] == float("inf"), "without pre-division the fp16 sum overflows"


def _divide_factors(strategy: str, when: str) -> list[list[float]]:
    """Factors (1, 1) ask for the plain sum over ranks; rank r's local gradient is r + 1."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    inner = nn.Linear(2, 2, bias=False)
    model = FSDP(
        nn.Sequential(FSDP(inner), nn.Linear(2, 1, bias=False)), sharding_strategy=ShardingStrategy[strategy]
    )
    grads = []
    for step in range(2):
        if step == {"before": 0, "after": 1}.get(when):
            model.set_gradient_divide_factors(1.0, 1.0, recursive=True)
        model.zero_grad()
        (model(torch.ones(1, 2)).sum() * (rank + 1)).backward()
        # the flat gradients (shards, or full copies under NO_SHARD), summed over ranks
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        dist.all_reduce(flat)
        grads.append([float(g) for g in flat])
    return grads


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_gradient_divide_factors_apply_to_every_strategy(pool: RankPool, strategy: str) -> None:
    mean = pool.run(_divide_factors, strategy, "never")[0][0]
    for when in ("before", "after"):
        for r in pool.run(_divide_factors, strategy, when):
            summed = r[0] if when == "before" else r[1]
            assert summed == pytest.approx([2 * g for g in mean]), (when, summed, mean)


def test_input_containers_keep_their_types() -> None:
    import collections

    from fsdp.wrapper.mixed_precision import cast_inputs

    class Batch(list):  # a list subclass whose constructor takes other arguments
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

    batch = Batch("b")
    batch.append(torch.ones(1))
    nested = collections.defaultdict(list, x=torch.ones(1), n=torch.arange(2), b=batch)
    out = cast_inputs((nested, [torch.ones(1)]), F32, BF16, detach=True)
    assert type(out[0]) is collections.defaultdict and out[0].default_factory is list
    assert out[0]["x"].dtype == BF16 and out[0]["n"].dtype == torch.int64, "only floating inputs are cast"
    assert type(out[0]["b"]) is Batch and out[0]["b"].name == "b" and out[0]["b"][0].dtype == BF16
    assert out[1][0].dtype == BF16 and nested["x"].dtype == F32, "the caller's containers are not changed"

    from torch.fx.immutable_collections import immutable_dict, immutable_list

    frozen = cast_inputs(immutable_dict(x=immutable_list([torch.ones(1)])), F32, BF16, detach=True)
    assert type(frozen) is immutable_dict and type(frozen["x"]) is immutable_list, (
        "immutable ones are rebuilt"
    )
    assert frozen["x"][0].dtype == BF16


def _hooked_nodes_after_forwards_without_backward() -> list[int]:
    """Forwards with grad enabled whose graphs are dropped (an evaluation that forgot no_grad)
    leave no hooked AccumulateGrad nodes behind: each is let go once its graph is gone."""
    torch.manual_seed(0)
    model = FSDP(
        nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), mixed_precision=True, compute_dtype=BF16
    )
    (handle,) = model.handles
    counts = []
    for _ in range(5):
        model(torch.randn(2, 4)).sum()  # a new node each time (the dtype of .data changes)
        counts.append(len(handle.accumulators))
    kept = model(torch.randn(2, 4)).sum()
    counts.append(len(handle.accumulators))
    kept.backward()  # the one graph kept still reduces
    counts.append(int(handle.flat_param.grad is not None))
    counts.append(len(handle.accumulators))  # its node stays hooked while `kept` holds the graph
    del kept
    model(torch.randn(2, 4)).sum()
    counts.append(len(handle.accumulators))  # and is let go once the graph is gone
    return counts


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_forwards_without_backward_leave_no_hooked_nodes(pool: RankPool) -> None:
    (counts,) = pool.run(_hooked_nodes_after_forwards_without_backward)
    assert counts == [1, 1, 1, 1, 1, 1, 1, 1, 1], counts


def _retained_graph_twice(forwards: int) -> float:
    """Two backwards through one retained graph add the gradient twice, also where the forward's
    AccumulateGrad node is not the one the parameter has at the second backward (mixed precision)."""

    def flat_grad(backwards: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = FSDP(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)),
            mixed_precision=True,
            compute_dtype=BF16,
        )
        x = torch.randn(4, 8)
        loss = sum((model(part).float().pow(2).mean() for part in x.chunk(forwards)), torch.zeros(()))
        for i in range(backwards):
            loss.backward(retain_graph=i < backwards - 1)
        assert model.flat_param_0.grad is not None
        return model.flat_param_0.grad.clone()

    once, twice = flat_grad(1), flat_grad(2)
    assert once.abs().max() > 0
    return (twice - 2 * once).abs().max().item()


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("forwards", [1, 2])
def test_two_backwards_through_a_retained_graph(pool: RankPool, forwards: int) -> None:
    assert pool.run(_retained_graph_twice, forwards) == [0.0, 0.0]


def _tokens_per_node_after_steps() -> list[int]:
    """In fp32 every step's forward reaches the same AccumulateGrad node: it keeps the forwards of
    live graphs only, not one per step."""
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    (handle,) = model.handles
    sizes = []
    for _ in range(6):
        loss = model(torch.randn(2, 4)).sum()  # the previous step's graph dies here
        loss.backward()
        sizes.append(handle.accumulators.tokens())
    return sizes


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_a_node_reached_every_step_keeps_live_forwards_only(pool: RankPool) -> None:
    assert pool.run(_tokens_per_node_after_steps) == [[1] * 6]
