"""torch FSDP1's whole-model state-dict functions on a plain root, as torch's ``test_fsdp_state_dict.py`` uses them.

``FSDP.state_dict_type`` / ``set_state_dict_type`` and ``FSDP.summon_full_params`` take the model
being trained: a wrapper, a plain module holding wrappers (torch's ``_get_non_fsdp_root_module``),
or a module without any (then they change nothing). Also torch's "skip module" idiom: a module taken
out before wrapping and attached again after, which stays a plain module.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from fsdp.wrap import ModuleWrapPolicy, enable_wrap, wrap
from tests.rank_pool import RankPool

KINDS = {
    "full": torch_fsdp.StateDictType.FULL_STATE_DICT,
    "sharded": torch_fsdp.StateDictType.SHARDED_STATE_DICT,
    "local": torch_fsdp.StateDictType.LOCAL_STATE_DICT,
}


def _nested(wrapped: bool = True) -> nn.Module:
    """torch's ``_get_simple_nested_model``: FSDP(Sequential(FSDP(lin1), lin2)), or plain."""
    lin1, lin2 = nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False)
    if not wrapped:
        return nn.Sequential(lin1, lin2)
    return FSDP(nn.Sequential(FSDP(lin1), lin2))


class Container(nn.Module):
    """torch's ``_get_non_fsdp_root_module``: a plain root with a plain layer and two wrapped models."""

    def __init__(self, wrapped: bool = True) -> None:
        super().__init__()
        self.non_fsdp_lin = nn.Linear(10, 10, bias=False)
        self.fsdp_1 = _nested(wrapped)
        self.fsdp_2 = _nested(wrapped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fsdp_2(self.fsdp_1(self.non_fsdp_lin(x)))


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


def _save_load_plain_root(kind: str) -> dict[str, Any]:
    """torch's ``test_basic_save_and_load_state_dict`` and ``test_state_dict_load_into_local_module``
    with the non-FSDP root: save under ``FSDP.state_dict_type(container, kind)``, load into a zeroed
    container (and, for the full kind, into the plain model)."""
    torch.manual_seed(0)
    model = Container()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(3, 10)).sum().backward()
        opt.step()
        opt.zero_grad()
    expected = _full_params(model)
    with FSDP.state_dict_type(model, KINDS[kind]):
        saved = model.state_dict()
        inside = FSDP.get_state_dict_type(model).state_dict_type
    torch.manual_seed(1)
    blank = Container()
    with torch.no_grad(), FSDP.summon_full_params(blank):
        for p in blank.parameters():
            p.zero_()
    zeroed = all(p.abs().sum() == 0 for p in _full_params(blank))
    with FSDP.state_dict_type(blank, KINDS[kind]):
        blank.load_state_dict(saved)
    out = {
        "after": FSDP.get_state_dict_type(model).state_dict_type,
        "inside": inside,
        "zeroed": zeroed,
        "loaded": all(torch.equal(a, b) for a, b in zip(_full_params(blank), expected)),
        "keys": sorted(saved),
    }
    if kind == "full":
        local = Container(wrapped=False)
        local.load_state_dict(saved)
        out["local"] = all(torch.equal(a, b) for a, b in zip(local.parameters(), expected))
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("kind", ["full", "sharded", "local"])
def test_state_dict_type_on_a_plain_root(pool: RankPool, kind: str) -> None:
    for r in pool.run(_save_load_plain_root, kind):
        assert r["inside"] == KINDS[kind] and r["after"] == fsdp.StateDictType.FULL_STATE_DICT
        assert r["zeroed"] and r["loaded"]
        if kind != "local":
            assert r["keys"] == sorted(Container(wrapped=False).state_dict())
        if kind == "full":
            assert r["local"]


def _summon_plain_root() -> dict[str, Any]:
    """``FSDP.summon_full_params(container)`` shows every wrapper's full parameters (torch's
    ``_compare_models`` does this on the non-FSDP root), with ``writeback`` and ``recurse``."""
    torch.manual_seed(0)
    model = Container()
    shapes = []
    with FSDP.summon_full_params(model):
        shapes = [tuple(p.shape) for p in model.parameters()]
        states = [w.training_state for w in FSDP.fsdp_modules(model)]
    with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    unchanged = _full_params(model)
    with FSDP.summon_full_params(model), torch.no_grad():
        for p in model.parameters():
            p.mul_(0.0)
    written = all(p.abs().sum() == 0 for p in _full_params(model))
    with FSDP.summon_full_params(model, recurse=False):  # not a wrapper: nothing to show
        not_recursed = [w.training_state for w in FSDP.fsdp_modules(model)]
    with model.fsdp_1.summon_full_params(model.fsdp_1):  # torch's instance spelling
        own = model.fsdp_1.training_state
    return {
        "shapes": shapes,
        "states": {s.name for s in states},
        "unchanged": [tuple(t.shape) for t in unchanged],
        "written": written,
        "not_recursed": {s.name for s in not_recursed},
        "own": own.name,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_summon_full_params_on_a_plain_root(pool: RankPool) -> None:
    for r in pool.run(_summon_plain_root):
        assert r["shapes"] == [(10, 10)] * 5
        assert r["states"] == {"SUMMON_FULL_PARAMS"} and r["not_recursed"] == {"IDLE"}
        assert r["written"] and r["own"] == "SUMMON_FULL_PARAMS"


def test_a_module_without_wrappers_is_left_as_it_is(single_rank_group: None) -> None:
    """torch: no FSDP instance, nothing to set or show; the previous settings returned are the default."""
    plain = _nested(wrapped=False)
    before = plain.state_dict()
    with FSDP.state_dict_type(plain, torch_fsdp.StateDictType.SHARDED_STATE_DICT):
        during = plain.state_dict()
    previous = FSDP.set_state_dict_type(plain, torch_fsdp.StateDictType.LOCAL_STATE_DICT)
    assert previous.state_dict_type == fsdp.StateDictType.FULL_STATE_DICT
    with FSDP.summon_full_params(plain):
        pass
    assert all(torch.equal(before[k], during[k]) for k in before)
    assert FSDP.fsdp_modules(plain) == []


def test_state_dict_type_settings_come_back_and_configs_are_checked(single_rank_group: None) -> None:
    """torch's ``test_state_dict_type`` and ``test_wrong_state_dict_config``."""
    model = Container()
    with FSDP.state_dict_type(model, torch_fsdp.StateDictType.LOCAL_STATE_DICT):
        assert {w._state_dict_type for w in FSDP.fsdp_modules(model)} == {fsdp.StateDictType.LOCAL_STATE_DICT}
    assert {w._state_dict_type for w in FSDP.fsdp_modules(model)} == {fsdp.StateDictType.FULL_STATE_DICT}
    for expected in (RuntimeError, TypeError):  # torch's type, and the one this library raised before
        with pytest.raises(expected, match="Expected state_dict_config of type") as caught:
            with FSDP.state_dict_type(
                model, torch_fsdp.StateDictType.FULL_STATE_DICT, torch_fsdp.LocalStateDictConfig()
            ):
                pass
        assert "FULL_STATE_DICT takes a FullStateDictConfig, got LocalStateDictConfig" in str(caught.value)
    with pytest.raises(RuntimeError, match="Expected optim_state_dict_config of type"):
        FSDP.set_state_dict_type(
            model,
            torch_fsdp.StateDictType.SHARDED_STATE_DICT,
            torch_fsdp.ShardedStateDictConfig(),
            torch_fsdp.FullOptimStateDictConfig(),
        )


class SkipModel(nn.Module):
    """torch's SkipModel(double_nest=True): ``linear_skip`` is taken out before wrapping, put back after."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 10, bias=False)
        self.linear_skip = nn.Linear(10, 10, bias=False)
        self.nested_linear = wrap(nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nested_linear(self.linear_skip(self.linear(x)))


def _skip_module(wrapped: bool = True, declared: bool = False) -> tuple[nn.Module, nn.Module]:
    if not wrapped:
        return SkipModel(), nn.Module()
    with enable_wrap(wrapper_cls=FSDP):
        module = SkipModel()
        skip = module.linear_skip
        delattr(module, "linear_skip")
        fsdp_model = wrap(module, ignored_modules=[skip]) if declared else wrap(module)
        module.linear_skip = skip  # re-attached: no wrapper manages it
    return fsdp_model, skip


def _skip_idiom(kind: str) -> dict[str, Any]:
    """torch's ``test_state_dict_skip_module``: train, save, load into a fresh copy (and, full and
    sharded, into the plain model)."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, skip = _skip_module()
        model(torch.randn(2, 10)).sum().backward()
    grad_is_local = skip.weight.grad is not None
    with FSDP.state_dict_type(model, KINDS[kind]):
        saved = model.state_dict()
    torch.manual_seed(1)
    fresh, _ = _skip_module(declared=True)  # (declared in ignored_modules: no warning)
    with torch.no_grad(), FSDP.summon_full_params(fresh):
        for p in fresh.parameters():
            p.zero_()
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        with FSDP.state_dict_type(fresh, KINDS[kind]):
            fresh.load_state_dict(saved)
    out = {
        "warned": [str(w.message) for w in caught if "attached inside the wrapper" in str(w.message)],
        "quiet": [str(w.message) for w in quiet if "attached" in str(w.message)],
        "grad_is_local": grad_is_local,
        "loaded": all(torch.equal(a, b) for a, b in zip(_full_params(fresh), _full_params(model))),
        "keys": sorted(saved),
    }
    if kind == "full":
        local, _ = _skip_module(wrapped=False)
        local.load_state_dict(saved)
        named = dict(local.named_parameters())
        with FSDP.summon_full_params(model):
            out["local"] = all(torch.equal(p, named[n]) for n, p in model.named_parameters())
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("kind", ["full", "sharded", "local"])
def test_a_module_attached_after_wrapping_stays_plain(pool: RankPool, kind: str) -> None:
    """The re-attached module is treated as an ignored one: trained on each rank's gradients, saved
    under its name, loaded back; a warning says so unless it was given in ``ignored_modules``."""
    for r in pool.run(_skip_idiom, kind):
        assert len(r["warned"]) == 1 and "'linear_skip'" in r["warned"][0] and not r["quiet"], r
        assert r["grad_is_local"] and r["loaded"]
        if kind != "local":
            assert r["keys"] == sorted(SkipModel().state_dict())
        if kind == "full":
            assert r["local"]


def _replaced_layer() -> str:
    """A layer replaced at a path it had when wrapped is still refused (it is not the skip idiom)."""
    model = FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    model.module[1] = nn.Linear(2, 2)
    try:
        model(torch.randn(1, 2))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_replaced_layer_is_still_refused(pool: RankPool) -> None:
    for message in pool.run(_replaced_layer):
        assert "were added after wrapping" in message, message


def _rank0_save_then_sync() -> bool:
    """torch's ``test_state_dict_rank0_offload_save_load_flow``: save on rank 0 only, load it into a
    plain model on rank 0 alone, and let ``sync_module_states=True`` give the other ranks its values."""
    torch.manual_seed(dist.get_rank())  # different values on each rank
    model = FSDP(_nested(wrapped=False), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    cfg = torch_fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT, cfg):
        saved = model.state_dict()
    plain = _nested(wrapped=False)
    if dist.get_rank() == 0:
        plain.load_state_dict(saved)
    synced = FSDP(plain, sync_module_states=True, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    mine = torch.cat([p.reshape(-1) for p in _full_params(synced)])
    theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(theirs, mine)
    return all(torch.equal(t, theirs[0]) for t in theirs) and (
        dist.get_rank() != 0 or torch.equal(mine, torch.cat([v.reshape(-1) for v in saved.values()]))
    )


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_rank0_save_and_sync_module_states_flow(pool: RankPool) -> None:
    assert pool.run(_rank0_save_then_sync) == [True, True]


def _ignored_entries(kind: str) -> dict[str, bool]:
    """torch's ``test_state_dict_with_ignored_modules``: the entries of ignored parameters and of
    buffers kept in their own dtype are the module's own tensors in every state-dict type."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for m in model:
        m.register_buffer("buffer", torch.randn(3))
    kinds = {
        "full": torch_fsdp.StateDictType.FULL_STATE_DICT,
        "sharded": torch_fsdp.StateDictType.SHARDED_STATE_DICT,
    }
    wrapped = FSDP(model, ignored_modules=[model[1]])
    with FSDP.state_dict_type(wrapped, kinds[kind]):
        sd = wrapped.state_dict()
    own = {"1.weight": model[1].weight, "1.bias": model[1].bias, "0.buffer": model[0].buffer}
    own["1.buffer"] = model[1].buffer
    return {name: sd[name].data_ptr() == t.data_ptr() for name, t in own.items()}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_ignored_parameters_and_buffers_are_the_modules_own_tensors(pool: RankPool, kind: str) -> None:
    for shared in pool.run(_ignored_entries, kind):
        assert all(shared.values()), shared


def _local_dtypes_under_mixed_precision() -> dict[str, Any]:
    """torch's LOCAL_STATE_DICT tests under mixed precision check every entry's dtype against the
    parameters' (no other entry: the identity is in the dict's _metadata)."""
    torch.manual_seed(0)
    mp = torch_fsdp.MixedPrecision(param_dtype=torch.float16)
    model = FSDP(
        nn.Sequential(FSDP(nn.Linear(4, 4), mixed_precision=mp), nn.Linear(4, 2)), mixed_precision=mp
    )
    with FSDP.state_dict_type(model, torch_fsdp.StateDictType.LOCAL_STATE_DICT):
        sd = model.state_dict()
    with FSDP.state_dict_type(model, torch_fsdp.StateDictType.LOCAL_STATE_DICT):
        model.load_state_dict(sd)  # (and it loads back, its identity checked)
    return {"dtypes": sorted({str(v.dtype) for v in sd.values()}), "identity": sorted(sd._metadata[""])}  # type: ignore[attr-defined]


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_local_state_dict_under_mixed_precision_holds_the_parameters_dtype_only(pool: RankPool) -> None:
    for r in pool.run(_local_dtypes_under_mixed_precision):
        assert r["dtypes"] == ["torch.float32"], r
        assert "_fsdp_local_state" in r["identity"], r
