"""auto_wrap_bn: batch-norm layers keep fp32 weights and statistics inside a mixed-precision model."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import MixedPrecision, auto_wrap_bn, config_auto_wrap_policy, enable_wrap, wrap

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fairscale.nn.data_parallel import auto_wrap_bn as fairscale_auto_wrap_bn


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_signature_matches_fairscale() -> None:
    ours = [(p.name, p.default) for p in inspect.signature(auto_wrap_bn).parameters.values()]
    theirs = [(p.name, p.default) for p in inspect.signature(fairscale_auto_wrap_bn).parameters.values()]
    assert ours == theirs


def test_batch_norm_trains_in_fp32_inside_a_bf16_model_exactly_as_cast_by_hand(
    single_rank_group: None,
) -> None:
    plain = _net()
    master = copy.deepcopy(plain)  # fp32 weights, stepped by hand below
    model = FSDP(auto_wrap_bn(plain), mixed_precision=True, compute_dtype=torch.bfloat16)
    inner = model.module[1]
    assert isinstance(inner, FSDP) and inner.mixed_precision is False and inner.flatten_parameters is False
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    master_opt = torch.optim.SGD(master.parameters(), lr=0.5)
    for step in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        # reference: linear layers computed in bf16 from the fp32 masters, batch norm in fp32
        compute = copy.deepcopy(master)
        for i in (0, 3):
            compute[i].to(torch.bfloat16)
        ref_out = compute(x.to(torch.bfloat16))
        ref_out.float().sum().backward()
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad = c.grad.float()
        master_opt.step()
        master_opt.zero_grad()
        for mine, theirs in zip(master.buffers(), compute.buffers()):
            mine.copy_(theirs)  # the running statistics

        out = model(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out)
        out.float().sum().backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    assert state["1.weight"].dtype == torch.float32 and state["1.running_var"].dtype == torch.float32
    for key, value in master.state_dict().items():
        assert torch.equal(state[key], value), key


def test_without_it_bf16_weights_meet_fp32_statistics_and_fail(single_rank_group: None) -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="expected scalar type"):
        FSDP(_net(), mixed_precision=mp)(torch.randn(6, 4))
    FSDP(auto_wrap_bn(_net()), mixed_precision=mp)(torch.randn(6, 4))  # the fix


def test_tags_collisions_overrides_and_refusals(single_rank_group: None) -> None:
    tagged = auto_wrap_bn(_net(), wrap_it=False)
    assert not any(isinstance(m, FSDP) for m in tagged.modules())
    assert tagged[1].wrapper_config["mixed_precision"] is False  # type: ignore[index]
    with pytest.raises(ValueError, match="'1' already has a wrapper_config"):
        auto_wrap_bn(tagged)
    with enable_wrap(config_auto_wrap_policy, wrapper_cls=FSDP):
        from fsdp import auto_wrap

        wrapped = auto_wrap(tagged)  # the tags alone drive config_auto_wrap_policy
    assert isinstance(wrapped[1], FSDP) and wrapped[1].reshard_after_forward is False

    custom = auto_wrap_bn(_net(), fsdp_config={"mixed_precision": False, "flatten_parameters": True})
    assert custom[1].flatten_parameters is True
    assert isinstance(auto_wrap_bn(nn.SyncBatchNorm(3)), FSDP), "a layer itself is returned wrapped"
    with pytest.raises(NotImplementedError, match="would never be averaged"):
        auto_wrap_bn(_net(), single_rank_pg=True)

    with enable_wrap(wrapper_cls=FSDP):  # works inside an enable_wrap context too
        net = _net()
        net[0] = wrap(net[0])
        auto_wrap_bn(net)
    assert isinstance(net[0], FSDP) and isinstance(net[1], FSDP)


def test_modules_tagged_before_the_call_are_wrapped_too(single_rank_group: None) -> None:
    """As fairscale's: the wrap pass is config_auto_wrap_policy's, so a module a user tagged with
    a wrapper_config beforehand is wrapped with its own kwargs, beside the batch norms."""
    net = _net()
    net[3].wrapper_config = {"reshard_after_forward": False, "flatten_parameters": False}
    wrapped = auto_wrap_bn(net)
    assert isinstance(wrapped[1], FSDP) and isinstance(wrapped[3], FSDP) and not isinstance(wrapped[0], FSDP)
    assert wrapped[3].reshard_after_forward is False and wrapped[3].flatten_parameters is False
    assert wrapped[1].mixed_precision is False
