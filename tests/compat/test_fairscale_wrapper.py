"""fairscale's wrapper as its users meet it: the scenarios of fairscale 0.4.13's
``tests/nn/data_parallel/test_fsdp*.py`` and ``tests/nn/checkpoint``, and of fairseq's use of it,
with the one import changed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from fsdp import checkpoint_wrapper, disable_checkpointing
from tests.rank_pool import RankPool
from tests.unit.conftest import single_rank_group  # noqa: F401  (the fixture, for the one-rank tests)


class _Net(nn.Module):
    """fairscale's NestedWrappedModule, small: the model keeps its layers under ``self.module``."""

    def __init__(self, wrap_inner: bool = True, **fsdp_kwargs: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 6))
        self.module = nn.Sequential(
            nn.Linear(3, 4), FSDP(inner, **fsdp_kwargs) if wrap_inner else inner, nn.Linear(6, 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def get_input(self) -> torch.Tensor:
        return torch.rand(4, 3, generator=torch.Generator().manual_seed(1))


@pytest.mark.usefixtures("single_rank_group")
# ---------------------------------------------------------------------- model.module, flat parameter names
def test_model_module_is_fairscales_flatten_params_level() -> None:
    net = _Net()
    model = FSDP(net)
    level = model.module
    assert level.module is net, "model.module.module is the wrapped module (fairseq's unwrapped_module)"
    assert level.module.module is net.module, "the module's own .module one level further"
    assert isinstance(level, _Net) and isinstance(level, nn.Module)
    assert repr(level).startswith("FlattenParamsWrapper(")
    x = level.get_input()  # the model's own methods, through the level (fairscale's tests do this)
    level.tag = "set through the level"
    assert net.tag == "set through the level"
    model(x).sum().backward()
    # the inner wrapper's level too: its .module is the Sequential it wraps; indexing passes through
    inner = model.module.module.module[1]
    assert (
        inner.module.module is inner._fsdp_wrapped_module and inner.module[0] is inner._fsdp_wrapped_module[0]
    )
    assert len(inner.module) == 2 and list(inner.module) == list(inner._fsdp_wrapped_module)


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(
    "torch_option",
    [
        {"use_orig_params": True},
        {"sharding_strategy": fsdp.ShardingStrategy.FULL_SHARD},
        {"mixed_precision": fsdp.MixedPrecision(param_dtype=torch.bfloat16)},
        {"backward_prefetch": fsdp.BackwardPrefetch.BACKWARD_PRE},
    ],
)
def test_a_wrapper_built_torchs_way_has_torchs_module(torch_option: dict) -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model = FSDP(net, **torch_option)
    assert model.module is net, "torch FSDP1's .module is the wrapped module itself"
    inner = nn.Linear(2, 2)
    by_policy = FSDP(nn.Sequential(inner, nn.ReLU()), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    assert by_policy.module[0].module is inner, "the wrappers a torch policy builds are torch's too"


@pytest.mark.usefixtures("single_rank_group")
def test_flat_parameter_names_follow_the_library_the_wrapper_was_built_for() -> None:
    fairscale_style = FSDP(_Net())
    names = [n for n, _ in fairscale_style.named_parameters()]
    assert names == [
        "_fsdp_wrapped_module.flat_param_0",
        "_fsdp_wrapped_module._fpw_module.module.1._fsdp_wrapped_module.flat_param_0",
    ]
    torch_style = FSDP(_Net(sharding_strategy=fsdp.ShardingStrategy.FULL_SHARD), sync_module_states=True)
    assert [n for n, _ in torch_style.named_parameters()] == [
        "_fsdp_wrapped_module._flat_param",
        "_fsdp_wrapped_module.module.1._fsdp_wrapped_module._flat_param",
    ]
    for model in (fairscale_style, torch_style):
        for name, p in model.named_parameters():
            assert model.get_parameter(name) is p
        model(model.module.get_input()).sum().backward()
        with model.summon_full_params():  # the unwrapped model's names, as both libraries give them
            assert [n for n, _ in model.named_parameters()] == [
                n for n, _ in _Net(wrap_inner=False).named_parameters()
            ]
    unflat = FSDP(_Net(flatten_parameters=False), flatten_parameters=False)
    assert [n for n, _ in unflat.named_parameters()] == [
        n for n, _ in _Net(wrap_inner=False).named_parameters()
    ]


@pytest.mark.usefixtures("single_rank_group")
# ---------------------------------------------------------------------- reset_parameters
def test_reset_parameters_inside_summon_full_params() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(10, 10)
    with torch.no_grad():  # (fairscale's test builds it so)
        model = FSDP(copy.deepcopy(ref), allow_reset_parameters=True)
    torch.manual_seed(7)
    with model.summon_full_params():
        model.reset_parameters()  # fairscale's way: on the full parameters shown, written back on exit
    torch.manual_seed(7)
    ref.reset_parameters()
    assert torch.equal(model.state_dict()["weight"], ref.weight.detach())
    torch.manual_seed(8)
    model.reset_parameters()  # outside: a summon of its own
    torch.manual_seed(8)
    ref.reset_parameters()
    assert torch.equal(model.state_dict()["bias"], ref.bias.detach())
    with pytest.raises(RuntimeError, match="allow_reset_parameters=True"):
        FSDP(nn.Linear(2, 2)).reset_parameters()


# ---------------------------------------------------------------------- root inputs under mixed precision
class _Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, self.lin.weight.dtype))
        return self.lin(x)


@pytest.mark.usefixtures("single_rank_group")
def test_the_root_casts_inputs_to_fp16_under_mixed_precision_with_fp32_compute() -> None:
    """fairscale's test_mixed_precision_autocast_fp32_compute: fp16 inputs, fp32 parameters, autocast."""
    recorder = _Recorder()
    model = FSDP(recorder, mixed_precision=True, compute_dtype=torch.float32)
    x = torch.rand(2, 5, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().sum()
    loss.backward()
    assert recorder.seen == [(torch.float16, torch.float32)]
    assert x.grad is None, "the root's cast is not recorded (fairscale's no_grad cast)"
    assert model.params[0].grad is not None and model.params[0].grad.dtype == torch.float32
    bf16 = _Recorder()
    FSDP(bf16, mixed_precision=True, compute_dtype=torch.bfloat16)(torch.rand(2, 5))
    assert bf16.seen == [(torch.bfloat16, torch.bfloat16)], "a low compute dtype is the inputs' dtype"


# ---------------------------------------------------------------------- activation checkpointing
class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x))


@pytest.mark.usefixtures("single_rank_group")
def test_disable_checkpointing_runs_checkpointed_modules_plainly() -> None:
    torch.manual_seed(0)
    ref = _Counted()
    block = checkpoint_wrapper(copy.deepcopy(ref))
    model = FSDP(nn.Sequential(block, nn.Linear(4, 1)))
    x = torch.randn(3, 4)
    model(x).sum().backward()
    assert block.calls == 2, "checkpointed: recomputed in backward"
    grads = model.params[0].grad.clone()
    model.zero_grad()
    with disable_checkpointing():
        with disable_checkpointing():
            pass  # (nested: leaving the inner one keeps checkpointing disabled)
        model(x).sum().backward()
    assert block.calls == 3, "inside disable_checkpointing(): the plain forward, once"
    assert torch.equal(model.params[0].grad, grads)
    model(x).sum().backward()
    assert block.calls == 5, "after it, checkpointed again"


@contextlib.contextmanager
def _recording_offload(seen: list[bool]) -> Iterator[None]:
    seen.append(True)
    yield


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("flag", [1, "yes", True])
def test_checkpoint_wrapper_takes_any_truthy_offload_flag(monkeypatch: pytest.MonkeyPatch, flag: Any) -> None:
    seen: list[bool] = []
    monkeypatch.setattr(
        torch.autograd.graph, "save_on_cpu", lambda pin_memory=False: _recording_offload(seen)
    )
    block = checkpoint_wrapper(_Counted(), offload_to_cpu=flag)
    block(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert seen == [True], "the saved inputs went through the CPU offload"
    plain = checkpoint_wrapper(_Counted(), offload_to_cpu=0)
    plain(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert seen == [True], "a falsy flag does not offload"


# ---------------------------------------------------------------------- no_sync(): memory and communication
def _nested(**cfg: Any) -> nn.Module:
    """fairscale's NestedWrappedModule: four wrappers that own parameters, one nested in another."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 4),
        FSDP(nn.Sequential(FSDP(nn.Linear(4, 16), **cfg), nn.Linear(16, 16)), **cfg),
        FSDP(nn.Linear(16, 4), **cfg),
        nn.Linear(4, 8),
    )
    return FSDP(model, **cfg)


def _no_sync_window(reshard_after_forward: bool, mixed: bool, keep: bool) -> dict[str, Any]:
    """fairscale's TestNoSyncCommunication and TestNoSync: collectives counted inside the window and
    after it, what stays gathered, and the accumulated gradients against one concatenated batch."""
    rank = dist.get_rank()
    cfg = {"reshard_after_forward": reshard_after_forward, "mixed_precision": mixed, "bucket_cap_mb": 0}
    model = _nested(**cfg)
    units = [w for w in model.modules() if isinstance(w, FSDP) and w.params]
    g = torch.Generator().manual_seed(rank)
    first, second = torch.rand(4, 8, generator=g), torch.rand(4, 8, generator=g)
    loss = lambda x: model(x).float().sum()  # noqa: E731
    loss(torch.cat([first, second])).backward()  # the reference: one batch of both
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.reset_comm_stats()
    with model.no_sync(keep_full_params=keep):
        loss(first).backward()
        inside = {k: v["calls"] for k, v in model.comm_stats().items()}
        kept = [w.has_full_params for w in units]
        unsharded = model.memory_stats()["unsharded"]
    loss(second).backward()
    after = {k: v["calls"] for k, v in model.comm_stats().items()}
    grads = [p.grad for p in model.parameters()]
    atol = 1e-2 if mixed else 1e-5
    return {
        "units": len(units),
        "inside": inside,
        "after": after,
        "kept": kept,
        "unsharded": unsharded,
        "root_full_bytes": sum(h._full.numel() * h._full.element_size() for h in model.handles),
        "grads_match": all(torch.allclose(a, b, atol=atol) for a, b in zip(grads, expected, strict=True)),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("mixed", [False, True])
def test_no_sync_follows_reshard_after_forward_as_fairscale(
    pool: RankPool, reshard_after_forward: bool, mixed: bool
) -> None:
    for r in pool.run(_no_sync_window, reshard_after_forward, mixed, False):
        n = r["units"]
        assert n == 4 and r["grads_match"], r
        assert r["inside"].get("reduce_scatter", 0) == 0, "nothing is reduced inside the window"
        if reshard_after_forward:
            # inside: every unit gathers in forward, every one but the root again in backward; after:
            # the root's full parameters are kept from the window, the others gather twice again
            assert r["inside"]["all_gather"] == 2 * n - 1 and r["after"]["all_gather"] == 4 * n - 3, r
            assert r["kept"] == [True, False, False, False], "only the root keeps its full parameters"
            assert r["unsharded"] == r["root_full_bytes"], "the others' full parameters are freed"
        else:  # every unit keeps its full parameters, inside and after, as outside no_sync()
            assert r["inside"]["all_gather"] == n and r["after"]["all_gather"] == n, r
            assert r["kept"] == [True] * n
        assert r["after"]["reduce_scatter"] == n, "the accumulated sum is reduced once per unit"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_no_sync_keep_full_params_keeps_every_unit_gathered(pool: RankPool) -> None:
    for r in pool.run(_no_sync_window, True, False, True):
        n = r["units"]
        assert r["grads_match"] and r["kept"] == [True] * n, r
        assert r["inside"]["all_gather"] == n, "gathered once in forward, kept for backward"
        assert r["unsharded"] > r["root_full_bytes"]
        # after: the kept parameters serve the next forward; the synced backward gathers the inner
        # units again, freed after that forward as outside no_sync()
        assert r["after"]["all_gather"] == n + n - 1 and r["after"]["reduce_scatter"] == n, r


# ---------------------------------------------------------------------- wrapping again
class _Inner(nn.Module):
    """fairscale's test_fsdp_multiple_wrapping model: all its parameters in an inner wrapper."""

    def __init__(self, **cfg: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(FSDP(nn.Linear(5, 5), **cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _wrap_again(mixed: bool, flatten: bool) -> dict[str, Any]:
    """Train a wrapped model, wrap its module again for inference (the first wrapper still alive),
    then train the first one on: each root takes the inner wrappers back at its next forward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"mixed_precision": mixed, "flatten_parameters": flatten}
    inner = _Inner(**cfg)
    torch.manual_seed(0)
    ref = nn.Linear(5, 5)
    model = FSDP(inner, **cfg)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

    def step(i: int) -> None:
        x = torch.rand(2 * world, 5, generator=torch.Generator().manual_seed(i))
        model(x[2 * rank : 2 * rank + 2]).float().sum().backward()
        (ref(x).sum() / world).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()

    for i in range(3):
        step(i)
    x = torch.rand(1, 5, generator=torch.Generator().manual_seed(9))
    output = model(x)
    rewrapped = FSDP(inner, **cfg)  # fairscale's test: the same module, wrapped a second time
    rewrapped_output = rewrapped(x)
    step(3)  # the first wrapper trains on, its inner wrapper taken back
    with torch.no_grad():
        again = rewrapped(x)  # and the second one runs again
    tol = 1e-2 if mixed else 1e-6
    return {
        "same_output": torch.allclose(output, rewrapped_output),
        "trained_on": torch.allclose(again.float(), ref(x), atol=tol),
        "roots": [model.is_root, rewrapped.is_root, inner.layers[0].is_root],
    }


@pytest.mark.parametrize("pool", [1, 2], indirect=True)
@pytest.mark.parametrize(("mixed", "flatten"), [(False, True), (True, True), (False, False)])
def test_wrapping_again_a_module_whose_inner_wrappers_trained(
    pool: RankPool, mixed: bool, flatten: bool
) -> None:
    for r in pool.run(_wrap_again, mixed, flatten):
        assert r["same_output"] and r["trained_on"], r
        assert r["roots"] == [None, True, False], "the last wrapper to run is the root"


def _inference_after_training() -> dict[str, Any]:
    """FSDP(nn.Sequential(trained_block, head)): a block trained inside one model, reused in another."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref_block, ref_head = nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 2)
    ref_trainer_head = nn.Linear(6, 1)
    block = FSDP(copy.deepcopy(ref_block))
    trainer = FSDP(nn.Sequential(block, copy.deepcopy(ref_trainer_head)))
    opt = torch.optim.SGD(trainer.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([*ref_block.parameters(), *ref_trainer_head.parameters()], lr=0.1)
    x = torch.rand(2 * world, 4, generator=torch.Generator().manual_seed(0))
    trainer(x[2 * rank : 2 * rank + 2]).sum().backward()
    (ref_trainer_head(ref_block(x)).sum() / world).backward()
    opt.step()
    ref_opt.step()
    head = copy.deepcopy(ref_head)
    serving = FSDP(nn.Sequential(block, head))  # the trained wrapper, under a new root
    with torch.no_grad():
        served = serving(x)
    serving.zero_grad()
    ref_block.zero_grad()
    serving(x[2 * rank : 2 * rank + 2]).sum().backward()  # and it trains there too
    (ref_head(ref_block(x)).sum() / world).backward()
    with serving.summon_full_params(with_grads=True):
        grads = {n: p.grad for n, p in serving.named_parameters()}
    expected = {f"0.{n}": p.grad for n, p in ref_block.named_parameters()}
    expected.update({f"1.{n}": p.grad for n, p in ref_head.named_parameters()})
    return {
        "served": torch.allclose(served, ref_head(ref_block(x)), atol=1e-6),
        "grads": sorted(grads) == sorted(expected)
        and all(torch.allclose(grads[n], g, atol=1e-6) for n, g in expected.items()),
        "block_is_unit": block.is_root is False and serving.is_root is True,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_trained_wrapper_under_a_new_root_serves_and_trains(pool: RankPool) -> None:
    for r in pool.run(_inference_after_training):
        assert r["served"] and r["grads"] and r["block_is_unit"], r


# ---------------------------------------------------------------------- stand-in process groups
class DummyProcessGroup:
    """fairscale's test helper (fairseq builds one-rank wrappers with it): a rank and a size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


_ROOT = Path(__file__).resolve().parents[2]

_ONE_RANK = """
import copy, json, torch, torch.distributed as dist
from torch import nn
from fsdp import FullyShardedDataParallel as FSDP
from tests.compat.test_fairscale_wrapper import DummyProcessGroup

group = DummyProcessGroup(rank=0, size=1)  # fairseq's way at world size 1: no init_process_group()
torch.manual_seed(0)
ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))
model = copy.deepcopy(ref)
model[2] = FSDP(model[2], process_group=group)
model = FSDP(model, process_group=group, process_group_reduce_scatter=DummyProcessGroup(0, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
out = {}
for step in range(3):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
    if step == 0:
        with model.no_sync():  # before the first forward too (fairscale's test_no_sync_before_first_forward)
            model(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
    model(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    out["norm"] = (model.clip_grad_norm_(1.0) - torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)).abs().item()
    opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
sd = model.state_dict()
out["keys"] = list(sd) == list(ref.state_dict())
out["state"] = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
model.load_state_dict(ref.state_dict())
local = model.local_state_dict()
model.load_local_state_dict(local)
with model.summon_full_params():
    out["summon"] = torch.equal(model.module.module[0].weight, ref[0].weight)
full_optim = model.gather_full_optim_state_dict(opt)
out["optim"] = full_optim is not None and len(full_optim["state"]) == len(list(ref.parameters()))
try:
    model.sharded_state_dict()
    out["sharded"] = ""
except RuntimeError as e:
    out["sharded"] = str(e)
out["initialized"] = dist.is_initialized()
print(json.dumps(out))
"""


def test_a_stand_in_group_trains_one_rank_without_init_process_group() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_RANK], cwd=_ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["initialized"] is False, "nothing called init_process_group()"
    assert r["keys"] and r["state"] <= 1e-6 and r["norm"] <= 1e-6, r
    assert r["summon"] and r["optim"], r
    assert "need a torch.distributed process group" in r["sharded"], "DTensor state dicts refuse clearly"


@pytest.mark.usefixtures("single_rank_group")
def test_stand_in_groups_are_checked_and_rebound() -> None:
    with pytest.raises(ValueError, match=r"says rank 1 of 1"):
        FSDP(nn.Linear(2, 2), process_group=DummyProcessGroup(1, 1))
    with pytest.raises(TypeError, match=r"HYBRID_SHARD takes process_group=.* not a stand-in"):
        FSDP(
            nn.Linear(2, 2),
            process_group=DummyProcessGroup(0, 2),
            sharding_strategy=fsdp.ShardingStrategy.HYBRID_SHARD,
        )
    with pytest.raises(ValueError, match=r"stand-in with rank.* cannot communicate"):
        FSDP(nn.Linear(2, 2), process_group=DummyProcessGroup(0, 2), sync_module_states=True)
    torch.manual_seed(0)
    ref = nn.Linear(3, 3)  # 12 elements: 6 per rank
    second = FSDP(copy.deepcopy(ref), process_group=DummyProcessGroup(rank=1, size=2))
    assert torch.equal(second.params[0].detach(), torch.cat([ref.weight.reshape(-1), ref.bias])[6:])
    with pytest.raises(
        RuntimeError, match=r"holds the shards of rank 1 of 2 and no group to communicate over"
    ):
        second(torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"built for rank 1 of 2 .* makes this process rank 0 of 1"):
        second.process_group = dist.group.WORLD  # (this process is rank 0 of a one-rank world)


def _built_elsewhere(tmp: str) -> dict[str, Any]:
    """fairscale's _test_multiprocessing: each rank's model is built in another process (here a
    subprocess, without a process group) with DummyProcessGroup(rank, size), sent back pickled, given
    the real group (fairscale's idiom) and trained, beside a model built here."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = Path(tmp) / f"rank{rank}.pt"
    code = (
        "import torch\n"
        "from tests.compat.test_fairscale_wrapper import DummyProcessGroup, _nested\n"
        f"group = DummyProcessGroup(rank={rank}, size={world})\n"
        "with torch.no_grad():\n"
        "    model = _nested(process_group=group)\n"
        f"torch.save(model, {str(path)!r})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = torch.load(path, weights_only=False)
    before = [str(m.process_group) for m in model.modules() if isinstance(m, FSDP)]
    groups = []
    for m in model.modules():
        if isinstance(m, FSDP):
            m.process_group = dist.group.WORLD
            m.process_group_reduce_scatter = dist.new_group()  # fairscale's _one_step, after unpickling
            groups.append(m.process_group_reduce_scatter)
    reduced_over = []
    real = fsdp.comm.collectives.reduce_scatter

    def reduce_scatter(out: Any, full: torch.Tensor, group: Any, *args: Any, **kwargs: Any) -> Any:
        reduced_over.append(group)
        return real(out, full, group, *args, **kwargs)

    # one collective per gradient (handle_grads), or per bucket of small ones (rs_buckets)
    fsdp.core.handle_grads.reduce_scatter = fsdp.comm.collectives.reduce_scatter = reduce_scatter  # type: ignore[assignment]
    here = _nested()
    x = torch.rand(4, 8, generator=torch.Generator().manual_seed(rank))
    for m in (model, here):
        optim = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        m(x).sum().backward()
        optim.step()
    fsdp.core.handle_grads.reduce_scatter = fsdp.comm.collectives.reduce_scatter = real  # type: ignore[assignment]
    mine = {id(g) for g in groups}
    reduced_over = reduced_over[: len(reduced_over) // 2]  # (the model built elsewhere trained first)
    return {
        "set": len(mine) == 4 and all(g is not dist.group.WORLD for g in groups),
        "used": bool(reduced_over) and all(id(g) in mine for g in reduced_over),
        "before": before,
        "same": all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(), here.state_dict().values())
        ),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_model_built_in_another_process_with_a_stand_in_trains_once_given_the_group(
    pool: RankPool, tmp_path: Path
) -> None:
    for rank, r in enumerate(pool.run(_built_elsewhere, str(tmp_path))):
        assert len(r["before"]) == 4 and all("DummyProcessGroup" in b for b in r["before"]), r
        assert r["same"], f"rank {rank}: the model built elsewhere trains as one built here"
        assert r["set"] and r["used"], r  # the groups set after unpickling carry the gradient reductions


# ---------------------------------------------------------------------- attributes set on parameters
class _Scaled(nn.Module):
    """Reads in forward an attribute it set on its own parameter (fairscale keeps the parameter object)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.fc.weight.scale = 0.5  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.fc.weight.scale


class _MevoLM(nn.Module):
    """fairscale's shared-weight MEVO test model, small: MEVO links a trigger parameter to the
    embedding's weight (``trigger._linked_param``)."""

    def __init__(self) -> None:
        super().__init__()
        from fairscale.experimental.nn import MEVO

        self.emb = nn.Embedding(8, 4)
        self.out = MEVO(self.emb.weight, tile_factor=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x), x)


class _Holder(nn.Module):
    """A root above an inner wrapper (as fairscale's tests nest them)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> torch.Tensor:
        return self.inner(*args)  # type: ignore[no-any-return]


class _Mevo(nn.Module):
    """MEVO with a projection of its own (no embedding shares it)."""

    def __init__(self) -> None:
        super().__init__()
        from fairscale.experimental.nn import MEVO

        self.out = MEVO(nn.Parameter(torch.randn(8, 4)), tile_factor=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)
        return self.out(hidden, x)  # type: ignore[no-any-return]


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x).sum().backward()
    optim.step()
    return model.state_dict()


def _attributes_in_forward(flatten: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = _Scaled()
    torch.manual_seed(0)  # (a deepcopy would drop the attribute: torch copies a parameter without it)
    model = FSDP(_Holder(FSDP(_Scaled(), flatten_parameters=flatten)))
    torch.manual_seed(0)
    root = FSDP(_Scaled(), flatten_parameters=flatten)  # (the root's own views too)
    x = torch.randn(2, 3)
    outputs = [model(x), ref(x), root(x)]
    outputs[0].sum().backward()
    outputs[2].sum().backward()
    tokens = torch.tensor([[1, 2, 3]])
    torch.manual_seed(0)
    plain = _step(_Holder(_MevoLM()), tokens)
    torch.manual_seed(0)
    lm = FSDP(_Holder(FSDP(_MevoLM(), flatten_parameters=flatten)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (MEVO reads .grad of a view, which torch warns about)
        trained = _step(lm, tokens)
        torch.manual_seed(0)
        plain_alone = _step(_Mevo(), tokens)
        torch.manual_seed(0)
        alone = _step(FSDP(_Holder(FSDP(_Mevo(), flatten_parameters=flatten))), tokens)
    try:
        lm.module.inner.module.out.trigger.trigger._linked_param + 1  # between steps
        between = "no error"
    except RuntimeError as e:
        between = str(e)
    return {
        "same": all(torch.allclose(out, outputs[1]) for out in outputs),
        "mevo": all(torch.equal(plain[k], trained[k]) for k in plain),
        "untied": all(torch.equal(v, alone[f"inner.{k}"]) for k, v in plain_alone.items()),
        "between": between,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("flatten", [False, True])
def test_attributes_set_on_a_parameter_are_seen_in_forward(pool: RankPool, flatten: bool) -> None:
    """An attribute a module set on its parameter is on what the module sees in forward, as on
    fairscale's parameter objects (it raised AttributeError). One that refers to another parameter
    (fairscale's MEVO: ``trigger._linked_param``) shows that parameter's view in forward, and the
    gradient MEVO sets on it by hand is reduced with the rest: one step equals the plain model's,
    tied to an embedding or not. Between steps it raises, saying why."""
    for r in pool.run(_attributes_in_forward, flatten):
        assert r["same"], r
        assert r["mevo"], "MEVO's step differs from the plain model's"
        assert "'_linked_param'" in r["between"] and "sharded now" in r["between"], r["between"]
        assert r["untied"], "MEVO with a projection of its own steps as in the plain model"


# ---------------------------------------------------------------------- fairscale's forward methods
class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))  # type: ignore[no-any-return]


def _pair(**kwargs: Any) -> FSDP:
    m = _Pair()
    m.a = FSDP(m.a, **kwargs)  # type: ignore[assignment]
    return FSDP(m, **kwargs)


def _forward_methods(reshard_after_forward: bool) -> dict[str, Any]:
    """fairscale's TestHooks and MoE delay test: code that replaces ``_register_pre_backward_hooks``,
    ``_register_post_backward_hooks`` or ``_free_full_params`` on a wrapper sees its forward call them."""
    from unittest import mock

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    mocked = _pair()
    mocked._register_post_backward_hooks = mock.MagicMock(return_value=None)
    mocked._register_pre_backward_hooks = mock.MagicMock(return_value=None)
    before = (mocked._register_post_backward_hooks.called, mocked._register_pre_backward_hooks.called)
    mocked(x)
    after = (mocked._register_post_backward_hooks.called, mocked._register_pre_backward_hooks.called)

    plain, patched = (
        _pair(reshard_after_forward=reshard_after_forward),
        _pair(reshard_after_forward=reshard_after_forward),
    )
    inner = patched.module.a
    original = inner._free_full_params
    calls = []

    def delayed(*args: Any) -> None:
        calls.append(inner.has_full_params)
        original(*args)

    with mock.patch.object(inner, "_free_full_params", delayed):
        for m in (plain, patched):
            m(x).sum().backward()
    inner._free_full_params()  # (called by hand between steps: nothing gathered, nothing to do)
    return {
        "before": before,
        "after": after,
        "calls": calls,
        "same": all(
            torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
            for p, q in zip(plain.parameters(), patched.parameters(), strict=True)
        ),
        "trains_after": patched(x).sum().item() == plain(x).sum().item(),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_the_forward_calls_fairscales_methods_through_the_wrapper(
    pool: RankPool, reshard_after_forward: bool
) -> None:
    for r in pool.run(_forward_methods, reshard_after_forward):
        assert r["before"] == (False, False) and r["after"] == (True, True), r
        # the free after the forward, and (resharding after forward) the one after backward's re-gather
        # goes through the handles directly; without resharding the forward keeps the full parameters
        assert r["calls"] == ([True] if reshard_after_forward else []), r["calls"]
        assert r["same"] and r["trains_after"], r
