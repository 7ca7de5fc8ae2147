"""The arguments of torch FSDP1's ``optim_state_dict`` / ``optim_state_dict_to_load``, as torch's
``test_fsdp_optim_state.py`` passes them (``test_interface_arguments``,
``test_state_dict_with_none_tensor_state``, ``test_optim_state_without_param_groups``,
``test_compatible_with_trec``): a given ``optim_state_dict`` that is not the optimizer's current
state, one with entries of the user's own (``None`` among them), one without ``"param_groups"``,
and a named optimizer (torch's ``_NamedOptimizer``) with ``is_named_optimizer=True``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from tests.rank_pool import RankPool

FULL, SHARDED = fsdp.StateDictType.FULL_STATE_DICT, fsdp.StateDictType.SHARDED_STATE_DICT


def _model(flatten: bool = True) -> FSDP:
    """torch's ``TestDummyModel``, wrapped at the root (flattened, or ``use_orig_params=True``)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.Linear(32, 8))
    return FSDP(net, use_orig_params=not flatten)


def _step(model: nn.Module, optim: Any, seed: int) -> None:
    model(torch.rand(4, 8, generator=torch.Generator().manual_seed(seed))).sum().backward()
    optim.step()
    model.zero_grad()  # (torch's _NamedOptimizer has no working zero_grad)


def _dense(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _same(a: dict[Any, dict[str, Any]], b: dict[Any, dict[str, Any]]) -> bool:
    """The same entries under the same keys (tensors equal, DTensors compared whole, other values ==)."""
    if a.keys() != b.keys() or any(a[k].keys() != b[k].keys() for k in a):
        return False
    return all(
        torch.equal(torch.as_tensor(_dense(v)), torch.as_tensor(_dense(b[k][n])))
        if isinstance(v, torch.Tensor)
        else v == b[k][n]
        for k, e in a.items()
        for n, v in e.items()
    )


def _given_dicts() -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, optim, 0)
    before = FSDP.optim_state_dict(model, optim)
    original = copy.deepcopy(optim.state_dict())
    _step(model, optim, 1)  # the optimizer moves on; `original` is what was saved
    osd = FSDP.optim_state_dict(model, optim, optim_state_dict=original)
    out["older"] = _same(osd["state"], before["state"]) and osd["param_groups"] == before["param_groups"]
    FSDP.optim_state_dict_to_load(model, optim, osd, load_directly=True)
    out["restored"] = _same(optim.state_dict()["state"], original["state"])
    _step(model, optim, 2)
    with FSDP.state_dict_type(model, SHARDED):
        sharded = FSDP.optim_state_dict(model, optim, optim_state_dict=original)
        out["sharded_dtensors"] = all(
            isinstance(v, DTensor) for e in sharded["state"].values() for v in e.values() if v.dim() > 0
        )
        FSDP.optim_state_dict_to_load(model, optim, sharded)
    out["sharded_restored"] = _same(optim.state_dict()["state"], original["state"])

    # torch's test_state_dict_with_none_tensor_state: entries of the user's own, None among them
    out["own_entries"] = []
    for flatten in (True, False):
        model = _model(flatten)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        _step(model, optim, 0)
        extended = copy.deepcopy(optim.state_dict())
        for entry in extended["state"].values():
            entry.update(value1=2.74, value2=None)
        osd = FSDP.optim_state_dict(model, optim, optim_state_dict=extended)
        to_load = FSDP.optim_state_dict_to_load(model, optim, osd)
        out["own_entries"].append(
            len(to_load["state"]) == len(extended["state"])
            and all(e["value1"] == 2.74 and e["value2"] is None for e in to_load["state"].values())
        )

    # torch's test_optim_state_without_param_groups: neither dict has param groups
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, optim, 0)
    original = copy.deepcopy(optim.state_dict())
    bare = copy.deepcopy(original)
    groups = bare.pop("param_groups")
    osd = FSDP.optim_state_dict(model, optim, optim_state_dict=bare)
    _step(model, optim, 1)
    to_load = FSDP.optim_state_dict_to_load(model, optim, osd)
    out["no_groups"] = "param_groups" not in osd and "param_groups" not in to_load
    optim.load_state_dict({**to_load, "param_groups": groups})
    out["no_groups_restored"] = _same(optim.state_dict()["state"], original["state"])
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_optim_state_dict_converts_the_dict_it_is_given(pool: RankPool) -> None:
    for r in pool.run(_given_dicts):
        assert r == {
            "older": True,
            "restored": True,
            "sharded_dtensors": True,
            "sharded_restored": True,
            "own_entries": [True, True],
            "no_groups": True,
            "no_groups_restored": True,
        }


def _named_optimizer(kind: fsdp.StateDictType) -> dict[str, Any]:
    """torch's ``test_compatible_with_trec``: a ``_NamedOptimizer`` over the wrapped model, its state
    saved by name and loaded back with ``is_named_optimizer=True``."""
    from torch.distributed.optim import _NamedOptimizer

    model = _model()
    named = _NamedOptimizer(model.named_parameters(), torch.optim.Adam, None, model, lr=1e-2)
    plain_model = _model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    for seed in range(2):
        _step(model, named, seed)
        _step(plain_model, plain, seed)
    FSDP.set_state_dict_type(model, kind)
    FSDP.set_state_dict_type(plain_model, kind)
    saved = copy.deepcopy(FSDP.optim_state_dict(model, named))
    given = FSDP.optim_state_dict(model, named, optim_state_dict=named.state_dict())
    reference = FSDP.optim_state_dict(plain_model, plain)
    for seed in range(2, 5):
        _step(model, named, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no name is left unknown)
        to_load = FSDP.optim_state_dict_to_load(model, named, saved, is_named_optimizer=True)
    keys_fit = to_load["state"].keys() == named.state_dict()["state"].keys()
    named.load_state_dict(to_load)
    return {
        "by_name": _same(saved["state"], reference["state"]),
        "given": _same(given["state"], reference["state"]),
        "keys_fit": keys_fit,
        "groups": [g["params"] for g in to_load["param_groups"]],
        "restored": _same(FSDP.optim_state_dict(model, named)["state"], saved["state"]),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("kind", [FULL, SHARDED])
def test_named_optimizer_state_round_trips(pool: RankPool, kind: fsdp.StateDictType) -> None:
    for r in pool.run(_named_optimizer, kind):
        assert r == {
            "by_name": True,
            "given": True,
            "keys_fit": True,
            "groups": [["_fsdp_wrapped_module.flat_param_0"]],
            "restored": True,
        }
