"""Sharding is real; full parameters appear only when needed; summon and state dicts round-trip."""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullOptimStateDictConfig, TrainingState
from fsdp import FullyShardedDataParallel as FSDP
from fsdp.api import MemoryState
from tests.checkpointing import scramble_
from tests.models import build, wrap
from tests.rank_pool import RankPool


def _local_fraction() -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    total = sum(p.numel() for p in model.parameters())
    for i in range(4):
        model[i] = FSDP(model[i])
    model = FSDP(model)
    local = sum(p.numel() for p in model.parameters())
    return {"fraction": local / total, "world": dist.get_world_size()}


@pytest.mark.parametrize("pool", [1, 2, 3, 4], indirect=True)
def test_each_rank_holds_one_nth(pool: RankPool) -> None:
    for r in pool.run(_local_fraction):
        n = r["world"]
        # padding adds at most world_size - 1 elements per flat parameter (4 of 4160 elements here)
        assert 1 / n <= r["fraction"] <= 1 / n + 4 * (n - 1) / 4160 + 1e-9


def _freed_after_forward() -> list[tuple[str, int, int]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2))
    model[1] = FSDP(model[1])
    root = FSDP(model)
    seen: list[tuple[str, int, int]] = []

    def during(module: nn.Module, inputs: object, output: object) -> None:
        h = root.module[1].handles[0]
        seen.append(("during", h._full.untyped_storage().size(), h.flat_param.numel()))

    root.module[1].module.register_forward_hook(during)
    out = root(torch.randn(4, 8))
    inner = root.module[1].handles[0]
    seen.append(("after_forward", inner._full.untyped_storage().size(), inner.flat_param.numel()))
    assert root.module[1].training_state is TrainingState.IDLE
    out.sum().backward()
    for w in (root, root.module[1]):
        for h in w.handles:
            assert h.state is MemoryState.SHARDED
            seen.append(("after_backward", h._full.untyped_storage().size(), h.flat_param.numel()))
    return seen


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
def test_inner_full_params_freed_after_forward(pool: RankPool) -> None:
    for seen in pool.run(_freed_after_forward):
        during, after, *end = seen
        assert during[1] == 72 * 4, "the inner unit is gathered during its forward"
        assert during[2] == 72, "flat_param.data is the (padded) full parameter during forward"
        assert after[1] == 0, "inner full parameter storage is freed after forward"
        assert after[2] == 72 // pool.world_size, "flat_param.data is the local shard after forward"
        assert all(size == 0 for _, size, _ in end), "every full parameter is freed after backward"


def _has_full_params(reshard_after_forward: bool) -> dict[str, object]:
    """fairscale's ``has_full_params`` of the root and an inner unit at each point of a step, and
    ``_print_r0`` logged on rank 0 only."""
    import logging

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2))
    model[1] = FSDP(model[1], reshard_after_forward=reshard_after_forward)
    root = FSDP(model)
    inner = root.module[1]
    opt = torch.optim.SGD(root.parameters(), lr=0.1)
    seen: dict[str, object] = {}

    def look(when: str) -> None:
        seen[when] = (root.has_full_params, inner.has_full_params)

    inner.module.register_forward_hook(lambda *_: look("inner_forward"))
    look("built")
    out = root(torch.randn(4, 8))
    look("after_forward")
    out.sum().backward()
    look("after_backward")
    root(torch.randn(4, 8))
    look("after_forward_2")
    opt.step()  # the shards change: a copy gathered before is stale
    look("after_step")
    with root.summon_full_params():
        look("summon")
    look("after_summon")

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("fsdp")
    logger.addHandler(handler)
    previous, logger.level = logger.level, logging.INFO
    try:
        root._print_r0("step 3", restart=True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    seen["logged"] = [(r.levelno, r.getMessage()) for r in records]
    return seen


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_has_full_params_and_print_r0(pool: RankPool, reshard_after_forward: bool) -> None:
    kept = not reshard_after_forward  # the inner unit keeps its gathered copy from forward to backward
    for rank, seen in enumerate(pool.run(_has_full_params, reshard_after_forward)):
        assert seen["built"] == (False, False)
        assert seen["inner_forward"] == (True, True)
        assert seen["after_forward"] == (True, kept), "the root keeps its full parameters for backward"
        assert seen["after_backward"] == (False, False)
        assert seen["after_forward_2"] == (True, kept)
        assert seen["after_step"] == (False, False), "a copy of shards that changed since is not full"
        assert seen["summon"] == (True, True)
        assert seen["after_summon"] == (False, False)
        logged = seen["logged"]
        if rank:
            assert logged == [], logged
        else:
            ((level, message),) = logged  # type: ignore[misc]
            assert level == logging.INFO
            assert re.fullmatch(
                r"step 3 unsharded cur= ?\d+\.\d{4} GB, max= ?\d+\.\d{4} GB, t=0\.0 s", message
            ), message


def _state_dict_roundtrip() -> dict[str, object]:
    rank = dist.get_rank()
    ref = build("buffers", seed=3)
    model = wrap(copy.deepcopy(ref), ("lin", "norm"))
    sd = model.state_dict()
    ref_sd = ref.state_dict()
    keys_equal = list(sd) == list(ref_sd)
    values_equal = all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)
    # a plain module loads it with strict=True
    plain = build("buffers", seed=99)
    plain.load_state_dict(sd, strict=True)
    plain_equal = all(torch.equal(plain.state_dict()[k], ref_sd[k]) for k in ref_sd)
    # and the wrapper loads a plain module's state dict (different values, rank-independent)
    other = build("buffers", seed=7)
    scramble_(other)  # its buffers, too, differ from the model's
    model.load_state_dict(other.state_dict())
    after = model.state_dict()
    loaded_equal = all(torch.equal(after[k], v) for k, v in other.state_dict().items())
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    out_equal = torch.allclose(model(x), other(x), atol=1e-6)
    # strict loading reports missing and unexpected keys by their plain names
    bad = dict(other.state_dict())
    bad.pop("lin.bias")
    bad["extra.weight"] = torch.zeros(1)
    try:
        model.load_state_dict(bad)
        strict_msg = ""
    except RuntimeError as e:
        strict_msg = str(e)
    result = model.load_state_dict(bad, strict=False)
    return {
        "keys_equal": keys_equal,
        "values_equal": values_equal,
        "plain_equal": plain_equal,
        "loaded_equal": loaded_equal,
        "out_equal": out_equal,
        "strict_msg": strict_msg,
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
        "fp32": all(v.dtype in (torch.float32, torch.long) for v in sd.values()),
    }


@pytest.mark.parametrize("pool", [1, 3], indirect=True)
def test_state_dict_roundtrip(pool: RankPool) -> None:
    for r in pool.run(_state_dict_roundtrip):
        assert r["keys_equal"] and r["values_equal"] and r["fp32"]
        assert r["plain_equal"], "the wrapper's state dict loads into a plain module"
        assert r["loaded_equal"] and r["out_equal"], "a plain state dict loads into the wrapper"
        assert '"lin.bias"' in r["strict_msg"] and '"extra.weight"' in r["strict_msg"]
        assert "_fsdp_wrapped_module" not in r["strict_msg"]
        assert r["missing"] == ["lin.bias"] and r["unexpected"] == ["extra.weight"]


def _load_one_unit_at_a_time() -> dict[str, object]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), *[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)])
    model = copy.deepcopy(ref)
    for i in range(1, 5):
        model[i] = FSDP(model[i])
    model = FSDP(model)
    handles = [h for w in model.modules() if isinstance(w, FSDP) for h in w.handles]
    full_counts: list[int] = []

    def count(*args: object) -> None:  # runs as each plain module loads its own tensors
        full_counts.append(sum(h.state is MemoryState.UNSHARDED for h in handles))

    for m in model.modules():
        if isinstance(m, nn.Linear):
            m._register_load_state_dict_pre_hook(count)
    other = copy.deepcopy(ref)
    with torch.no_grad():
        for i, p in enumerate(other.parameters()):
            p.fill_(float(i))
    model.load_state_dict(other.state_dict())
    loaded = all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())
    return {
        "full_counts": full_counts,
        "loaded": loaded,
        "all_sharded_after": all(h.state is MemoryState.SHARDED for h in handles),
        "idle_after": {w.training_state.name for w in model.modules() if isinstance(w, FSDP)},
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_load_state_dict_gathers_one_unit_at_a_time(pool: RankPool) -> None:
    for r in pool.run(_load_one_unit_at_a_time):
        assert r["loaded"] and r["all_sharded_after"] and r["idle_after"] == {"IDLE"}
        # five Linear layers load; each sees its own unit full, and the root's while it is an ancestor
        assert r["full_counts"] == [1, 2, 2, 2, 2], r["full_counts"]


def _load_edge_cases() -> dict[str, object]:
    rank = dist.get_rank()
    out: dict[str, object] = {}

    # a module registered under two names (a layer shared ALBERT-style) loads strictly
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.Linear(4, 4)
            self.layers = nn.ModuleList([layer, layer])

    shared = FSDP(Shared())
    out["shared_keys"] = list(shared.load_state_dict(Shared().state_dict()).missing_keys)

    # a size mismatch is reported under plain names, beside the missing keys
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    model = copy.deepcopy(ref)
    model[1] = FSDP(model[1])
    model = FSDP(model)
    bad = dict(ref.state_dict())
    bad["1.0.weight"] = torch.zeros(3, 4)
    del bad["0.bias"]
    try:
        model.load_state_dict(bad)
        out["mismatch"] = ""
    except RuntimeError as e:
        out["mismatch"] = str(e)

    # a dict saved with state_dict_on_rank_0_only is empty on rank 1: every rank raises, nothing loads
    before = model.state_dict()
    other = copy.deepcopy(ref)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    try:
        model.load_state_dict(other.state_dict() if rank == 0 else {})
        out["rank0_only"] = ""
    except RuntimeError as e:
        out["rank0_only"] = str(e)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    # a load hook above an inner unit sees its full parameters, and its writes persist
    seen: list[tuple[int, ...]] = []

    def renorm(module: nn.Module, keys: object) -> None:
        inner = model.module[1].module[0].weight
        seen.append(tuple(inner.shape))
        with torch.no_grad():
            inner.mul_(0)

    hook = model.module.register_load_state_dict_post_hook(renorm)
    model.load_state_dict(other.state_dict())
    hook.remove()
    after = model.state_dict()
    out["hook_saw"] = seen
    out["hook_wrote"] = bool((after["1.0.weight"] == 0).all())
    out["rest_loaded"] = torch.equal(after["0.weight"], other.state_dict()["0.weight"])
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_load_state_dict_edge_cases(pool: RankPool) -> None:
    for r in pool.run(_load_edge_cases):
        assert r["shared_keys"] == []
        msg = r["mismatch"]
        assert "for Sequential" in msg and "size mismatch for 1.0.weight" in msg, msg
        assert 'Missing key(s) in state_dict: "0.bias"' in msg and "_fsdp_wrapped_module" not in msg, msg
        assert "nothing was loaded" in r["rank0_only"] and "state_dict_on_rank_0_only" in r["rank0_only"]
        assert r["unchanged"]
        assert r["hook_saw"] == [(4, 4)] and r["hook_wrote"] and r["rest_loaded"], r


def _state_dict_fairscale_calls() -> dict[str, object]:
    import warnings

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    model = copy.deepcopy(ref)
    model[1] = FSDP(model[1])
    model = FSDP(model)
    with model.summon_full_params():
        with torch.no_grad():
            model.module[1].module[0].weight.fill_(7.0)
        inside = model.state_dict()  # fairscale allows it: the shown values, edits included
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        positional = model.state_dict(None, "net.")
    return {
        "inside_edit": bool((inside["1.0.weight"] == 7.0).all()),
        "inside_keys": list(inside) == list(ref.state_dict()),
        "positional_keys": list(positional) == ["net." + k for k in ref.state_dict()],
        "warned": any(issubclass(w.category, FutureWarning) for w in caught),
        "idle": all(w.training_state is TrainingState.IDLE for w in model.modules() if isinstance(w, FSDP)),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_state_dict_inside_summon_and_with_positional_arguments(pool: RankPool) -> None:
    for r in pool.run(_state_dict_fairscale_calls):
        assert all(r.values()), r


def _load_with_user_code() -> dict[str, object]:
    rank = dist.get_rank()

    failing = [rank == 1]

    class Flaky(nn.Linear):  # extra state that only rank 1 fails to restore, once
        def get_extra_state(self) -> int:
            return 0

        def set_extra_state(self, state: object) -> None:
            if failing[0]:
                raise ValueError("rank 1 cannot restore this")

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), Flaky(4, 4), nn.Sequential(nn.Linear(4, 2)))
    model = copy.deepcopy(ref)
    model[2] = FSDP(model[2])
    model = FSDP(model)
    out: dict[str, object] = {}
    try:
        model.load_state_dict(ref.state_dict())  # rank 0 loads everything, rank 1 raises part-way
        out["raised"] = ""
    except ValueError as e:
        out["raised"] = str(e)
    out["sharded_after"] = all(
        h.state is MemoryState.SHARDED for w in model.modules() if isinstance(w, FSDP) for h in w.handles
    )
    # a user pre-hook on a wrapper runs after the wrapper gathered: it reads real values
    failing[0] = False
    seen: list[float] = []
    inner = model.module[2]
    inner._register_load_state_dict_pre_hook(lambda *a: seen.append(float(inner.module[0].bias.sum())))
    model.load_state_dict(ref.state_dict())
    out["hook_saw"] = seen
    out["expected"] = float(ref[2][0].bias.sum())
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_load_state_dict_with_user_code(pool: RankPool) -> None:
    r0, r1 = pool.run(_load_with_user_code)
    assert r0["raised"] == "" and "rank 1 cannot restore" in r1["raised"], "rank 0 was not left in a gather"
    for r in (r0, r1):
        assert r["sharded_after"]
        assert len(r["hook_saw"]) == 1 and abs(r["hook_saw"][0] - r["expected"]) < 1e-6, r


def _state_dict_options() -> dict[str, object]:
    rank = dist.get_rank()
    ref = build("nested", seed=1)
    on_rank0 = wrap(copy.deepcopy(ref), ("body",), state_dict_on_rank_0_only=True)
    sd0 = on_rank0.state_dict()
    meta = wrap(copy.deepcopy(ref), ("body",), state_dict_device=torch.device("meta"))
    sd_meta = meta.state_dict()
    return {
        "rank": rank,
        "rank0_keys": list(sd0),
        "rank0_ok": all(torch.equal(sd0[k], v) for k, v in ref.state_dict().items()) if rank == 0 else True,
        "devices": sorted({str(v.device) for v in sd_meta.values()}),
        "n_keys": len(ref.state_dict()),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_state_dict_on_rank_0_only_and_device(pool: RankPool) -> None:
    for r in pool.run(_state_dict_options):
        if r["rank"] == 0:
            assert len(r["rank0_keys"]) == r["n_keys"] and r["rank0_ok"]
        else:
            assert r["rank0_keys"] == []
        assert r["devices"] == ["meta"], "state_dict_device moves every value"


def _state_dict_types() -> dict[str, object]:
    from torch.distributed.fsdp import FullStateDictConfig  # torch's config, read by duck typing

    from fsdp import StateDictType

    rank = dist.get_rank()
    ref = build("buffers", seed=1)
    model = wrap(copy.deepcopy(ref), ("lin",))
    out: dict[str, object] = {"rank": rank, "n_keys": len(ref.state_dict())}
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        out["rank0_only_keys"] = len(model.state_dict())
    out["after_keys"] = len(model.state_dict())  # the constructor's options again: every rank
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
        out["local_is_local"] = list(local) == list(model.local_state_dict())
        saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in local.items()}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
        out["sharded_keys_plain"] = sorted(sharded) == sorted(ref.state_dict())
        out["sharded_is_dtensor"] = all(
            type(v).__name__ == "DTensor" for k, v in sharded.items() if k in dict(ref.named_parameters())
        )
        snapshot = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in sharded.items()}
    scramble_(model)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(snapshot)  # back to the saved values
    out["sharded_roundtrip"] = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values())
    )
    scramble_(model)
    previous = FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)  # lasting, torch's setter
    model.load_state_dict(saved)
    FSDP.set_state_dict_type(model, *previous)
    out["local_roundtrip"] = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values())
    )
    errors = []
    for call in (
        lambda: FSDP.state_dict_type(model, "full").__enter__(),
        lambda: FSDP.state_dict_type(
            model, StateDictType.SHARDED_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=True)
        ).__enter__(),
    ):
        try:
            call()
        except (TypeError, ValueError, NotImplementedError) as e:
            errors.append(type(e).__name__)
    out["errors"] = errors
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_state_dict_type_switches_what_state_dict_means(pool: RankPool) -> None:
    for r in pool.run(_state_dict_types):
        assert r["rank0_only_keys"] == (r["n_keys"] if r["rank"] == 0 else 0), (
            "FullStateDictConfig(rank0_only)"
        )
        assert r["after_keys"] == r["n_keys"], "the context restores the wrapper's own setting"
        assert r["local_is_local"] and r["local_roundtrip"]
        assert r["sharded_keys_plain"] and r["sharded_is_dtensor"] and r["sharded_roundtrip"]
        # (a module without wrappers is accepted as torch does: tests/compat/test_torch_state_dict.py)
        assert r["errors"] == ["TypeError", "NotImplementedError"]


def _plain_parent_loads() -> dict[str, object]:
    """A plain module holding wrappers: its own load_state_dict() takes what its state_dict() wrote."""
    from fsdp import StateDictType

    torch.manual_seed(3)
    body = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Sequential(nn.Linear(6, 6), nn.ReLU()))
    ref = nn.Sequential(body, nn.Linear(6, 2))
    ref[0][1].running_mean.uniform_()  # a buffer inside a wrapper, not at its default
    parent = copy.deepcopy(ref)
    parent[0][2] = FSDP(parent[0][2])
    parent[0] = FSDP(parent[0])  # the parent itself stays a plain nn.Sequential
    parent(torch.randn(4, 5)).sum().backward()  # lazy init: each wrapper child is a root
    expected = {k: v.clone() for k, v in parent.state_dict().items()}

    def same_as_ref() -> bool:
        got = parent.state_dict()
        return sorted(got) == sorted(ref.state_dict()) and all(
            torch.equal(got[k], v) for k, v in expected.items()
        )

    out: dict[str, object] = {}
    results = {}
    for kind in (
        StateDictType.FULL_STATE_DICT,
        StateDictType.LOCAL_STATE_DICT,
        StateDictType.SHARDED_STATE_DICT,
    ):
        with FSDP.state_dict_type(parent, kind):
            saved = {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in parent.state_dict().items()
            }
        scramble_(parent)
        with FSDP.state_dict_type(parent, kind):
            result = parent.load_state_dict(saved)
        results[kind.name] = (list(result.missing_keys), list(result.unexpected_keys), same_as_ref())
    out["results"] = results
    full = expected
    broken = {("0.2.0.weightx" if k == "0.2.0.weight" else k): v for k, v in full.items()}
    result = parent.load_state_dict(broken, strict=False)
    out["lenient"] = (sorted(result.missing_keys), sorted(result.unexpected_keys))
    try:
        parent.load_state_dict(broken)
        out["strict"] = "loaded"
    except RuntimeError as e:
        out["strict"] = str(e)
    try:
        parent.load_state_dict(full, assign=True)
        out["assign"] = "loaded"
    except NotImplementedError as e:
        out["assign"] = str(e)
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_plain_parent_loads_what_it_saved(pool: RankPool) -> None:
    for r in pool.run(_plain_parent_loads):
        for kind, (missing, unexpected, same) in r["results"].items():
            assert (missing, unexpected) == ([], []), kind
            assert same, f"{kind}: the parent's load_state_dict restored every parameter and buffer"
        assert r["lenient"] == (["0.2.0.weight"], ["0.2.0.weightx"]), "keys reported under plain names"
        assert 'Missing key(s) in state_dict: "0.2.0.weight"' in r["strict"]
        assert "_fsdp_wrapped_module" not in r["strict"]
        assert "assign=True" in r["assign"]


class _Versioned(nn.Module):
    """A module with a load pre-hook that fills a default for a buffer older checkpoints lack."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.hook_calls = 0
        self._register_load_state_dict_pre_hook(self._fill_defaults)

    def _fill_defaults(self, state_dict: dict[str, object], prefix: str, *args: object) -> None:
        self.hook_calls += 1
        state_dict.setdefault(prefix + "ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.ema


def _plain_parent_edges() -> dict[str, object]:
    from torch.distributed.fsdp import FullStateDictConfig

    from fsdp import StateDictSettings, StateDictType

    rank = dist.get_rank()
    out: dict[str, object] = {}
    # a hook inside the wrapper runs once, and does not overwrite what was loaded
    torch.manual_seed(0)
    ref = nn.Sequential(_Versioned(), nn.Linear(4, 1))
    ref[0].ema.fill_(7.0)
    parent = copy.deepcopy(ref)
    parent[0] = FSDP(parent[0])
    parent[0].module.hook_calls = 0
    parent.load_state_dict(ref.state_dict())
    out["ema"] = parent[0].module.ema.tolist()
    out["hook_calls"] = parent[0].module.hook_calls
    out["children_back"] = parent[0].module.module is parent[0]._fsdp_wrapped_module

    # rank0_only and the state dict device cover the wrapper's buffers too, under a parent
    def body() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    parent = nn.Sequential(body(), nn.Linear(4, 2))
    parent[0] = FSDP(parent[0], state_dict_on_rank_0_only=True)
    out["rank0_only_keys"] = sorted(parent.state_dict())
    parent = nn.Sequential(body(), nn.Linear(4, 2))
    parent[0] = FSDP(parent[0], state_dict_device=torch.device("meta"))
    out["devices"] = {k: v.device.type for k, v in parent.state_dict().items()}
    with FSDP.state_dict_type(parent, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        out["config_rank0_only_keys"] = sorted(parent.state_dict())
    # size mismatches under the parent's names, with the other errors
    parent = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(3, 3)))
    parent[1] = FSDP(parent[1])
    wrong = parent.state_dict()
    wrong["1.0.weight"] = torch.zeros(5, 5)
    try:
        parent.load_state_dict(wrong)
        out["mismatch"] = "loaded"
    except RuntimeError as e:
        out["mismatch"] = str(e)
    # under LOCAL, a parent's own keys alone load with strict=False: the wrapper's are missing
    with FSDP.state_dict_type(parent, StateDictType.LOCAL_STATE_DICT):
        result = parent.load_state_dict({k: v for k, v in wrong.items() if k.startswith("0.")}, strict=False)
        out["local_missing"] = sorted(result.missing_keys)
    # one kind per tree; torch's settings API
    torch.manual_seed(0)
    nested = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    nested[1] = FSDP(nested[1])
    root = FSDP(nested)
    previous = FSDP.set_state_dict_type(root.module[1], StateDictType.LOCAL_STATE_DICT)
    errors = []
    for call in (root.state_dict, lambda: root.load_state_dict({}), lambda: FSDP.get_state_dict_type(root)):
        try:
            call()
        except ValueError as e:
            errors.append("set it on the outermost module" in str(e) or "set_state_dict_type" in str(e))
    out["mixed_refused"] = errors
    FSDP.set_state_dict_type(root.module[1], *previous)
    config = FullStateDictConfig(offload_to_cpu=True)
    before = FSDP.set_state_dict_type(root, StateDictType.FULL_STATE_DICT, config)
    now = FSDP.get_state_dict_type(root)
    out["settings"] = (
        isinstance(before, StateDictSettings) and before.state_dict_type is StateDictType.FULL_STATE_DICT,
        now.state_dict_config is config,
        {v.device.type for v in root.state_dict().values()},
    )
    FSDP.set_state_dict_type(root, *before)
    out["restored"] = FSDP.get_state_dict_type(root) == before
    out["rank"] = rank
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_plain_parent_saves_and_loads_like_the_wrapper(pool: RankPool) -> None:
    for r in pool.run(_plain_parent_edges):
        assert r["ema"] == [7.0] * 4, "a load hook inside the wrapper must not overwrite the loaded buffer"
        assert r["hook_calls"] == 1 and r["children_back"]
        plain = ["1.bias", "1.weight"]
        bn = ["0.1.running_mean", "0.1.running_var", "0.1.num_batches_tracked"]
        full = sorted(["0.0.weight", "0.0.bias", "0.1.weight", "0.1.bias", *bn, *plain])
        assert r["rank0_only_keys"] == (full if r["rank"] == 0 else plain), "rank0_only drops the buffers too"
        assert r["config_rank0_only_keys"] == (full if r["rank"] == 0 else plain)
        assert all(d == ("meta" if k.startswith("0.") else "cpu") for k, d in r["devices"].items()), r[
            "devices"
        ]
        assert "size mismatch for 1.0.weight" in r["mismatch"] and "_fsdp_wrapped_module" not in r["mismatch"]
        assert r["local_missing"] == ["1.flat_param_0"]  # (the identity is in _metadata, not an entry)
        assert r["mixed_refused"] == [True, True, True]
        assert r["settings"] == (True, True, {"cpu"}) and r["restored"]


def _summon() -> dict[str, object]:
    rank = dist.get_rank()
    ref = build("tied", seed=2)
    model = wrap(copy.deepcopy(ref), ("mix",))
    flat_before = [p.detach().clone() for p in model.parameters()]
    with model.summon_full_params():
        named = {n: tuple(p.shape) for n, p in model.named_parameters()}
        states = {w.training_state for w in model.modules() if isinstance(w, FSDP)}
        full_equal = torch.equal(model.module.mix.module.weight, ref.mix.weight)
        with torch.no_grad():
            model.module.mix.module.weight.fill_(rank + 1.0)  # ranks disagree: each writes its own chunk back
            model.module.emb.weight.add_(1.0)
    after = model.state_dict()
    with model.summon_full_params(volatile=True):
        with torch.no_grad():
            model.module.mix.module.bias.fill_(100.0)
    after_volatile = model.state_dict()
    with model.summon_full_params(recurse=False):
        inner_sharded = model.module.mix.handles[0].state is MemoryState.SHARDED
        root_full = model.handles[0].state is MemoryState.UNSHARDED
    # a summon that only reads, between forward and backward, leaves the backward intact
    idx = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(rank))
    loss = model(idx).pow(2).mean()
    with model.summon_full_params():
        model.module.mix.module.weight.sum()
    loss.backward()
    return {
        "named": named,
        "states": {s.name for s in states},
        "full_equal": full_equal,
        "mix_weight": after["mix.weight"],
        "emb_delta": (after["emb.weight"] - ref.emb.weight).abs().max().item(),
        "tied_same": after["head.weight"] is after["emb.weight"],
        "bias_kept": torch.equal(after_volatile["mix.bias"], after["mix.bias"]),
        "flat_shapes_back": [tuple(p.shape) for p in model.parameters()]
        == [tuple(p.shape) for p in flat_before],
        "inner_sharded": inner_sharded,
        "root_full": root_full,
        "grads": all(p.grad is not None for p in model.parameters()),
    }


def _summon_compares_bits() -> dict[str, object]:
    model = wrap(build("tied", seed=2), ("mix",))
    with model.summon_full_params(), torch.no_grad():
        model.module.mix.module.bias.zero_()
        model.module.emb.weight[0, 0] = float("nan")  # NaN is not torch.equal to itself
    with model.summon_full_params(), torch.no_grad():
        model.module.mix.module.bias.neg_()  # -0.0 is torch.equal to 0.0, yet a write
    signs = torch.signbit(model.state_dict()["mix.bias"]).tolist()
    idx = torch.randint(1, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    loss = model(idx).pow(2).mean()
    with model.summon_full_params():  # reads only, over a NaN
        model.module.emb.weight.sum()
    loss.backward()
    return {"signs": signs, "grads": all(p.grad is not None for p in model.parameters())}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_summon_writes_back_by_bits(pool: RankPool) -> None:
    for r in pool.run(_summon_compares_bits):
        assert r["signs"] == [True] * 6, "a -0.0 written over 0.0 persists"
        assert r["grads"], "a read-only summon over NaN values keeps the backward intact"


@pytest.mark.parametrize("pool", [1, 2, 3], indirect=True)
def test_summon_full_params(pool: RankPool) -> None:
    results = pool.run(_summon)
    n = pool.world_size
    for r in results:
        names = r["named"]
        assert names["emb.weight"] == (11, 6), "inside summon the names are the plain module's (fairscale)"
        assert names["mix.weight"] == (6, 6)
        assert not any("_fsdp_wrapped_module" in k for k in names)
        assert not any("flat_param" in k for k in names), "flat parameters are hidden inside summon"
        assert r["states"] == {"SUMMON_FULL_PARAMS"} and r["full_equal"]
        assert abs(r["emb_delta"] - 1.0) < 1e-6, "in-place writes persist after summon"
        assert r["tied_same"], "tied parameters are one tensor in the state dict, as in a plain module"
        assert r["bias_kept"], "volatile summon discards writes"
        assert r["flat_shapes_back"] and r["inner_sharded"] and r["root_full"]
        assert r["grads"], "a read-only summon between forward and backward keeps the backward intact"
        # each rank wrote rank+1 into its view: its own chunk of the flat parameter is what persists
        w = r["mix_weight"].reshape(-1)
        chunk = -(-42 // n)  # mix: 36 weight + 6 bias elements
        for i in range(36):
            assert w[i].item() == i // chunk + 1.0


def _apply_and_reset() -> dict[str, object]:
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), FSDP(nn.Linear(4, 4), allow_reset_parameters=True)))

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            with torch.no_grad():
                m.weight.fill_(0.25)
                m.bias.zero_()

    model.apply(init)
    sd = model.state_dict()
    applied = all(torch.all(sd[k] == 0.25) for k in ("0.weight", "1.weight"))
    model.module[1].reset_parameters()
    sd2 = model.state_dict()
    plain = FSDP(nn.Linear(2, 2))
    try:
        plain.reset_parameters()
        refused = False
    except RuntimeError as e:
        refused = "allow_reset_parameters=True" in str(e)
    return {
        "applied": applied,
        "reset": not torch.all(sd2["1.weight"] == 0.25).item(),
        "root_kept": torch.equal(sd2["0.weight"], sd["0.weight"]),
        "refused": refused,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_apply_sees_full_params_and_reset_parameters(pool: RankPool) -> None:
    for r in pool.run(_apply_and_reset):
        assert r == {"applied": True, "reset": True, "root_kept": True, "refused": True}


def _eval_and_no_grad() -> dict[str, float]:
    rank = dist.get_rank()
    ref = build("nested", seed=4)
    model = wrap(copy.deepcopy(ref), ("body", "inp"))
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
    model.eval()
    with torch.no_grad():
        a = model(x)
        b = model(x)  # twice in a row: root's full params must not be stale or leaked
    states = [h.state for w in model.modules() if isinstance(w, FSDP) for h in w.handles]
    model.train()
    loss = model(x).sum()
    loss.backward()
    return {
        "err": max((a - ref(x)).abs().max().item(), (b - ref(x)).abs().max().item()),
        "all_sharded": float(all(s is MemoryState.SHARDED for s in states)),
    }


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_eval_and_no_grad_forward(pool: RankPool) -> None:
    for r in pool.run(_eval_and_no_grad):
        assert r["err"] < 1e-6 and r["all_sharded"] == 1.0


def _grad_accumulation() -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build("nested", seed=5)
    model = wrap(copy.deepcopy(ref), ("body",))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2 * world, 6, generator=g) for _ in range(3)]
    for b in batches:  # three backward passes, no zero_grad: gradients sum
        model(b[2 * rank : 2 * rank + 2]).pow(2).mean().backward()
        ref(b).pow(2).mean().backward()
    from tests.parity import handles_with_ref_names, reference_flat, shard_of

    err = 0.0
    for h, names in handles_with_ref_names(model):
        expected = reference_flat(ref, names, "grad")
        err = max(err, (h.flat_param.grad - shard_of(expected, h)).abs().max().item())
    return err


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_gradient_accumulation_across_backwards(pool: RankPool) -> None:
    assert max(pool.run(_grad_accumulation)) < 1e-5


def _comm_counts(bucket_cap_mb: float = 25) -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 1))
    model[0], model[1] = FSDP(model[0]), FSDP(model[1])
    root = FSDP(model, bucket_cap_mb=bucket_cap_mb)
    root(torch.randn(2, 5)).sum().backward()  # lazy init + warm-up
    root.reset_comm_stats()
    root(torch.randn(2, 5)).sum().backward()
    return root.comm_stats()


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_collectives_per_step(pool: RankPool) -> None:
    n = pool.world_size
    padded = -(-30 // n) * n  # each Linear(5, 5) has 30 elements
    root_padded = -(-6 // n) * n
    for cap, rs_calls in ((0, 3), (25, 1)):
        for stats in pool.run(_comm_counts, cap):
            # inner units: gathered in forward and again in backward; the root keeps its params
            assert stats["all_gather"]["calls"] == 2 + 2 + 1
            assert stats["all_gather"]["numel"] == 4 * padded + root_padded
            # one reduce-scatter per flat parameter, or all three in one 25 MB bucket: same elements
            assert stats["reduce_scatter"]["calls"] == rs_calls
            assert stats["reduce_scatter"]["numel"] == 2 * padded + root_padded
            assert stats["all_reduce"]["calls"] == 1, "one small consistency check per backward"


def _bucketed(cap_bytes: int) -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)], nn.Linear(6, 1))
    net = copy.deepcopy(ref)
    for i in range(4):
        net[i] = FSDP(net[i])
    model = FSDP(net, bucket_cap_mb=cap_bytes / 2**20)
    from tests.parity import compare_training

    model.reset_comm_stats()
    diffs = compare_training(
        ref, model, lambda g, n: torch.randn(n, 6, generator=g), lambda y: y.pow(2).mean()
    )
    stats = model.comm_stats()["reduce_scatter"]
    return {"diff": max(diffs.values()), "calls": stats["calls"], "rank": rank, "world": world}


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
def test_reduce_scatter_buckets_follow_bucket_cap_mb(pool: RankPool) -> None:
    n = pool.world_size
    unit = -(-42 // n) * n * 4  # bytes of one padded Linear(6, 6) gradient
    for cap, per_step in ((0, 5), (2 * unit, 3), (10**6, 1)):
        for r in pool.run(_bucketed, cap):
            assert r["diff"] <= 1e-5, (cap, r)
            assert r["calls"] == 3 * per_step, (cap, r)  # three training steps


def _large_and_small_gradients() -> list[int]:
    from fsdp.comm import collectives
    from fsdp.comm.rs_buckets import SMALL_GRADIENT_BYTES

    torch.manual_seed(0)
    width = 520  # Linear(520, 520): 270,920 elements, over 1 MiB of fp32 gradient
    assert (width * width + width) * 4 >= SMALL_GRADIENT_BYTES
    net = nn.Sequential(
        FSDP(nn.Linear(width, width)),
        FSDP(nn.Linear(width, 4)),
        FSDP(nn.Linear(4, 4)),
        nn.Linear(4, width),
        FSDP(nn.Linear(width, width)),
    )
    model = FSDP(net)  # default bucket_cap_mb=25: every gradient here would fit one bucket
    sizes: list[int] = []
    real = collectives.CommStats.record

    def logged(self: collectives.CommStats, kind: collectives.CollectiveKind, tensor: torch.Tensor) -> None:
        if kind is collectives.CollectiveKind.REDUCE_SCATTER:
            sizes.append(tensor.numel())
        real(self, kind, tensor)

    collectives.CommStats.record = logged  # type: ignore[method-assign]
    try:
        model(torch.randn(3, width)).sum().backward()
    finally:
        collectives.CommStats.record = real  # type: ignore[method-assign]
    return sizes


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_large_gradients_skip_the_bucket(pool: RankPool) -> None:
    # the two gradients of over 1 MiB are reduce-scattered on their own, each as soon as it is ready
    # (in backward order); the three small ones (the root's and two units') share one bucket, sent
    # when it is waited on at the end of backward
    big = 520 * 520 + 520
    small = (4 * 520 + 520) + (4 * 4 + 4) + (520 * 4 + 4)
    for sizes in pool.run(_large_and_small_gradients):
        assert sizes == [big, big, small], sizes


def _local_state_of_a_newer_format() -> dict[str, Any]:
    """A local state dict whose identity says a newer format than this version reads is refused,
    with the model unchanged (not read as this version's own)."""
    from collections import OrderedDict

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    state = model.local_state_dict()
    identity = state._metadata[""]["_fsdp_local_state"]  # type: ignore[attr-defined]
    identity["version"] += 1
    metadata = state._metadata  # type: ignore[attr-defined]
    state = OrderedDict((k, v + 1) for k, v in state.items())  # values that would change the model
    state._metadata = metadata  # type: ignore[attr-defined]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        model.load_local_state_dict(state)
        message = "loaded"
    except ValueError as e:
        message = str(e)
    after = model.state_dict()
    return {"message": message, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


@pytest.mark.parametrize("pool", [1, 2], indirect=True)
def test_a_local_state_dict_of_a_newer_format_is_refused(pool: RankPool) -> None:
    for r in pool.run(_local_state_of_a_newer_format):
        assert "saved by a newer version of fsdp" in r["message"] and "upgrade fsdp" in r["message"], r
        assert r["unchanged"], r


def _frozen_tied_embedding() -> dict[str, Any]:
    """An embedding frozen before wrapping and tied to an output head in another wrapper: the outer
    wrapper adopts the tie (see [Note: parameters shared across wrappers]) and must keep it frozen."""
    from tests.models import Tied

    torch.manual_seed(0)
    model = Tied()
    model.emb.weight.requires_grad_(False)
    model.emb = FSDP(model.emb)
    model = FSDP(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    idx = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model(idx).square().mean().backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    return {
        "emb": torch.equal(before["emb.weight"], after["emb.weight"]),
        "head": torch.equal(after["head.weight"], after["emb.weight"]),
        "mix_trained": not torch.equal(before["mix.weight"], after["mix.weight"]),
        "frozen": [n for n, p in model.named_parameters() if not p.requires_grad],
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_frozen_embedding_tied_across_wrappers_stays_frozen(pool: RankPool) -> None:
    for r in pool.run(_frozen_tied_embedding):
        assert r["emb"] and r["head"] and r["mix_trained"], r
        assert r["frozen"], r  # the flat parameter that holds the tie requires no gradient
