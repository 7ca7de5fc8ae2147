"""torch FSDP1's static optimizer-state functions on any model, as torch's ``test_fsdp_optim_state.py`` uses them.

torch's own test model is a plain module whose blocks are wrapped one by one (``NestedModel.wrap``):
the root is not a wrapper, has a parameter of its own (``bias``) and an unwrapped block. The
functions take that model as it is; its plain parameters are kept as they are (each rank's own),
the wrapped ones are gathered and resharded. Also torch's deprecated ``optim_input`` argument,
accepted with torch's ``FutureWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from tests.rank_pool import RankPool

FULL, SHARDED = fsdp.StateDictType.FULL_STATE_DICT, fsdp.StateDictType.SHARDED_STATE_DICT


class Bias(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.bias_module0 = Bias(d_out)
        self.bias_module1 = Bias(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias_module1(torch.relu(self.bias_module0(x @ self.weight)))


class Nested(nn.Module):
    """torch's NestedModel in small: ``bias`` belongs to the root itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block0 = Block(5, 3)
        self.block1 = Block(3, 7)
        self.bias = nn.Parameter(torch.randn(5))
        self.block2 = nn.Sequential(Block(7, 9), Block(9, 9), Block(9, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block2(self.block1(self.block0(x))) + self.bias

    def groups(self, two: bool) -> list[Any]:
        """One group of every parameter, or torch's two groups that leave ``bias`` out, in another order."""
        if not two:
            return list(self.parameters())
        return [
            {"params": list(self.block1.parameters())},
            {"params": [*self.block2.parameters(), *self.block0.parameters()], "weight_decay": 0.9},
        ]


def _wrap(model: Nested, alt: bool = False, group: Any = None) -> Nested:
    """torch's ``NestedModel.wrap`` (or ``wrap_alt``): wrappers around some blocks, the root left plain."""
    if alt:
        model.block0.bias_module0 = FSDP(model.block0.bias_module0, process_group=group)  # type: ignore[assignment]
        model.block0 = FSDP(model.block0, process_group=group)  # type: ignore[assignment]
        return model
    model.block1.bias_module0 = FSDP(model.block1.bias_module0, process_group=group)  # type: ignore[assignment]
    model.block1 = FSDP(model.block1, process_group=group)  # type: ignore[assignment]
    model.block2[1].bias_module0 = FSDP(model.block2[1].bias_module0, process_group=group)
    model.block2[1].bias_module1 = FSDP(model.block2[1].bias_module1, process_group=group)
    model.block2[1] = FSDP(model.block2[1], process_group=group)
    model.block2[2] = FSDP(model.block2[2], process_group=group)
    return model


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        optim.zero_grad()
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).sum().backward()
        optim.step()


def _named_plain_state(two: bool) -> tuple[dict[str, dict[str, torch.Tensor]], list[list[str]]]:
    """The plain model's optimizer state after the same steps, keyed by parameter name."""
    model = Nested()
    optim = torch.optim.Adam(model.groups(two), lr=0.01)
    _train(model, optim)
    name_of = {id(p): n for n, p in model.named_parameters()}
    ids = [name_of[id(p)] for g in optim.param_groups for p in g["params"]]
    saved = optim.state_dict()
    state = {ids[i]: v for i, v in saved["state"].items()}
    return state, [[ids[i] for i in g["params"]] for g in saved["param_groups"]]


def _dense(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _max_diff(osd: dict[str, Any], ref: dict[str, dict[str, torch.Tensor]]) -> float:
    assert osd["state"].keys() == ref.keys(), (sorted(osd["state"]), sorted(ref))
    return max(
        (torch.as_tensor(_dense(v)).float() - torch.as_tensor(ref[n][k]).float()).abs().max().item()
        for n, entry in osd["state"].items()
        for k, v in entry.items()
    )


def _saved_by_name(kind: str, two: bool) -> dict[str, Any]:
    model = _wrap(Nested())
    optim = torch.optim.Adam(model.groups(two), lr=0.01)
    _train(model, optim)
    ref_state, ref_groups = _named_plain_state(two)
    out: dict[str, Any] = {
        "wrappers": len(FSDP.fsdp_modules(model)),
        "root_is_plain": not isinstance(model, FSDP),
    }
    if kind == "full":
        osd = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    elif kind == "full_rank0":
        osd = FSDP.full_optim_state_dict(model, optim)
        if dist.get_rank() != 0:
            return {**out, "empty": osd == {}}
    elif kind == "sharded_static":
        osd = FSDP.sharded_optim_state_dict(model, optim)
    else:
        with FSDP.state_dict_type(model, FULL if kind == "optim_state_dict_full" else SHARDED):
            osd = FSDP.optim_state_dict(model, optim)
    out["diff"] = _max_diff(osd, ref_state)
    out["groups"] = [sorted(g["params"]) for g in osd["param_groups"]] == [sorted(g) for g in ref_groups]
    out["hyper"] = [g.get("weight_decay") for g in osd["param_groups"]]
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    "kind", ["full", "full_rank0", "sharded_static", "optim_state_dict_full", "optim_state_dict_sharded"]
)
@pytest.mark.parametrize("two_groups", [False, True])
def test_optim_state_dict_of_a_plain_root_with_nested_wrappers(
    pool: RankPool, kind: str, two_groups: bool
) -> None:
    """torch's ``test_optim_state_dict_nested``: the name-keyed state of a plain root holding wrappers
    equals the plain optimizer's (its own ``bias`` and unwrapped ``block0`` included; with two param
    groups that leave ``bias`` out, in another order than the model's)."""
    for rank, r in enumerate(pool.run(_saved_by_name, kind, two_groups)):
        assert r["wrappers"] == 6 and r["root_is_plain"]
        if kind == "full_rank0" and rank != 0:
            assert r["empty"]
            continue
        assert r["diff"] < 1e-6 and r["groups"], r
        assert r["hyper"] == ([0.0, 0.9] if two_groups else [0.0])


def _keys_match_state_dict() -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = Nested()
    model.block1 = FSDP(model.block1)  # type: ignore[assignment]
    model.block2[2] = FSDP(model.block2[2], ignored_modules=[model.block2[2].bias_module0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Sequential))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, optim, 1)
    osd = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    with FSDP.state_dict_type(model, FULL):
        keys = model.state_dict().keys()
    return bool(osd["state"].keys() == keys) and all(
        "_checkpoint_wrapped_module" not in k for k in osd["state"]
    )


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_full_optim_state_dict_keys_are_the_state_dicts(pool: RankPool) -> None:
    """torch's ``test_full_optim_state_dict_keys``: a plain root with nested wrappers, an ignored
    module and activation checkpointing."""
    assert pool.run(_keys_match_state_dict) == [True, True]


def _load_into(method: str, halve: bool, alt: bool, two: bool, optim_input: bool) -> dict[str, Any]:
    """torch's ``_test_load_optim_state``: save from one wrap plan at world size 2, load into another
    (``wrap_alt``) at world size 2 or 1, and compare with that model's own optimizer state."""
    model1 = _wrap(Nested())
    optim1 = torch.optim.Adam(model1.groups(two), lr=0.01)
    _train(model1, optim1)
    full = FSDP.full_optim_state_dict(model1, optim1, rank0_only=method == "scatter")
    reference = FSDP.full_optim_state_dict(model1, optim1, rank0_only=False)
    group = dist.new_group([0]) if halve else None
    if halve and dist.get_rank() != 0:
        return {"skipped": True}
    model2 = _wrap(Nested(), alt=alt, group=group)
    given = model2.groups(two)
    optim2 = torch.optim.Adam(given, lr=0.01)
    _train(model2, optim2)
    own = FSDP.full_optim_state_dict(model2, optim2, rank0_only=False, group=group)
    kwargs: dict[str, Any] = {"optim_input": given} if optim_input else {"optim": optim2}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if method == "shard":
            loaded = FSDP.shard_full_optim_state_dict(full, model2, **kwargs)
            mine = FSDP.shard_full_optim_state_dict(own, model2, **kwargs)
        else:
            loaded = FSDP.scatter_full_optim_state_dict(
                full if dist.get_rank() == 0 else None, model2, **kwargs, group=group
            )
            mine = FSDP.scatter_full_optim_state_dict(
                own if dist.get_rank() == 0 else None, model2, **kwargs, group=group
            )
    local = optim2.state_dict()
    same_own = all(
        torch.equal(torch.as_tensor(mine["state"][i][k]), torch.as_tensor(v))
        for i, e in local["state"].items()
        for k, v in e.items()
    )
    optim2.load_state_dict(loaded)
    reloaded = FSDP.full_optim_state_dict(model2, optim2, rank0_only=False, group=group)
    _train(model2, optim2, 1)  # loads and steps
    return {
        "skipped": False,
        "same_own": same_own,
        "diff": max(
            (torch.as_tensor(v).float() - torch.as_tensor(reference["state"][n][k]).float())
            .abs()
            .max()
            .item()
            for n, e in reloaded["state"].items()
            for k, v in e.items()
        ),
        "names": reloaded["state"].keys() == reference["state"].keys(),
        "warned": sum(
            issubclass(w.category, FutureWarning) and "optim_input" in str(w.message) for w in caught
        ),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    ("method", "halve", "alt", "two", "optim_input"),
    [
        ("shard", False, False, False, False),
        ("shard", False, True, True, True),
        ("shard", True, True, True, False),
        ("scatter", False, True, False, False),
        ("scatter", True, True, True, True),
    ],
)
def test_full_optim_state_loads_into_another_wrap_plan_and_world_size(
    pool: RankPool, method: str, halve: bool, alt: bool, two: bool, optim_input: bool
) -> None:
    """torch's ``test_shard_full_optim_state_dict_nested(_halve_world_size)`` and
    ``test_scatter_full_optim_state_dict_nested(_halve_world_size)``."""
    for r in pool.run(_load_into, method, halve, alt, two, optim_input):
        if r["skipped"]:
            continue
        assert r["same_own"] and r["names"] and r["diff"] == 0.0, r
        assert r["warned"] == (2 if optim_input else 0)


def _optim_state_dict_round_trip(kind: fsdp.StateDictType, alt: bool) -> float:
    """torch's ``_test_load_optim_state_with_optim_state_dict``, plain roots on both sides."""
    model1 = _wrap(Nested())
    optim1 = torch.optim.Adam(model1.parameters(), lr=0.01)
    FSDP.set_state_dict_type(model1, kind)
    _train(model1, optim1)
    osd = FSDP.optim_state_dict(model1, optim1)
    model2 = _wrap(Nested(), alt=alt)
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    FSDP.set_state_dict_type(model2, kind)
    _train(model2, optim2, 1)
    FSDP.optim_state_dict_to_load(model2, optim2, osd, load_directly=True)
    with FSDP.state_dict_type(model1, FULL), FSDP.state_dict_type(model2, FULL):
        a, b = FSDP.optim_state_dict(model1, optim1), FSDP.optim_state_dict(model2, optim2)
    return _max_diff(b, {n: {k: torch.as_tensor(v) for k, v in e.items()} for n, e in a["state"].items()})


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("kind", [FULL, SHARDED])
@pytest.mark.parametrize("alt", [False, True])
def test_optim_state_dict_to_load_into_a_plain_root(
    pool: RankPool, kind: fsdp.StateDictType, alt: bool
) -> None:
    assert pool.run(_optim_state_dict_round_trip, kind, alt) == [0.0, 0.0]


def _unmanaged(kind: str) -> dict[str, Any]:
    """torch's ``test_shard_full_optim_state_dict_unmanaged_params``: a saved state without the
    parameter ``unmanaged_param``, loaded into a model that has it, on the plain root (no wrapper
    manages it) or inside a wrapped block (flattened with parameters that have state)."""
    model = _wrap(Nested())
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optim, 1)
    if kind == "full":
        saved = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    else:
        saved = FSDP.sharded_optim_state_dict(model, optim)
    out: dict[str, Any] = {}
    for where in ("root", "wrapped"):
        plain = Nested()
        extra = nn.Parameter(torch.randn(5, 5))
        (plain if where == "root" else plain.block2[2]).register_parameter("unmanaged_param", extra)
        new = _wrap(plain)
        optim2 = torch.optim.Adam(new.parameters(), lr=0.01)
        try:
            if kind == "full":
                flat = FSDP.shard_full_optim_state_dict(saved, new, optim=optim2)
            else:
                flat = FSDP.flatten_sharded_optim_state_dict(saved, new, optim2)
        except ValueError as e:
            out[where] = str(e)
            continue
        # torch's add_unmanaged_param_entry: the id left out is the new parameter's; give it state and load
        ids = flat["param_groups"][0]["params"]
        skipped = sorted(set(range(len(ids) + 1)) - set(ids))
        flat["state"][skipped[0]] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(5, 5),
            "exp_avg_sq": torch.rand(5, 5),
        }
        flat["param_groups"][0]["params"] = sorted([*ids, skipped[0]])
        optim2.load_state_dict(flat)
        position = [id(p) for p in new.parameters()].index(id(extra))
        out[where] = {"skipped": skipped == [position], "loaded": len(optim2.state) == len(optim.state) + 1}
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_parameter_unknown_to_the_saved_state(pool: RankPool, kind: str) -> None:
    """On the plain root it is left out of the groups (its id skipped, as torch does, for model
    parallelism); inside a wrapper it would need Adam's ``step``, which cannot be made up: torch's
    ``ValueError``, in torch's words."""
    for r in pool.run(_unmanaged, kind):
        assert r["root"] == {"skipped": True, "loaded": True}, r
        assert r["wrapped"].startswith(
            "All unflattened parameters comprising a single flat parameter must have scalar state with the same "
            "value and dtype"
        ), r["wrapped"]
        assert "block2.2.unmanaged_param" in r["wrapped"] and "'step'" in r["wrapped"]


def _rekeyed(kind: fsdp.StateDictType) -> dict[str, Any]:
    """torch's ``test_rekey_optim_state_dict_to_ids`` (two param groups in another order than the
    model's, ``bias`` in neither) and ``test_rekey_optim_state_dict_to_names``."""
    model1 = _wrap(Nested())
    optim1 = torch.optim.Adam(model1.groups(True), lr=0.01)
    _train(model1, optim1)
    if kind is FULL:
        osd = FSDP.full_optim_state_dict(model1, optim1, rank0_only=False)
    else:
        osd = FSDP.sharded_optim_state_dict(model1, optim1)
    model2 = Nested()
    optim2 = torch.optim.Adam(model2.groups(True), lr=0.01)
    _train(model2, optim2)
    ids = FSDP.rekey_optim_state_dict(osd, fsdp.OptimStateKeyType.PARAM_ID, model2, optim=optim2)
    ref = optim2.state_dict()
    out = {
        "groups": ids["param_groups"] == ref["param_groups"],
        "keys": ids["state"].keys() == ref["state"].keys(),
        "diff": max(
            (torch.as_tensor(_dense(v)).float() - torch.as_tensor(ref["state"][i][k]).float())
            .abs()
            .max()
            .item()
            for i, e in ids["state"].items()
            for k, v in e.items()
        ),
    }
    if kind is FULL:  # and back: the plain optimizer's state by name, sharded into the wrapped model
        names = FSDP.rekey_optim_state_dict(ref, fsdp.OptimStateKeyType.PARAM_NAME, model2, optim=optim2)
        out["names_sorted"] = all(g["params"] == sorted(g["params"]) for g in names["param_groups"])
        loaded = FSDP.shard_full_optim_state_dict(names, model1, optim=optim1)
        own = optim1.state_dict()
        out["sharded_back"] = loaded["param_groups"] == own["param_groups"] and all(
            torch.allclose(torch.as_tensor(v), torch.as_tensor(own["state"][i][k]), atol=1e-6)
            for i, e in loaded["state"].items()
            for k, v in e.items()
        )
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("kind", [FULL, SHARDED])
def test_rekey_optim_state_dict_between_names_and_ids(pool: RankPool, kind: fsdp.StateDictType) -> None:
    """Each group's keys come sorted, as torch's do: the ids are then those of the plain optimizer's own state dict."""
    for r in pool.run(_rekeyed, kind):
        assert r["groups"] and r["keys"] and r["diff"] < 1e-6, r
        if kind is FULL:
            assert r["names_sorted"] and r["sharded_back"], r


def _deprecated_optim_input() -> list[str]:
    """torch's ``test_optim_input_warning``: every function takes ``optim_input`` with a FutureWarning."""
    model = _wrap(Nested())
    params = list(model.parameters())
    optim = torch.optim.Adam(params, lr=0.01)
    _train(model, optim, 1)
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("full_optim_state_dict", lambda: FSDP.full_optim_state_dict(model, optim, params, rank0_only=False)),
        (
            "shard_full_optim_state_dict",
            lambda: FSDP.shard_full_optim_state_dict(full, model, optim_input=params),
        ),
        (
            "scatter_full_optim_state_dict",
            lambda: FSDP.scatter_full_optim_state_dict(full, model, optim_input=params),
        ),
    ]
    warned = []
    full: dict[str, Any] = {}
    for name, call in calls:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = call()
        full = result if name == "full_optim_state_dict" else full
        warned += [
            name
            for w in caught
            if issubclass(w.category, FutureWarning) and "`optim_input`" in str(w.message)
        ]
    plain = Nested()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP.rekey_optim_state_dict(
            full, fsdp.OptimStateKeyType.PARAM_ID, plain, optim_input=list(plain.parameters())
        )
    warned += ["rekey_optim_state_dict" for w in caught if issubclass(w.category, FutureWarning)]
    return warned


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_optim_input_is_accepted_with_a_future_warning(pool: RankPool) -> None:
    for warned in pool.run(_deprecated_optim_input):
        assert warned == [
            "full_optim_state_dict",
            "shard_full_optim_state_dict",
            "scatter_full_optim_state_dict",
            "rekey_optim_state_dict",
        ]


def _different_optimizers() -> str:
    """torch's ``test_full_optim_state_dict_nested_invalid``: rank 1's optimizer leaves one parameter out."""
    model = _wrap(Nested())
    params = list(model.parameters())
    optim = torch.optim.Adam(params if dist.get_rank() == 0 else params[:-1], lr=0.01)
    _train(model, optim, 1)
    try:
        FSDP.full_optim_state_dict(model, optim)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_ranks_with_different_optimizers_fail_together(pool: RankPool) -> None:
    for message in pool.run(_different_optimizers):
        assert message.startswith("gather_full_optim_state_dict"), message
        # (torch's first sentence, which its test matches)
        assert (
            "FSDP currently requires each rank to have at least the optimizer states needed by rank 0"
            in message
        )


def _no_wrapper_and_empty_state() -> dict[str, Any]:
    """A module without any wrapper (torch works on it as on a plain model), and torch's
    ``test_with_empty_optimizer_state``."""
    plain = Nested()
    optim = torch.optim.Adam(plain.parameters(), lr=0.01)
    empty = FSDP.optim_state_dict(plain, optim)
    _train(plain, optim, 1)
    osd = FSDP.optim_state_dict(plain, optim)
    name_of = {id(p): n for n, p in plain.named_parameters()}
    same = all(
        torch.equal(osd["state"][name_of[id(p)]]["exp_avg"], s["exp_avg"]) for p, s in optim.state.items()
    )
    return {"empty": empty["state"], "same": same, "count": len(osd["state"])}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_model_without_wrappers_gives_its_named_state(pool: RankPool) -> None:
    for r in pool.run(_no_wrapper_and_empty_state):
        assert r["empty"] == {} and r["same"] and r["count"] == 16


def _reversed_on_rank_1(two: bool) -> dict[str, Any]:
    """torch's ``use_diff_optim_inputs``: rank 1's optimizer lists the parameters in reverse order."""
    model = _wrap(Nested())
    groups = model.groups(two)
    if dist.get_rank() == 1:
        groups = [{**g, "params": g["params"][::-1]} for g in groups] if two else groups[::-1]
    optim = torch.optim.Adam(groups, lr=0.01)
    _train(model, optim)
    ref_state, _ = _named_plain_state(two)
    full = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optim.state.items()}
    optim.load_state_dict(FSDP.shard_full_optim_state_dict(full, model, optim=optim))
    with FSDP.state_dict_type(model, SHARDED):
        FSDP.optim_state_dict_to_load(model, optim, FSDP.optim_state_dict(model, optim), load_directly=True)
    after = {id(p): s for p, s in optim.state.items()}
    return {
        "diff": _max_diff(full, ref_state),
        "unchanged": all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i]),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("two", [False, True])
def test_ranks_may_list_the_parameters_in_different_orders(pool: RankPool, two: bool) -> None:
    """Collectives run in the model's order, so each rank's optimizer may order its parameters its own way."""
    for r in pool.run(_reversed_on_rank_1, two):
        assert r["diff"] < 1e-6 and r["unchanged"], r


def _flattened_sharded(alt: bool) -> dict[str, Any]:
    """torch's ``test_flatten_sharded_optim_state_dict_nested``: the deprecated sharded pair
    (``sharded_optim_state_dict`` then ``flatten_sharded_optim_state_dict`` into another wrap plan)
    gives what the full pair (``full_optim_state_dict`` then ``shard_full_optim_state_dict``) gives."""
    model1 = _wrap(Nested())
    optim1 = torch.optim.Adam(model1.groups(False), lr=0.01)
    _train(model1, optim1)
    sharded = FSDP.sharded_optim_state_dict(model1, optim1)
    full = FSDP.full_optim_state_dict(model1, optim1, rank0_only=False)
    model2 = _wrap(Nested(), alt=alt)
    optim2 = torch.optim.Adam(model2.groups(False), lr=0.01)
    flattened = FSDP.flatten_sharded_optim_state_dict(sharded, model2, optim2)
    expected = FSDP.shard_full_optim_state_dict(full, model2, optim=optim2)
    same = flattened["state"].keys() == expected["state"].keys() and all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(expected["state"][i][k]))
        for i, e in flattened["state"].items()
        for k, v in e.items()
    )
    optim2.load_state_dict(flattened)
    reloaded = FSDP.full_optim_state_dict(model2, optim2, rank0_only=False)
    diff = max(
        (torch.as_tensor(v).float() - torch.as_tensor(full["state"][n][k]).float()).abs().max().item()
        for n, e in reloaded["state"].items()
        for k, v in e.items()
    )
    return {"same": same, "entries": len(flattened["state"]), "diff": diff}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("alt", [False, True])
def test_flatten_sharded_optim_state_dict_equals_the_full_path(pool: RankPool, alt: bool) -> None:
    for r in pool.run(_flattened_sharded, alt):
        assert r["same"] and r["entries"] > 0 and r["diff"] == 0.0, r


class _RankLocal(nn.Module):
    """torch's ``test_compatible_with_trec``: a wrapped dense layer, and a plain layer of this rank's
    own outside any wrapper (model parallelism, as torchrec places its sparse modules)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = FSDP(nn.Linear(8, 8), use_orig_params=True)
        torch.manual_seed(1 + dist.get_rank())
        setattr(self, f"sparse{dist.get_rank()}", nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = getattr(self, f"sparse{dist.get_rank()}")(x)
        dist.all_reduce(out)
        return self.dense(out)  # type: ignore[no-any-return]


def _rank_local_round_trip() -> dict[str, Any]:
    model = _RankLocal()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.rand(5, 8, generator=torch.Generator().manual_seed(2))).sum().backward()
    optim.step()
    own = f"sparse{dist.get_rank()}"
    before = {k: v.clone() for k, v in optim.state[getattr(model, own).weight].items()}
    osd = FSDP.optim_state_dict(model, optim)
    fresh = torch.optim.Adam(model.parameters(), lr=1e-2)
    fresh.load_state_dict(FSDP.optim_state_dict_to_load(model, fresh, osd))
    after = fresh.state[getattr(model, own).weight]
    return {
        "keys": sorted(osd["state"]),
        "own": own,
        "same": set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_rank_local_parameters_keep_each_ranks_own_optimizer_state(pool: RankPool) -> None:
    """Each rank's full optimizer state dict holds its own rank-local parameters' state (it held the
    first rank's, and loading it on another rank raised that the model lacks them), and it loads back."""
    for r in pool.run(_rank_local_round_trip):
        assert r["keys"] == ["dense.bias", "dense.weight", f"{r['own']}.bias", f"{r['own']}.weight"], r
        assert r["same"], r
