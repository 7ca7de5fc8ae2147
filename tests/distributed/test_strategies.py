"""Sharding strategies: parity with the plain model, and the collectives each one issues."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ProcessGroupName, ShardingStrategy
from fsdp.comm.collectives import hybrid_groups
from tests.models import CASES, build, wrap
from tests.parity import compare_training
from tests.rank_pool import RankPool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5


def _parity(case: str, strategy: str, hybrid: str | None = None) -> dict[str, float]:
    spec = CASES[case]
    kwargs: dict[str, Any] = {"sharding_strategy": ShardingStrategy[strategy]}
    if hybrid == "groups":  # an explicit (shard, replicate) pair: 2 x 2 at world size 4
        kwargs["process_group"] = hybrid_groups(2)
    elif hybrid == "env":  # built from LOCAL_WORLD_SIZE as torchrun sets it
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        ref = build(case)
        model = wrap(copy.deepcopy(ref), spec.wrap, **kwargs)
        return compare_training(ref, model, spec.make_input, spec.loss, steps=3)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("case", ["nested", "tiny", "frozen_mixed", "tied"])
def test_strategy_parity(pool: RankPool, strategy: str, case: str) -> None:
    for diffs in pool.run(_parity, case, strategy):
        assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("pool", [4], indirect=True)
@pytest.mark.parametrize("hybrid", ["groups", "env"])
@pytest.mark.parametrize("case", ["nested", "tiny", "called_twice"])
def test_hybrid_shard_2x2_parity(pool: RankPool, hybrid: str, case: str) -> None:
    for diffs in pool.run(_parity, case, "HYBRID_SHARD", hybrid):
        assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("pool", [4], indirect=True)
def test_hybrid_shard_zero2_2x2_parity(pool: RankPool) -> None:
    for diffs in pool.run(_parity, "called_twice", "_HYBRID_SHARD_ZERO2", "groups"):
        assert max(diffs.values()) <= TOL, diffs


def _step_collectives(strategy: str, bucket_cap_mb: int = 25) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 1))
    kwargs: dict[str, Any] = {"sharding_strategy": ShardingStrategy[strategy], "bucket_cap_mb": bucket_cap_mb}
    if "HYBRID" in strategy:
        kwargs["process_group"] = hybrid_groups(2)
    net[0], net[1] = FSDP(net[0], **kwargs), FSDP(net[1], **kwargs)
    model = FSDP(net, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # the second step is the one counted
        model.reset_comm_stats()
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
    stats = model.comm_stats()
    return {k: (v["calls"], v["numel"]) for k, v in stats.items()}


@pytest.mark.parametrize("pool", [4], indirect=True)
def test_collectives_issued_by_each_strategy(pool: RankPool) -> None:
    unit, root = 42, 7  # Linear(6, 6) and Linear(6, 1) elements
    pad4 = {42: 44, 7: 8}
    pad2 = {42: 42, 7: 8}
    full = pool.run(_step_collectives, "FULL_SHARD")[0]
    # inner units gathered in forward and backward, the root once; one reduce-scatter per unit
    assert full["all_gather"] == (5, 4 * pad4[unit] + pad4[root])
    assert full["reduce_scatter"] == (1, 2 * pad4[unit] + pad4[root]), "the three fit one bucket"
    grad_op = pool.run(_step_collectives, "SHARD_GRAD_OP")[0]
    assert grad_op["all_gather"] == (3, 2 * pad4[unit] + pad4[root]), "no all-gather in backward"
    assert grad_op["reduce_scatter"] == full["reduce_scatter"]
    no_shard = pool.run(_step_collectives, "NO_SHARD")[0]
    assert no_shard["all_gather"][0] == 0 and no_shard["reduce_scatter"][0] == 0
    # the bucket engine (shared with fsdp.DistributedDataParallel) puts the three flat parameters in
    # one bucket (25 MB by default), with its one-element missing-gradient flag; plus the check vector
    assert no_shard["all_reduce"] == (1 + 1, 2 * unit + root + 1 + 2 * 3)
    assert no_shard["broadcast"] == (0, 0), "the bucket layout is broadcast in the first step only"
    # with bucket_cap_mb=0 every flat parameter is a bucket of its own
    tiny = pool.run(_step_collectives, "NO_SHARD", 0)[0]
    assert tiny["all_reduce"] == (3 + 1, 2 * unit + root + 3 + 2 * 3)
    hybrid = pool.run(_step_collectives, "HYBRID_SHARD")[0]
    assert hybrid["all_gather"] == (5, 4 * pad2[unit] + pad2[root])
    assert hybrid["reduce_scatter"] == (1, 2 * pad2[unit] + pad2[root])
    # the shards (half of each padded flat parameter) all-reduced across the 2 replicas, plus the check
    assert hybrid["all_reduce"] == (3 + 1, (2 * pad2[unit] + pad2[root]) // 2 + 2 * 3)
    zero2 = pool.run(_step_collectives, "_HYBRID_SHARD_ZERO2")[0]  # torch's name
    assert zero2["all_gather"] == (3, 2 * pad2[unit] + pad2[root]), "no all-gather in backward"
    assert zero2["reduce_scatter"] == hybrid["reduce_scatter"] and zero2["all_reduce"] == hybrid["all_reduce"]


def _bad_strategy_args(which: str) -> str:
    try:
        if which == "full_without_reshard":
            FSDP(nn.Linear(2, 2), sharding_strategy=ShardingStrategy.FULL_SHARD, reshard_after_forward=False)
        elif which == "hybrid_without_groups":
            FSDP(nn.Linear(2, 2), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        elif which == "pair_without_hybrid":
            FSDP(nn.Linear(2, 2), process_group=(dist.group.WORLD, dist.group.WORLD))
        elif which == "not_a_strategy":
            FSDP(nn.Linear(2, 2), sharding_strategy="FULL_SHARD")
    except (ValueError, TypeError) as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    ("which", "match"),
    [
        ("full_without_reshard", "use ShardingStrategy.SHARD_GRAD_OP"),
        ("hybrid_without_groups", "LOCAL_WORLD_SIZE"),
        ("pair_without_hybrid", "needs sharding_strategy=HYBRID_SHARD"),
        ("not_a_strategy", "must be a fsdp.ShardingStrategy"),
    ],
)
def test_invalid_strategy_arguments(pool: RankPool, which: str, match: str) -> None:
    for msg in pool.run(_bad_strategy_args, which):
        assert match in msg


def _bad_hybrid_groups(which: str) -> str:
    rank = dist.get_rank()
    shard, replicate = hybrid_groups(2)  # shards {0, 1}, {2, 3}; replicas {0, 2}, {1, 3}
    crossed, _ = dist.new_subgroups_by_enumeration([[0, 3], [1, 2]])  # every rank makes every group
    partial = dist.new_group([0, 1, 2])
    hybrid = ShardingStrategy.HYBRID_SHARD
    try:
        if which == "world_as_replicate":
            FSDP(nn.Linear(2, 2), sharding_strategy=hybrid, process_group=(shard, dist.group.WORLD))
        elif which == "shard_twice":
            FSDP(nn.Linear(2, 2), sharding_strategy=hybrid, process_group=(shard, shard))
        elif which == "part_of_the_world":
            FSDP(nn.Linear(2, 2), sharding_strategy=hybrid, process_group=(shard, dist.new_group([rank])))
        elif which == "crossed":  # each replicate group holds different shards: caught at the first forward
            FSDP(nn.Linear(2, 2), sharding_strategy=hybrid, process_group=(shard, crossed))(torch.ones(1, 2))
        elif which == "not_a_member":
            FSDP(nn.Linear(2, 2), process_group=partial)
            return "no error" if rank < 3 else "rank 3 was accepted"
        elif which == "strategies_differ":  # rank 0 alone builds HYBRID: refused at construction
            # (no second reduce-scatter group here; tests/distributed/test_agreement.py builds one)
            kwargs: dict[str, Any] = {"sharding_strategy": hybrid, "process_group": (shard, replicate)}
            FSDP(
                nn.Linear(2, 2),
                process_group_reduce_scatter=ProcessGroupName.default,
                **(kwargs if rank == 0 else {}),
            )(torch.ones(1, 2))
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [4], indirect=True)
@pytest.mark.parametrize(
    ("which", "match"),
    [
        ("world_as_replicate", "must have only this rank in common"),
        ("shard_twice", "must have only this rank in common"),
        ("part_of_the_world", "must cover the world of 4 ranks"),
        ("crossed", "must hold the ranks that keep the same shard"),
        ("strategies_differ", "sharding_strategy: HYBRID_SHARD on rank 0; FULL_SHARD on ranks 1, 2, 3"),
    ],
)
def test_hybrid_groups_that_do_not_fit_are_refused(pool: RankPool, which: str, match: str) -> None:
    for msg in pool.run(_bad_hybrid_groups, which, timeout=60):
        assert match in msg, msg


@pytest.mark.parametrize("pool", [4], indirect=True)
def test_a_process_group_without_this_rank_is_refused(pool: RankPool) -> None:
    msgs = pool.run(_bad_hybrid_groups, "not_a_member", timeout=60)
    assert msgs[:3] == ["no error"] * 3
    assert "this rank (3) is not a member of process_group" in msgs[3], msgs[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_hybrid_shard_across_two_torchrun_nodes(tmp_path: Any) -> None:
    """Two `torchrun --nnodes=2` launches on localhost: shard within each 'node', replicate across."""
    port = _free_port()
    script = os.path.join(ROOT, "tests", "distributed", "hybrid_two_nodes.py")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
               f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", script,
               str(tmp_path)]  # fmt: skip
        procs.append(  # a session of its own: on failure the launcher and its workers die together
            subprocess.Popen(
                cmd,
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0, out.decode()[-3000:]
    finally:  # also reaps workers left behind by a launcher that died
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert r["local_world_size"] == 2 and r["shard_size"] == 2 and r["replicated"]
        assert r["max_diff"] <= TOL, r
