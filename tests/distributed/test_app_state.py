"""The training loop's own state in a checkpoint (``app_state=``): every rank gets its own back, the
next random draws and the LR schedule continue exactly, other world sizes get rank ``r % N``'s state,
and every misuse fails on every rank with the model and the optimizer unchanged."""

from __future__ import annotations

import fractions
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp import load_checkpoint, save_checkpoint
from fsdp.checkpoints.save_load import COMMIT_MARKER, CheckpointError, read_checkpoint_info
from tests.checkpointing import expect_error, flat_snapshot, make, same, train
from tests.rank_pool import RankPool

CASE = "nested"


class RNG:
    """This rank's torch RNG stream, as an application would checkpoint it."""

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "rank": dist.get_rank(), "world_size": dist.get_world_size()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        self.loaded_from = (state["rank"], state["world_size"])


class Progress:
    """Per-rank loop state whose structure changes as training goes (a list that grows)."""

    def __init__(self, step: int = 0, history: list[float] | None = None) -> None:
        self.step, self.history = step, list(history or [])

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.history = state["step"], list(state["history"])


def _app(opt: torch.optim.Optimizer) -> tuple[dict[str, Any], torch.optim.lr_scheduler.LRScheduler]:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return {"rng": RNG(), "progress": Progress(), "scheduler": sched}, sched


def _save(tmp: str) -> dict[str, Any]:
    rank = dist.get_rank()
    _, model = make(CASE, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    app, sched = _app(opt)
    train(model, opt, CASE, range(2))
    for _ in range(3):
        sched.step()
    torch.manual_seed(100 + rank)  # each rank its own stream, part-way through it
    torch.rand(5)
    app["progress"].step, app["progress"].history = 3, [float(rank)] * (rank + 2)  # lengths differ per rank
    save_checkpoint(Path(tmp) / "ckpt", model, opt, app_state=app)
    expected = torch.rand(4)  # the draws a resumed run must see next
    return {"expected": expected, "lr": opt.param_groups[0]["lr"], "last_epoch": sched.last_epoch}


def _load(tmp: str) -> dict[str, Any]:
    _, model = make(CASE, seed=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    app, sched = _app(opt)
    torch.manual_seed(12345)  # a fresh process's stream: unrelated to the saved one
    load_checkpoint(Path(tmp) / "ckpt", model, opt, app_state=app)
    return {
        "draws": torch.rand(4),
        "progress": app["progress"].state_dict(),
        "from": app["rng"].loaded_from,
        "lr": opt.param_groups[0]["lr"],
        "last_epoch": sched.last_epoch,
        "names": read_checkpoint_info(Path(tmp) / "ckpt")["app_state"],
    }


def test_every_rank_gets_its_own_state_back(rank_pools: Callable[[int], RankPool], tmp_path: Path) -> None:
    saved = rank_pools(2).run(_save, str(tmp_path))
    assert not torch.equal(saved[0]["expected"], saved[1]["expected"]), "the ranks' streams must differ"
    for rank, r in enumerate(rank_pools(2).run(_load, str(tmp_path))):
        assert r["from"] == (rank, 2)
        assert torch.equal(r["draws"], saved[rank]["expected"]), "this rank's RNG stream continues exactly"
        assert r["progress"] == {"step": 3, "history": [float(rank)] * (rank + 2)}
        assert r["last_epoch"] == saved[rank]["last_epoch"] == 3 and r["lr"] == saved[rank]["lr"] == 5e-3
        assert r["names"] == ["progress", "rng", "scheduler"]
    # at another world size, rank r continues from what rank r % 2 saved
    for world in (3, 1, 4):  # (at 4, rank 3 resumes rank 1: "rank 0 for every extra rank" would differ)
        for rank, r in enumerate(rank_pools(world).run(_load, str(tmp_path))):
            assert r["from"] == (rank % 2, 2), (world, rank, r["from"])
            assert torch.equal(r["draws"], saved[rank % 2]["expected"])
            assert r["progress"]["history"] == [float(rank % 2)] * (rank % 2 + 2)
            assert r["last_epoch"] == 3


class Refuses(Progress):
    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("saved by another version")


def _misuse(tmp: str) -> dict[str, Any]:
    rank = dist.get_rank()
    root = Path(tmp)
    _, model = make(CASE, seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, CASE, range(1))
    save_checkpoint(root / "good", model, opt, app_state={"progress": Progress(7)})
    train(model, opt, CASE, range(1, 2))
    before = flat_snapshot(model, opt)
    m: dict[str, Any] = {}
    m["missing"] = expect_error(
        CheckpointError, load_checkpoint, root / "good", model, opt, app_state={"rng": RNG()}
    )
    refusing = {"progress": Refuses() if rank == 1 else Progress()}
    m["refused"] = expect_error(
        CheckpointError, load_checkpoint, root / "good", model, opt, app_state=refusing
    )
    m["unchanged"] = same(before, flat_snapshot(model, opt))
    m["not_stateful"] = expect_error(TypeError, save_checkpoint, root / "x", model, opt, app_state={"a": 3})
    m["not_mapping"] = expect_error(TypeError, load_checkpoint, root / "good", model, opt, app_state=[RNG()])
    # state that torch.load(weights_only=True) could not read back, on one rank only
    odd = Progress(1, [fractions.Fraction(1, 3)] if rank == 1 else [])
    m["unreadable"] = expect_error(
        CheckpointError, save_checkpoint, root / "odd", model, opt, app_state={"p": odd}
    )
    names = {"progress": Progress()} if rank == 0 else {"other": Progress()}
    m["names"] = expect_error(CheckpointError, save_checkpoint, root / "names", model, opt, app_state=names)
    m["committed"] = sorted(p.name for p in root.iterdir() if (p / COMMIT_MARKER).exists())
    return m


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_app_state_misuse_fails_on_every_rank(pool: RankPool, tmp_path: Path) -> None:
    for r in pool.run(_misuse, str(tmp_path)):
        assert "holds no application state 'rng'" in r["missing"] and "'progress'" in r["missing"]
        assert "rank(s) [1]" in r["refused"] and "saved by another version" in r["refused"]
        assert "the model and the optimizer were not loaded" in r["refused"]
        assert r["unchanged"], "a refused load leaves the model and the optimizer as they were"
        assert "app_state['a'] is a int" in r["not_stateful"] and "Stateful" in r["not_stateful"]
        assert "mapping" in r["not_mapping"]
        assert "rank(s) [1]" in r["unreadable"] and "app_state['p']" in r["unreadable"]
        assert "weights_only" in r["unreadable"] and "Fraction" in r["unreadable"]
        assert "different names" in r["names"]
        assert r["committed"] == ["good"], "no refused save commits"
