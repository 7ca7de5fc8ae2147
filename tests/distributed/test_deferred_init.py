"""Deferred initialization: models built on the meta device are materialized one unit at a time."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from tests.models import Nested, Tied, wrap
from tests.parity import compare_training
from tests.rank_pool import RankPool


def _init(module: nn.Module) -> None:
    """Deterministic per-module init, independent of the order modules are initialized in."""
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            n = p.numel()
            p.copy_((torch.arange(n, dtype=torch.float32).mul(0.37 + len(name)).sin() * 0.5).view_as(p))
        for b in module.buffers(recurse=False):
            b.fill_(0.25)


def _materialized_counts(model: nn.Module) -> dict[str, int]:
    real = sum(p.numel() for p in model.parameters() if not p.is_meta)
    meta = sum(p.numel() for p in model.parameters() if p.is_meta)
    return {"real": real, "meta": meta}


# The modules whose reset_parameters() a deferred wrap runs, in its order: inner units first (deepest
# first, as tests.models.wrap builds them), each unit's modules parent before child; the head of
# "tied" shares the embedding's weight, which is initialized once, by the embedding.
RESET_ORDER = {
    "nested": ("body.2.0", "body.2.2", "body.0", "inp", "out"),
    "tied": ("mix", "emb"),
}


def _deferred(case: str, use_reset: bool) -> dict[str, object]:
    cls = {"nested": Nested, "tied": Tied}[case]
    paths = {"nested": ("body.2", "body", "inp"), "tied": ("mix",)}[case]
    torch.manual_seed(0)
    ref = cls()
    if not use_reset:
        ref.apply(_init)
    with torch.device("meta"):
        torch.manual_seed(0)
        lazy = cls()
    kwargs = {} if use_reset else {"param_init_fn": _init}
    torch.manual_seed(1)  # reset_parameters() draws from the RNG: every rank must draw alike
    model = wrap(lazy, paths, **kwargs)
    counts = _materialized_counts(model)
    tied_ok = True
    if case == "tied":
        with model.summon_full_params():
            tied_ok = model.module.head.weight is model.module.emb.weight
    if use_reset:
        # the eager build's values: the same reset_parameters() calls, in the same order, same seed
        torch.manual_seed(1)
        for path in RESET_ORDER[case]:
            ref.get_submodule(path).reset_parameters()
        sd, eager = model.state_dict(), ref.state_dict()
        return {
            "counts": counts,
            "diff": max((sd[k] - v).abs().max().item() for k, v in eager.items()),
            "keys": list(sd) == list(eager),
            "tied": tied_ok,
            "sd": {k: v.tolist() for k, v in sd.items()},
        }
    diffs = compare_training(
        ref,
        model,
        (lambda g, n: torch.randint(0, 11, (n, 5), generator=g))
        if case == "tied"
        else (lambda g, n: torch.randn(n, 6, generator=g)),
        lambda y: y.pow(2).mean(),
    )
    return {"counts": counts, "diff": max(diffs.values()), "tied": tied_ok}


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("case", ["nested", "tied"])
def test_meta_model_trains_like_the_eagerly_built_one(pool: RankPool, case: str) -> None:
    for r in pool.run(_deferred, case, False):
        assert r["counts"]["meta"] == 0, "every flat parameter is real after wrapping"
        assert r["diff"] <= 1e-5, r
        assert r["tied"], "a tied weight stays one tensor"


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("case", ["nested", "tied"])
def test_meta_model_initialized_by_reset_parameters(pool: RankPool, case: str) -> None:
    results = pool.run(_deferred, case, True)
    for r in results:
        assert r["counts"]["meta"] == 0 and r["tied"]
        assert r["keys"] and r["diff"] == 0.0, (
            "reset_parameters() initialized every module, as an eager build"
        )
    assert results[0]["sd"] == results[1]["sd"], "ranks seeded alike materialize identical values"


class _Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(256, 256) for _ in range(6)])
        self.head = nn.Linear(256, 4)


def _sharded_on_creation() -> dict[str, object]:
    world = dist.get_world_size()
    with torch.device("meta"):
        model = _Big()
    total = sum(p.numel() for p in model.parameters())
    real_during: list[int] = []
    materialized: list[weakref.ref[torch.Tensor]] = []
    alive_during: list[int] = []

    def init(module: nn.Module) -> None:
        _init(module)
        materialized.extend(weakref.ref(p) for p in module.parameters(recurse=False))

    def make(block: nn.Module) -> FSDP:
        wrapped = FSDP(block, param_init_fn=init)
        # after each unit: only shards of the units built so far are real, everything else is meta
        real_during.append(sum(p.numel() for p in model.parameters() if not p.is_meta))
        # and the unit's full parameters are gone at once, not when the garbage collector runs
        alive_during.append(sum(r() is not None for r in materialized))
        return wrapped

    gc.disable()
    try:
        for i in range(len(model.blocks)):
            model.blocks[i] = make(model.blocks[i])
    finally:
        gc.enable()
    root = FSDP(model, param_init_fn=_init)
    local = sum(p.numel() for p in root.parameters())
    return {
        "total": total,
        "local": local,
        "world": world,
        "real_during": real_during,
        "alive_during": alive_during,
        "materialized": len(materialized),
    }


@pytest.mark.parametrize("pool", [2, 4], indirect=True)
def test_no_rank_materializes_more_than_its_shards(pool: RankPool) -> None:
    unit = 256 * 256 + 256
    for r in pool.run(_sharded_on_creation):
        n = r["world"]
        assert r["local"] <= r["total"] / n + 8 * n, "each rank keeps 1/N of every unit"
        for k, real in enumerate(r["real_during"], start=1):
            assert real <= k * (-(-unit // n)), f"after {k} units only their shards are real: {real}"
        assert r["materialized"] > 0 and r["alive_during"] == [0] * len(r["real_during"]), r["alive_during"]


def _errors() -> list[str]:
    out = []

    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        m = NoReset()
    try:
        FSDP(m)
    except ValueError as e:
        out.append(str(e))
    try:
        FSDP(nn.Linear(2, 2), param_init_fn=_init)
    except ValueError as e:
        out.append(str(e))
    return out


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_deferred_init_errors_say_what_to_do(pool: RankPool) -> None:
    (msgs,) = pool.run(_errors)
    assert len(msgs) == 2
    assert "has no reset_parameters(); pass param_init_fn" in msgs[0]
    assert "no meta parameters or buffers; drop param_init_fn" in msgs[1]


def _root_owning_nothing() -> int:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for i in range(2):
        model[i] = FSDP(model[i], param_init_fn=_init)
    # fairscale's pattern: the same options for the root, which owns no parameter of its own
    root = FSDP(model, param_init_fn=_init)
    return sum(p.numel() for p in root.parameters())


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_param_init_fn_on_a_wrapper_that_owns_nothing_is_accepted(pool: RankPool) -> None:
    assert pool.run(_root_owning_nothing) == [2 * (16 + 4)]


def _init_failing_at_the_last(module: nn.Module) -> None:
    if isinstance(module, nn.LayerNorm):
        raise KeyError("no rule for LayerNorm")
    _init(module)


def _failed_init_leaves_meta() -> dict[str, object]:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    model[1].weight = model[0].weight  # tied: the successor is shared only at the end
    notes: list[str] = []
    try:
        FSDP(model, param_init_fn=_init_failing_at_the_last)
    except KeyError as e:
        notes = getattr(e, "__notes__", [])
    still_meta = all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    tied = model[1].weight is model[0].weight
    wrapped = FSDP(model, param_init_fn=_init)  # the retry initializes every module
    eager = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    eager[1].weight = eager[0].weight
    eager.apply(_init)
    with wrapped.summon_full_params():
        same = all(
            torch.equal(a, b) for a, b in zip(wrapped.module.parameters(), eager.parameters(), strict=True)
        )
    return {"notes": notes, "still_meta": still_meta, "tied": tied, "same": same}


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_a_failed_param_init_fn_leaves_the_model_on_meta_for_a_retry(pool: RankPool) -> None:
    (r,) = pool.run(_failed_init_leaves_meta)
    assert r["notes"] == [
        "FullyShardedDataParallel: the module was left on the meta device, as it was before the wrap"
    ]
    assert r["still_meta"], "nothing half materialized (uninitialized memory that a second wrap would accept)"
    assert r["tied"]
    assert r["same"], "the retry initializes every module"


def _in_place_init(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        p.fill_(0.5)  # in place on a leaf that requires grad: allowed only under no_grad


def _init_in_place() -> float:
    with torch.device("meta"):
        model = nn.Linear(3, 3)
    wrapped = FSDP(model, param_init_fn=_in_place_init)
    with wrapped.summon_full_params():
        return float(wrapped.module.weight.sum())


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_param_init_fn_may_initialize_in_place(pool: RankPool) -> None:
    assert pool.run(_init_in_place) == [4.5]


class _ScaledLinear(nn.Module):
    """A meta module with a real buffer that reset_parameters does not write."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))  # real, set at construction

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class _WithOwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.empty(4))
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x + self.pos)


def _to_empty_recursive(module: nn.Module) -> None:
    module.to_empty(device=torch.device("cpu"))  # torch-style, recurse=True: reaches the inner wrapper
    for p in module.parameters(recurse=False):
        p.fill_(0.25)


def _real_tensors_survive() -> dict[str, object]:
    scaled = FSDP(_ScaledLinear())
    with torch.device("meta"):
        outer = _WithOwnParameter()
    torch.manual_seed(0)
    inner = nn.Linear(4, 4)  # a real inner unit, built eagerly
    expected = inner.weight.detach().clone()
    outer.inner = FSDP(inner)
    wrapped = FSDP(outer, param_init_fn=_to_empty_recursive)
    with wrapped.summon_full_params():
        inner_equal = torch.equal(wrapped.module.inner.module.weight, expected)
        pos = wrapped.module.pos.tolist()
    return {"scale": scaled.module.scale.tolist(), "inner_equal": inner_equal, "pos": pos}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_materialization_keeps_real_tensors_and_inner_units(pool: RankPool) -> None:
    for r in pool.run(_real_tensors_survive):
        assert r["scale"] == [2.0] * 4, "a real buffer of a meta unit keeps its values"
        assert r["inner_equal"], "a param_init_fn calling to_empty(recurse=True) leaves inner units alone"
        assert r["pos"] == [0.25] * 4
