"""torch FSDP1's option attributes and ``FSDP_USE_FULL_PREC_IN_EVAL`` on a wrapper built torch's way.

Follows the attribute checks of torch's ``test_wrap.py`` (``_check_cpu_offload``,
``_check_backward_prefetch``), ``test_fsdp_mixed_precision.py`` (``model.mixed_precision`` equal to
the ``MixedPrecision`` given, the full-precision batch-norm wrappers' ``MixedPrecision()``,
``test_full_precision_in_eval*``, ``test_eval_root_cast_inputs``) and ``test_fsdp_misc.py``
(``test_homogeneous_attributes`` for the environment variable).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from fsdp.wrap import ModuleWrapPolicy
from tests.rank_pool import RankPool

BF16, F32 = torch.bfloat16, torch.float32
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


class _TwoRanks:
    """A stand-in group of two ranks (torch's ``DummyProcessGroup(rank=0, size=2)``): at one rank every
    strategy becomes ``NO_SHARD``, as in torch."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharding_strategy_equals_torchs_member(single_rank_group: None, strategy: str) -> None:
    model = FSDP(
        nn.Linear(2, 2),
        process_group=_TwoRanks(),
        sharding_strategy=getattr(torch_fsdp.ShardingStrategy, strategy),
    )
    assert model.sharding_strategy == getattr(torch_fsdp.ShardingStrategy, strategy)
    assert getattr(torch_fsdp.ShardingStrategy, strategy) == model.sharding_strategy
    assert model.sharding_strategy is getattr(fsdp.ShardingStrategy, strategy)
    others = [getattr(torch_fsdp.ShardingStrategy, s) for s in STRATEGIES if s != strategy]
    assert all(model.sharding_strategy != o for o in others)
    assert {model.sharding_strategy: 1}.get(getattr(torch_fsdp.ShardingStrategy, strategy)) == 1, (
        "hashes alike"
    )


@pytest.mark.parametrize("lib", ["torch", "fsdp"])
def test_a_wrapper_built_torchs_way_shows_torchs_option_objects(single_rank_group: None, lib: str) -> None:
    """torch's ``_check_cpu_offload`` / ``_check_backward_prefetch`` and the mixed precision tests'
    ``model.mixed_precision == mp_config``, with torch's objects or ours."""
    opts: Any = torch_fsdp if lib == "torch" else fsdp
    mp = opts.MixedPrecision(param_dtype=BF16, reduce_dtype=F32)
    model = FSDP(
        nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)),
        mixed_precision=mp,
        cpu_offload=opts.CPUOffload(offload_params=False),
        backward_prefetch=opts.BackwardPrefetch.BACKWARD_POST,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    for w in FSDP.fsdp_modules(model):
        assert w.cpu_offload == torch_fsdp.CPUOffload(offload_params=False)
        assert w.cpu_offload.offload_params is False
        assert w.backward_prefetch == torch_fsdp.BackwardPrefetch.BACKWARD_POST
    assert model.mixed_precision == torch_fsdp.MixedPrecision(param_dtype=BF16, reduce_dtype=F32)
    assert model.mixed_precision.param_dtype == BF16 and model.mixed_precision
    bn = model.module[1]
    assert isinstance(bn, FSDP), "batch norm got a full-precision wrapper of its own"
    assert bn.mixed_precision == torch_fsdp.MixedPrecision(), "torch shows MixedPrecision() there"
    assert not bn.mixed_precision, "and it casts nothing, as fairscale's False says"


def test_torch_style_defaults_and_fairscale_style_bools(single_rank_group: None) -> None:
    """Without an option object, a wrapper given a torch-only argument shows torch's defaults; one
    built with fairscale's arguments keeps fairscale's bools (and a fairscale bool given to a torch
    style call keeps its meaning)."""
    torch_way = FSDP(nn.Linear(2, 2), sharding_strategy=torch_fsdp.ShardingStrategy.FULL_SHARD)
    assert torch_way.mixed_precision == torch_fsdp.MixedPrecision()
    assert torch_way.cpu_offload == torch_fsdp.CPUOffload(offload_params=False)
    assert torch_way.backward_prefetch == torch_fsdp.BackwardPrefetch.BACKWARD_PRE
    fairscale_way = FSDP(nn.Linear(2, 2), mixed_precision=True, move_params_to_cpu=False)
    assert fairscale_way.mixed_precision is True and fairscale_way.cpu_offload is False
    assert FSDP(nn.Linear(2, 2), backward_prefetch=False).backward_prefetch is None
    mixed = FSDP(nn.Linear(2, 2), mixed_precision=True, sharding_strategy=fsdp.ShardingStrategy.NO_SHARD)
    assert mixed.mixed_precision is True and mixed.cpu_offload == fsdp.CPUOffload()


def _shows_torch_style(w: FSDP) -> bool:
    """Whether every difference between the two libraries follows torch on ``w`` (and none does otherwise)."""
    torch_module = w.module is w._fsdp_wrapped_module
    flat = [name for name, _ in w.named_parameters(recurse=False)]
    torch_names = all(n == "_fsdp_wrapped_module._flat_param" for n in flat) if flat else torch_module
    torch_objects = isinstance(w.mixed_precision, fsdp.MixedPrecision) and isinstance(
        w.cpu_offload, fsdp.CPUOffload
    )
    assert torch_module == torch_names == torch_objects, (torch_module, flat, torch_objects)
    return torch_module


def test_one_decision_says_which_library_a_wrapper_follows(single_rank_group: None) -> None:
    """``model.module``, the flat parameters' names and the option attributes follow one decision:
    every torch-only argument counts (``limit_all_gathers=False`` too), and the wrappers an
    ``auto_wrap_policy`` builds are torch's like their root."""
    policy = FSDP(
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
    )
    wrappers = FSDP.fsdp_modules(policy)
    assert len(wrappers) == 3 and all(_shows_torch_style(w) for w in wrappers)
    assert wrappers[1].mixed_precision == torch_fsdp.MixedPrecision()
    assert wrappers[1].cpu_offload == torch_fsdp.CPUOffload(offload_params=False)
    assert _shows_torch_style(FSDP(nn.Linear(2, 2), limit_all_gathers=False))
    assert _shows_torch_style(FSDP(nn.Linear(2, 2), forward_prefetch=False))
    assert _shows_torch_style(FSDP(nn.Linear(2, 2), mixed_precision=None))
    assert not _shows_torch_style(FSDP(nn.Linear(2, 2), mixed_precision=False, cpu_offload=False))
    assert not _shows_torch_style(FSDP(nn.Linear(2, 2), backward_prefetch=True, limit_all_gathers=True))


@contextlib.contextmanager
def _full_prec_in_eval(value: str | None) -> Iterator[None]:
    before = os.environ.pop("FSDP_USE_FULL_PREC_IN_EVAL", None)
    if value is not None:
        os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = value
    try:
        yield
    finally:
        os.environ.pop("FSDP_USE_FULL_PREC_IN_EVAL", None)
        if before is not None:
            os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = before


class _Probe(nn.Module):
    """Records the dtypes its forward sees: input, weight, running mean."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, self.fc.weight.dtype, self.bn.running_mean.dtype))
        return self.bn(self.fc(x))


def _reduced_dtypes(backward: Any) -> set[torch.dtype]:
    """The dtypes of the gradients reduce-scattered while ``backward()`` runs."""
    import fsdp.comm.collectives as collectives
    import fsdp.core.handle_grads as handle_grads

    real, seen = collectives.reduce_scatter, set()

    def reduce_scatter(out: Any, full: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.add(full.dtype)
        return real(out, full, *args, **kwargs)

    collectives.reduce_scatter = handle_grads.reduce_scatter = reduce_scatter  # type: ignore[assignment]
    try:
        backward()
    finally:
        collectives.reduce_scatter = handle_grads.reduce_scatter = real  # type: ignore[assignment]
    return seen


def _precision_in_eval(env: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = _Probe()
    mp = torch_fsdp.MixedPrecision(param_dtype=BF16, reduce_dtype=BF16, buffer_dtype=BF16)
    with _full_prec_in_eval(env):
        model = FSDP(_Probe(), mixed_precision=mp)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    model.train()
    model(x).float().sum().backward()
    # the reference's weights and statistics (mean 0, variance 1: exact in bf16 buffers too)
    model.load_state_dict(ref.state_dict())
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, expected = model(x), ref(x)
    buffer_after_eval = model.module.bn.running_mean.dtype
    model.zero_grad()
    with_grad = model(x)  # eval with gradients enabled, and its backward (torch's test_eval_root_cast_inputs)
    wire = _reduced_dtypes(lambda: with_grad.float().sum().backward())
    ref(x).sum().backward()
    grads = [(p.grad.dtype, p.grad.shape) for p in model.parameters() if p.grad is not None]
    with FSDP.summon_full_params(model, with_grads=True):
        grad_error = max(  # relative to the largest gradient of the tensor
            ((p.grad.float() - q.grad).abs().max() / q.grad.abs().max()).item()
            for p, q in zip(model.module.parameters(), ref.parameters(), strict=True)
        )
    model.train()
    model(x)
    return {
        "seen": model.module.seen,
        "out_dtype": out.dtype,
        "with_grad_dtype": with_grad.dtype,
        "error": (out.float() - expected).abs().max().item(),
        "grad_error": grad_error,
        "wire": wire,
        "grads": grads,
        "buffer_after_eval": buffer_after_eval,
        "buffer_after_train": model.module.bn.running_mean.dtype,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("env", ["1", None, "0"])  # torch turns it on for "1" only
def test_full_precision_in_eval(pool: RankPool, env: str | None) -> None:
    """torch's ``test_full_precision_in_eval``, ``_buffers`` and ``test_eval_root_cast_inputs``: with the
    variable set, an eval-mode forward computes in fp32 (parameters, buffers, the root's input uncast),
    with gradients enabled too, and matches the fp32 model, its backward as well; the buffers stay in
    their own dtype until a forward in training mode casts them back. Training, and eval without the
    variable, run in bf16."""
    for r in pool.run(_precision_in_eval, env):
        train, eval_, eval_grad, train_again = r["seen"]
        assert train == train_again == (BF16, BF16, BF16)
        assert r["buffer_after_train"] == BF16, "a forward in training mode casts the buffers back"
        assert r["grads"] and all(dtype == F32 for dtype, _ in r["grads"]), r["grads"]
        if env == "1":
            assert eval_ == eval_grad == (F32, F32, F32)
            assert r["out_dtype"] == r["with_grad_dtype"] == F32 and r["error"] < 1e-5, r
            assert r["buffer_after_eval"] == F32, "torch keeps them in full precision after an eval forward"
            assert r["grad_error"] < 1e-5, r
            assert r["wire"] == {F32}, "reduced in full precision, as torch (it was reduced in bf16)"
        else:
            assert eval_ == eval_grad == (BF16, BF16, BF16)
            assert r["out_dtype"] == r["with_grad_dtype"] == BF16 and r["error"] > 1e-4, r
            assert r["buffer_after_eval"] == BF16
            assert r["wire"] == {BF16}, r["wire"]


def test_full_precision_in_eval_is_one_value_for_the_tree(single_rank_group: None) -> None:
    """torch's ``test_homogeneous_attributes`` for ``_use_full_prec_in_eval``."""
    mp = fsdp.MixedPrecision(param_dtype=BF16)
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    net[1] = FSDP(net[1], mixed_precision=mp)
    with _full_prec_in_eval("1"):
        model = FSDP(net, mixed_precision=mp)
    with pytest.raises(ValueError, match="FSDP_USE_FULL_PREC_IN_EVAL=1 was set when 1 of the 2 wrappers"):
        model(torch.randn(1, 2))


def test_summon_with_rank0_only_and_writeback_is_refused_in_torchs_words(single_rank_group: None) -> None:
    """torch's ``test_rank0_only_with_writeback_raises`` (and ``test_offload_to_cpu_no_shard_raises``,
    which makes the same call under ``NO_SHARD``)."""
    for strategy in (torch_fsdp.ShardingStrategy.FULL_SHARD, torch_fsdp.ShardingStrategy.NO_SHARD):
        model = FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), sharding_strategy=strategy)
        with pytest.raises(NotImplementedError, match="is not supported"):
            with FSDP.summon_full_params(model, rank0_only=True, writeback=True):
                pass


class _Swapped(nn.Module):
    """torch's ``test_invalid_first_iter_order``: the ranks run two wrapped layers in opposite orders."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = FSDP(nn.Linear(4, 4)), FSDP(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.a, self.b) if torch.distributed.get_rank() == 0 else (self.b, self.a)
        return second(first(x))  # type: ignore[no-any-return]


def _error_of(step: Any) -> str:
    """The message of the ``RuntimeError`` that ``step()`` raises, or "no error"."""
    try:
        step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _run_in_opposite_orders() -> str:
    model = FSDP(_Swapped())
    return _error_of(lambda: model(torch.randn(2, 4)).sum().backward())


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_units_run_in_another_order_on_some_ranks_fail_in_torchs_words(pool: RankPool) -> None:
    for msg in pool.run(_run_in_opposite_orders, timeout=60):
        assert msg.startswith("Forward order differs across ranks"), msg


def test_clip_grad_norm_on_an_inner_wrapper_is_refused_in_torchs_words(single_rank_group: None) -> None:
    """torch's ``test_non_root``: clipping through an inner wrapper raises its sentence."""
    model = FSDP(nn.Sequential(FSDP(nn.Linear(3, 3)), nn.Linear(3, 3)))
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="should only be called on the root FSDP instance"):
        model.module[0].clip_grad_norm_(1.0)
    assert model.clip_grad_norm_(1.0) > 0  # (the root clips)


def _torch_optimizer_in_backward_flat() -> str:
    from torch.distributed.optim import _apply_optimizer_in_backward

    model = FSDP(
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
    )
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.03}, register_hook=False)
    return _error_of(lambda: model(torch.randn(2, 2)).sum().backward())


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_torchs_private_optimizer_in_backward_on_flat_parameters_is_refused(pool: RankPool) -> None:
    """torch's ``test_fsdp_optim_overlap_no_use_orig_params_error`` (its words): a flat parameter of
    several originals cannot step with one optimizer per original; refused at the forward with what to
    use instead."""
    for message in pool.run(_torch_optimizer_in_backward_flat):
        assert "only supported with use_orig_params=True" in message, message
        assert "fsdp.optimizer_in_backward(model" in message, message


def _torch_optimizer_in_backward_parity(offload: bool, register_hook: bool, strategy: str) -> list[int]:
    from torch.distributed.optim import _apply_optimizer_in_backward

    def build() -> nn.Module:
        torch.manual_seed(0)
        return FSDP(
            nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=True,
            sharding_strategy=getattr(torch_fsdp.ShardingStrategy, strategy),
            cpu_offload=torch_fsdp.CPUOffload(offload_params=offload),
        )

    usual, overlap = build(), build()
    optim = torch.optim.SGD(usual.parameters(), lr=0.03, momentum=0.9)
    _apply_optimizer_in_backward(
        torch.optim.SGD, overlap.parameters(), {"lr": 0.03, "momentum": 0.9}, register_hook=register_hook
    )
    torch.manual_seed(1 + torch.distributed.get_rank())
    changed = []
    for _ in range(3):
        x = torch.randn(5, 4)
        before = [p.detach().clone() for p in overlap.parameters()]
        usual(x).sum().backward()
        overlap(x).sum().backward()  # each parameter steps here
        assert all(p.grad is None for p in overlap.parameters()), "the gradients were not consumed"
        assert all(h.sharded_grad is None for w in FSDP.fsdp_modules(overlap) for h in w._handles)
        changed.append(sum(not torch.equal(b, p) for b, p in zip(before, overlap.parameters())))
        optim.step()
        optim.zero_grad()
        for p, q in zip(usual.parameters(), overlap.parameters(), strict=True):
            assert torch.equal(p, q), "the step in backward differs from the usual one"
    return changed


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    ("offload", "register_hook", "strategy"),
    [
        (False, False, "FULL_SHARD"),
        (True, False, "FULL_SHARD"),
        (False, True, "SHARD_GRAD_OP"),
        (False, False, "NO_SHARD"),
    ],
)
def test_torchs_private_optimizer_in_backward_steps_like_the_usual_optimizer(
    pool: RankPool, offload: bool, register_hook: bool, strategy: str
) -> None:
    """torch's ``test_fsdp_optimizer_overlap``: with ``use_orig_params=True`` the optimizers torch's
    ``_apply_optimizer_in_backward`` attached step each parameter in backward, right after its gradient
    is reduced, and free the gradient (torch's ``handle.sharded_grad`` None); the parameters equal those
    of a usual optimizer's step, bit for bit, with CPU offload and with torch's own hook registered."""
    for changed in pool.run(_torch_optimizer_in_backward_parity, offload, register_hook, strategy):
        assert all(n > 0 for n in changed), changed  # (parameters stepped in every backward)
