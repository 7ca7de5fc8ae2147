"""``nn.Module`` operations on a wrapped model, as torch FSDP1 (and fairscale) allow them.

Scenarios of torch's ``test_fsdp_misc.py`` (a CPU-built wrapper moved with ``.cuda()`` trains),
``test_fsdp_freezing_weights.py`` (freezing after wrapping, by ``requires_grad`` and by dropping
gradients) and ``test_fsdp_use_orig_params.py`` (per-parameter trainability), and fairscale's
``_apply`` (``model.half()`` after wrapping), each trained beside a plain model converted or frozen
alike.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy
from tests.models import Nested, build, wrap
from tests.parity import handles_with_ref_names, reference_flat, shard_of
from tests.rank_pool import RankPool
from tests.unit.conftest import single_rank_group  # noqa: F401  (the fixture, for the one-rank tests)


def _largest_gap(model: nn.Module, ref: nn.Module, what: str) -> float:
    """The largest difference between the wrapped model's shards (or their gradients) and the
    reference's values; a gradient present on one side only counts as infinite."""
    gap = 0.0
    for h, names in handles_with_ref_names(model):
        expected = reference_flat(ref, names, what)
        mine = h.flat_param.detach() if what == "param" else h.flat_param.grad
        if (mine is None) != (expected is None):
            return float("inf")
        if expected is not None:
            gap = max(gap, (mine.double() - shard_of(expected, h).double()).abs().max().item())
    return gap


class _Normed(nn.Module):
    """Linear layers, a layer norm and buffers: a floating one that follows conversions, an integer
    one that does not."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.out = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.out(self.norm(self.inp(x)) * self.scale)


# ---------------------------------------------------------------------- .half() / .to() / .cuda()
def _convert_after_wrapping(dtype_name: str, strategy: str) -> dict[str, Any]:
    """One fp32 step, then the wrapped model and the plain one are converted alike and train on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    ref = _Normed()
    model = wrap(copy.deepcopy(ref), ("out",), sharding_strategy=ShardingStrategy[strategy])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses, grad_gaps = [], []
    for step in range(4):
        if step == 1:  # after training started: the optimizer keeps the same parameter objects
            model.to(dtype)
            ref.to(dtype)
            for o in (opt, ref_opt):  # (the momentum buffers of a plain model need the same care)
                for state in o.state.values():
                    state["momentum_buffer"] = state["momentum_buffer"].to(dtype)
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4 * world, 6, generator=g).to(dtype if step else torch.float32)
        loss = model(x[4 * rank : 4 * rank + 4]).float().pow(2).mean()
        loss.backward()
        ref_loss = ref(x).float().pow(2).mean()
        ref_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world - ref_loss.detach()).abs().item())
        grad_gaps.append(_largest_gap(model, ref, "grad"))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    sd, ref_sd = model.state_dict(), ref.state_dict()
    return {
        "loss": losses,
        "grad": grad_gaps,
        "param": _largest_gap(model, ref, "param"),
        "state_dtypes": {k: str(v.dtype) for k, v in sd.items()},
        "ref_dtypes": {k: str(v.dtype) for k, v in ref_sd.items()},
        "state": max((sd[k].double() - v.double()).abs().max().item() for k, v in ref_sd.items()),
        "flat_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_to_float64_after_training_started_matches_a_plain_model_cast_alike(
    pool: RankPool, strategy: str
) -> None:
    for r in pool.run(_convert_after_wrapping, "float64", strategy):
        assert r["flat_dtypes"] == ["torch.float64"], r
        assert max(r["loss"]) <= 1e-6 and max(r["grad"]) <= 1e-6 and r["param"] <= 1e-6, r
        assert r["state_dtypes"] == r["ref_dtypes"], "the state dict holds what the plain model holds"
        assert r["state"] <= 1e-6, r


@pytest.mark.usefixtures("single_rank_group")
def test_half_after_wrapping_trains_in_fp16_like_a_plain_half_model() -> None:
    torch.manual_seed(0)
    ref = _Normed()
    model = FSDP(copy.deepcopy(ref))
    model.half()  # before the first forward, as torch's tests convert a freshly wrapped model
    ref.half()
    assert model.compute_dtype == torch.float16 and model.params[0].dtype == torch.float16
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step)).half()
        out = model(x)
        assert out.dtype == torch.float16
        out.float().pow(2).mean().backward()
        ref(x).float().pow(2).mean().backward()
        assert model.params[0].grad is not None and model.params[0].grad.dtype == torch.float16
        assert _largest_gap(model, ref, "grad") <= 1e-3  # (fp16 kernels on views may round differently)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert _largest_gap(model, ref, "param") <= 1e-3
    assert model.module.module.scale.dtype == torch.float16 and model.module.module.calls.dtype == torch.long
    model.float()  # and back, as fairscale allows
    ref.float()
    x = torch.randn(5, 6)
    assert torch.allclose(model(x), ref(x), atol=1e-3)


@pytest.mark.usefixtures("single_rank_group")
def test_conversions_that_cannot_be_followed_are_refused_before_anything_changes() -> None:
    mixed = FSDP(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), mixed_precision=True)
    with pytest.raises(RuntimeError, match=r"would make the master weights of '<root>' torch\.float16"):
        mixed.half()  # masters stay fp32: compute_dtype says what compute runs in
    assert (
        mixed.params[0].dtype == torch.float32 and mixed.module.module[1].running_mean.dtype == torch.float16
    )
    mixed.float()  # changes nothing: the masters are fp32 and the buffers stay in buffer_dtype
    assert mixed.module.module[1].running_mean.dtype == torch.float16
    sd = mixed.state_dict()
    assert sd["1.running_mean"].dtype == torch.float32, "the state dict keeps the buffers' own dtype"

    model = FSDP(nn.Sequential(FSDP(nn.Linear(2, 2)), nn.Linear(2, 1)))
    with model.no_sync():
        model(torch.ones(3, 2)).sum().backward()
        with pytest.raises(RuntimeError, match=r"\.to\(\) / \.cuda\(\) on '<root>' during a step"):
            model.double()  # the gradients accumulated in no_sync() are not reduced yet
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with model.summon_full_params():
        with pytest.raises(RuntimeError, match="during a step"):
            model.double()
    model(torch.ones(3, 2)).sum().backward()
    model.double()  # between steps: allowed
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    model(torch.ones(3, 2, dtype=torch.float64)).sum().backward()
    assert model.module.module[0].params[0].grad.dtype == torch.float64


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.gpu
def test_cuda_after_wrapping_a_cpu_model_trains_on_the_gpu() -> None:
    torch.manual_seed(0)
    ref = _Normed()
    model = wrap(copy.deepcopy(ref), ("out",))
    assert model.compute_device.type == "cpu"
    model.cuda()  # torch's test_fsdp_cpu_init_stays_on_cpu: wrapped on the CPU, moved after
    ref.cuda()
    assert model.compute_device.type == "cuda" and {p.device.type for p in model.parameters()} == {"cuda"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).cuda()
        model(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert _largest_gap(model, ref, "param") <= 1e-5
    assert {v.device.type for v in model.state_dict().values()} == {"cuda"}


# ---------------------------------------------------------------------- requires_grad changed between steps
# step -> (prefix of the parameters frozen in that step); every other parameter trains
_STAGES = [("inp", "body"), ("inp", "body"), ("inp",), (), ("out",)]


def _attribute(model: nn.Module, name: str) -> Any:
    """``model.a.0.b`` as user code reaches it (attributes and indexing through the wrappers)."""
    obj: Any = model
    for part in name.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _staged_unfreezing(strategy: str, via: str = "named_parameters") -> dict[str, Any]:
    """torch's use_orig_params=True idiom: per-parameter requires_grad, changed between steps, through
    ``named_parameters()`` or through the modules' attributes (``model.net[0].weight.requires_grad =
    flag``, torch's ``test_no_grad``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build("nested")
    ref.inp.requires_grad_(False)  # frozen when wrapped too, trained from the fourth step
    torch.manual_seed(0)
    model = FSDP(
        copy.deepcopy(ref),
        use_orig_params=True,
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built once, over every parameter
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gaps, norms, frozen_grads = [], [], []
    for step, frozen in enumerate(_STAGES):
        for name, p in ref.named_parameters():
            p.requires_grad_(not name.startswith(frozen))
            if via == "attributes":
                _attribute(model, name).requires_grad = not name.startswith(frozen)
        if via == "named_parameters":
            for name, p in model.named_parameters():
                p.requires_grad_(not name.startswith(frozen))
        x = torch.randn(2 * world, 6, generator=torch.Generator().manual_seed(step))
        model(x[2 * rank : 2 * rank + 2]).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        gaps.append(_largest_gap(model, ref, "grad"))
        trainable = [p for p in ref.parameters() if p.requires_grad]  # (what the norm covers)
        norms.append(
            (model.clip_grad_norm_(1e9) - torch.nn.utils.clip_grad_norm_(trainable, 1e9)).abs().item()
        )
        frozen_grads.append(
            sorted(n for n, p in model.named_parameters() if n.startswith(frozen) and p.grad is not None)
        )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    sd = model.state_dict()
    return {
        "grad": gaps,
        "norm": norms,
        "frozen_grads": frozen_grads,
        "param": _largest_gap(model, ref, "param"),
        "state": max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
    }


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize(
    ("strategy", "via"),
    [
        ("FULL_SHARD", "named_parameters"),
        ("SHARD_GRAD_OP", "named_parameters"),
        ("NO_SHARD", "named_parameters"),
        ("FULL_SHARD", "attributes"),
        ("NO_SHARD", "attributes"),
    ],
)
def test_staged_unfreezing_with_use_orig_params_matches_a_plain_model(
    pool: RankPool, strategy: str, via: str
) -> None:
    for r in pool.run(_staged_unfreezing, strategy, via):
        assert max(r["grad"]) <= 1e-5 and r["param"] <= 1e-5 and r["state"] <= 1e-5, r
        assert max(r["norm"]) <= 1e-5, "clip_grad_norm_ covers the parameters trainable now"
        assert r["frozen_grads"] == [[]] * len(_STAGES), "a frozen parameter gets no gradient"


class _Trunk(nn.Module):
    """torch's freezing-test model, small: a trunk of two blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 8)))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def _freeze_after_wrapping(method: str) -> dict[str, Any]:
    """torch's test_freezing_weights, freeze_after_wrap_fsdp: the trunk's wrappers are built, then
    their (flat) parameters frozen, or their gradients dropped after each backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _Trunk()
    model = copy.deepcopy(ref)
    model.trunk[0] = FSDP(model.trunk[0])
    model.trunk = FSDP(model.trunk)
    model.head = FSDP(model.head)
    model = FSDP(model)
    if method == "requires_grad":
        for m in (model.module.trunk, ref.trunk):
            for p in m.parameters():
                p.requires_grad = False
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(2 * world, 6, generator=torch.Generator().manual_seed(step))
        model(x[2 * rank : 2 * rank + 2]).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        if method == "grad_to_none":
            for m in (model.module.trunk, ref.trunk):
                for p in m.parameters():
                    p.grad = None
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    sd = model.state_dict()
    return {"state": max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("method", ["requires_grad", "grad_to_none"])
def test_freezing_wrapped_modules_after_wrapping_matches_a_plain_model(pool: RankPool, method: str) -> None:
    for r in pool.run(_freeze_after_wrapping, method):
        assert r["state"] <= 1e-6, r


@pytest.mark.usefixtures("single_rank_group")
def test_unfreezing_a_flat_parameter_frozen_at_construction_reduces_its_gradient() -> None:
    torch.manual_seed(0)
    ref = Nested()
    ref.inp.requires_grad_(False)  # frozen when wrapped: a flat parameter of its own, unhooked before
    model = FSDP(copy.deepcopy(ref))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert len(frozen) == 1
    frozen[0].requires_grad_(True)
    ref.inp.requires_grad_(True)
    x = torch.randn(4, 6)
    model(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    assert frozen[0].grad is not None and frozen[0].grad.shape == frozen[0].shape
    assert _largest_gap(model, ref, "grad") <= 1e-6


# ---------------------------------------------------------------------- copies: deepcopy, pickle, torch.save
def _ema_copies(strategy: str, mixed: bool) -> dict[str, Any]:
    """An EMA copy made with copy.deepcopy, before the first forward and after training started,
    kept beside the model and updated from its shards, against the same on a plain model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs: dict[str, Any] = {"sharding_strategy": ShardingStrategy[strategy]}
    if mixed:
        kwargs.update(mixed_precision=True, compute_dtype=torch.bfloat16)
    torch.manual_seed(0)
    ref = _Normed()
    model = wrap(copy.deepcopy(ref), ("out",), **kwargs)
    early = copy.deepcopy(model)  # before the first forward
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ema = ref_ema = None
    out: dict[str, Any] = {}
    for step in range(3):
        x = torch.randn(2 * world, 6, generator=torch.Generator().manual_seed(step))
        model(x[2 * rank : 2 * rank + 2]).float().pow(2).mean().backward()
        ref(x).float().pow(2).mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if ema is None:  # after the first step: the model has a root context, kept full parameters...
            ema, ref_ema = copy.deepcopy(model), copy.deepcopy(ref)
            out["shares_storage"] = any(
                e.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                for e, p in zip(ema.parameters(), model.parameters())
            )
            out["same_output"] = torch.equal(ema(x).float(), model(x).float())
            out["ema_is_own_root"] = ema.is_root is True and model.is_root is True
        else:
            with torch.no_grad():
                for e, p in zip(
                    [*ema.parameters(), *ref_ema.parameters()], [*model.parameters(), *ref.parameters()]
                ):
                    e.mul_(0.9).add_(p, alpha=0.1)
    probe = torch.randn(3, 6, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = model(probe).float()
        out["ema_matches"] = torch.allclose(
            ema(probe).float(), ref_ema(probe).float(), atol=1e-2 if mixed else 1e-6
        )
        out["model_untouched"] = torch.equal(model(probe).float(), before)
    sd, ref_sd = ema.state_dict(), ref_ema.state_dict()  # (the call counters differ: more calls above)
    out["state"] = max((sd[k] - v).abs().max().item() for k, v in ref_sd.items() if v.is_floating_point())
    ema(probe).float().sum().backward()  # the copy trains on its own
    torch.optim.SGD(ema.parameters(), lr=1.0).step()
    with torch.no_grad():
        out["model_untouched_by_training"] = torch.equal(model(probe).float(), before)
        torch.manual_seed(0)
        initial = _Normed()  # what the model was when the early copy was made
        out["early_is_initial"] = torch.allclose(
            early(probe).float(), initial(probe), atol=1e-2 if mixed else 1e-6
        )
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    ("strategy", "mixed"), [("FULL_SHARD", False), ("NO_SHARD", False), ("FULL_SHARD", True)]
)
def test_deepcopy_gives_an_independent_model_for_ema(pool: RankPool, strategy: str, mixed: bool) -> None:
    for r in pool.run(_ema_copies, strategy, mixed):
        assert not r["shares_storage"], "a copy must not share the original's shards"
        assert r["same_output"] and r["ema_is_own_root"] and r["early_is_initial"], r
        assert r["ema_matches"] and r["state"] <= (1e-2 if mixed else 1e-6), r
        assert r["model_untouched"] and r["model_untouched_by_training"], r


def _pickled(how: str, mixed: bool) -> dict[str, Any]:
    """pickle / torch.save of the module, before the first forward and after training, loaded in
    the same processes: the copy trains on as the original does (fairscale's test_pickle)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = wrap(_Normed(), ("out",), mixed_precision=mixed)
    x = torch.randn(2 * world, 6, generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {}
    for moment in ("fresh", "trained"):
        if moment == "trained":
            model(x[2 * rank : 2 * rank + 2]).float().pow(2).mean().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            model.zero_grad()
        if how == "pickle":
            loaded = pickle.loads(pickle.dumps(model))
        else:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
        out[f"{moment}_rebound"] = all(
            w.process_group is dist.group.WORLD for w in loaded.modules() if isinstance(w, FSDP)
        )
        for m in (model, loaded):  # one more step each, from the same values: the same results
            m(x[2 * rank : 2 * rank + 2]).float().pow(2).mean().backward()
            torch.optim.SGD(m.parameters(), lr=0.1).step()
        out[f"{moment}_same"] = all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values())
        )
    group = dist.new_group(list(range(world)))  # not the default group: not taken back by itself
    sub = wrap(_Normed(), ("out",), process_group=group, mixed_precision=mixed)
    loaded = pickle.loads(pickle.dumps(sub))
    try:
        loaded(x)
        out["detached_error"] = ""
    except RuntimeError as e:
        out["detached_error"] = str(e)
    for m in loaded.modules():
        if isinstance(m, FSDP):
            m.process_group = group  # fairscale's idiom after unpickling
    loaded(x[2 * rank : 2 * rank + 2]).float().sum().backward()
    out["bound_trains"] = all(p.grad is not None for p in loaded.parameters())
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    ("how", "mixed"), [("pickle", False), ("pickle", True), ("torch.save", False), ("torch.save", True)]
)
def test_a_pickled_wrapped_model_loads_and_trains_on(pool: RankPool, how: str, mixed: bool) -> None:
    for r in pool.run(_pickled, how, mixed):
        assert r["fresh_rebound"] and r["trained_rebound"], (
            "unpickled among the same ranks: the default group"
        )
        assert r["fresh_same"] and r["trained_same"], r
        assert "`model.process_group = group` on every wrapper" in r["detached_error"], r
        assert r["bound_trains"], r
