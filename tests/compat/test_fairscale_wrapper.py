"""fairscale's wrapper as its users meet it: the scenarios of fairscale 0.4.13's
``tests/nn/data_parallel/test_fsdp*.py`` and ``tests/nn/checkpoint``, and of fairseq's use of it,
with the one import changed.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

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
