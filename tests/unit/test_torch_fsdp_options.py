"""torch FSDP1's option objects and arguments in one process: MixedPrecision's fields mean what
torch's do, the constructor takes torch's arguments, and summon_full_params torch's keywords."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from fsdp.comm.topology import resolve_strategy

BF16, F32 = torch.bfloat16, torch.float32


# ---------------------------------------------------------------------- MixedPrecision, torch's meaning
class _Probe(nn.Module):
    """Records the dtype of its input and of its buffer; computes in its weight's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return self.fc(x.to(self.fc.weight.dtype)) * self.scale.to(self.fc.weight.dtype)


class _Outer(nn.Module):
    """Feeds the inner probe an fp32 tensor made inside forward, besides the root's input."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _Probe()
        self.inner = _Probe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.ones(x.shape[0], 8) + self.first(x).float())


def _cast_inputs(mp: fsdp.MixedPrecision) -> dict[str, Any]:
    torch.manual_seed(0)
    net = _Outer()
    net.inner = FSDP(net.inner, mixed_precision=mp)
    model = FSDP(net, mixed_precision=mp)
    x = torch.randn(2, 8, requires_grad=True)
    out = model(x)
    out.float().sum().backward()
    inner = net.inner.module
    return {
        "root_input": net.first.seen[0],
        "inner_input": inner.seen[0],
        "output": out.dtype,
        "root_buffer": net.first.scale.dtype,
        "leaf_grad": x.grad is not None,
        "weight_grad": model.flat_param_0.grad.dtype,
    }


@pytest.mark.parametrize(
    ("mp", "expected"),
    [
        # torch's defaults: the root casts its inputs, nothing else; buffers are kept
        (
            fsdp.MixedPrecision(param_dtype=BF16),
            {"root_input": BF16, "inner_input": F32, "output": BF16, "root_buffer": F32},
        ),
        (
            fsdp.MixedPrecision(param_dtype=BF16, cast_forward_inputs=True, buffer_dtype=BF16),
            {"root_input": BF16, "inner_input": BF16, "output": BF16, "root_buffer": BF16},
        ),
        (
            fsdp.MixedPrecision(param_dtype=BF16, cast_root_forward_inputs=False),
            {"root_input": F32, "inner_input": F32, "output": BF16, "root_buffer": F32},
        ),
        # no param_dtype: compute stays fp32, only the reduction is cast
        (
            fsdp.MixedPrecision(reduce_dtype=BF16),
            {"root_input": F32, "inner_input": F32, "output": F32, "root_buffer": F32},
        ),
    ],
)
def test_mixed_precision_fields_mean_what_torchs_do(
    single_rank_group: None, mp: fsdp.MixedPrecision, expected: dict[str, Any]
) -> None:
    seen = _cast_inputs(mp)
    assert {k: seen[k] for k in expected} == expected
    assert seen["leaf_grad"], "the root's cast keeps the input's gradient"
    assert seen["weight_grad"] == F32, "gradients land on the fp32 master shard"


def test_keep_low_precision_grads_is_taken_from_torchs_twin() -> None:
    ours = fsdp.api.from_torch_fsdp(
        torch_fsdp.MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True)
    )
    assert ours == fsdp.MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True)
    assert ours.keep_low_precision_grads


# ---------------------------------------------------------------------- constructor arguments
def test_torch_enum_values_without_a_twin_are_refused(single_rank_group: None) -> None:
    import enum

    class ShardingStrategy(enum.Enum):  # a value a later torch might add
        ZERO_FOUR = 1

    ShardingStrategy.__module__ = "torch.distributed.fsdp.api"
    with pytest.raises(ValueError, match=r"ShardingStrategy\.ZERO_FOUR is not supported"):
        FSDP(nn.Linear(2, 2), sharding_strategy=ShardingStrategy.ZERO_FOUR)


def test_hybrid_shard_zero2_keeps_full_parameters_for_backward(
    single_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    for value in (torch_fsdp.ShardingStrategy._HYBRID_SHARD_ZERO2, fsdp.ShardingStrategy._HYBRID_SHARD_ZERO2):
        resolved = resolve_strategy(fsdp.api.from_torch_fsdp(value), True)
        assert resolved == (fsdp.ShardingStrategy.HYBRID_SHARD, False)
        with pytest.warns(
            UserWarning, match="instead of ShardingStrategy.HYBRID_SHARD since the world size is 1"
        ):
            sharding = FSDP(nn.Linear(2, 2), sharding_strategy=value).fsdp_config.sharding
        assert sharding.strategy is fsdp.ShardingStrategy.NO_SHARD and not sharding.reshard_after_forward


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False),
        (torch_fsdp.BackwardPrefetch.BACKWARD_PRE, True),
        (fsdp.BackwardPrefetch.BACKWARD_PRE, True),
        (False, False),
    ],
)
def test_backward_prefetch_takes_torchs_values(single_rank_group: None, value: Any, expected: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings(
            "ignore", message=".*switching to use `NO_SHARD`"
        )  # (one rank: torch's warning)
        model = FSDP(nn.Linear(2, 2), backward_prefetch=value)
    assert model.fsdp_config.schedule.backward_prefetch is expected


@pytest.mark.parametrize("enum", [torch_fsdp.BackwardPrefetch, fsdp.BackwardPrefetch])
def test_backward_post_prefetches_after_the_reduction(single_rank_group: None, enum: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings(
            "ignore", message=".*switching to use `NO_SHARD`"
        )  # (one rank: torch's warning)
        post = FSDP(nn.Linear(2, 2), backward_prefetch=enum.BACKWARD_POST).fsdp_config.schedule
        pre = FSDP(nn.Linear(2, 2), backward_prefetch=enum.BACKWARD_PRE).fsdp_config.schedule
    assert post.backward_prefetch and post.backward_prefetch_post
    assert pre.backward_prefetch and not pre.backward_prefetch_post


def test_device_id_names_the_compute_device(single_rank_group: None) -> None:
    assert FSDP(nn.Linear(2, 2), device_id=torch.device("cpu")).compute_device == torch.device("cpu")
    with pytest.raises(ValueError, match="name different devices"):
        FSDP(nn.Linear(2, 2), device_id="cpu", compute_device=torch.device("meta"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available in this process"):
            FSDP(nn.Linear(2, 2), device_id=0)
    with pytest.raises(TypeError, match="device_id"):
        FSDP(nn.Linear(2, 2), device_id=1.5)


def test_use_orig_params_true_keeps_one_named_shard_per_parameter(single_rank_group: None) -> None:
    model = FSDP(nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3)), use_orig_params=True)
    assert not model.fsdp_config.sharding.flatten_parameters
    assert [(n, p.ndim) for n, p in model.named_parameters()] == [
        ("0.weight", 1),
        ("0.bias", 1),
        ("1.weight", 1),
        ("1.bias", 1),
    ]
    assert FSDP(nn.Linear(2, 2), use_orig_params=False).fsdp_config.sharding.flatten_parameters
    with pytest.raises(TypeError, match="use_orig_params"):
        FSDP(nn.Linear(2, 2), use_orig_params=1)


def test_fsdp_modules_lists_wrappers_outermost_first(single_rank_group: None) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    net[1] = FSDP(net[1])
    model = FSDP(net)
    assert FSDP.fsdp_modules(model) == [model, net[1]]
    assert FSDP.fsdp_modules(nn.Sequential(model), root_only=True) == [model]


# ---------------------------------------------------------------------- summon_full_params
def test_summon_takes_torchs_arguments(single_rank_group: None) -> None:
    model = FSDP(nn.Linear(2, 2, bias=False))
    before = model.state_dict()["weight"].clone()
    with FSDP.summon_full_params(model, writeback=False):
        model.module.weight.data.add_(1)
    assert torch.equal(model.state_dict()["weight"], before), "writeback=False discards the change"
    with FSDP.summon_full_params(model, writeback=True, offload_to_cpu=True):  # (the CPU already)
        model.module.weight.data.add_(1)
    assert torch.equal(model.state_dict()["weight"], before + 1)
    with pytest.raises(NotImplementedError, match="pass writeback=False"):
        with model.summon_full_params(rank0_only=True):  # (torch refuses it too)
            pass
    with pytest.raises(ValueError, match="contradicts"):
        with model.summon_full_params(volatile=True, writeback=True):
            pass
    with FSDP.summon_full_params(nn.Sequential(model)):  # a plain module holding the wrapper, as torch takes
        assert model.training_state is fsdp.TrainingState.SUMMON_FULL_PARAMS


@pytest.mark.parametrize("mixed", [False, True])
def test_summon_with_grads_shows_and_writes_back_full_gradients(single_rank_group: None, mixed: bool) -> None:
    """At world size 1 the shard is the whole flat parameter, and (without casting) the same tensor: a
    gradient replaced in a volatile summon is dropped, a writing one keeps it; an in-place change stays
    even without writeback, since the shown gradient is the shard gradient itself (NO_SHARD, as torch)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model = FSDP(copy.deepcopy(ref), mixed_precision=mixed)
    x = torch.randn(5, 3)
    ref(x).sum().backward()
    model(x).sum().backward()
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.module[0].weight.grad = torch.zeros_like(model.module[0].weight.grad)  # replaced: dropped
    tol = 1e-2 if mixed else 0.0
    assert grads.keys() == dict(ref.named_parameters()).keys()
    for n, p in ref.named_parameters():
        assert (grads[n] - p.grad).abs().max() <= tol, n
    with FSDP.summon_full_params(model, with_grads=True):
        assert model.module[0].weight.grad.abs().sum() > 0, "the volatile change was discarded"
        model.module[0].weight.grad.mul_(2)  # in place
        model.module[1].bias.grad = torch.full((2,), 7.0)  # replaced
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        assert torch.allclose(model.module[0].weight.grad, 2 * grads["0.weight"])
        assert torch.equal(model.module[1].bias.grad, torch.full((2,), 7.0))
        assert torch.equal(model.module[0].bias.grad, grads["0.bias"]), "the rest unchanged"
        model.module[0].bias.grad.add_(1.0)  # in place, without writeback
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        assert torch.equal(model.module[0].bias.grad, grads["0.bias"] + 1), "kept, as torch keeps it"
    model.zero_grad(set_to_none=True)
    with FSDP.summon_full_params(model, with_grads=True):
        assert all(p.grad is None for p in model.parameters()), "no gradient shows none"
        model.module[1].bias.grad = torch.ones(2)
    assert model.flat_param_0.grad is not None, "a gradient set inside is kept"
    with FSDP.summon_full_params(model, with_grads=True):
        for p in model.parameters():
            p.grad = None
    assert model.flat_param_0.grad is None, "gradients cleared inside are cleared"


def test_state_dict_type_takes_torchs_types_and_configs(single_rank_group: None) -> None:
    model = FSDP(nn.Linear(2, 2))
    sharded = torch_fsdp.StateDictType.SHARDED_STATE_DICT
    # torch's default sharded configs offload to the CPU: where compute runs on the CPU, that is a no-op
    with FSDP.state_dict_type(
        model,
        sharded,
        torch_fsdp.ShardedStateDictConfig(offload_to_cpu=True),
        torch_fsdp.ShardedOptimStateDictConfig(),
    ):
        state = model.state_dict()
        assert FSDP.get_state_dict_type(model).state_dict_type is fsdp.StateDictType.SHARDED_STATE_DICT
    assert type(state["weight"]).__name__ == "DTensor"
    for configs in (
        (fsdp.FullStateDictConfig(rank0_only=True), None),
        (None, fsdp.FullOptimStateDictConfig(rank0_only=True)),
    ):
        with pytest.raises(
            NotImplementedError, match=r"appl(y|ies) to FULL_STATE_DICT only, not SHARDED_STATE_DICT"
        ):
            FSDP.set_state_dict_type(model, sharded, *configs)
    assert FSDP.get_state_dict_type(model).state_dict_type is fsdp.StateDictType.FULL_STATE_DICT


def test_a_policy_that_is_not_callable_leaves_the_model_unwrapped(single_rank_group: None) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(TypeError, match="auto_wrap_policy must be callable"):
        FSDP(net, auto_wrap_policy={nn.Linear}, mixed_precision=fsdp.MixedPrecision(param_dtype=BF16))
    assert not any(isinstance(m, FSDP) for m in net.modules()), "the batch norm was not wrapped either"


class _HalfHead(nn.Module):
    """Two fp32 layers a policy wraps, and the root's own parameter in fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.head = nn.Parameter(torch.ones(2, dtype=torch.float16))


@pytest.mark.parametrize("where", ["root", "last child"])
def test_a_failing_auto_wrap_call_leaves_the_model_as_it_was(single_rank_group: None, where: str) -> None:
    """Every option and every parameter's dtype is checked before the policy wraps anything, so a
    failing call does not leave the first children flattened into wrappers."""
    net: nn.Module = _HalfHead()
    if where == "last child":
        net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2).half())
    before = {name: (p, p.detach().clone()) for name, p in net.named_parameters()}
    with pytest.raises(ValueError, match=r"mixed precision keeps fp32 \(or fp64\) master weights"):
        FSDP(net, auto_wrap_policy=fsdp.transformer_auto_wrap_policy({nn.Linear}), mixed_precision=True)
    assert not any(isinstance(m, FSDP) for m in net.modules())
    after = dict(net.named_parameters())
    assert after.keys() == before.keys()
    for name, (p, value) in before.items():
        assert after[name] is p and torch.equal(p, value), name


def test_full_precision_classes_keep_their_dtype_check_of_their_own(single_rank_group: None) -> None:
    """The early check leaves out the modules ``_module_classes_to_ignore`` wraps without mixed
    precision: their parameters need not be fp32, as before."""
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2).half())
    mp = fsdp.MixedPrecision(param_dtype=BF16)
    model = FSDP(net, auto_wrap_policy=fsdp.transformer_auto_wrap_policy({nn.Linear}), mixed_precision=mp)
    assert isinstance(net[1], FSDP) and net[1].flat_param_0.dtype == torch.float16
    assert isinstance(net[0], FSDP) and model.module is net


def test_a_custom_policy_may_give_a_module_a_precision_of_its_own(single_rank_group: None) -> None:
    """torch's ``CustomPolicy``: a dict overrides the constructor's options for that module, and
    the early dtype check leaves its parameters to its own wrapper."""
    from torch.distributed.fsdp.wrap import CustomPolicy

    def pick(m: nn.Module) -> bool | dict[str, Any]:
        return {"mixed_precision": None} if isinstance(m, nn.BatchNorm1d) else isinstance(m, nn.Linear)

    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2).half())
    FSDP(net, auto_wrap_policy=CustomPolicy(pick), mixed_precision=fsdp.MixedPrecision(param_dtype=BF16))
    assert isinstance(net[0], FSDP) and net[0].mixed_precision
    assert isinstance(net[1], FSDP) and not net[1].mixed_precision
    assert net[1].flat_param_0.dtype == torch.float16


class _Seen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.dtypes.append(x.dtype)
        return self.fc(x)


@pytest.mark.parametrize(
    ("param_dtype", "given", "seen"),
    [(BF16, torch.float16, BF16), (BF16, torch.float64, BF16), (F32, BF16, F32), (BF16, torch.int64, None)],
)
def test_a_mixed_precision_root_casts_every_floating_input(
    single_rank_group: None, param_dtype: torch.dtype, given: torch.dtype, seen: torch.dtype | None
) -> None:
    """torch's rule: every floating input that is not ``param_dtype`` is cast, not only fp32 ones."""
    inner = _Seen()
    model = FSDP(inner, mixed_precision=fsdp.MixedPrecision(param_dtype=param_dtype))
    if seen is None:  # integers are left alone (here they reach the linear layer and fail there)
        with pytest.raises(RuntimeError):
            model(torch.ones(2, 4, dtype=given))
        assert inner.dtypes == [given]
        return
    model(torch.randn(2, 4).to(given))
    assert inner.dtypes == [seen]


def test_fairscales_flag_keeps_fairscales_casts(single_rank_group: None) -> None:
    """``mixed_precision=True``: buffers in the compute dtype, only fp32 inputs cast, and the root's
    cast unrecorded (the fp32 leaf gets no gradient; the cast copy does)."""
    inner = _Seen()
    model = FSDP(inner, mixed_precision=True, compute_dtype=BF16)
    assert inner.scale.dtype == BF16
    x = torch.randn(2, 4, requires_grad=True)
    model(x).float().sum().backward()
    assert inner.dtypes == [BF16] and x.grad is None
    with pytest.raises(RuntimeError):  # an fp16 input is not cast under fairscale's rule
        model(torch.randn(2, 4, dtype=torch.float16))
    assert inner.dtypes[-1] == torch.float16


class _Router(nn.Module):
    """A module that must run in fp32 (a gate, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 4)
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.dtypes.append(x.dtype)
        return torch.softmax(self.gate(x), dim=-1)


@pytest.mark.parametrize("param_dtype", [BF16, None])
def test_ignored_classes_run_in_fp32_between_casts(
    single_rank_group: None, param_dtype: torch.dtype | None
) -> None:
    net = nn.Sequential(nn.Linear(4, 4), _Router(), nn.Linear(4, 4))
    mp = fsdp.MixedPrecision(param_dtype=param_dtype, buffer_dtype=BF16, _module_classes_to_ignore=(_Router,))
    model = FSDP(net, auto_wrap_policy=lambda module, recurse, **_: recurse, mixed_precision=mp)
    router = net[1]
    assert isinstance(router, FSDP) and not router.mixed_precision
    out = model(torch.randn(3, 4))
    assert router.module.dtypes == [F32], "the ignored module computes in fp32"
    assert out.dtype == (param_dtype or F32), "and hands the next layer the dtype it was given"
    out.float().sum().backward()
    assert router.flat_param_0.grad.dtype == F32


class _Gate(nn.Module):
    def forward(self, mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x * mask


def test_an_ignored_module_hands_back_the_dtype_it_cast(single_rank_group: None) -> None:
    """Outputs go back to the dtype of the inputs that were cast, not of an fp32 input beside them."""
    net = nn.Sequential(nn.Linear(4, 4))
    net.gate = _Gate()
    mp = fsdp.MixedPrecision(param_dtype=BF16, _module_classes_to_ignore=(_Gate,))
    FSDP(net, auto_wrap_policy=lambda module, recurse, **_: recurse, mixed_precision=mp)
    out = net.gate(torch.ones(2, 4), torch.ones(2, 4, dtype=BF16))
    assert out.dtype == BF16
    assert net.gate(torch.ones(2, 4), torch.ones(2, 4)).dtype == F32, "nothing cast: nothing cast back"


def _tied_adam() -> tuple[FSDP, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    net[1].weight = net[0].weight  # tied: "0.weight" first, "1.weight" its alias
    model = FSDP(net)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2]])).sum().backward()
    optim.step()
    return model, optim, FSDP.full_optim_state_dict(model, optim)


def test_name_keyed_optimizer_state_reads_aliases_and_refuses_stray_entries(single_rank_group: None) -> None:
    model, optim, full = _tied_adam()
    assert full["param_groups"][0]["params"] == ["0.weight"]
    aliased = {**full, "state": {"1.weight": full["state"]["0.weight"]}}  # the state under the alias
    loaded = FSDP.shard_full_optim_state_dict(aliased, model)
    assert torch.equal(loaded["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])
    stray = {**full, "state": {**full["state"], "2.weight": full["state"]["0.weight"]}}
    with pytest.raises(ValueError, match=r"an entry for '2\.weight', which no param group lists"):
        FSDP.shard_full_optim_state_dict(stray, model)


def test_optim_state_dict_converts_the_dict_it_is_given(single_rank_group: None) -> None:
    model, optim, full = _tied_adam()
    named = FSDP.optim_state_dict(model, optim, optim.state_dict())
    assert torch.equal(named["state"]["0.weight"]["exp_avg"], full["state"]["0.weight"]["exp_avg"])
    changed = optim.state_dict()
    changed["param_groups"][0]["lr"] = 0.5
    assert FSDP.optim_state_dict(model, optim, changed)["param_groups"][0]["lr"] == 0.5
