"""Distributed mistakes fail on every rank with an error that names the problem; none hangs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy
from tests.parity import compare_training
from tests.rank_pool import RankFailure, RankPool


def _expect(exc_type: type[BaseException], fn, *args, **kwargs) -> str:  # type: ignore[no-untyped-def]
    """Run fn and return the message of the expected exception (raise if none or another)."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return str(e)
    raise AssertionError(f"{exc_type.__name__} was not raised")


def _different_wrappers(how: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    if how == "construction":  # only rank 1 wraps the second layer: the first constructions differ
        if dist.get_rank() == 1:
            return _expect(ValueError, FSDP, model[1])
        return _expect(ValueError, FSDP, model)
    if dist.get_rank() == 1:  # the same modules, one frozen on rank 1 only: seen in the fingerprint
        model[1].weight.requires_grad_(False)
    root = FSDP(model)
    return _expect(RuntimeError, root, torch.randn(2, 4))


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("how", ["construction", "first_forward"])
def test_ranks_with_different_wrappers_fail(pool: RankPool, how: str) -> None:
    for msg in pool.run(_different_wrappers, how, timeout=60):
        if how == "construction":
            assert "construct wrappers with different options, or around different modules" in msg, msg
            assert "Sequential with 4 parameters (40 elements) on rank" in msg, msg
            assert "Linear with 2 parameters (20 elements) on rank 1" in msg, msg
        else:
            assert "ranks built different FSDP wrappers" in msg and "rank 1" in msg, msg


def _inner_root_first(how: str) -> Any:
    """An inner wrapper runs alone first (as fairscale allows: an evaluation, an EMA copy), then the
    outer wrapper trains; or the tree is reset with fairscale's ``_reset_lazy_init`` mid-training."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    net = copy.deepcopy(ref)
    net[0] = FSDP(net[0])
    if how == "unfinished":
        with net[0].no_sync():
            net[0](torch.randn(2, 4)).sum().backward()  # its no_sync() is still open at the outer's forward
            outer = FSDP(net)
            return _expect(RuntimeError, outer, torch.randn(2, 4))
    if how == "first":
        with torch.no_grad():
            net[0](torch.randn(2, 4))  # becomes a root of its own
        net[0](torch.randn(2, 4)).sum().backward()  # and trains alone once (no optimizer step)
        net[0].zero_grad()
    model = FSDP(net)
    diffs = compare_training(
        ref, model, lambda g, n: torch.randn(n, 4, generator=g), lambda o: o.pow(2).mean(), steps=2
    )
    roots = [model.is_root, net[0].is_root]
    if how == "reset":
        net[0]._reset_lazy_init()  # an inner wrapper resets the whole tree
        roots += [model.is_root, net[0].is_root]
        diffs2 = compare_training(
            ref, model, lambda g, n: torch.randn(n, 4, generator=g), lambda o: o.pow(2).mean(), steps=2
        )
        diffs = {k: max(v, diffs2[k]) for k, v in diffs.items()}
        roots += [model.is_root, net[0].is_root]
    return max(diffs.values()), roots


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("how", ["first", "reset", "unfinished"])
def test_an_inner_wrapper_that_ran_alone_becomes_a_unit_of_the_outer_root(pool: RankPool, how: str) -> None:
    for result in pool.run(_inner_root_first, how, timeout=60):
        if how == "unfinished":
            assert "ran a forward as a root of its own and is not done with it" in result and "'0'" in result
            continue
        diff, roots = result
        assert diff <= 1e-5, diff
        assert roots == ([True, False] if how == "first" else [True, False, None, None, True, False]), roots


def _create_graph() -> str:
    model = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4)), nn.Linear(4, 1)))
    loss = model(torch.randn(2, 4)).sum()
    return _expect(RuntimeError, loss.backward, create_graph=True)


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_backward_with_create_graph_is_refused(pool: RankPool) -> None:
    for msg in pool.run(_create_graph, timeout=60):
        assert "create_graph=True" in msg


class _TwoUnits(nn.Module):
    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        kwargs = kwargs or {"reshard_after_forward": False}
        self.a = FSDP(nn.Linear(4, 4), **kwargs)  # type: ignore[arg-type]
        self.b = FSDP(nn.Linear(4, 4), **kwargs)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _different_reductions(no_shard: bool) -> str:
    torch.manual_seed(0)
    kwargs = {"sharding_strategy": ShardingStrategy.NO_SHARD} if no_shard else {}
    root = FSDP(_TwoUnits(**kwargs), **kwargs)  # type: ignore[arg-type]
    # NO_SHARD: two good backwards first, so the learned buckets are sent during backward and rank
    # 0's bucket of `a` is in flight when rank 1 reaches the end of its backward
    for _ in range(2 if no_shard else 0):
        sum(y.sum() for y in root(torch.randn(2, 4))).backward()
    ya, yb = root(torch.randn(2, 4))
    # rank 1 leaves unit `a` out of its loss: its parameters get no gradient there, but do on rank 0
    loss = (ya.sum() if dist.get_rank() == 0 else 0) + yb.sum()
    return _expect(RuntimeError, loss.backward)


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("no_shard", [False, True], ids=["shard_grad_op", "no_shard"])
def test_ranks_reducing_different_parameters_fail_on_all_ranks(pool: RankPool, no_shard: bool) -> None:
    try:
        for msg in pool.run(_different_reductions, no_shard, timeout=60):
            assert "ranks disagree on which parameters got gradients" in msg
    finally:
        pool.close()  # a reduce-scatter was left unmatched: start the next test on fresh ranks


def _tied_to_a_sibling() -> str:
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    # both wrapped on their own and no wrapper around both (tests/compat covers the supported ties)
    first = FSDP(emb)  # alive while the second is built and run
    second = FSDP(head)
    msg = _expect(ValueError, second, torch.randn(2, 3))
    del first
    return msg


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_parameter_tied_to_a_sibling_without_a_common_wrapper_is_refused(pool: RankPool) -> None:
    (msg,) = pool.run(_tied_to_a_sibling)
    assert "'weight'" in msg and "common parent" in msg, msg


class _Opaque:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _ReturnsOpaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> _Opaque:
        return _Opaque(self.lin(x))


def _opaque_output() -> str:
    model = FSDP(_ReturnsOpaque())
    return _expect(TypeError, model, torch.randn(2, 4))


def _forward_inside_summon() -> str:
    model = FSDP(nn.Linear(4, 4))
    with model.summon_full_params():
        return _expect(RuntimeError, model, torch.randn(2, 4))


def _scalar_and_unused_outputs() -> float:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.tensor(2.0))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * self.s, (x * self.s).detach()

    model = FSDP(M())
    out, _ = model(torch.ones(3))
    out.sum().backward()
    return model.params[0].grad.sum().item()


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_single_process_misuse_messages(pool: RankPool) -> None:
    for msg in pool.run(_opaque_output):
        assert "cannot find the tensors in the output" in msg and "_Opaque" in msg
    for msg in pool.run(_forward_inside_summon):  # (under no_grad it runs: test_direct_calls.py)
        assert "a forward inside summon_full_params() with gradients enabled" in msg
    # a scalar parameter shards (rank 1 holds only padding) and trains: d(sum(x*s))/ds = 3, averaged
    grads = pool.run(_scalar_and_unused_outputs)
    assert sum(grads) == pytest.approx(3.0)


def _raises_on_one_rank() -> None:
    if dist.get_rank() == 1:
        raise ValueError("only rank 1")
    dist.barrier()


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_pool_fails_fast_when_one_rank_raises(pool: RankPool) -> None:
    grace, pool.grace = pool.grace, 2.0  # rank 0 waits in a barrier forever: do not wait long for it
    try:
        with pytest.raises(RankFailure, match="only rank 1"):
            pool.run(_raises_on_one_rank, timeout=60)
    finally:
        pool.grace = grace


class _Branchy(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.out, self.skip = inner, nn.Linear(4, 4), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x if self.skip else self.inner(x))


def _diverging_collectives(kind: str) -> str:
    """Ranks that wait in different collectives time out (on a group with a short timeout); the
    error keeps the backend's message and adds what usually causes it."""
    import datetime

    import fsdp

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    try:
        if kind == "forward":  # rank 1 takes a branch that skips the inner wrapper
            net = _Branchy(FSDP(nn.Linear(4, 4), process_group=group))
            root = FSDP(net, process_group=group)
            root(x).sum().backward()  # the first forward checks that the ranks built the same wrappers
            net.skip = dist.get_rank() == 1
            root(x).sum().backward()
        else:  # DistributedDataParallel: rank 1 freezes a parameter alone
            ddp = fsdp.DistributedDataParallel(
                nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), process_group=group
            )
            ddp(x).sum().backward()
            if dist.get_rank() == 1:
                ddp.module[0].weight.requires_grad_(False)
            ddp(x).sum().backward()
    except RuntimeError as e:
        return str(e)
    finally:
        dist.barrier()  # (both ranks are past the timed-out group before the next test)
    return "no error"


@pytest.mark.parametrize("kind", ["forward", "ddp_trainable_set"])
@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_collective_timeout_says_what_usually_causes_it(pool: RankPool, kind: str) -> None:
    messages = pool.run(_diverging_collectives, kind, timeout=60)
    if kind == "forward":  # a branch inside the forward is caught by the units' handshakes, at once
        for m in messages:
            assert "inside the root's forward some ranks run a wrapped module that others skip" in m, m
        return
    assert any(
        "fsdp: a collective did not complete within the process group's timeout" in m for m in messages
    ), messages
