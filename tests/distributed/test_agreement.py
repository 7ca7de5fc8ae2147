"""Ranks agree before they communicate: options that decide collectives, the number of wrappers, and
the collective methods, each called on one rank only. Every case raises our error on every rank
within seconds; none hangs or aborts in the backend (a hang fails the task's timeout, an abort
kills the pool and fails as a dead worker)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from fsdp import MixedPrecision, ProcessGroupName, ShardingStrategy
from fsdp.wrap import lambda_auto_wrap_policy
from tests.rank_pool import RankPool


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _two_units(**kwargs: Any) -> FSDP:
    model = _model()
    model[0] = FSDP(model[0], **kwargs)
    model[2] = FSDP(model[2], **kwargs)
    return FSDP(model, **kwargs)


# Each option that decides which collectives a rank issues: (name in the message, rank 0's keyword
# arguments, rank 1's). Rank 0 keeps the defaults where it can.
_FULL = {"sharding_strategy": ShardingStrategy.FULL_SHARD}
OPTIONS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "strategy": ("sharding_strategy", _FULL, {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}),
    "no_shard": ("sharding_strategy", _FULL, {"sharding_strategy": ShardingStrategy.NO_SHARD}),
    # rank 1 would make hybrid groups (a world collective) where rank 0 makes a reduce-scatter group:
    # this hung in dist.new_group before the constructor agreed first
    "hybrid": ("sharding_strategy", _FULL, {"sharding_strategy": ShardingStrategy.HYBRID_SHARD}),
    "reshard_after_forward": ("reshard_after_forward", {}, {"reshard_after_forward": False}),
    "disable_reshard_on_root": ("disable_reshard_on_root", {}, {"disable_reshard_on_root": False}),
    "mixed_precision": ("mixed_precision", {}, {"mixed_precision": True, "compute_dtype": torch.bfloat16}),
    "param_dtype": (
        "mixed_precision",
        {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)},
        {"mixed_precision": MixedPrecision(param_dtype=torch.float16)},
    ),
    "reduce_dtype": (
        "mixed_precision",
        {"mixed_precision": MixedPrecision(reduce_dtype=torch.float32)},
        {"mixed_precision": MixedPrecision(reduce_dtype=torch.bfloat16)},
    ),
    "fp32_reduce_scatter": (
        "fp32_reduce_scatter",
        {"mixed_precision": True, "compute_dtype": torch.bfloat16},
        {"mixed_precision": True, "compute_dtype": torch.bfloat16, "fp32_reduce_scatter": True},
    ),
    "flatten_parameters": ("flatten_parameters", {}, {"flatten_parameters": False}),
    "use_orig_params": ("flatten_parameters", {}, {"use_orig_params": True}),
    "bucket_cap_mb": ("bucket_cap_mb", {}, {"bucket_cap_mb": 0}),
    "backward_prefetch": ("backward_prefetch", {}, {"backward_prefetch": False}),
    "forward_prefetch": ("forward_prefetch", {}, {"forward_prefetch": False}),
    "cpu_offload": ("move_params_to_cpu", {}, {"move_params_to_cpu": True}),
    "gradient_predivide_factor": ("gradient_predivide_factor", {}, {"gradient_predivide_factor": 2.0}),
    "reduce_scatter_group": (
        "process_group_reduce_scatter",
        {},
        {"process_group_reduce_scatter": ProcessGroupName.default},
    ),
    "sync_module_states": ("sync_module_states", {}, {"sync_module_states": True}),
    "no_broadcast_optim_state": ("no_broadcast_optim_state", {}, {"no_broadcast_optim_state": True}),
}


def _different_options(case: str) -> tuple[str, float]:
    _, first, other = OPTIONS[case]
    kwargs = first if dist.get_rank() == 0 else other
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # (HYBRID_SHARD without groups: shard within each "node")
    start = time.perf_counter()
    try:
        _two_units(**kwargs)
    except ValueError as e:
        return str(e), time.perf_counter() - start
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    return "no error", 0.0


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_ranks_with_different_options_fail_at_construction(pool: RankPool, case: str) -> None:
    option = OPTIONS[case][0]
    for rank, (msg, seconds) in enumerate(pool.run(_different_options, case, timeout=60)):
        assert "the ranks construct wrappers with different options" in msg, (rank, msg)
        line = next((x for x in msg.splitlines() if x.strip().startswith(f"{option}:")), "")
        assert "on rank 0" in line and "on rank 1" in line, (rank, msg)  # each rank's value, by name
        assert seconds < 10, seconds


def _different_hybrid_groups() -> str:
    """HYBRID_SHARD with (shard, replicate) groups of other sizes on half of the ranks."""
    from fsdp.comm.collectives import hybrid_groups

    pairs = [hybrid_groups(1), hybrid_groups(2)]  # (every rank makes every group)
    pair = pairs[0] if dist.get_rank() < 2 else pairs[1]
    try:
        FSDP(_model(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=pair)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [4], indirect=True)
def test_ranks_with_different_hybrid_group_sizes_fail_at_construction(pool: RankPool) -> None:
    for msg in pool.run(_different_hybrid_groups, timeout=60):
        assert (
            "process_group: (a group of 1 ranks, a group of 4 ranks) on ranks 0, 1; "
            "(a group of 2 ranks, a group of 2 ranks) on ranks 2, 3"
        ) in msg, msg


def _different_number_of_wrappers() -> str:
    """Rank 0's policy wraps every Linear, rank 1's none: the root's options agree, then rank 0's
    first inner construction meets rank 1's first forward."""
    wraps = dist.get_rank() == 0
    policy = lambda_auto_wrap_policy(lambda m: wraps and isinstance(m, nn.Linear))
    try:
        model = FSDP(_model(), auto_wrap_policy=policy)
        model(torch.randn(2, 8))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_ranks_that_build_a_different_number_of_wrappers_fail(pool: RankPool) -> None:
    for msg in pool.run(_different_number_of_wrappers, timeout=60):
        assert "the ranks are not making the same call" in msg, msg
        assert "the construction of a wrapper on rank 0" in msg, msg
        assert "the first use of the root (its lazy init) on rank 1" in msg, msg
        assert "ranks that build a different number of wrappers meet here" in msg, msg


# ---------------------------------------------------------------------- a collective method on one rank
def _train_step(model: FSDP, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _call(method: str, model: FSDP, opt: torch.optim.Optimizer, tmp: str) -> Any:
    if method == "state_dict":
        return model.state_dict()
    if method == "load_state_dict":
        return model.load_state_dict(_saved_state)
    if method == "summon_full_params":
        with model.summon_full_params():
            return None
    if method == "sharded_state_dict":
        return model.sharded_state_dict()
    if method == "gather_full_optim_state_dict":
        return model.gather_full_optim_state_dict(opt)
    if method == "full_optim_state_dict":
        return FSDP.full_optim_state_dict(model, opt)
    if method == "clip_grad_norm_":
        return model.clip_grad_norm_(1.0)
    if method == "save_checkpoint":
        return fsdp.save_checkpoint(Path(tmp) / "one_rank", model, opt)
    if method == "load_checkpoint":
        return fsdp.load_checkpoint(Path(tmp) / "both", model, opt)
    if method == "scaler_step":
        scaler = fsdp.ShardedGradScaler()
        scaler.scale(torch.ones(()))  # (what a loss would be)
        return scaler.step(opt)
    raise AssertionError(method)


_saved_state: dict[str, Any] = {}

# the name each method's handshake gives
ENTERED = {
    "state_dict": "state_dict()",
    "load_state_dict": "load_state_dict()",
    "summon_full_params": "summon_full_params()",
    "sharded_state_dict": "sharded_state_dict()",
    "gather_full_optim_state_dict": "gather_full_optim_state_dict()",
    "full_optim_state_dict": "full_optim_state_dict()",
    "clip_grad_norm_": "clip_grad_norm_()",
    "save_checkpoint": "save_checkpoint()",
    "load_checkpoint": "load_checkpoint()",
    "scaler_step": "ShardedGradScaler's inf/nan check (unscale_() or step())",
}


def _one_rank_calls(method: str, when: str, tmp: str) -> tuple[str, float]:
    """Rank 0 calls ``method`` alone; rank 1 goes on training: at its next step (``when="between"``),
    or in the backward of a step whose forward both ranks ran (``"mid_step"``)."""
    model = _two_units()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, opt)
    if method == "load_state_dict":
        _saved_state.clear()
        _saved_state.update(model.state_dict())
    if method == "load_checkpoint":
        fsdp.save_checkpoint(Path(tmp) / "both", model, opt)
    start = time.perf_counter()
    try:
        if when == "mid_step":
            loss = model(torch.randn(4, 8)).pow(2).mean()
            if dist.get_rank() == 0:
                _call(method, model, opt, tmp)
            loss.backward()
        elif dist.get_rank() == 0:
            _call(method, model, opt, tmp)
        else:
            _train_step(model, opt)
    except RuntimeError as e:
        return str(e), time.perf_counter() - start
    return "no error", 0.0


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("when", ["between", "mid_step"])
@pytest.mark.parametrize("method", sorted(ENTERED))
def test_a_collective_method_on_one_rank_fails_on_every_rank(
    pool: RankPool, method: str, when: str, tmp_path: Path
) -> None:
    results = pool.run(_one_rank_calls, method, when, str(tmp_path), timeout=60)
    other = "the forward of the root" if when == "between" else "the backward of the root"
    for rank, (msg, seconds) in enumerate(results):
        assert "the ranks are not making the same call" in msg, (rank, msg)
        assert f"{ENTERED[method]} on rank 0" in msg and f"{other} on rank 1" in msg, (rank, msg)
        assert seconds < 10, seconds


def _different_modes(how: str) -> str:
    model = _two_units()
    model(torch.randn(4, 8)).sum().backward()
    try:
        if how == "no_grad":  # rank 0 evaluates while rank 1 trains
            with torch.no_grad() if dist.get_rank() == 0 else torch.enable_grad():
                model(torch.randn(4, 8))
        elif how == "no_sync":  # rank 1 accumulates while rank 0 reduces: the backwards differ
            loss = model(torch.randn(4, 8)).sum() if dist.get_rank() == 0 else None
            if dist.get_rank() == 1:
                with model.no_sync():
                    model(torch.randn(4, 8)).sum().backward()
            else:
                assert loss is not None
                loss.backward()
        elif how == "clip_norm_type":  # SUM on one rank and MAX on the other would clip silently apart
            model.clip_grad_norm_(1.0, norm_type=2.0 if dist.get_rank() == 0 else float("inf"))
        else:  # the same call with another max_norm
            model.clip_grad_norm_(1.0 + dist.get_rank())
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("how", ["no_grad", "no_sync", "clip_max_norm", "clip_norm_type"])
def test_ranks_in_different_modes_or_with_different_arguments_fail(pool: RankPool, how: str) -> None:
    expected = {
        "no_grad": "RuntimeError: FullyShardedDataParallel: the ranks run the forward of the root differently "
        "(every rank must run it in the same mode, since the mode decides what is gathered, kept and "
        "reduced):\n  torch.is_grad_enabled(): False on rank 0; True on rank 1",
        "no_sync": "the ranks run the forward of the root differently",
        "clip_max_norm": "ValueError: FullyShardedDataParallel: the ranks called clip_grad_norm_() with different "
        "arguments (every rank must pass the same):\n  max_norm: 1.0 on rank 0; 2.0 on rank 1",
        "clip_norm_type": "ValueError: FullyShardedDataParallel: the ranks called clip_grad_norm_() with "
        "different arguments (every rank must pass the same):\n  norm_type: 2.0 on rank 0; inf on rank 1",
    }[how]
    for msg in pool.run(_different_modes, how, timeout=60):
        assert expected in msg, msg
        if how == "no_sync":
            assert "inside no_sync(): False on rank 0; True on rank 1" in msg, msg


def _different_models() -> str:
    """Two models trained in turn (a GAN's two halves, say); rank 1 runs them in the other order."""
    first, second = _two_units(), FSDP(nn.Sequential(FSDP(nn.Linear(8, 3)), nn.Linear(3, 2)))
    for model in (first, second):  # the first use of each, in the same order
        model(torch.randn(2, 8))
    try:
        (first if dist.get_rank() == 0 else second)(torch.randn(2, 8))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_ranks_running_different_models_fail(pool: RankPool) -> None:
    for msg in pool.run(_different_models, timeout=60):
        assert "in the forward of the root, the ranks run different wrapped models" in msg, msg
        assert "rank 0: <root> [Sequential]" in msg and "rank 1: <root> [Sequential]" in msg, msg


def _requires_grad_on_one_rank(step: str) -> str:
    """Between steps rank 1 alone freezes a parameter (``flatten_parameters=False``: each parameter its
    own flat parameter): its backward would reduce one flat parameter fewer. Before the fix the
    end-of-backward check itself, sized by the parameters that require a gradient, aborted in gloo."""
    model = _two_units(flatten_parameters=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    if dist.get_rank() == 1:
        model._fsdp_wrapped_module[4].weight.requires_grad_(False)
    try:
        out = model(torch.randn(4, 8))
        if step == "backward":
            out.sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_parameter_frozen_on_one_rank_fails_on_every_rank(pool: RankPool) -> None:
    for msg in pool.run(_requires_grad_on_one_rank, "backward", timeout=60):
        assert "the ranks run the forward of the root differently" in msg, msg
        assert "the parameters that require no gradient: none on rank 0; ['4.weight'] on rank 1" in msg, msg


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = FSDP(nn.Linear(8, 8)), FSDP(nn.Linear(8, 8)), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        x = self.a(x)
        return self.c(x if skip else self.b(x))


def _one_rank_skips_a_unit(mode: str) -> list[str]:
    """The issue's case: in eval under no_grad, rank 1 skips a wrapped block (before, its all-gather met
    rank 0's of another unit and gloo aborted the process); and the same in training, and where the
    skipped unit is the last one (no later all-gather to meet)."""
    model = FSDP(_Branchy())
    model(torch.randn(2, 8)).sum().backward()
    if mode == "eval":
        model.eval()
    errors = []
    for _ in range(2):  # the next forward still works after the error
        try:
            with torch.no_grad() if mode == "eval" else contextlib.nullcontext():
                out = model(torch.randn(2, 8), skip=dist.get_rank() == 1)
                if mode == "train":
                    out.sum().backward()
            errors.append("no error")
        except RuntimeError as e:
            errors.append(str(e))
    model(torch.randn(2, 8))  # every rank the same: fine again
    return errors


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_unit_skipped_on_one_rank_fails_on_every_rank(pool: RankPool, mode: str) -> None:
    for errors in pool.run(_one_rank_skips_a_unit, mode, timeout=60):
        for msg in errors:
            assert (
                "the forward of a wrapped unit on rank 0; the end of the forward of the root on rank 1" in msg
            ), msg
            assert "some ranks run a wrapped module that others skip" in msg, msg


def _unit_handshakes(env: str | None) -> int:
    """How many handshakes of units one forward of a three-unit model makes."""
    import fsdp.comm.consistency as consistency

    before = os.environ.pop("FSDP_CHECK_UNITS", None)
    if env is not None:
        os.environ["FSDP_CHECK_UNITS"] = env
    try:
        model = FSDP(_Branchy())  # (two units under the root)
        model(torch.randn(2, 8))
    finally:
        os.environ.pop("FSDP_CHECK_UNITS", None)
        if before is not None:
            os.environ["FSDP_CHECK_UNITS"] = before
    seen: list[str] = []
    real = consistency.agree_on_entry

    def counting(group: Any, op: str, *args: Any, **kwargs: Any) -> None:
        seen.append(op)
        real(group, op, *args, **kwargs)

    consistency.agree_on_entry = counting  # type: ignore[assignment]
    try:
        model(torch.randn(2, 8))
    finally:
        consistency.agree_on_entry = real  # type: ignore[assignment]
    return seen.count(consistency.UNIT_FORWARD)


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_fsdp_check_units_0_turns_the_unit_handshakes_off(pool: RankPool) -> None:
    assert pool.run(_unit_handshakes, None) == [2, 2]
    assert pool.run(_unit_handshakes, "1") == [2, 2]
    assert pool.run(_unit_handshakes, "0") == [0, 0]
