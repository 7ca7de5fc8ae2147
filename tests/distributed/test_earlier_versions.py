"""What version 0.1.0 wrote (its flat module layout) still loads: checkpoints at any world size,
pickled wrappers, local state dicts and gathered optimizer state. Fixtures: tests/fixtures/v0_1_0,
written by ``tests/fixtures/make_fixtures.py`` before the package was split into subpackages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from tests.fixtures.make_fixtures import model
from tests.rank_pool import RankPool

OLD = Path(__file__).resolve().parents[1] / "fixtures" / "v0_1_0"


def _wrapped() -> FSDP:
    m = model()
    m[2] = FSDP(m[2])
    return FSDP(m)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _same_optim(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        a["state"][i].keys() == b["state"][i].keys()
        and all(
            torch.equal(torch.as_tensor(a["state"][i][k]), torch.as_tensor(b["state"][i][k]))
            for k in a["state"][i]
        )
        for i in a["state"]
    )


def _load_checkpoint() -> dict[str, Any]:
    m = _wrapped()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    extra = fsdp.load_checkpoint(OLD / "checkpoint_ws2", m, opt)
    optim = m.gather_full_optim_state_dict(opt)
    return {
        "extra": extra,
        "model": _same(m.state_dict(), torch.load(OLD / "full_state.pt")),
        "optim": optim is None
        or _same_optim(optim, torch.load(OLD / "full_optim_rank0.pt", weights_only=False)),
    }


@pytest.mark.parametrize("pool", [1, 2, 3], indirect=True)
def test_a_checkpoint_of_version_0_1_0_loads_at_any_world_size(pool: RankPool) -> None:
    for got in pool.run(_load_checkpoint):
        assert got == {"extra": {"step": 1}, "model": True, "optim": True}


def _unpickle_and_load_local() -> dict[str, bool]:
    rank = dist.get_rank()
    pickled = torch.load(OLD / f"model_rank{rank}.pt", weights_only=False)
    local = torch.load(OLD / f"local_state_rank{rank}.pt")
    shards = {n: p.detach() for n, p in pickled.named_parameters()}
    for w in pickled.modules():
        if isinstance(w, FSDP):
            w.process_group = dist.group.WORLD  # fairscale's idiom after unpickling
    fresh = _wrapped()
    fresh.load_local_state_dict(local)
    full = torch.load(OLD / "full_state.pt")
    return {
        "type": type(pickled) is FSDP,
        "shards": [t.tolist() for t in shards.values()]
        == [local[k].tolist() for k in local if "flat_param" in k],
        "pickled": _same(pickled.state_dict(), full),
        "local": _same(fresh.state_dict(), full),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_pickled_wrappers_and_local_state_dicts_of_version_0_1_0_load(pool: RankPool) -> None:
    for got in pool.run(_unpickle_and_load_local):
        assert got == {"type": True, "shards": True, "pickled": True, "local": True}
