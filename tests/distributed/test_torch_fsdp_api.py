"""torch FSDP1's spellings: a script written for ``torch.distributed.fsdp`` runs after changing the
import of the wrapper alone, and trains like the plain model."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from tests.parity import compare_training
from tests.rank_pool import RankPool

BF16, F32 = torch.bfloat16, torch.float32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8) if batch_norm else nn.Identity()
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.bn(self.inp(x))))


def _vec(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(n, 6, generator=g)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _torch_script_options(kind: str) -> dict[str, Any]:
    """The constructor arguments of a typical torch FSDP1 script, as torch's objects or ours."""
    lib: Any = torch_fsdp if kind == "torch" else fsdp
    return {
        "auto_wrap_policy": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        "sharding_strategy": lib.ShardingStrategy.SHARD_GRAD_OP,
        "cpu_offload": lib.CPUOffload(offload_params=False),
        "backward_prefetch": lib.BackwardPrefetch.BACKWARD_PRE,
        "mixed_precision": lib.MixedPrecision(param_dtype=F32, reduce_dtype=F32),
        "device_id": torch.device("cpu"),
        "limit_all_gathers": True,
        "use_orig_params": False,
        "sync_module_states": True,
    }


def _config_of(model: FSDP) -> list[tuple[Any, ...]]:
    return [
        (w.fsdp_config.sharding, w.fsdp_config.precision, w.fsdp_config.schedule, w.fsdp_config.offload)
        for w in FSDP.fsdp_modules(model)
    ]


def _train_torch_script(kind: str) -> tuple[list[tuple[Any, ...]], list[str], dict[str, float]]:
    torch.manual_seed(0)
    ref = Net()
    model = FSDP(copy.deepcopy(ref), **_torch_script_options(kind))
    paths = [n for n, m in model.named_modules() if isinstance(m, FSDP)]
    return _config_of(model), paths, compare_training(ref, model, _vec, _loss, steps=3)


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_torch_option_objects_configure_the_wrapper_as_ours_do(pool: RankPool) -> None:
    for (theirs, paths, diffs), (ours, _, _) in zip(
        pool.run(_train_torch_script, "torch"), pool.run(_train_torch_script, "ours")
    ):
        assert theirs == ours, "torch's option objects give the configuration of ours"
        assert paths == ["", "_fsdp_wrapped_module.blocks.0", "_fsdp_wrapped_module.blocks.1"]
        assert theirs[0][0].strategy is fsdp.ShardingStrategy.SHARD_GRAD_OP
        assert theirs[0][2].backward_prefetch is True
        assert max(diffs.values()) < 1e-5, diffs


def _reduce_bytes(mp: Any) -> tuple[int, int, torch.dtype]:
    torch.manual_seed(0)
    model = FSDP(nn.Linear(8, 8), mixed_precision=mp, bucket_cap_mb=0)
    model(torch.randn(4, 8)).sum().backward()
    stats = model.comm_stats()
    return stats["reduce_scatter"]["bytes"], stats["all_gather"]["bytes"], model.flat_param_0.grad.dtype


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_reduce_dtype_alone_casts_the_reduction_only(pool: RankPool) -> None:
    for (rs_low, ag_low, grad), (rs_full, ag_full, _) in zip(
        pool.run(_reduce_bytes, fsdp.MixedPrecision(reduce_dtype=BF16)), pool.run(_reduce_bytes, None)
    ):
        assert rs_low * 2 == rs_full, "the gradients travel in bf16"
        assert ag_low == ag_full, "the parameters travel in fp32"
        assert grad == F32


def _batch_norm_apart(ignore: tuple[type, ...] | None) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = Net(batch_norm=True)
    # eval mode: normalized by running statistics, so a rank's part of the batch is normalized as in
    # the whole batch (train mode would use per-rank batch statistics, not those of the plain model)
    ref.bn.eval()
    ref.bn.running_mean.normal_()
    ref.bn.running_var.uniform_(0.5, 2.0)
    kwargs = {} if ignore is None else {"_module_classes_to_ignore": ignore}
    mp = torch_fsdp.MixedPrecision(param_dtype=BF16, buffer_dtype=BF16, **kwargs)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FSDP(copy.deepcopy(ref), auto_wrap_policy=policy, mixed_precision=mp)
    diffs = compare_training(ref, model, _vec, _loss, steps=2)
    bn = model.module.bn
    return {
        "warned": any(
            "These modules will be wrapped as separate FSDP" in str(w.message)
            and "BatchNorm1d" in str(w.message)
            for w in caught
        ),
        "wrapped": isinstance(bn, FSDP),
        "mixed": bn.mixed_precision if isinstance(bn, FSDP) else None,
        "stats": (bn.module if isinstance(bn, FSDP) else bn).running_mean.dtype,
        "paths": [n for n, m in model.named_modules() if isinstance(m, FSDP)],
        "loss": diffs["loss"],
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_batch_norm_gets_a_full_precision_wrapper_under_an_auto_wrap_policy(pool: RankPool) -> None:
    for apart, together in zip(pool.run(_batch_norm_apart, None), pool.run(_batch_norm_apart, ())):
        assert apart["wrapped"] and not apart["mixed"] and apart["warned"], "as torch, with a UserWarning"
        assert apart["stats"] == F32, "its running statistics stay fp32"
        assert apart["paths"][1] == "_fsdp_wrapped_module.bn"
        assert apart["loss"] < 0.05, "bf16 training follows the plain model"
        assert not together["wrapped"] and not together["warned"] and together["stats"] == BF16, (
            "_module_classes_to_ignore=() turns it off"
        )


def _param_groups_by_name() -> tuple[list[str], float]:
    """torch's use_orig_params=True idiom: AdamW groups picked by parameter name (no decay for biases
    and norms); the wrapped model must train like the plain one with the same groups."""
    torch.manual_seed(0)
    ref = Net()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=policy, use_orig_params=True)

    def groups(m: nn.Module) -> list[dict[str, Any]]:
        named = list(m.named_parameters())
        plain = [p for n, p in named if n.endswith("bias") or "norm" in n]
        decayed = [p for n, p in named if not (n.endswith("bias") or "norm" in n)]
        return [{"params": decayed, "weight_decay": 0.5}, {"params": plain, "weight_decay": 0.0}]

    optims = [torch.optim.AdamW(groups(m), lr=1e-2) for m in (model, ref)]
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        batch = _vec(torch.Generator().manual_seed(step), 4 * world)
        for m, x, opt in ((model, batch[4 * rank : 4 * rank + 4], optims[0]), (ref, batch, optims[1])):
            opt.zero_grad()
            _loss(m(x)).backward()
            opt.step()
    full = model.state_dict()
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    resolved = all(model.get_parameter(n) is p for n, p in model.named_parameters())
    return sorted(n for n, _ in model.named_parameters()), diff, resolved


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_use_orig_params_lets_the_optimizer_group_parameters_by_name(pool: RankPool) -> None:
    for names, diff, resolved in pool.run(_param_groups_by_name):
        assert names == sorted(n for n, _ in Net().named_parameters())
        assert diff < 1e-5
        assert resolved, "get_parameter() finds every name named_parameters() gives"


# ---------------------------------------------------------------------- optimizer state, torch's methods
def _trained(seed: int, auto: bool, steps: int = 2) -> tuple[nn.Module, FSDP, torch.optim.Optimizer]:
    """A plain reference and its wrapped copy, both trained ``steps`` Adam steps on the same data."""
    torch.manual_seed(seed)
    ref = Net()
    kwargs: dict[str, Any] = {}
    if auto:
        kwargs["auto_wrap_policy"] = functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}
        )
    model = FSDP(copy.deepcopy(ref), **kwargs)
    _adam_steps(ref, model, steps)
    return ref, model, model._test_optim  # type: ignore[return-value]


def _adam_steps(ref: nn.Module, model: FSDP, steps: int, start: int = 0) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if not hasattr(model, "_test_optim"):
        model._test_optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref._test_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(start, start + steps):
        batch = _vec(torch.Generator().manual_seed(step), 4 * world)
        for m, x in ((model, batch[4 * rank : 4 * rank + 4]), (ref, batch)):
            m._test_optim.zero_grad()
            _loss(m(x)).backward()
            m._test_optim.step()


def _plain_named_state(ref: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    names = [n for n, _ in ref.named_parameters()]
    return {names[i]: v for i, v in ref._test_optim.state_dict()["state"].items()}


def _largest_difference(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            worst = max(
                worst,
                (torch.as_tensor(a[name][key]).float() - torch.as_tensor(b[name][key]).float())
                .abs()
                .max()
                .item(),
            )
    return worst


def _full_optim_state(rank0_only: bool) -> tuple[bool, float, list[str]]:
    ref, model, optim = _trained(0, auto=True)
    config = fsdp.FullOptimStateDictConfig(rank0_only=rank0_only)
    with FSDP.state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT, None, config):
        osd = FSDP.optim_state_dict(model, optim)
    if not osd:
        return False, 0.0, []
    return True, _largest_difference(osd["state"], _plain_named_state(ref)), osd["param_groups"][0]["params"]


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_optim_state_dict_is_keyed_by_name_like_the_plain_optimizers(pool: RankPool) -> None:
    names = [n for n, _ in Net().named_parameters()]
    for held, diff, params in pool.run(_full_optim_state, False):
        assert held, "every rank holds it by default"
        assert diff < 1e-6 and params == names
    assert [held for held, _, _ in pool.run(_full_optim_state, True)] == [True, False]


def _round_trip(kind: str) -> float:
    """Save the optimizer state of a model wrapped one way, load it into a model wrapped another way,
    train both on; the loaded one must follow the uninterrupted reference."""
    ref, model, optim = _trained(0, auto=True)
    state_type = getattr(fsdp.StateDictType, kind)
    with FSDP.state_dict_type(model, state_type):
        msd, osd = model.state_dict(), FSDP.optim_state_dict(model, optim)
    fresh = FSDP(Net())  # another wrap plan: one wrapper
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with FSDP.state_dict_type(fresh, state_type):
        fresh.load_state_dict(msd)
        fresh_optim.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optim, osd))
    fresh._test_optim = fresh_optim
    _adam_steps(ref, fresh, 2, start=2)
    full = fresh.state_dict()
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_optim_state_dict_round_trips_into_another_wrap_plan(pool: RankPool, kind: str) -> None:
    assert max(pool.run(_round_trip, kind)) < 1e-6


def _full_then_scatter(how: str) -> tuple[float, bool]:
    _, model, optim = _trained(0, auto=False)
    full = FSDP.full_optim_state_dict(model, optim, rank0_only=(how == "scatter"))
    held = bool(full)
    fresh = FSDP(Net())  # (its values do not matter: only the optimizer state is compared)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    if how == "scatter":
        shard = FSDP.scatter_full_optim_state_dict(full if dist.get_rank() == 0 else None, fresh)
    else:
        shard = FSDP.shard_full_optim_state_dict(full, fresh)
    fresh_optim.load_state_dict(shard)
    mine, loaded = optim.state_dict()["state"], fresh_optim.state_dict()["state"]
    diff = max((mine[i][k].float() - loaded[i][k].float()).abs().max().item() for i in mine for k in mine[i])
    return diff, held


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_full_optim_state_dict_shards_and_scatters_back(pool: RankPool) -> None:
    assert pool.run(_full_then_scatter, "shard") == [(0.0, True), (0.0, True)]
    assert pool.run(_full_then_scatter, "scatter") == [(0.0, True), (0.0, False)]


def _rekeyed() -> dict[str, Any]:
    """A full optimizer state dict re-keyed by id loads into a plain optimizer; a plain optimizer's
    re-keyed by name loads into the wrapped one; torch's own rekey agrees on the plain model."""
    ref, model, optim = _trained(0, auto=True)
    full = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    by_id = FSDP.rekey_optim_state_dict(full, fsdp.OptimStateKeyType.PARAM_ID, ref)
    plain = ref._test_optim.state_dict()
    torch_by_name = torch_fsdp.FullyShardedDataParallel.rekey_optim_state_dict(
        plain, torch_fsdp.OptimStateKeyType.PARAM_NAME, ref
    )
    ours_by_name = FSDP.rekey_optim_state_dict(plain, torch_fsdp.OptimStateKeyType.PARAM_NAME, ref)
    fresh = torch.optim.Adam(ref.parameters(), lr=1e-2)
    fresh.load_state_dict(by_id)
    loaded = fresh.state_dict()["state"]
    diff = max(
        (plain["state"][i][k].float() - loaded[i][k].float()).abs().max().item()
        for i in plain["state"]
        for k in plain["state"][i]
    )
    wrapped_optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    wrapped_optim.load_state_dict(FSDP.shard_full_optim_state_dict(ours_by_name, model))
    mine, back = optim.state_dict()["state"], wrapped_optim.state_dict()["state"]
    diff_back = max(
        (mine[i][k].float() - back[i][k].float()).abs().max().item() for i in mine for k in mine[i]
    )
    errors = []
    for call in (
        lambda: FSDP.rekey_optim_state_dict(full, fsdp.OptimStateKeyType.PARAM_ID, model),
        lambda: FSDP.rekey_optim_state_dict(full, "PARAM_NUMBER", ref),
        lambda: FSDP.rekey_optim_state_dict(
            {**full, "state": {"nope": {}}}, fsdp.OptimStateKeyType.PARAM_ID, ref
        ),
    ):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return {
        "id_keys": sorted(by_id["state"]) == sorted(plain["state"])
        and by_id["param_groups"] == plain["param_groups"],
        "same_as_torch": [{**g, "params": sorted(g["params"])} for g in ours_by_name["param_groups"]]
        == torch_by_name["param_groups"]  # (torch sorts each group's names)
        and _largest_difference(ours_by_name["state"], torch_by_name["state"]) == 0.0,
        "noop": FSDP.rekey_optim_state_dict(full, fsdp.OptimStateKeyType.PARAM_NAME, ref) is full,
        "diff": diff,
        "diff_back": diff_back,
        "errors": errors,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_rekey_optim_state_dict_moves_state_between_names_and_ids(pool: RankPool) -> None:
    for r in pool.run(_rekeyed):
        assert r["id_keys"] and r["same_as_torch"] and r["noop"], r
        assert r["diff"] < 1e-6 and r["diff_back"] < 1e-6, r  # (the plain and wrapped runs round apart)
        assert len(r["errors"]) == 3, r
        assert "flattened parameters" in r["errors"][0]
        assert "PARAM_NAME or OptimStateKeyType.PARAM_ID" in r["errors"][1]
        assert "name no parameter of the model" in r["errors"][2]


def _roots_and_refusals() -> dict[str, Any]:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    net[0] = FSDP(net[0])
    model = FSDP(net)
    before = model.is_root
    roots = [model.check_is_root(), net[0].check_is_root()]
    refused = []
    for call in (lambda: model.register_comm_hook(None, lambda *a: None),):
        try:
            call()
        except NotImplementedError as e:
            refused.append(str(e).split(" is not supported")[0])
    return {"before": before, "roots": roots, "refused": refused}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_check_is_root_and_torchs_unsupported_methods(pool: RankPool) -> None:
    for r in pool.run(_roots_and_refusals):
        assert r["before"] is None and r["roots"] == [True, False], r
        assert r["refused"] == ["FullyShardedDataParallel.register_comm_hook"], r


def _bad_calls() -> list[str]:
    model = FSDP(Net())
    optim = torch.optim.Adam(model.parameters())
    errors = []
    other = dist.new_group([0])
    for call in (
        lambda: FSDP.full_optim_state_dict(model, optim, group=other),
        lambda: FSDP.full_optim_state_dict(model, optim, optim_input=[nn.Parameter(torch.zeros(1))]),
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # (optim_input is deprecated, as in torch)
                call()
        except (TypeError, ValueError, NotImplementedError) as e:
            errors.append(str(e))
    return errors


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_optimizer_state_calls_that_cannot_be_honoured_say_why(pool: RankPool) -> None:
    for errors in pool.run(_bad_calls):
        assert len(errors) == 2
        assert "`group` must hold the ranks the model trains over" in errors[0]
        assert "`optim_input` holds other parameters than `optim`'s" in errors[1]


# ---------------------------------------------------------------------- torch FSDP1's own checkpoints
class Mid(nn.Linear):
    """Wrapped alone: torch's flat order (the root's 0.*, 2.*, then 1.*) is not named_parameters' order."""


def _mid_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Mid(8, 8), nn.Linear(8, 8))


def _wrap_mid(cls: Any) -> Any:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return cls(_mid_net(), auto_wrap_policy=ModuleWrapPolicy({Mid}), device_id=torch.device("cpu"))


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        optim.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step + dist.get_rank()))).pow(
            2
        ).mean().backward()
        optim.step()
    return optim


def _named_state(osd: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {k: torch.as_tensor(v).float() for k, v in entry.items()} for n, entry in osd["state"].items()}


def _cross_load(direction: str) -> float:
    """Optimizer state saved by one library (trained), loaded into the other (fresh), read back by name."""
    TorchFSDP = torch_fsdp.FullyShardedDataParallel
    src_cls, dst_cls = (TorchFSDP, FSDP) if direction == "torch_to_ours" else (FSDP, TorchFSDP)
    src = _wrap_mid(src_cls)
    src_optim = _adam(src)
    full = src_cls.full_optim_state_dict(src, src_optim, rank0_only=False)
    with src_cls.state_dict_type(src, torch_fsdp.StateDictType.FULL_STATE_DICT):
        named = src_cls.optim_state_dict(src, src_optim)
    worst = 0.0
    for how in ("optim_state_dict_to_load", "shard_full_optim_state_dict"):
        dst = _wrap_mid(dst_cls)
        dst_optim = torch.optim.Adam(dst.parameters(), lr=1e-2)
        with dst_cls.state_dict_type(dst, torch_fsdp.StateDictType.FULL_STATE_DICT):
            if how == "optim_state_dict_to_load":
                dst_optim.load_state_dict(dst_cls.optim_state_dict_to_load(dst, dst_optim, named))
            else:
                dst_optim.load_state_dict(dst_cls.shard_full_optim_state_dict(full, dst))
            back = _named_state(dst_cls.optim_state_dict(dst, dst_optim))
        expected = _named_state(named)
        assert back.keys() == expected.keys()
        for n in expected:
            for k in expected[n]:
                worst = max(worst, (back[n][k] - expected[n][k]).abs().max().item())
    return worst


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_optimizer_state_crosses_between_torch_fsdp1_and_this_library(pool: RankPool, direction: str) -> None:
    assert pool.run(_cross_load, direction) == [0.0, 0.0]


def _rank0_only_load() -> float:
    model = _wrap_mid(FSDP)
    optim = _adam(model)
    configs = (fsdp.FullStateDictConfig(rank0_only=True), fsdp.FullOptimStateDictConfig(rank0_only=True))
    with FSDP.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT, *configs):
        saved = FSDP.optim_state_dict(model, optim)  # rank 0 only; {} elsewhere
    fresh = _wrap_mid(FSDP)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with FSDP.state_dict_type(fresh, fsdp.StateDictType.FULL_STATE_DICT, *configs):
        fresh_optim.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optim, saved))
    mine, loaded = optim.state_dict()["state"], fresh_optim.state_dict()["state"]
    return max((mine[i][k].float() - loaded[i][k].float()).abs().max().item() for i in mine for k in mine[i])


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_rank0_only_optimizer_state_loads_on_every_rank(pool: RankPool) -> None:
    assert pool.run(_rank0_only_load) == [0.0, 0.0]


# ---------------------------------------------------------------------- summon_full_params, torch's keywords
def _summon_with_grads(use_orig_params: bool, strategy: str) -> dict[str, Any]:
    """Full gradients of a nested model, as the plain model has them after the same (whole) batch."""
    torch.manual_seed(0)
    ref = Net()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(
        copy.deepcopy(ref),
        auto_wrap_policy=policy,
        use_orig_params=use_orig_params,
        sharding_strategy=fsdp.ShardingStrategy[strategy],
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = _vec(torch.Generator().manual_seed(3), 4 * world)
    _loss(model(batch[4 * rank : 4 * rank + 4])).backward()
    _loss(ref(batch)).backward()
    with FSDP.summon_full_params(model, with_grads=True):
        shown = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.module.out.bias.grad.fill_(float(rank + 1))  # each rank writes back its own chunk
    diff = max((shown[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    with FSDP.summon_full_params(model, with_grads=True, writeback=False):
        written = model.module.out.bias.grad.clone()
    return {"names": sorted(shown), "diff": diff, "written": written.tolist()}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    "use_orig_params, strategy", [(False, "FULL_SHARD"), (True, "FULL_SHARD"), (False, "NO_SHARD")]
)
def test_summon_with_grads_shows_the_plain_models_gradients(
    pool: RankPool, use_orig_params: bool, strategy: str
) -> None:
    results = pool.run(_summon_with_grads, use_orig_params, strategy)
    for r in results:
        assert r["names"] == sorted(n for n, _ in Net().named_parameters())
        assert r["diff"] < 1e-6
    values = set(results[0]["written"])
    if strategy == "NO_SHARD":  # every rank holds (and writes) the whole gradient
        assert [r["written"] for r in results] == [[1.0] * 3, [2.0] * 3]
        return
    assert results[0]["written"] == results[1]["written"]
    if use_orig_params:  # the 3-element bias is a flat parameter of its own, padded to 2 x 2
        assert results[0]["written"] == [1.0, 1.0, 2.0]
    else:
        assert values <= {1.0, 2.0}, "every element comes from the rank that holds it"


def _summon_rank0_only() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = Net()
    model = FSDP(copy.deepcopy(ref))
    _loss(model(_vec(torch.Generator().manual_seed(dist.get_rank()), 4))).backward()
    model.reset_comm_stats()
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False, with_grads=True):
        names = sorted(n for n, _ in model.named_parameters())
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = [p.grad is not None for _, p in model.named_parameters()]
    gathered = model.comm_stats()["all_gather"]["calls"]
    diff = (
        max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
        if full.keys() == dict(ref.named_parameters()).keys()
        else None
    )
    return {"names": names, "diff": diff, "grads": all(grads), "gathers": gathered}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_summon_rank0_only_shows_full_parameters_on_rank_0_alone(pool: RankPool) -> None:
    first, second = pool.run(_summon_rank0_only)
    assert first["names"] == sorted(n for n, _ in Net().named_parameters())
    assert first["diff"] == 0.0 and first["grads"]
    assert second["names"] == ["flat_param_0"], "the other ranks keep their shards"
    assert first["gathers"] == second["gathers"] == 2, "every rank takes part in the gathers"


# ---------------------------------------------------------------------- torch's activation checkpointing
class _CountingBlock(Block):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


def _with_torch_checkpointing(cls: Any, ref: nn.Module, impl: str, order: str) -> Any:
    """torch FSDP1's recipe: ``apply_activation_checkpointing`` on the blocks, after wrapping (the
    checkpoint wrapper then sits inside each block's wrapper) or before it."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as ac

    def apply(m: nn.Module) -> None:
        ac.apply_activation_checkpointing(
            m,
            checkpoint_wrapper_fn=functools.partial(
                ac.checkpoint_wrapper, checkpoint_impl=ac.CheckpointImpl[impl]
            ),
            check_fn=lambda s: isinstance(s, _CountingBlock),
        )

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={_CountingBlock})
    model = copy.deepcopy(ref)
    if order == "before":
        apply(model)
    model = cls(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    if order == "after":
        apply(model)
    return model


def _counting_net() -> nn.Module:
    torch.manual_seed(0)
    ref = Net()
    for i in range(2):
        ref.blocks[i].__class__ = _CountingBlock
    return ref


def _torch_activation_checkpointing(impl: str, order: str) -> dict[str, Any]:
    ref = _counting_net()
    model = _with_torch_checkpointing(FSDP, ref, impl, order)
    _CountingBlock.calls = 0
    diffs = compare_training(ref, model, _vec, _loss, steps=2)
    recomputed = _CountingBlock.calls - 2 * 2  # (the reference: 2 steps x 2 blocks, no recomputation)
    kinds = [type(m).__name__ for m in model.modules()]
    keys: dict[str, list[str]] = {}
    loaded: dict[str, float] = {}
    fresh = _with_torch_checkpointing(FSDP, Net(), impl, order)
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        with FSDP.state_dict_type(model, torch_fsdp.StateDictType[kind]):
            state = model.state_dict()
        keys[kind] = list(state)
        with FSDP.state_dict_type(fresh, torch_fsdp.StateDictType[kind]):
            fresh.load_state_dict(state)
        with FSDP.summon_full_params(model), FSDP.summon_full_params(fresh):
            loaded[kind] = max(
                (a - b).abs().max().item() for a, b in zip(model.parameters(), fresh.parameters())
            )
    optim = torch.optim.Adam(model.parameters())
    _loss(model(_vec(torch.Generator(), 4))).backward()
    optim.step()
    keys["optim"] = list(FSDP.optim_state_dict(model, optim)["state"])
    # torch FSDP1 with the same recipe names its state dicts so, too
    theirs = _with_torch_checkpointing(torch_fsdp.FullyShardedDataParallel, _counting_net(), impl, order)
    torch_keys = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        with torch_fsdp.FullyShardedDataParallel.state_dict_type(theirs, torch_fsdp.StateDictType[kind]):
            torch_keys[kind] = list(theirs.state_dict())
    return {
        "diffs": diffs,
        "recomputed": recomputed,
        "kinds": (kinds.count("CheckpointWrapper"), kinds.count("FullyShardedDataParallel")),
        "keys": keys,
        "torch_keys": torch_keys,
        "loaded": loaded,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    "impl, order", [("NO_REENTRANT", "after"), ("REENTRANT", "after"), ("NO_REENTRANT", "before")]
)
def test_torchs_apply_activation_checkpointing_recomputes_and_keeps_plain_names(
    pool: RankPool, impl: str, order: str
) -> None:
    plain = list(Net().state_dict())
    for r in pool.run(_torch_activation_checkpointing, impl, order):
        assert max(r["diffs"].values()) < 1e-5, r["diffs"]
        assert r["recomputed"] == 2 * 2 * 2, "each block runs forward twice per step: once more in backward"
        assert r["kinds"] == (2, 3)
        assert r["keys"]["FULL_STATE_DICT"] == plain == r["torch_keys"]["FULL_STATE_DICT"]
        assert r["keys"]["SHARDED_STATE_DICT"] == r["torch_keys"]["SHARDED_STATE_DICT"]
        assert sorted(r["keys"]["optim"]) == sorted(n for n, _ in Net().named_parameters())
        assert r["loaded"] == {"FULL_STATE_DICT": 0.0, "SHARDED_STATE_DICT": 0.0}


def _checkpoint_wrapper_placement(case: str) -> dict[str, Any]:
    """torch's checkpoint wrapper inside a unit (not at its boundary), around the root's module, and
    a plain child that only happens to be called like its attribute."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(4, 2))
    model_in = copy.deepcopy(ref)
    if case == "inside":
        model_in[1] = checkpoint_wrapper(model_in[1])
        model = FSDP(model_in, mixed_precision=True)  # (buffers in fp16 inside, fp32 in the state dict)
    elif case == "root":
        model = FSDP(checkpoint_wrapper(model_in))
    else:
        holder = nn.Module()
        holder._checkpoint_wrapped_module = model_in[1]  # a plain child of that name keeps its level
        model_in[1] = holder
        ref = copy.deepcopy(model_in)
        model = FSDP(model_in)
    state = model.state_dict()
    plain = ref.state_dict()
    result = {
        "keys": list(state) == list(plain),
        "freed": [k for k, v in state.items() if v.untyped_storage().size() == 0],
        "diff": max((state[k].float() - v.float()).abs().max().item() for k, v in plain.items()),
        "dtypes": {k: v.dtype for k, v in state.items()} == {k: v.dtype for k, v in plain.items()},
    }
    with torch.no_grad():
        for v in state.values():
            v.add_(1) if v.is_floating_point() else None
    model.load_state_dict(state)
    back = model.state_dict()
    result["loaded"] = max((back[k].float() - v.float()).abs().max().item() for k, v in state.items())
    return result


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("case", ["inside", "root", "literal_name"])
def test_full_state_dict_around_a_checkpoint_wrapper_anywhere(pool: RankPool, case: str) -> None:
    for r in pool.run(_checkpoint_wrapper_placement, case):
        assert r["keys"] and r["dtypes"], r
        assert r["freed"] == [], "every value is a copy, not a view of a freed full parameter"
        assert r["diff"] == 0.0 and r["loaded"] == 0.0, r


def _rank0_only_misuse() -> dict[str, Any]:
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), use_orig_params=True)
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        names = sorted(n for n, _ in model.named_parameters())
        try:
            model.state_dict()
            error = ""
        except RuntimeError as e:
            error = str(e)
    return {"names": names, "error": error}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_inside_a_rank0_only_summon_names_hold_and_state_dict_is_refused_everywhere(pool: RankPool) -> None:
    for r in pool.run(_rank0_only_misuse):
        assert r["names"] == ["0.bias", "0.weight", "1.bias", "1.weight"], "original names on every rank"
        assert "inside summon_full_params(rank0_only=True)" in r["error"], "every rank refuses (none gathers)"


def _reentrant_inside_a_unit(case: str) -> str:
    """torch's reentrant checkpointing inside a unit runs a backward per checkpointed region, so the
    unit's gradient comes in parts: refused with a message that says what to do, on every rank."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 4))
    )
    net[1] = checkpoint_wrapper(net[1], checkpoint_impl=CheckpointImpl.REENTRANT)
    if case == "two_regions":
        net[2] = checkpoint_wrapper(net[2], checkpoint_impl=CheckpointImpl.REENTRANT)
    model = FSDP(net)
    try:
        model(torch.randn(2, 4)).pow(2).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("case", ["one_region", "two_regions"])
def test_reentrant_checkpointing_inside_a_unit_says_what_to_do(pool: RankPool, case: str) -> None:
    for msg in pool.run(_reentrant_inside_a_unit, case):
        assert "during backward, after the wrapper that owns it reduced its gradient" in msg, msg
        assert "CheckpointImpl.NO_REENTRANT" in msg, msg
