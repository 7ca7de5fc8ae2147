"""checkpoint_wrapper on its own and under a one-rank FSDP: batch norms count each batch once."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp.training.activation_checkpoint import checkpoint_wrapper


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


@pytest.mark.parametrize("wrapped", [False, True])
def test_batch_norm_statistics_update_once_per_forward(single_rank_group: None, wrapped: bool) -> None:
    ref = _block()
    block = checkpoint_wrapper(copy.deepcopy(ref))
    model = FSDP(block) if wrapped else block
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        for m in (ref, model):
            m(x).pow(2).mean().backward()
    ours = model.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.allclose(ours[key], value, atol=1e-6), key
    assert int(ours["1.num_batches_tracked"]) == 3


def test_a_checkpointed_module_compiles() -> None:
    ref = _block()
    block = checkpoint_wrapper(copy.deepcopy(ref))
    compiled = torch.compile(block, backend="aot_eager")
    x = torch.randn(8, 4)
    assert torch.allclose(compiled(x), ref(x), atol=1e-6)
    compiled(x).sum().backward()
    assert int(block[1].num_batches_tracked) == 2, "two forwards, two updates: the recomputation adds none"


def test_a_recomputed_wrapper_casts_its_inputs_as_in_forward(single_rank_group: None) -> None:
    """``force_input_to_fp32`` casts bf16 inputs to fp32 in forward; the recomputation in backward
    must cast them again (it used to feed bf16 into the fp32 layers)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model = FSDP(nn.Sequential(checkpoint_wrapper(FSDP(copy.deepcopy(ref), force_input_to_fp32=True))))
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    model(x.clone().requires_grad_()).sum().backward()
    ref(x.float()).sum().backward()
    grads = torch.cat([p.grad for p in model.parameters() if p.grad is not None])
    expected = torch.cat([r.grad.flatten() for r in ref.parameters()])
    torch.testing.assert_close(grads[: expected.numel()], expected)
