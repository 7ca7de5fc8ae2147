"""A deleted model is freed by reference counting, at once, not left to the cyclic garbage collector.

On a GPU, memory held by a model that only the cyclic collector can free stays allocated after
``del model`` until a collection happens to run. Each test disables the collector, builds, trains
and uses a model, deletes it and the optimizer, and checks that the wrappers, the wrapped modules
and every parameter (flat or original) are gone.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp.wrap
from torch import nn

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy
from tests.rank_pool import RankPool


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _fsdp(inner: Callable[[nn.Module], nn.Module] | None = None, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        m = _net()
        m[2] = inner(m[2]) if inner is not None else FSDP(m[2], **kw)
        return FSDP(m, **kw)

    return build


def _auto_wrapped() -> nn.Module:
    policy = functools.partial(fsdp.default_auto_wrap_policy, min_num_params=1)
    with fsdp.enable_wrap(wrapper_cls=FSDP):
        return FSDP(fsdp.auto_wrap(fsdp.auto_wrap_bn(_net()), auto_wrap_policy=policy))


BUILDS: dict[str, Callable[[], nn.Module]] = {
    "full_shard": _fsdp(),
    "bf16": _fsdp(mixed_precision=True, compute_dtype=torch.bfloat16),
    "shard_grad_op": _fsdp(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP),
    "no_shard": _fsdp(sharding_strategy=ShardingStrategy.NO_SHARD),
    "cpu_offload": _fsdp(move_params_to_cpu=True),
    "keep_full_forward_prefetch": _fsdp(reshard_after_forward=False, forward_prefetch=True),
    "unflattened": _fsdp(flatten_parameters=False),
    "checkpoint_inside": _fsdp(lambda m: FSDP(fsdp.checkpoint_wrapper(m))),
    "checkpoint_outside_offloaded": _fsdp(lambda m: fsdp.checkpoint_wrapper(FSDP(m), offload_to_cpu=True)),
    "auto_wrap": _auto_wrapped,
    # torch's form: the batch norm gets a full-precision wrapper and fp32 hooks
    "torch_style_mixed_precision": lambda: FSDP(
        _net(),
        auto_wrap_policy=torch.distributed.fsdp.wrap.ModuleWrapPolicy({nn.Linear}),
        mixed_precision=fsdp.MixedPrecision(param_dtype=torch.bfloat16),
        use_orig_params=True,
    ),
    "ddp": lambda: fsdp.DistributedDataParallel(_net()),
    "offload_model": lambda: fsdp.OffloadModel(
        _net(), device=torch.device("cpu"), num_slices=2, checkpoint_activation=True, num_microbatches=2
    ),
}


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _use(model: nn.Module, directory: str) -> None:
    """Train two steps and call what a training script calls on the wrapper."""
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    sharded = isinstance(model, FSDP)
    for _ in range(2):
        if sharded or isinstance(model, fsdp.DistributedDataParallel):
            with model.no_sync():
                model(torch.randn(4, 8, generator=g)).sum().backward()
        model(torch.randn(4, 8, generator=g)).sum().backward()
        if sharded:
            model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
    if sharded:
        assert isinstance(model, FSDP)
        with model.summon_full_params():
            pass
        model.load_state_dict(model.state_dict())
        model.load_local_state_dict(model.local_state_dict())
        model.gather_full_optim_state_dict(optim)
        model.comm_stats()
        model.memory_stats()
        fsdp.save_checkpoint(Path(directory) / "checkpoint", model, optim)
        fsdp.load_checkpoint(Path(directory) / "checkpoint", model, optim)
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 8, generator=g))


def _alive_after_delete(name: str, directory: str) -> list[str]:
    torch.optim.Adam(
        nn.Linear(1, 1).parameters()
    ).step()  # torch's own first-step state, made outside the check
    with _collector_off():
        model = BUILDS[name]()
        _use(model, directory)
        watched = {f"module {n or '<root>'}": weakref.ref(m) for n, m in model.named_modules()}
        watched |= {f"parameter {n}": weakref.ref(p) for n, p in model.named_parameters()}
        del model
        alive = [what for what, ref in watched.items() if ref() is not None]
    gc.collect()
    return alive


@pytest.mark.parametrize("name", sorted(BUILDS))
@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_deleted_model_is_freed_without_the_cyclic_collector(
    pool: RankPool, name: str, tmp_path: Path
) -> None:
    for alive in pool.run(_alive_after_delete, name, str(tmp_path)):
        assert alive == [], f"still alive after del, until the cyclic collector runs: {alive[:5]}"


_FIRST_WRAPPER = """
import gc, os, socket, weakref
import torch, torch.distributed as dist
from torch import nn
from fsdp import FullyShardedDataParallel as FSDP
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
gc.disable()
model = FSDP(nn.Linear(4, 4))  # the first wrapper of the process imports the compiler's skip list
ref = weakref.ref(model)
del model
print("alive" if ref() is not None else "freed")
"""


def test_the_first_wrapper_of_a_process_is_freed_too() -> None:
    """Importing torch's compiler (which the first wrapper does) leaves a frame cycle that would hold
    the constructor's frame, and so the wrapper, until the cyclic collector runs."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_WRAPPER],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "freed"
