"""Checkpoints: save/load continues training exactly, resumes at other world sizes, consolidates
offline, and turns every kind of broken checkpoint into the same clear error on every rank."""

from __future__ import annotations

import copy
import fractions
import json
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy, latest_checkpoint, load_checkpoint, save_checkpoint
from fsdp.checkpoints.files import marker_text
from fsdp.checkpoints.save_load import COMMIT_MARKER, PROBE, CheckpointError
from fsdp.consolidate import main as consolidate_main
from tests.checkpointing import (
    expect_error,
    flat_snapshot,
    make,
    optim_diff,
    same,
    scramble_,
    state_diff,
    train,
    train_ref,
)
from tests.models import build, wrap
from tests.rank_pool import RankPool

ROOT = Path(__file__).resolve().parents[2]


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


# ---------------------------------------------------------------------- save, zero, load
def _save_zero_load(tmp: str, case: str, **fsdp_kwargs: Any) -> dict[str, Any]:
    ref, model = make(case, seed=1, **fsdp_kwargs)
    opt, ref_opt = _adam(model.parameters()), _adam(ref.parameters())
    diffs: dict[str, Any] = {"loss": 0.0, "param": 0.0}

    def lockstep(steps: range) -> None:
        for a, b in zip(train(model, opt, case, steps), train_ref(ref, ref_opt, case, steps), strict=True):
            diffs["loss"] = max(diffs["loss"], abs(a - b))
        diffs["param"] = max(diffs["param"], state_diff(model.state_dict(), ref.state_dict()))

    lockstep(range(2))
    path = save_checkpoint(Path(tmp) / "dcp", model, opt, extra={"step": 2})
    scramble_(model, opt)  # parameters, buffers and optimizer state all differ from the saved ones
    diffs["scrambled_differs"] = state_diff(model.state_dict(), ref.state_dict()) > 1e-3
    diffs["extra"] = load_checkpoint(path, model, opt)
    diffs["loaded"] = state_diff(model.state_dict(), ref.state_dict())
    lockstep(range(2, 4))

    # the same-topology fast path: local shards and the optimizer's own (flat) state dict
    local = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.local_state_dict().items()}
    local_opt = torch.load(_roundtrip(opt.state_dict()), weights_only=True)
    scramble_(model, opt)
    model.load_local_state_dict(local)
    opt.load_state_dict(local_opt)
    diffs["loaded_local"] = state_diff(model.state_dict(), ref.state_dict())
    lockstep(range(4, 6))
    full = model.gather_full_optim_state_dict(opt)  # rank 0 only
    diffs["gathered"] = None if full is None else optim_diff(full, ref_opt.state_dict())
    return diffs


def _roundtrip(obj: Any) -> Any:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize(
    ("case", "strategy"),
    [
        ("buffers", ShardingStrategy.FULL_SHARD),
        ("tiny", ShardingStrategy.FULL_SHARD),
        ("tiny", ShardingStrategy.NO_SHARD),
    ],
)
def test_save_zero_load_continues_exactly(
    pool: RankPool, case: str, strategy: ShardingStrategy, tmp_path: Path
) -> None:
    results = pool.run(_save_zero_load, str(tmp_path), case, sharding_strategy=strategy)
    for rank, r in enumerate(results):
        assert r["scrambled_differs"], "scrambling must change the model (else the test proves nothing)"
        assert r["extra"] == {"step": 2}
        assert r["loaded"] < 1e-5 and r["loaded_local"] < 1e-5, r
        assert r["loss"] < 1e-5 and r["param"] < 1e-5, r
        assert (r["gathered"] is None) == (rank != 0)
        assert rank != 0 or r["gathered"] < 1e-5, r


# ---------------------------------------------------------------------- resume at another world size
CASE = "nested"


def _groups(model: nn.Module, ref: nn.Module) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two param groups: the root's own parameters (lr 1e-2) and those of the inner units (lr 5e-3)."""
    inner = [p for m in model.modules() if isinstance(m, FSDP) and m is not model for p in m.params]
    root = [p for p in model.parameters() if all(p is not q for q in inner)]
    root_names = {f"{h.meta.params[i].fqn}" for h in model.handles for i in range(len(h.meta.params))}
    ref_root = [p for n, p in ref.named_parameters() if n in root_names]
    ref_inner = [p for n, p in ref.named_parameters() if n not in root_names]
    return (
        [{"params": root, "lr": 1e-2}, {"params": inner, "lr": 5e-3}],
        [{"params": ref_root, "lr": 1e-2}, {"params": ref_inner, "lr": 5e-3}],
    )


def _first_half(tmp: str) -> list[float]:
    ref, model = make(CASE, seed=2)
    groups, _ = _groups(model, ref)
    opt = torch.optim.Adam(groups)
    losses = train(model, opt, CASE, range(3))
    save_checkpoint(Path(tmp) / "step3", model, opt, extra={"step": 3})
    # the fairscale-style full path: a full state dict and a gathered optimizer state dict on rank 0
    sd, osd = model.state_dict(), model.gather_full_optim_state_dict(opt)
    local = model.local_state_dict()
    if dist.get_rank() == 0:
        torch.save({"model": sd, "optim": osd, "local": local}, Path(tmp) / "full.pt")
    return losses


def _second_half(tmp: str) -> dict[str, Any]:
    ref, model = make(CASE, seed=2)
    groups, ref_groups = _groups(model, ref)
    opt, ref_opt = torch.optim.Adam(groups), torch.optim.Adam(ref_groups)
    ref_losses = train_ref(ref, ref_opt, CASE, range(6))
    scramble_(model)
    extra = load_checkpoint(latest_checkpoint(tmp), model, opt)
    losses = train(model, opt, CASE, range(3, 6))
    full_osd = model.gather_full_optim_state_dict(opt)

    # the same from the full state dicts written by rank 0 of the first run
    saved = torch.load(Path(tmp) / "full.pt", weights_only=True)
    _, other = make(CASE, seed=5)
    other_groups, _ = _groups(other, ref)
    other_opt = torch.optim.Adam(other_groups)
    other.load_state_dict(saved["model"])
    other_opt.load_state_dict(other.get_shard_from_optim_state_dict(saved["optim"]))
    other_losses = train(other, other_opt, CASE, range(3, 6))
    return {
        "extra": extra,
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses[3:], strict=True)),
        "param": state_diff(model.state_dict(), ref.state_dict()),
        "optim": optim_diff(full_osd, ref_opt.state_dict()) if full_osd is not None else None,
        "other_loss": max(abs(a - b) for a, b in zip(other_losses, ref_losses[3:], strict=True)),
        "other_param": state_diff(other.state_dict(), ref.state_dict()),
        "local_error": expect_error(ValueError, model.load_local_state_dict, saved["local"]),
        "ref_losses": ref_losses,
    }


def test_resume_at_other_world_sizes(rank_pools: Callable[[int], RankPool], tmp_path: Path) -> None:
    """Train 3 steps at world size 2, checkpoint, resume at world sizes 3 and 1: equal to 6 plain steps."""
    first = rank_pools(2).run(_first_half, str(tmp_path))[0]
    for world in (3, 1):
        results = rank_pools(world).run(_second_half, str(tmp_path))
        for rank, r in enumerate(results):
            assert r["extra"] == {"step": 3}
            assert max(abs(a - b) for a, b in zip(first, r["ref_losses"][:3], strict=True)) < 1e-5
            assert r["loss"] < 1e-5 and r["param"] < 1e-5, (world, r)
            assert r["other_loss"] < 1e-5 and r["other_param"] < 1e-5, (world, r)
            assert r["optim"] is None if rank else r["optim"] < 1e-5, (world, r["optim"])
            if world != 2:
                assert "saved at world size 2" in r["local_error"], r["local_error"]


# ---------------------------------------------------------------------- offline consolidation
def _consolidation_inputs(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, kwargs in (
        ("tied", {}),
        ("buffers", {"mixed_precision": True, "compute_dtype": torch.bfloat16}),
    ):
        _, model = make(case, seed=3, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, opt, case, range(1))
        out[case] = {
            "weights": {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in model.local_state_dict().items()
            },
            "metadata": model.local_metadata_dict(),
            "state_dict": model.state_dict(),
        }
        save_checkpoint(Path(tmp) / case, model)
    return out


@pytest.mark.parametrize("pool", [3], indirect=True)
def test_offline_consolidation_equals_state_dict(pool: RankPool, tmp_path: Path) -> None:
    results = pool.run(_consolidation_inputs, str(tmp_path))  # this process has no process group
    for case in ("tied", "buffers"):
        expected = results[0][case]["state_dict"]
        weights = [r[case]["weights"] for r in results][::-1]  # any order: ranks are in the metadata
        metadata = [r[case]["metadata"] for r in results][::-1]
        consolidated = FSDP.consolidate_shard_weights(weights, metadata)
        assert list(consolidated) == list(expected)
        assert all(
            torch.equal(consolidated[k], v) and consolidated[k].dtype == v.dtype for k, v in expected.items()
        )

        out = tmp_path / f"{case}.pt"
        if case == "buffers":  # the real command once (a fresh interpreter costs seconds), else its main()
            cmd = [sys.executable, "-m", "fsdp.consolidate", str(tmp_path / case), str(out)]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, done.stderr
            assert f"wrote {out}" in done.stdout
        else:
            assert consolidate_main([str(tmp_path / case), str(out)]) == 0
        plain = build(case, seed=99)
        plain.load_state_dict(torch.load(out, weights_only=True), strict=True)
        assert state_diff(plain.state_dict(), expected) == 0.0


def _local_shards(cases: tuple[str, ...], **fsdp_kwargs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in cases:
        _, model = make(case, seed=3, **fsdp_kwargs)
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), case, range(1))
        weights = {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.local_state_dict().items()
        }
        out[case] = {"weights": weights, "metadata": model.local_metadata_dict()}
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_fairscale_consolidates_our_shards(pool: RankPool) -> None:
    """fairscale's static consolidate_shard_weights reads our local shards and metadata (it unpacks each
    flat parameter's entry as exactly four values) and rebuilds what ours does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

    cases = ("nested", "tiny", "buffers", "tied")
    results = pool.run(_local_shards, cases)
    # fairscale returns the buffers as the local state dicts hold them: in their original dtype
    mixed = pool.run(_local_shards, ("buffers",), mixed_precision=True, compute_dtype=torch.bfloat16)
    for r, m in zip(results, mixed, strict=True):
        r["buffers_bf16"] = m["buffers"]
    for case in (*cases, "buffers_bf16"):
        weights = [r[case]["weights"] for r in results]  # rank order: fairscale takes list index as rank
        metadata = [r[case]["metadata"] for r in results]
        ours = FSDP.consolidate_shard_weights(weights, metadata)
        theirs = FairscaleFSDP.consolidate_shard_weights(weights, metadata)
        # fairscale copies the ties of the last wrapper it lists only: the root's tie of "tied" is not there
        assert set(theirs) == set(ours) - ({"head.weight"} if case == "tied" else set()), case
        assert all(torch.equal(v, ours[k]) and v.dtype == ours[k].dtype for k, v in theirs.items()), case


class _TiedBlock(nn.Module):
    """Two linears sharing a weight, and a buffer-holding norm: each kind of state under one module."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.b(torch.relu(self.a(x))))


def _checkpointed_net(case: str) -> nn.Module:
    """The plain model of each case: with "inside", the first linear is tied to the block too (one
    unit holds it all, so the tie crosses the checkpoint wrapper's level)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), _TiedBlock(), nn.Linear(4, 2))
    if case == "inside":
        net[0].weight = net[1].a.weight
    return net


def _checkpointed_local_shards(case: str) -> dict[str, Any]:
    """torch's checkpoint wrapper inside the root's unit ("inside", with bf16 mixed precision), at the
    boundary inside a unit ("unit": wrapper(checkpoint(block))), outside it ("outside") and around the
    root's whole module ("root")."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    net = _checkpointed_net(case)
    if case == "inside":
        apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, _TiedBlock))
        model = FSDP(net, mixed_precision=True, compute_dtype=torch.bfloat16)
    elif case == "unit":
        net[1] = FSDP(checkpoint_wrapper(net[1]))
        model = FSDP(net)
    elif case == "outside":
        net[1] = checkpoint_wrapper(FSDP(net[1]))
        model = FSDP(net)
    else:
        model = FSDP(checkpoint_wrapper(net))
    g = torch.Generator().manual_seed(dist.get_rank())
    model(torch.randn(8, 4, generator=g)).square().sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    weights = {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.local_state_dict().items()
    }
    return {"weights": weights, "metadata": model.local_metadata_dict(), "state_dict": model.state_dict()}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("case", ["inside", "unit", "outside", "root"])
def test_consolidation_around_torchs_checkpoint_wrapper_equals_state_dict(pool: RankPool, case: str) -> None:
    """The metadata names parameters (tied ones too) as state_dict() does, without the checkpoint
    wrapper's level: consolidation, ours and fairscale's, gives state_dict()'s keys, which load
    strictly into the plain model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

    results = pool.run(_checkpointed_local_shards, case)
    expected = results[0]["state_dict"]
    plain = _checkpointed_net(case)
    assert list(expected) == list(plain.state_dict())
    weights = [r["weights"] for r in results]
    metadata = [r["metadata"] for r in results]
    ours = FSDP.consolidate_shard_weights(weights, metadata)
    assert list(ours) == list(expected)
    assert all(torch.equal(ours[k], v) and ours[k].dtype == v.dtype for k, v in expected.items())
    plain.load_state_dict(ours, strict=True)
    assert state_diff(plain.state_dict(), expected) == 0.0
    for unit in metadata[0]["param_metadata"]:
        for entry in unit["params"].values():
            assert list(entry) == ["names", "shapes", "numels", "padding"]  # fairscale unpacks them so
    theirs = FairscaleFSDP.consolidate_shard_weights(weights, metadata)
    assert set(theirs) <= set(expected) and set(theirs) >= {n for n, _ in plain.named_parameters()}
    assert all(torch.equal(v, ours[k]) and v.dtype == ours[k].dtype for k, v in theirs.items())
    if case == "unit":  # metadata of earlier versions, with the level in the names, consolidates as it did
        level = "_checkpoint_wrapped_module."
        legacy = copy.deepcopy(metadata)
        for meta in legacy:
            (unit,) = [u for u in meta["param_metadata"] if u["fsdp_path"] == "1"]
            unit["params"]["flat_param_0"]["names"] = [
                level + n for n in unit["params"]["flat_param_0"]["names"]
            ]
            unit["shared_param_info"] = [
                (a[:2] + level + a[2:], b[:2] + level + b[2:]) for a, b in unit["shared_param_info"]
            ]
        old = FSDP.consolidate_shard_weights(weights, legacy)
        buffers = set(metadata[0]["buffer_names"])
        renamed = {
            k if k in buffers or not k.startswith("1.") else k[:2] + level + k[2:]: v
            for k, v in expected.items()
        }
        assert set(old) == set(renamed) and all(torch.equal(old[k], v) for k, v in renamed.items())


# ---------------------------------------------------------------------- raw DCP with the public methods
def _raw_dcp(tmp: str, save: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    ref, model = make("tiny", seed=4 if save else 8)
    if save:
        sd = model.sharded_state_dict()
        mesh = next(v for v in sd.values() if isinstance(v, DTensor)).device_mesh
        layout_ok = all(
            torch.equal(v.to_local(), distribute_tensor(ref.state_dict()[k], mesh, [Shard(0)]).to_local())
            for k, v in sd.items()
            if isinstance(v, DTensor)
        )
        dcp_save(sd, storage_writer=FileSystemWriter(tmp))
        return {"layout_ok": layout_ok, "kinds": {k: type(v).__name__ for k, v in sd.items()}}
    scramble_(model)
    sd = model.sharded_state_dict()
    dcp_load(sd, storage_reader=FileSystemReader(tmp))
    model.load_sharded_state_dict(sd)
    return {"diff": state_diff(model.state_dict(), build("tiny", seed=4).state_dict())}


def test_raw_dcp_reshards(rank_pools: Callable[[int], RankPool], tmp_path: Path) -> None:
    """``torch.distributed.checkpoint`` saves a sharded state dict at 3 ranks and loads it at 2."""
    for r in rank_pools(3).run(_raw_dcp, str(tmp_path), True):
        assert r["layout_ok"], "local rows must be DTensor's own Shard(0) chunks"
        assert r["kinds"] == {"scale": "Tensor", "one": "DTensor", "lin.weight": "DTensor", "lin.bias": "DTensor",
                              "small.weight": "DTensor"}  # fmt: skip
    for r in rank_pools(2).run(_raw_dcp, str(tmp_path), False):
        assert r["diff"] == 0.0


# ---------------------------------------------------------------------- broken checkpoints
class _WriterFails(Exception):
    pass


def _broken(tmp: str) -> dict[str, Any]:
    rank = dist.get_rank()
    root = Path(tmp)
    _, model = make(CASE, seed=6)
    opt = _adam(model.parameters())
    train(model, opt, CASE, range(1))
    good = save_checkpoint(root / "good", model, opt)
    if rank == 0:  # damaged copies of the good checkpoint
        shutil.copytree(good, root / "no_marker")
        (root / "no_marker" / COMMIT_MARKER).unlink()
        shutil.copytree(good, root / "truncated")
        shard = next((root / "truncated").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        marker = root / "truncated" / COMMIT_MARKER  # the newest, but damaged: latest_checkpoint skips it
        info = json.loads(marker.read_text())
        info["saved_at_ns"] += 1
        marker.write_text(marker_text({k: v for k, v in info.items() if k != "marker_crc32"}, None))
    dist.barrier()
    before = flat_snapshot(model, opt)
    messages: dict[str, str] = {}

    def failing(path: Path, target: nn.Module, optim: torch.optim.Optimizer | None = None) -> str:
        return expect_error(CheckpointError, load_checkpoint, path, target, optim)

    messages["no_marker"] = failing(root / "no_marker", model, opt)
    messages["truncated"] = failing(root / "truncated", model, opt)
    messages["committed_target"] = expect_error(CheckpointError, save_checkpoint, good, model, opt)
    unchanged = same(before, flat_snapshot(model, opt))

    # another model: one parameter more (missing from the checkpoint), or one with another shape
    def variant(extra_layer: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        m = build(CASE, seed=7)
        if extra_layer:
            m.extra = nn.Linear(3, 3)
        else:
            m.out = nn.Linear(8, 4)
        wrapped = wrap(m, ("body.2", "body", "inp"))
        return wrapped, _adam(wrapped.parameters())

    for name, extra_layer in (("missing_key", True), ("shape", False)):
        m, o = variant(extra_layer)
        train(m, o, CASE, range(1))
        snap = flat_snapshot(m, o)
        messages[name] = failing(good, m, o)
        unchanged = unchanged and same(snap, flat_snapshot(m, o))

    # a save that fails on one rank only: every rank raises, nothing is committed
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_data(self: Any, *args: Any, **kwargs: Any) -> Any:
        if rank == dist.get_world_size() - 1:
            raise _WriterFails("disk full (simulated)")
        return original(self, *args, **kwargs)

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    try:
        messages["failed_save"] = expect_error(CheckpointError, save_checkpoint, root / "failed", model, opt)
    finally:
        FileSystemWriter.write_data = original  # type: ignore[method-assign]
    messages["load_failed_save"] = failing(root / "failed", model, opt)
    unchanged = unchanged and same(before, flat_snapshot(model, opt))
    load_checkpoint(good, model, opt)  # the previous checkpoint still loads
    return {
        "messages": messages,
        "unchanged": unchanged,
        "latest": str(latest_checkpoint(root)),
        "committed": sorted(p.name for p in root.iterdir() if (p / COMMIT_MARKER).exists()),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_broken_checkpoints_fail_on_every_rank(pool: RankPool, tmp_path: Path) -> None:
    for r in pool.run(_broken, str(tmp_path), timeout=120):
        m = r["messages"]
        assert "has no commit marker" in m["no_marker"] and "did not finish" in m["no_marker"]
        assert "damaged: __" in m["truncated"] and ".distcp has" in m["truncated"], m["truncated"]
        assert "already holds a committed checkpoint" in m["committed_target"]
        assert "missing from the checkpoint" in m["missing_key"] and "'extra.weight'" in m["missing_key"]
        assert "'out.weight': shape (3, 8) in the checkpoint, (4, 8) in the model" in m["shape"]
        assert "disk full (simulated)" in m["failed_save"]
        assert "has no commit marker" in m["load_failed_save"]
        assert r["unchanged"], "a failed load must leave parameters, buffers and optimizer state untouched"
        assert "failed" not in r["committed"] and Path(r["latest"]).name == "good"


def _mismatched_use(tmp: str) -> dict[str, Any]:
    rank = dist.get_rank()
    root = Path(tmp)
    _, model = make(CASE, seed=6)
    opt = _adam(model.parameters())
    train(model, opt, CASE, range(1))
    messages: dict[str, str] = {}
    # a directory named per rank: every rank refuses, nothing is committed
    messages["save_paths"] = expect_error(CheckpointError, save_checkpoint, root / f"step_{rank}", model, opt)
    a = save_checkpoint(root / "a", model, opt)
    b = save_checkpoint(root / "b", model, opt)
    before = flat_snapshot(model, opt)
    messages["load_paths"] = expect_error(CheckpointError, load_checkpoint, a if rank == 0 else b, model, opt)
    unchanged = same(before, flat_snapshot(model, opt))

    class Local:  # cannot even be pickled
        pass

    messages["extra"] = expect_error(
        CheckpointError, save_checkpoint, root / "extra", model, opt, {"x": fractions.Fraction(1, 3)}
    )
    messages["extra_local"] = expect_error(
        CheckpointError, save_checkpoint, root / "extra", model, opt, Local()
    )
    foreign = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # not over the model
    messages["foreign"] = expect_error(CheckpointError, save_checkpoint, root / "foreign", model, foreign)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    messages["optimizer_class"] = expect_error(CheckpointError, load_checkpoint, a, model, sgd)
    # tensor and nested hyperparameters come back as they were
    tensor_lr = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.02))
    tensor_lr.param_groups[0]["meta"] = {"tag": "x", "k": 2}
    tensor_lr.param_groups[0]["scales"] = [torch.tensor(1.0), torch.tensor(2.0)]
    train(model, tensor_lr, CASE, range(1))
    save_checkpoint(root / "hyper", model, tensor_lr)
    fresh = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.5))
    fresh.param_groups[0]["meta"] = {}
    load_checkpoint(root / "hyper", model, fresh)
    group = fresh.param_groups[0]
    # an inner wrapper is refused
    messages["inner"] = expect_error(ValueError, save_checkpoint, root / "inner", model.module.body, None)
    # the same shared directory mounted under another name on rank 1's node works (simulated: the
    # path rank 1 resolves differs from rank 0's; the ranks compare what they read there instead)
    original = Path.resolve
    if rank == 1:
        Path.resolve = lambda self, strict=False: Path("/mnt/node1") / original(self, strict).relative_to("/")  # type: ignore[method-assign]
    try:
        save_checkpoint(root / "mounted", model, opt)
        load_checkpoint(root / "mounted", model, opt)
    finally:
        Path.resolve = original  # type: ignore[method-assign]
    return {
        "messages": messages,
        "unchanged": unchanged,
        "lr": (type(group["lr"]).__name__, float(group["lr"])),
        "meta": group["meta"],
        "scales": [float(t) for t in group["scales"]] if isinstance(group.get("scales"), list) else None,
        "committed": sorted(p.name for p in root.iterdir() if (p / COMMIT_MARKER).exists()),
        "left": sorted(p.name for p in root.iterdir() if not (p / COMMIT_MARKER).exists()),
        "probes": sorted(str(p) for p in root.rglob(PROBE)),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_checkpoints_used_inconsistently_fail_on_every_rank(pool: RankPool, tmp_path: Path) -> None:
    for r in pool.run(_mismatched_use, str(tmp_path), timeout=120):
        m = r["messages"]
        assert "different checkpoint directories" in m["save_paths"]
        assert "different checkpoint directories" in m["load_paths"] and r["unchanged"]
        assert "weights_only" in m["extra"] and "Fraction" in m["extra"]
        assert "extra cannot be saved" in m["extra_local"]
        assert "torch.optim.adam.Adam" in m["optimizer_class"] and "SGD" in m["optimizer_class"]
        assert r["lr"] == ("Tensor", pytest.approx(0.02)) and r["meta"] == {"tag": "x", "k": 2}
        assert r["scales"] == [1.0, 2.0]
        assert "not an inner one" in m["inner"]
        assert r["committed"] == ["a", "b", "hyper", "mounted"], r["committed"]
        assert m["foreign"], "an optimizer over other parameters is refused"
        assert r["left"] == [], "a refused save leaves no directory it made (nor a probe) behind"
        assert r["probes"] == [], "the save probe is removed before the commit"


# ---------------------------------------------------------------------- local state dict misuse
def _local_misuse() -> dict[str, str]:
    rank = dist.get_rank()
    _, model = make(CASE, seed=1)
    local = model.local_state_dict()
    _, other_plan = make(CASE, seed=1, paths=("body",))
    box = [copy.deepcopy(local)]  # (a copy keeps the identity, in the dict's _metadata)
    dist.broadcast_object_list(box, src=1)  # every rank now holds rank 1's shards
    bad_shape = dict(local)
    bad_shape["flat_param_0"] = torch.zeros(5)  # the root's shard
    before = flat_snapshot(model)
    out = {
        "plan": expect_error(ValueError, other_plan.load_local_state_dict, local),
        "rank": expect_error(ValueError, model.load_local_state_dict, box[0]) if rank == 0 else "",
        "full": expect_error(ValueError, model.load_local_state_dict, model.state_dict()),
        "shape": expect_error(RuntimeError, model.load_local_state_dict, bad_shape),
    }
    assert same(before, flat_snapshot(model)), "a refused local state dict must not be loaded in part"
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_local_state_dict_refuses_other_plans_and_ranks(pool: RankPool) -> None:
    r0, r1 = pool.run(_local_misuse)
    for r in (r0, r1):
        assert "different wrap plan" in r["plan"]
        assert "not a local state dict" in r["full"]
        assert "'flat_param_0': shape (5,) in the state dict, (14,) in the model" in r["shape"]
    assert "holds the shards of rank 1, not of rank 0" in r0["rank"]


# ---------------------------------------------------------------------- interoperability with torch FSDP2
def _fsdp2_roundtrip(tmp: str) -> tuple[float, float]:
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.fsdp import fully_shard

    expected = build(CASE, seed=0).state_dict()
    theirs = build(CASE, seed=0)
    for sub in (theirs.body[2], theirs.body, theirs.inp, theirs):
        fully_shard(sub)
    dcp_save({"model": theirs.state_dict()}, checkpoint_id=f"{tmp}/fsdp2")
    ours = wrap(build(CASE, seed=5), ("body",))
    state = {"model": ours.sharded_state_dict()}
    dcp_load(state, checkpoint_id=f"{tmp}/fsdp2")
    ours.load_sharded_state_dict(state["model"])
    into_ours = state_diff(ours.state_dict(), expected)

    dcp_save({"model": ours.sharded_state_dict()}, checkpoint_id=f"{tmp}/ours")
    back = build(CASE, seed=9)
    fully_shard(back)
    state = {"model": back.state_dict()}
    dcp_load(state, checkpoint_id=f"{tmp}/ours")
    back.load_state_dict(state["model"])
    full = {k: v.full_tensor() for k, v in back.state_dict().items()}
    return into_ours, state_diff(full, expected)


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_torch_fsdp2_checkpoints_load_both_ways(pool: RankPool, tmp_path: Path) -> None:
    """Same names, shapes and row sharding as torch's fully_shard: each loads the other's DCP checkpoint."""
    for into_ours, into_theirs in pool.run(_fsdp2_roundtrip, str(tmp_path)):
        assert into_ours == 0.0 and into_theirs == 0.0
