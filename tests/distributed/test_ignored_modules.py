"""torch FSDP1's ``ignored_modules`` / ``ignored_states``: the ignored parameters stay plain
parameters under their names (not flattened, sharded, gathered, reduced or cast), the state dicts
and optimizer-state forms hold them, the policy wraps nothing inside them, and clipping counts them
once. Their gradients are the rank's own: the tests average them by hand, as a user would."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from fsdp import lambda_auto_wrap_policy
from fsdp.core.sharding import padded_numel
from tests.checkpointing import scramble_
from tests.distributed.test_torch_fsdp_api import Block
from tests.parity import handles_with_ref_names, reference_flat, shard_of
from tests.rank_pool import RankPool

PER_RANK = 4


class Head(nn.Module):
    """The module to ignore: a linear layer (that the policy would wrap) and a floating buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.head = Head()
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.head(self.inp(x))))


# wraps each Block and every Linear, so the Linear inside the ignored Head would be wrapped too
POLICY = lambda_auto_wrap_policy(lambda m: isinstance(m, (Block, nn.Linear)))
IGNORED = ["head.proj.weight", "head.proj.bias"]


def _wrapped(seed: int = 0, **kwargs: Any) -> tuple[Net, FSDP]:
    torch.manual_seed(seed)
    ref = Net()
    net = copy.deepcopy(ref)
    model = FSDP(net, ignored_modules=[net.head], auto_wrap_policy=POLICY, **kwargs)
    return ref, model


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(PER_RANK * dist.get_world_size(), 6, generator=g)


def _mine(batch: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return batch[rank * PER_RANK : (rank + 1) * PER_RANK]


def _average_ignored_grads(model: FSDP) -> None:
    """The user's part: make the ignored gradients the global batch's (the wrapper leaves them)."""
    for name, p in model.named_parameters():
        if name.endswith(tuple(IGNORED)) and p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def _step(
    model: FSDP, opt: torch.optim.Optimizer, step: int, clip: float | None = None
) -> torch.Tensor | None:
    model(_mine(_batch(step))).pow(2).mean().backward()
    _average_ignored_grads(model)
    norm = model.clip_grad_norm_(clip) if clip is not None else None
    opt.step()
    opt.zero_grad()
    return norm


# ---------------------------------------------------------------------- what is managed
def _layout(**kwargs: Any) -> dict[str, Any]:
    _, model = _wrapped(**kwargs)
    net = model.module
    params = dict(model.named_parameters())
    flat_names = [n for h, names in handles_with_ref_names(model) for n in names]
    wrapped = sorted(
        fsdp.comm.consistency.plain_name(n) or "<root>"
        for n, m in model.named_modules()
        if isinstance(m, FSDP)
    )
    return {
        "ignored_registered": [
            (
                n,
                tuple(params[f"_fsdp_wrapped_module.{n}"].shape),
                type(params[f"_fsdp_wrapped_module.{n}"]).__name__,
            )
            for n in IGNORED
        ],
        "ignored_are_the_modules_own": net.head.proj.weight
        is params["_fsdp_wrapped_module.head.proj.weight"],
        "flattened": sorted(flat_names),
        "wrappers": wrapped,
        "wrapper_inside_head": any(isinstance(m, FSDP) for m in net.head.modules()),
        "dtypes": (str(net.head.proj.weight.dtype), str(net.head.scale.dtype)),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_ignored_parameters_are_not_flattened_and_not_wrapped(pool: RankPool) -> None:
    for r in pool.run(_layout):
        assert r["ignored_registered"] == [
            ("head.proj.weight", (8, 8), "Parameter"),
            ("head.proj.bias", (8,), "Parameter"),
        ]
        assert r["ignored_are_the_modules_own"]
        assert not set(IGNORED) & set(r["flattened"]), r["flattened"]
        assert "inp.weight" in r["flattened"] and "blocks.0.fc.weight" in r["flattened"]
        assert not r["wrapper_inside_head"], "the policy must not wrap inside an ignored module"
        assert r["wrappers"] == sorted(
            ["<root>", "inp", "blocks.0", "blocks.0.fc", "blocks.1", "blocks.1.fc", "out"]
        )


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_mixed_precision_leaves_ignored_parameters_and_buffers_alone(pool: RankPool) -> None:
    mp = fsdp.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    for r in pool.run(_layout, mixed_precision=mp):
        assert r["dtypes"] == ("torch.float32", "torch.float32")
        assert not set(IGNORED) & set(r["flattened"])


def _ignored_inside_a_policy_unit() -> dict[str, Any]:
    """An ignored module inside a unit the policy wraps: that inner wrapper ignores it too."""
    torch.manual_seed(0)
    ref = Net()
    net = copy.deepcopy(ref)
    norm = net.blocks[0].norm
    model = FSDP(net, ignored_modules=[norm], auto_wrap_policy=POLICY)
    block = net.blocks[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    return {
        "block_wrapped": isinstance(block, FSDP),
        "block_ignores": isinstance(block, FSDP) and block._ignored.has_module(norm),
        "flattened": sorted(n for _, names in handles_with_ref_names(model) for n in names),
        "norm_params": [type(p).__name__ for p in norm.parameters()],
        "keys": list(model.state_dict()) == list(ref.state_dict()),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_policy_units_ignore_the_ignored_modules_inside_them(pool: RankPool) -> None:
    for r in pool.run(_ignored_inside_a_policy_unit):
        assert r["block_wrapped"] and r["block_ignores"]
        assert not any(n.startswith("blocks.0.norm.") for n in r["flattened"]), r["flattened"]
        assert "blocks.1.norm.weight" in r["flattened"]
        assert r["norm_params"] == ["Parameter", "Parameter"]
        assert r["keys"]


# ---------------------------------------------------------------------- training
def _train_beside_plain(steps: int, clip: float | None) -> dict[str, Any]:
    ref, model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    diffs = {"loss": 0.0, "grad": 0.0, "param": 0.0, "ignored": 0.0, "norm": 0.0}
    for step in range(steps):
        batch = _batch(step)
        loss = model(_mine(batch)).pow(2).mean()
        loss.backward()
        _average_ignored_grads(model)
        ref_loss = ref(batch).pow(2).mean()
        ref_loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        diffs["loss"] = max(diffs["loss"], (global_loss / dist.get_world_size() - ref_loss).abs().item())
        if clip is not None:
            norm = model.clip_grad_norm_(clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            diffs["norm"] = max(diffs["norm"], (norm - ref_norm).abs().item())
        for h, names in handles_with_ref_names(model):
            expected = reference_flat(ref, names, "grad")
            assert expected is not None
            diffs["grad"] = max(diffs["grad"], (h.flat_param.grad - shard_of(expected, h)).abs().max().item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for h, names in handles_with_ref_names(model):
        expected = reference_flat(ref, names, "param")
        assert expected is not None
        diffs["param"] = max(
            diffs["param"], (h.flat_param.detach() - shard_of(expected, h)).abs().max().item()
        )
    ref_params = dict(ref.named_parameters())
    for name in IGNORED:
        mine = model.module.get_parameter(name)
        diffs["ignored"] = max(diffs["ignored"], (mine - ref_params[name]).abs().max().item())
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd), (list(sd), list(ref_sd))
    diffs["state_dict"] = max((sd[k] - v).abs().max().item() for k, v in ref_sd.items())
    return diffs


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("clip", [None, 0.05])
def test_training_matches_the_plain_model(pool: RankPool, clip: float | None) -> None:
    for diffs in pool.run(_train_beside_plain, 3, clip):
        assert max(diffs.values()) <= 1e-5, diffs


def _clip_with_different_ignored_grads() -> list[float]:
    """Ignored gradients are the rank's own: each rank's norm counts its own once, not reduced."""
    torch.manual_seed(0)
    net = Net()
    model = FSDP(net, ignored_modules=[net.head])
    model(_mine(_batch(0))).pow(2).mean().backward()
    managed = torch.linalg.vector_norm(model.handles[0].flat_param.grad) ** 2
    dist.all_reduce(managed)
    ignored = sum(torch.linalg.vector_norm(net.head.get_parameter(n[5:]).grad) ** 2 for n in IGNORED)
    norm = model.clip_grad_norm_(1e9)  # (no clipping)
    return [norm.item(), (managed + ignored).sqrt().item()]


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_clip_counts_each_ranks_ignored_gradients_once(pool: RankPool) -> None:
    results = pool.run(_clip_with_different_ignored_grads)
    for norm, expected in results:
        assert norm == pytest.approx(expected, rel=1e-5)
    assert results[0][0] != pytest.approx(results[1][0]), "the ranks' ignored gradients differ"


def _step_bytes() -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    model = FSDP(net, ignored_modules=[net.head])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    model.reset_comm_stats()
    _step(model, opt, 1)  # the second step is the one counted
    stats = model.comm_stats()
    managed = sum(p.numel() for n, p in Net().named_parameters() if not n.startswith("head."))
    return {
        "all_gather": stats["all_gather"]["bytes"],
        "reduce_scatter": stats["reduce_scatter"]["bytes"],
        "expected": padded_numel(managed, dist.get_world_size()) * 4,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_collectives_carry_the_managed_parameters_only(pool: RankPool) -> None:
    for r in pool.run(_step_bytes):
        # one unit: gathered once (the root keeps it for backward), reduce-scattered once
        assert r["all_gather"] == r["expected"], r
        assert r["reduce_scatter"] == r["expected"], r


# ---------------------------------------------------------------------- state dicts
def _state_dicts() -> dict[str, Any]:
    _, model = _wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    full = model.state_dict()
    out: dict[str, Any] = {
        "full_keys": list(full),
        "full_ignored_equal": all(torch.equal(full[n], model.module.get_parameter(n)) for n in IGNORED),
    }
    with FSDP.state_dict_type(model, fsdp.StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    out["sharded_ignored"] = [(type(sharded[n]).__name__, tuple(sharded[n].shape)) for n in IGNORED]
    with FSDP.state_dict_type(model, fsdp.StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()  # (references, as nn.Module's: copied before the model changes)
        local = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in local.items()}
    out["local_ignored"] = [n in local for n in IGNORED]
    expected = {k: v.clone() for k, v in full.items()}
    # load each form into a fresh model built with another seed
    results = {}
    for kind, state in (
        ("full", full),
        ("sharded", sharded),
    ):
        _, fresh = _wrapped(seed=1)
        scramble_(fresh)  # the ignored module's buffer differs too
        if kind == "sharded":
            with FSDP.state_dict_type(fresh, fsdp.StateDictType.SHARDED_STATE_DICT):
                fresh.load_state_dict(state)
        else:
            fresh.load_state_dict(state)
        got = fresh.state_dict()
        results[kind] = max((got[k] - v).abs().max().item() for k, v in expected.items())
    scramble_(model)  # a local state dict loads back into the model it came from
    with FSDP.state_dict_type(model, fsdp.StateDictType.LOCAL_STATE_DICT):
        model.load_state_dict(local)
    got = model.state_dict()
    results["local"] = max((got[k] - v).abs().max().item() for k, v in expected.items())
    out["roundtrip"] = results
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_state_dicts_hold_ignored_parameters_under_their_names(pool: RankPool) -> None:
    plain_keys = list(Net().state_dict())
    for r in pool.run(_state_dicts):
        assert r["full_keys"] == plain_keys
        assert r["full_ignored_equal"]
        assert r["sharded_ignored"] == [("Tensor", (8, 8)), ("Tensor", (8,))]
        assert r["local_ignored"] == [True, True]
        assert r["roundtrip"] == {"full": 0.0, "sharded": 0.0, "local": 0.0}, r["roundtrip"]


# ---------------------------------------------------------------------- optimizer state
def _optim_round_trip(form: str, path: str = "") -> dict[str, Any]:
    _, model = _wrapped()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        _step(model, opt, step)
    _, fresh = _wrapped(seed=1)
    scramble_(fresh)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    out: dict[str, Any] = {}
    if form == "torch_full":
        full = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
        out["ignored_state"] = tuple(full["state"]["head.proj.weight"]["exp_avg"].shape)
        fresh_opt.load_state_dict(FSDP.shard_full_optim_state_dict(full, fresh))
    elif form == "torch_optim_state_dict":
        saved = FSDP.optim_state_dict(model, opt)
        out["ignored_state"] = tuple(saved["state"]["head.proj.weight"]["exp_avg"].shape)
        FSDP.optim_state_dict_to_load(fresh, fresh_opt, saved, load_directly=True)
    elif form == "fairscale":
        gathered = model.gather_full_optim_state_dict(opt)
        box = [gathered]
        dist.broadcast_object_list(box, src=0)
        full = box[0]
        index = full["param_names"].index("head.proj.weight")
        out["ignored_state"] = tuple(full["state"][index]["exp_avg"].shape)
        fresh_opt.load_state_dict(model.get_shard_from_optim_state_dict(full))
    elif form == "sharded":
        saved = model.sharded_optim_state_dict(opt)
        out["ignored_state"] = tuple(saved["state"]["head.proj.weight"]["exp_avg"].shape)
        fresh.load_sharded_optim_state_dict(fresh_opt, saved)
    else:  # a checkpoint directory (DCP), model and optimizer loaded into a fresh pair
        fsdp.save_checkpoint(f"{path}/ckpt", model, opt)
        _, fresh = _wrapped(seed=1)
        scramble_(fresh)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        fsdp.load_checkpoint(f"{path}/ckpt", fresh, fresh_opt)
        out["ignored_state"] = tuple(fresh_opt.state[fresh.module.head.proj.weight]["exp_avg"].shape)
    for step in range(2, 4):  # both continue identically
        _step(model, opt, step)
        _step(fresh, fresh_opt, step)
    a, b = model.state_dict(), fresh.state_dict()
    out["diff"] = max((a[k] - b[k]).abs().max().item() for k in a)
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    "form", ["torch_full", "torch_optim_state_dict", "fairscale", "sharded", "checkpoint"]
)
def test_optimizer_state_round_trips_with_ignored_parameters(
    pool: RankPool, form: str, tmp_path: Path
) -> None:
    for r in pool.run(_optim_round_trip, form, str(tmp_path)):
        assert r["ignored_state"] == (8, 8)
        assert r["diff"] == 0.0, r


# ---------------------------------------------------------------------- ignored_states
def _ignored_parameters() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = Net()
    net = copy.deepcopy(ref)
    model = FSDP(net, ignored_states=[net.out.bias])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(_mine(_batch(0))).pow(2).mean().backward()
    bias_grad = net.out.bias.grad.clone()
    opt.step()
    names = [n for h in model.handles for n in h.meta.fqns]
    return {
        "bias_registered": type(net.out._parameters.get("bias")).__name__,
        "flattened_has_bias": "out.bias" in names,
        "flattened_has_weight": "out.weight" in names,
        "keys": list(model.state_dict()) == list(ref.state_dict()),
        "grad": bias_grad.tolist(),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_ignored_states_takes_parameters(pool: RankPool) -> None:
    results = pool.run(_ignored_parameters)
    for r in results:
        assert r["bias_registered"] == "Parameter"
        assert not r["flattened_has_bias"] and r["flattened_has_weight"]
        assert r["keys"]
    assert results[0]["grad"] != results[1]["grad"], "an ignored gradient is the rank's own (not reduced)"


def _meta_ignored_is_left_alone() -> list[str]:
    with torch.device("meta"):
        net = Net()
    FSDP(net, ignored_modules=[net.head], device_id=torch.device("cpu"))
    return [str(net.head.proj.weight.device), str(net.head.scale.device)]


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_deferred_init_leaves_ignored_modules_on_meta(pool: RankPool) -> None:
    for r in pool.run(_meta_ignored_is_left_alone):
        assert r == ["meta", "meta"]


def _meta_ignored_parameter_is_materialized() -> dict[str, Any]:
    """An ignored parameter of a module the wrapper materializes is materialized with it, and stays
    ignored (it is ignored where it is registered, not by the meta tensor's identity)."""
    with torch.device("meta"):
        net = Net()
    meta_bias = net.out.bias

    def init(m: nn.Module) -> None:
        if isinstance(m, Head):
            m.scale.fill_(0.5)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()

    model = FSDP(net, ignored_states=[meta_bias], device_id=torch.device("cpu"), param_init_fn=init)
    model(_mine(_batch(0))).pow(2).mean().backward()
    expected = sum(
        torch.linalg.vector_norm(p.grad) ** 2 for p in net.out._parameters.values() if p is not None
    )
    return {
        "bias": (str(net.out.bias.device), type(net.out._parameters["bias"]).__name__),
        "flattened": any("out.bias" in n for h in model.handles for n in h.meta.fqns),
        "clip_counts_it": model.clip_grad_norm_(1e9).item() ** 2 >= expected.item() * (1 - 1e-6),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_deferred_init_keeps_an_ignored_parameter_ignored(pool: RankPool) -> None:
    for r in pool.run(_meta_ignored_parameter_is_materialized):
        assert r == {"bias": ("cpu", "Parameter"), "flattened": False, "clip_counts_it": True}


# ---------------------------------------------------------------------- errors
def _errors() -> dict[str, str]:
    out = {}

    def attempt(name: str, build: Any) -> None:
        try:
            build()
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        else:
            out[name] = "no error"

    def fsdp_instance() -> None:
        net = Net()
        net.head = FSDP(net.head)
        FSDP(net, ignored_modules=[net.head])

    def wrapper_inside() -> None:
        net = Net()
        net.blocks[0] = FSDP(net.blocks[0])
        FSDP(net, ignored_modules=[net.blocks])

    def not_inside() -> None:
        FSDP(Net(), ignored_modules=[nn.Linear(2, 2)])

    def both() -> None:
        net = Net()
        FSDP(net, ignored_modules=[net.head], ignored_states=[net.head])

    def mixed() -> None:
        net = Net()
        FSDP(net, ignored_states=[net.head, net.out.bias])

    def tied() -> None:
        net = Net()
        net.head.proj.weight = net.blocks[0].fc.weight  # tied to a managed layer
        FSDP(net, ignored_modules=[net.head])

    def itself() -> None:
        net = Net()
        FSDP(net, ignored_modules=[net])

    for name, build in list(locals().items()):
        if callable(build) and name != "attempt":
            attempt(name, build)
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_mistakes_are_refused_with_clear_errors(pool: RankPool) -> None:
    for r in pool.run(_errors):
        assert (
            r["fsdp_instance"].startswith("ValueError") and "wrapper cannot be ignored" in r["fsdp_instance"]
        )
        # torch's leniency (tests/compat/test_torch_ignored_modules.py): a module holding a wrapper, and one
        # outside the wrapped module, are accepted
        assert r["wrapper_inside"] == "no error" and r["not_inside"] == "no error"
        assert r["both"].startswith("ValueError") and "not both" in r["both"]
        assert r["mixed"].startswith("ValueError") and "all nn.Parameters or all nn.Modules" in r["mixed"]
        assert r["tied"].startswith("ValueError") and "blocks.0.fc.weight" in r["tied"]
        assert r["itself"] == "no error", "torch's reading: a warning, and nothing sharded (tests/compat)"
