"""The bookkeeping of CPU offload's side-stream copies, driven on CPU.

On CUDA, ``move_params_to_cpu`` routes every host<->device copy through ``SideCopies``: shards go
to the device inside the side stream, reduced gradients come back asynchronously during backward
and land on ``.grad`` only at the end of backward. On CPU the same object runs with no-op streams,
so these tests give every handle one and check that training is unchanged to the last bit:
gradients accumulated over two backwards, then optimizer steps. The streams themselves are checked
on a GPU by ``tests/gpu/offload_streams.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp.common.device import DeviceHandle, SideCopies
from tests.rank_pool import RankPool


class _CountingCopies(SideCopies):
    def __init__(self) -> None:
        super().__init__(DeviceHandle(torch.device("cpu")))
        self.to_device_calls = self.to_host_calls = self.side_calls = 0

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        self.side_calls += 1
        with super().side():
            yield

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        self.to_device_calls += 1
        return super().to_device(dst, src)

    def to_host(self, src: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        self.to_host_calls += 1
        return super().to_host(src, dtype)


def _model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    for i in (0, 2, 4):
        net[i] = FSDP(net[i], mixed_precision=True, compute_dtype=torch.bfloat16, bucket_cap_mb=0)
    return FSDP(net, mixed_precision=True, compute_dtype=torch.bfloat16, bucket_cap_mb=0)


def _train_with_and_without_copies() -> dict[str, Any]:
    plain, routed = _model(), _model()
    copies = _CountingCopies()
    handles = [h for w in routed.modules() if isinstance(w, FSDP) for h in w.handles]
    for h in handles:
        h.copies = copies
    deferred = collected_early = 0
    for h in handles:
        real = h.finalize_gradient

        def finalize(asynchronous: bool = False, _real: Any = real, _h: Any = h) -> None:
            nonlocal deferred, collected_early
            queued = _h._grad_copy is not None
            _real(asynchronous)
            deferred += _h._grad_copy is not None and not queued  # a copy whose .grad lands later
            # the queuing pass must not wait for a copy queued before it (a host sync per handle)
            collected_early += asynchronous and queued and _h._grad_copy is None

        h.finalize_gradient = finalize  # type: ignore[method-assign]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, routed)]
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    diff = 0.0
    for _ in range(2):
        for _ in range(2):  # two backwards into the same .grad before each step
            x = torch.randn(4, 8, generator=g)
            for m in (plain, routed):
                m(x).float().pow(2).mean().backward()
            for a, b in zip(plain.parameters(), routed.parameters(), strict=True):
                assert a.grad is not None and b.grad is not None
                diff = max(diff, (a.grad - b.grad).abs().max().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for a, b in zip(plain.parameters(), routed.parameters(), strict=True):
            diff = max(diff, (a - b).abs().max().item())
    return {
        "diff": diff,
        "deferred": deferred,
        "collected_early": collected_early,
        "to_host": copies.to_host_calls,
        "to_device": copies.to_device_calls,
        "side": copies.side_calls,
        "left": [h._grad_copy is not None for h in handles],
    }


@pytest.mark.parametrize("pool", [1, 2], indirect=True)
def test_side_copies_change_nothing(pool: RankPool) -> None:
    for r in pool.run(_train_with_and_without_copies):
        assert r["diff"] == 0.0, r
        assert r["to_host"] == 3 * 4, r  # 3 flat parameters x 4 backwards
        # every gather of the 3 units (forward, and again in backward) goes through the copier: at
        # world size 1 as a copy to the device, above it as a copy plus all-gather on the side stream
        gathers = 3 * 2 * 4
        if pool.world_size == 1:
            assert r["to_device"] == gathers, r
        else:
            assert r["to_device"] == 0 and r["side"] == gathers + r["to_host"], r
        # no copy is waited for when it is queued: the two units reduced first queue theirs during
        # backward, and the end-of-backward callback queues the last one before it waits for any
        assert r["deferred"] == 3 * 4, r
        assert r["collected_early"] == 0, r
        assert not any(r["left"]), r


def _step_after_forward_without_backward() -> dict[str, Any]:
    model = _model()
    copies = _CountingCopies()
    synced = []
    copies.synchronize = lambda: synced.append(len(synced))  # type: ignore[method-assign]
    for w in model.modules():
        if isinstance(w, FSDP):
            for h in w.handles:
                h.copies = copies
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    key = torch.device("cuda", 99)  # an instance as CUDA offload registers one; no device is used
    SideCopies._instances[key] = copies
    try:
        model(torch.randn(4, 8)).float().sum()  # grad enabled; the graph is dropped, no backward
        before_step = len(synced)
        opt.step()  # writes the host shards the forward's copies read
        return {"before_step": before_step, "after_step": len(synced), "to_device": copies.to_device_calls}
    finally:
        del SideCopies._instances[key]


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_step_waits_for_copies_of_a_forward_without_backward(pool: RankPool) -> None:
    (r,) = pool.run(_step_after_forward_without_backward)
    assert r["to_device"] == 3, r  # the forward's three gathers read the host shards
    assert r["before_step"] == 0, r  # a forward with grad enabled does not wait for its copies ...
    assert r["after_step"] == 1, r  # ... the optimizer step does, before it writes the shards
