"""The bucket engine on its own: layout learning and encoding, and one rank's reduce protocol."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp.comm.buckets import (
    BucketConfig,
    BucketLayout,
    GradBucketer,
    MissingGradientError,
    layout_by_dtype,
    learn_layout,
)
from fsdp.common.device import DeviceHandle


def _t(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def test_learn_layout_closes_buckets_by_size_per_dtype() -> None:
    ts = [_t(6), _t(2), _t(6, torch.bfloat16), _t(3), _t(1, torch.bfloat16)]
    # ready order: 2 (bf16, 6 >= 4: closes alone), 1 (fp32, 2), 0 (fp32, 8: closes), 3, 4 (left open)
    layout = learn_layout(ts, [2, 1, 0, 3, 4], message_size=4)
    assert layout.buckets == ((2,), (1, 0), (3,), (4,))


def test_learn_layout_appends_tensors_that_got_no_gradient() -> None:
    ts = [_t(5), _t(5), _t(5)]
    assert learn_layout(ts, [2], message_size=100).buckets == ((2, 0, 1),)
    assert learn_layout(ts, [2, 2], message_size=5).buckets == ((2,), (0,), (1,))


def test_learn_layout_with_triggers_ignores_message_size() -> None:
    ts = [_t(100)] * 4
    assert learn_layout(ts, [3, 2, 1, 0], message_size=1, triggers={2}).buckets == ((3, 2), (1, 0))


def test_layout_by_dtype_is_one_bucket_per_dtype_in_index_order() -> None:
    ts = [_t(1), _t(1, torch.float16), _t(1), _t(1, torch.bfloat16)]
    assert layout_by_dtype(ts).buckets == ((0, 2), (1,), (3,))


def test_layout_encoding_round_trips_at_a_fixed_length() -> None:
    layout = BucketLayout(((3, 1), (0,), (2, 4)))
    encoded = layout.encode(5)
    assert encoded.shape == (11,)
    assert BucketLayout.decode(encoded) == layout


def test_layout_check_names_what_does_not_fit() -> None:
    ts = [_t(1), _t(1, torch.float16)]
    with pytest.raises(RuntimeError, match="same model"):
        BucketLayout(((0,),)).check(ts, ["a", "b"])
    with pytest.raises(RuntimeError, match="dtypes must be the same"):
        BucketLayout(((0, 1),)).check(ts, ["a", "b"])


def test_config_validates() -> None:
    with pytest.raises(ValueError, match="message_size"):
        BucketConfig(message_size=0)
    with pytest.raises(TypeError, match="message_size"):
        BucketConfig(message_size=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        BucketConfig(gradient_predivide_factor=float("inf"))


def _bucketer(params: list[torch.nn.Parameter], **config: object) -> GradBucketer:
    group = dist.group.WORLD
    assert group is not None
    names = [f"p{i}" for i in range(len(params))]
    return GradBucketer(params, names, group, BucketConfig(**config), DeviceHandle(torch.device("cpu")))  # type: ignore[arg-type]


def _backward(b: GradBucketer, params: list[torch.nn.Parameter], ready: list[int]) -> None:
    b.begin_backward()
    for i in ready:
        params[i].grad = torch.full_like(params[i], float(i + 1))
        b.grad_ready(i)
    b.finish_backward()


def test_one_rank_learns_from_its_ready_order_and_scales(single_rank_group: None) -> None:
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    b = _bucketer(params, message_size=4, gradient_average=False, gradient_predivide_factor=2.0)
    assert b.layout is None
    _backward(b, params, [2, 0, 1])
    assert b.layout_names == (("p2",), ("p0",), ("p1",))
    assert [p.grad[0].item() for p in params if p.grad is not None] == [0.5, 1.0, 1.5]  # sum / factor


def test_missing_gradient_is_named(single_rank_group: None) -> None:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    b = _bucketer(params)
    _backward(b, params, [0, 1, 2])
    for p in params:
        p.grad = None
    with pytest.raises(MissingGradientError, match=r"on this rank: p1\b"):
        _backward(b, params, [2, 0])
    _backward(b, params, [0, 1, 2])  # the next backward is clean again


def test_one_rank_reads_no_flag_from_the_device(
    single_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At world size 1 the host knows whether a gradient is missing: no ``.item()`` (a CUDA sync)."""
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    b = _bucketer(params)
    _backward(b, params, [0, 1])

    def no_read(self: torch.Tensor) -> None:
        raise AssertionError("the missing-gradient flag was read from the device")

    monkeypatch.setattr(torch.Tensor, "item", no_read)
    _backward(b, params, [1, 0])
    for p in params:
        p.grad = None
    with pytest.raises(MissingGradientError, match=r"on this rank: p0\b"):
        _backward(b, params, [1])


def test_retained_buffers_become_the_gradients(single_rank_group: None) -> None:
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    b = _bucketer(params, retain_allreduce_buffers=True)
    _backward(b, params, [1, 0])
    (buffer,) = b.allreduce_buffers
    assert torch.equal(buffer, torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0, 1.0]))
    for p in params:
        assert (
            p.grad is not None and p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        )
