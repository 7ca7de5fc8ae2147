"""OffloadModel: parity with the plain model, the slice schedule, and errors.

Every parity test also checks that the layers computed with device copies of the parameters
(``_assert_ran_on_copies``), so that a pass-through ``OffloadModel`` could not pass it.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import runpy
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import fsdp
from fsdp.offload.model import OffloadModel, Residency, _Engine, split_layers

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only spin, and on a busy 2-core machine that costs 5-10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Shift(nn.Module):
    """A layer with a buffer and no parameters."""

    shift: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


class Counter(nn.Module):
    """A buffer that forward both reads and updates: recompute must see the value forward saw."""

    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * (1.0 + self.count)
        self.count += 1
        return y


class Ema(nn.Module):
    """A buffer assigned anew in forward (not updated in place), as running averages often are."""

    avg: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
        return x - self.avg


class Scale(nn.Module):
    """Autograd saves the buffer (d(x * scale)/dx = scale), then forward assigns it anew."""

    scale: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale
        self.scale = self.scale * 1.25
        return y


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class BatchMean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(0, keepdim=True)


def make_model(seed: int = 0) -> nn.Sequential:
    """10 layers: 4 Linear, LayerNorm, a buffer layer, and parameter-free layers."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.LayerNorm(16),
        nn.ReLU(),
        nn.Linear(16, 16),
        Shift(16),
        nn.Tanh(),
        nn.Identity(),
        nn.Linear(16, 12),
        nn.GELU(),
        nn.Linear(12, 3),
    )


def _offload(ref: nn.Sequential, **kwargs: object) -> OffloadModel:
    return OffloadModel(copy.deepcopy(ref), CPU, **kwargs)  # type: ignore[arg-type]


def _assert_ran_on_copies(off: OffloadModel) -> Callable[[], None]:
    """Hook every layer with a weight; the returned check asserts no layer computed with its master."""
    masters = {id(m): m.weight for m in off.module if isinstance(getattr(m, "weight", None), nn.Parameter)}
    used_master: list[bool] = []

    def hook(module: nn.Module, args: object) -> None:
        used_master.append(module.weight is masters[id(module)])

    handles = [m.register_forward_pre_hook(hook) for m in off.module if id(m) in masters]

    def check() -> None:
        for h in handles:
            h.remove()
        assert used_master, "no layer ran"
        assert not any(used_master), "a layer computed with its master parameter, not a device copy"

    return check


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y * torch.arange(1, y.shape[-1] + 1, dtype=y.dtype, device=y.device)).square().mean()


def _train_and_compare(
    ref: nn.Sequential,
    off: OffloadModel,
    make_opt: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    steps: int = 3,
    batch: int = 8,
    width: int = 6,
    ref_microbatches: int = 1,
) -> None:
    """Train both side by side; outputs, input and parameter gradients, parameters and buffers must
    agree. ``ref_microbatches``: the plain model runs over that many micro-batches one after the
    other (the reference where buffers change from one micro-batch to the next)."""
    check_copies = _assert_ran_on_copies(off)
    opt_ref, opt_off = make_opt(ref.parameters()), make_opt(off.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(batch, width, generator=gen)
        x_ref, x_off = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref = torch.cat([ref(x_mb) for x_mb in x_ref.tensor_split(ref_microbatches)])
        y_off = off(x_off)
        assert_close(y_off, y_ref, **TOL)
        _loss(y_ref).backward()
        _loss(y_off).backward()
        assert x_off.grad is not None and x_ref.grad is not None
        assert_close(x_off.grad, x_ref.grad, **TOL)
        for (name, p_ref), p_off in zip(ref.named_parameters(), off.parameters()):
            assert p_off.device == CPU and p_off.grad is not None, name
            assert p_ref.grad is not None
            assert_close(p_off.grad, p_ref.grad, **TOL, msg=name)
        opt_ref.step()
        opt_off.step()
        opt_ref.zero_grad()
        opt_off.zero_grad()
        for (name, p_ref), p_off in zip(ref.named_parameters(), off.parameters()):
            assert_close(p_off, p_ref, **TOL, msg=name)
        for (name, b_ref), b_off in zip(ref.named_buffers(), off.buffers(), strict=True):
            assert_close(b_off, b_ref, **TOL, msg=name)
    check_copies()
    assert all(sl.residency is Residency.OFFLOADED for sl in off._engine.slices)


OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


# ---------------------------------------------------------------------------- parity
@pytest.mark.parametrize("checkpoint_activation", [False, True])
@pytest.mark.parametrize("num_microbatches", [1, 2, 4])
@pytest.mark.parametrize("num_slices", [1, 2, 3, 10])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_training_matches_plain_model(
    num_slices: int, num_microbatches: int, checkpoint_activation: bool, optimizer: str
) -> None:
    ref = make_model()
    off = _offload(
        ref,
        num_slices=num_slices,
        checkpoint_activation=checkpoint_activation,
        num_microbatches=num_microbatches,
    )
    assert len(off.slice_bounds) == num_slices
    _train_and_compare(ref, off, OPTIMIZERS[optimizer])


@pytest.mark.parametrize("checkpoint_activation", [False, True])
@pytest.mark.parametrize(("batch", "num_microbatches"), [(7, 4), (5, 2), (4, 4)])
def test_uneven_microbatches_match_plain_model(
    batch: int, num_microbatches: int, checkpoint_activation: bool
) -> None:
    ref = make_model()
    off = _offload(
        ref, num_slices=3, checkpoint_activation=checkpoint_activation, num_microbatches=num_microbatches
    )
    _train_and_compare(ref, off, OPTIMIZERS["sgd_momentum"], steps=2, batch=batch)


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_batchnorm_running_stats_match_plain_model(checkpoint_activation: bool) -> None:
    """Buffers updated in forward are written back once (recompute must not update them again)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8))
    off = _offload(ref, num_slices=2, checkpoint_activation=checkpoint_activation)
    _train_and_compare(ref, off, OPTIMIZERS["adam"], steps=3)
    for (name, b_ref), b_off in zip(ref.named_buffers(), off.buffers()):
        assert b_off.device == CPU
        assert_close(b_off, b_ref, **TOL, msg=name)
    assert int(off.module[1].num_batches_tracked) == 3
    ref.eval()
    off.eval()
    x = torch.randn(5, 6)
    assert_close(off(x), ref(x), **TOL)


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_buffer_read_and_updated_in_forward_matches_plain_model(checkpoint_activation: bool) -> None:
    """The update is written back once; a recomputed forward sees the value the forward saw."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), Counter(), nn.Tanh(), nn.Linear(8, 8), Counter(), nn.Linear(8, 3))
    off = _offload(ref, num_slices=3, checkpoint_activation=checkpoint_activation)
    _train_and_compare(ref, off, OPTIMIZERS["sgd_momentum"], steps=3)
    assert [float(b) for b in off.buffers()] == [3.0, 3.0]


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_each_slice_runs_over_every_microbatch_before_the_next(checkpoint_activation: bool) -> None:
    off = OffloadModel(
        make_model(), CPU, num_slices=2, checkpoint_activation=checkpoint_activation, num_microbatches=4
    )
    (_, cut), _ = off.slice_bounds
    calls: list[tuple[int, int]] = []  # (slice, rows) per call of each slice's first layer
    for index, layer in ((0, off.module[0]), (1, off.module[cut])):
        layer.register_forward_pre_hook(lambda m, args, i=index: calls.append((i, args[0].shape[0])))
    _loss(off(torch.randn(7, 6))).backward()
    forward = [(0, 2), (0, 2), (0, 2), (0, 1), (1, 2), (1, 2), (1, 2), (1, 1)]
    recompute = forward[4:] + forward[:4]  # backward brings slice 1 back first
    assert calls == forward + (recompute if checkpoint_activation else [])


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_checkpoint_recompute_replays_dropout(num_microbatches: int) -> None:
    """The recomputed forward sees the RNG state of the original one, per micro-batch."""
    torch.manual_seed(0)
    layers = [
        nn.Linear(6, 16),
        nn.Dropout(0.5),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.Dropout(0.3),
        nn.Linear(16, 3),
    ]
    ref = nn.Sequential(*layers)
    # Without checkpointing the graph keeps the masks drawn in forward: the reference for
    # micro-batches, where a plain model would draw its masks in another order.
    plain_graph = _offload(ref, num_slices=3, num_microbatches=num_microbatches)
    ckpt = _offload(ref, num_slices=3, checkpoint_activation=True, num_microbatches=num_microbatches)
    x = torch.randn(8, 6)
    grads = []
    for model in ([ref] if num_microbatches == 1 else []) + [plain_graph, ckpt]:
        torch.manual_seed(123)
        _loss(model(x)).backward()
        grads.append([p.grad for p in model.parameters()])
    for other in grads[1:]:
        for g0, g1 in zip(grads[0], other):
            assert g0 is not None and g1 is not None
            assert_close(g1, g0, **TOL)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_forward_matches_and_keeps_nothing(mode: Callable[[], AbstractContextManager[None]]) -> None:
    ref = make_model()
    off = _offload(ref, num_slices=3, num_microbatches=2)
    check_copies = _assert_ran_on_copies(off)
    x = torch.randn(6, 6)
    with mode():
        y = off(x)
    assert not y.requires_grad
    assert_close(y, ref(x), **TOL)
    check_copies()
    for sl in off._engine.slices:
        assert sl.residency is Residency.OFFLOADED
        assert all(t.untyped_storage().size() == 0 for t in sl.device_tensors())
    _train_and_compare(ref, off, OPTIMIZERS["sgd_momentum"], steps=1)  # training works afterwards


def test_gradients_accumulate_over_two_backwards_like_plain_model() -> None:
    ref = make_model()
    off = _offload(ref, num_slices=3, checkpoint_activation=True, num_microbatches=2)
    for seed in (1, 2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
        _loss(ref(x)).backward()
        _loss(off(x)).backward()
    for p_ref, p_off in zip(ref.parameters(), off.parameters()):
        assert p_ref.grad is not None and p_off.grad is not None
        assert_close(p_off.grad, p_ref.grad, **TOL)


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_frozen_layer_integer_input_and_weights_tied_across_slices(checkpoint_activation: bool) -> None:
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
    head.weight = emb.weight  # tied: slice 0 and slice 2 both use it
    ref = nn.Sequential(emb, nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), head)
    ref[1].requires_grad_(False)
    off = _offload(ref, num_slices=3, checkpoint_activation=checkpoint_activation)
    assert off.slice_bounds[0][1] <= 1 and off.slice_bounds[-1][1] == 5
    ids = torch.randint(0, 10, (4, 3))
    _loss(ref(ids)).backward()
    _loss(off(ids)).backward()
    for (name, p_ref), p_off in zip(ref.named_parameters(), off.module.parameters()):
        if not p_ref.requires_grad:
            assert p_off.grad is None, name
            continue
        assert p_ref.grad is not None and p_off.grad is not None
        assert_close(p_off.grad, p_ref.grad, **TOL, msg=name)


def test_checkpointed_backward_can_run_twice_with_retain_graph() -> None:
    """Each recompute starts from the buffers' forward-time values (Counter updates one in place)."""
    ref = make_model()
    ref.insert(2, Counter())
    off = _offload(ref, num_slices=3, checkpoint_activation=True)
    x = torch.randn(4, 6)
    for model in (ref, off):
        loss = _loss(model(x))
        loss.backward(retain_graph=True)
        loss.backward()
    for p_ref, p_off in zip(ref.parameters(), off.parameters()):
        assert p_ref.grad is not None and p_off.grad is not None
        assert_close(p_off.grad, p_ref.grad, **TOL)


# ---------------------------------------------------------------------------- schedule and memory
@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_slices_move_in_order_forward_and_reverse_in_backward(
    checkpoint_activation: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    off = _offload(make_model(), num_slices=3, checkpoint_activation=checkpoint_activation)
    log: list[tuple[str, int]] = []
    reload, free = _Engine.reload, _Engine.free

    def logged_reload(self: _Engine, sl: object) -> None:
        log.append(("load", sl.index))  # type: ignore[attr-defined]
        reload(self, sl)  # type: ignore[arg-type]

    def logged_free(self: _Engine, sl: object) -> None:
        log.append(("free", sl.index))  # type: ignore[attr-defined]
        free(self, sl)  # type: ignore[arg-type]

    monkeypatch.setattr(_Engine, "reload", logged_reload)
    monkeypatch.setattr(_Engine, "free", logged_free)
    y = off(torch.randn(4, 6, requires_grad=True))
    forward = list(log)
    # Slice k+1 is copied in (prefetched) before slice k computes and is freed.
    assert forward == [("load", 0), ("load", 1), ("free", 0), ("load", 2), ("free", 1), ("free", 2)]
    for sl in off._engine.slices:  # between forward and backward nothing of the slices is on the device
        assert all(t.untyped_storage().size() == 0 for t in sl.device_tensors())
    log.clear()
    _loss(y).backward()
    assert log == [("load", 2), ("load", 1), ("free", 2), ("load", 0), ("free", 1), ("free", 0)]
    resident = peak = 0
    for op, _ in forward + log:
        resident += 1 if op == "load" else -1
        peak = max(peak, resident)
    assert peak == 2 and resident == 0


class _StreamLog:
    """Stands in for the engine's DeviceHandle and logs the stream protocol as CUDA would see it."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.current = "compute"
        self.streams = iter(["copy", "offload"])
        self.events = 0

    def current_stream(self) -> str:
        return self.current

    def new_stream(self) -> str:
        return next(self.streams)

    @contextlib.contextmanager
    def stream(self, stream: str) -> Iterator[None]:
        before, self.current = self.current, stream
        yield
        self.current = before

    def wait_stream(self, waiter: str, producer: str) -> None:
        self.log.append(("wait_stream", waiter, producer))

    def record_event(self, stream: str) -> str:
        self.events += 1
        self.log.append(("record", stream, f"e{self.events}"))
        return f"e{self.events}"

    def wait_event(self, stream: str, event: str) -> None:
        self.log.append(("wait_event", stream, event))

    def synchronize_event(self, event: str) -> None:
        self.log.append(("host_waits", event))

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("record_stream", stream))

    def get_rng_state(self) -> None:
        return None

    def set_rng_state(self, state: None) -> None:
        pass


def _check_stream_order(log: list[tuple[str, ...]], order: list[int]) -> None:
    """Each reload waits for compute and offload work, then copies and records an event; each
    slice's compute waits for that event, and is queued after the next slice's reload."""
    loaded: dict[str, str] = {}
    reloads = []
    for pos, entry in enumerate(log):
        if entry[0] == "reload":
            reloads.append(entry[1])
            assert log[pos + 1 : pos + 3] == [
                ("wait_stream", "copy", "compute"),
                ("wait_stream", "copy", "offload"),
            ]
            assert log[pos + 3][:2] == ("record", "copy")
            loaded[entry[1]] = log[pos + 3][2]
        if entry[0] == "compute":
            i = entry[1]
            assert ("wait_event", "compute", loaded[i]) in log[:pos], f"slice {i} computed before its copy"
            nxt = order.index(int(i)) + 1
            if nxt < len(order):
                assert str(order[nxt]) in reloads, (
                    f"slice {order[nxt]} not prefetched before slice {i} computed"
                )
    assert reloads == [str(i) for i in order]
    for event in loaded.values():  # every copied slice was waited for by compute
        assert ("wait_event", "compute", event) in log


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_stream_protocol_orders_copies_before_compute_and_overlaps_the_prefetch(
    checkpoint_activation: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """See [Note: offload streams]: the calls that make the CUDA schedule correct, logged on CPU."""
    off = _offload(make_model(), num_slices=3, checkpoint_activation=checkpoint_activation)
    streams = _StreamLog()
    off._engine.handle = streams  # type: ignore[assignment]
    reload = _Engine.reload

    def logged_reload(self: _Engine, sl: object) -> None:
        streams.log.append(("reload", str(sl.index)))  # type: ignore[attr-defined]
        reload(self, sl)  # type: ignore[arg-type]

    monkeypatch.setattr(_Engine, "reload", logged_reload)
    for sl in off._engine.slices:
        hook = lambda m, a, i=sl.index: streams.log.append(("compute", str(i)))  # noqa: E731
        off.module[sl.start].register_forward_pre_hook(hook)
    y = off(torch.randn(4, 6))
    forward = list(streams.log)
    _check_stream_order(forward, [0, 1, 2])
    # Forward returns only when no copy still reads a master and every host copy is written.
    (_, copy_event), (_, offload_event) = forward[-4][1:], forward[-2][1:]
    assert forward[-4:] == [
        ("record", "copy", copy_event),
        ("host_waits", copy_event),
        ("record", "offload", offload_event),
        ("host_waits", offload_event),
    ]
    streams.log.clear()
    _loss(y).backward()
    backward = streams.log
    _check_stream_order(backward, [2, 1, 0])
    if checkpoint_activation:  # the recompute runs the layers again, in reverse slice order
        assert [e[1] for e in backward if e[0] == "compute"] == ["2", "1", "0"]
    # Each slice's backward blocks the host on its gradient copies before autograd reads them.
    assert sum(1 for e in backward if e[0] == "host_waits") == 3
    # The buffer values written back are marked as read by the offload stream (the Shift layer's).
    assert forward.count(("record_stream", "offload")) == 1


def test_forward_leaves_master_parameters_untouched_and_on_offload_device() -> None:
    ref = make_model()
    off = _offload(ref, num_slices=2)
    ptrs = [p.data_ptr() for p in off.parameters()]
    _loss(off(torch.randn(3, 6))).backward()
    assert [p.data_ptr() for p in off.parameters()] == ptrs
    for p_ref, p_off in zip(ref.parameters(), off.parameters()):
        assert p_off.device == CPU
        assert_close(p_off, p_ref)


# ---------------------------------------------------------------------------- splitting
def test_split_layers_examples() -> None:
    assert split_layers([10, 0, 10, 0, 10, 0], 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_layers([0, 0, 0, 0], 2) == [(0, 2), (2, 4)]
    assert split_layers([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert split_layers([3, 4, 5], 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_layers([3, 4, 5], 1) == [(0, 3)]
    with pytest.raises(ValueError, match="between 1 and the number of layers"):
        split_layers([1, 2], 3)


@pytest.mark.parametrize("seed", range(20))
def test_split_layers_covers_all_layers_in_balanced_contiguous_slices(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 30, (1,), generator=gen))
    sizes = [int(s) for s in torch.randint(0, 100, (n,), generator=gen)]
    k = int(torch.randint(1, n + 1, (1,), generator=gen))
    bounds = split_layers(sizes, k)
    assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b for a, b in bounds) and all(b == a2 for (_, b), (a2, _) in itertools.pairwise(bounds))
    # Every cut is within one layer of its ideal place: no slice exceeds ideal + 2 * largest layer.
    ideal = sum(sizes) / k
    assert max(sum(sizes[a:b]) for a, b in bounds) <= ideal + 2 * max(sizes)


def test_equal_layers_split_into_equal_slices() -> None:
    model = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(4, 4), nn.ReLU())])
    off = OffloadModel(model, CPU, num_slices=4)
    assert off.slice_bounds == [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert "slices=" in repr(off)


# ---------------------------------------------------------------------------- errors
def test_constructor_errors_say_what_to_change() -> None:
    with pytest.raises(TypeError, match=r"needs an nn\.Sequential"):
        OffloadModel(nn.Linear(2, 2), CPU)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs an nn\.Sequential"):
        OffloadModel([nn.Linear(2, 2)], CPU)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        OffloadModel(nn.Sequential(), CPU)
    with pytest.raises(ValueError, match=r"num_slices=4 but the nn\.Sequential has only 3 layers"):
        OffloadModel(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), CPU, num_slices=4)
    with pytest.raises(ValueError, match="`num_slices` must be >= 1"):
        OffloadModel(make_model(), CPU, num_slices=0)
    with pytest.raises(TypeError, match="`num_slices` must be an int"):
        OffloadModel(make_model(), CPU, num_slices=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`num_microbatches` must be >= 1"):
        OffloadModel(make_model(), CPU, num_microbatches=0)
    with pytest.raises(TypeError, match="`checkpoint_activation` must be a bool"):
        OffloadModel(make_model(), CPU, checkpoint_activation="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`device` must be a torch\.device"):
        OffloadModel(make_model(), 0)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_refused() -> None:
    with pytest.raises(ValueError, match="not available"):
        OffloadModel(make_model(), torch.device("cuda"))


def test_forward_errors_say_what_to_change() -> None:
    off = OffloadModel(nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 2)), CPU, num_slices=2, num_microbatches=4)
    with pytest.raises(ValueError, match="cannot split a 0-dim tensor into num_microbatches=4"):
        off(torch.randn(()))
    with pytest.raises(TypeError, match="takes one tensor"):
        off((torch.randn(4, 6),))  # type: ignore[arg-type]
    mixing = OffloadModel(
        nn.Sequential(nn.Linear(6, 6), BatchMean(), nn.Linear(6, 2)), CPU, num_slices=2, num_microbatches=2
    )
    with pytest.raises(ValueError, match="keep the batch in dim 0"):
        mixing(torch.randn(4, 6))
    assert all(sl.residency is Residency.OFFLOADED for sl in mixing._engine.slices)


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_tuple_at_a_slice_boundary_is_refused_and_nothing_stays_loaded(checkpoint_activation: bool) -> None:
    off = OffloadModel(
        nn.Sequential(nn.Linear(6, 6), Pair(), nn.Linear(6, 2)),
        CPU,
        num_slices=3,
        checkpoint_activation=checkpoint_activation,
    )
    with pytest.raises(TypeError, match="must return a tensor"):
        off(torch.randn(4, 6))
    assert all(sl.residency is Residency.OFFLOADED for sl in off._engine.slices)


def test_second_backward_without_checkpointing_is_refused() -> None:
    off = _offload(make_model(), num_slices=2)
    loss = _loss(off(torch.randn(4, 6)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="checkpoint_activation=True"):
        loss.backward()
    assert all(sl.residency is Residency.OFFLOADED for sl in off._engine.slices)


def test_moving_the_model_or_replacing_a_layer_is_refused() -> None:
    off = _offload(make_model(), num_slices=2)
    off.module[3] = nn.Linear(16, 16)
    with pytest.raises(RuntimeError, match="replaced after construction"):
        off(torch.randn(2, 6))
    off = _offload(make_model(), num_slices=2)
    loss = _loss(off(torch.randn(2, 6)))
    off.module[0].weight = nn.Parameter(torch.randn(16, 5))
    with pytest.raises(RuntimeError, match="replaced between forward and backward"):
        loss.backward()
    off = _offload(make_model(), num_slices=2)
    twin = nn.Linear(6, 16)  # holds the same parameters: their names do not change, their slots do
    twin.weight, twin.bias = off.module[0].weight, off.module[0].bias
    off.module[0].add_module("twin", twin)
    with pytest.raises(RuntimeError, match="or they moved between the modules that hold them"):
        off(torch.randn(2, 6))
    off = _offload(make_model(), num_slices=2)
    off.module.to("meta")
    with pytest.raises(RuntimeError, match=r"do not call \.to\(\)"):
        off(torch.randn(2, 6))


# ---------------------------------------------------------------------------- shared modules, buffers
class CountedBlock(nn.Module):
    """A Linear and a buffer updated in place, for a block used several times in one layer."""

    count: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return torch.tanh(self.linear(x)) * (1.0 + 0.1 * self.count)


@pytest.mark.parametrize("checkpoint_activation", [False, True])
@pytest.mark.parametrize("num_slices", [1, 2, 3])
def test_module_used_several_times_matches_plain_model(num_slices: int, checkpoint_activation: bool) -> None:
    """ALBERT-style sharing: one Linear four times (within a slice and across slices) and one block
    with a buffer three times inside one layer; the masters stay the user's Parameter objects."""
    torch.manual_seed(0)
    shared, block = nn.Linear(8, 8), CountedBlock(8)
    ref = nn.Sequential(nn.Linear(6, 8), *[shared] * 4, nn.Sequential(*[block] * 3), nn.Linear(8, 3))
    off = _offload(
        ref, num_slices=num_slices, checkpoint_activation=checkpoint_activation, num_microbatches=2
    )
    masters = list(off.module[1].parameters()) + list(off.module[5][0].parameters())
    _train_and_compare(ref, off, OPTIMIZERS["adam"], steps=3, ref_microbatches=2)
    assert list(off.module[1].parameters()) + list(off.module[5][0].parameters()) == masters
    assert all(off.module[i].weight is masters[0] for i in range(1, 5))
    assert float(off.module[5][0].count) == 3 * 2 * 3  # three uses, two micro-batches, three steps
    # The masters are plain CPU tensors again: reading the state dict sees their values.
    for (name, t_ref), (key, t_off) in zip(ref.state_dict().items(), off.state_dict().items(), strict=True):
        assert key == f"module.{name}"
        assert_close(t_off, t_ref, **TOL, msg=name)


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x.unflatten(1, (2, 3)))[0].flatten(1)


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_recurrent_layer_computes_with_the_device_copies(checkpoint_activation: bool) -> None:
    """An LSTM reads its weights through ``_flat_weights``, not its attributes: it must follow the swap."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), _Recurrent(), nn.Linear(8, 3))
    off = _offload(ref, num_slices=3, checkpoint_activation=checkpoint_activation, num_microbatches=2)
    lstm = off.module[1].lstm
    masters = {id(p) for p in lstm.parameters()}
    used: list[bool] = []
    lstm.register_forward_hook(lambda m, *_: used.append(any(id(w) in masters for w in m._flat_weights)))
    _train_and_compare(ref, off, OPTIMIZERS["adam"], steps=2, ref_microbatches=2)
    assert used and not any(used), "the LSTM computed with its master weights"


@pytest.mark.parametrize("checkpoint_activation", [False, True])
@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("num_slices", [1, 3])
def test_buffers_assigned_anew_in_forward_match_plain_model(
    num_slices: int, num_microbatches: int, checkpoint_activation: bool
) -> None:
    """A buffer assigned a new tensor is written back and carried to the next micro-batch; a buffer
    value autograd saved is the forward-time one in backward (the reference runs the plain model
    over the micro-batches one after the other)."""
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Linear(6, 8), Ema(8), Scale(8), nn.Tanh(), nn.Linear(8, 8), Scale(8), nn.Linear(8, 3)
    )
    off = _offload(
        ref,
        num_slices=num_slices,
        checkpoint_activation=checkpoint_activation,
        num_microbatches=num_microbatches,
    )
    _train_and_compare(ref, off, OPTIMIZERS["sgd_momentum"], steps=3, ref_microbatches=num_microbatches)
    assert_close(off.module[2].scale, torch.linspace(0.5, 1.5, 8) * 1.25 ** (3 * num_microbatches))


def test_buffer_assigned_a_different_shape_is_refused() -> None:
    class Grow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = torch.zeros(3)
            return x

    off = OffloadModel(nn.Sequential(nn.Linear(2, 2), Grow()), CPU, num_slices=2)
    with pytest.raises(RuntimeError, match=r"set buffer '1\.seen' to shape \(3,\).*same shape and dtype"):
        off(torch.randn(2, 2))
    assert off.module[1].seen.shape == (2,)
    assert all(sl.residency is Residency.OFFLOADED for sl in off._engine.slices)


def test_buffer_shared_by_two_slices_is_refused_and_works_in_one() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(8)
    ref = nn.Sequential(nn.Linear(6, 8), bn, nn.Linear(8, 8), bn, nn.Linear(8, 3))
    with pytest.raises(
        ValueError, match=r"buffer '1\.running_mean' is used by layers \[1, 3\].*slices \[0, 1\]"
    ):
        _offload(ref, num_slices=2)
    with pytest.raises(ValueError, match="Choose num_slices so that these layers share one slice"):
        _offload(ref, num_slices=3)
    off = _offload(ref, num_slices=1)
    _train_and_compare(ref, off, OPTIMIZERS["adam"], steps=3)


@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_parameters_shared_across_slices_match_plain_model(checkpoint_activation: bool) -> None:
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    ref = nn.Sequential(nn.Linear(6, 8), shared, nn.Tanh(), nn.Linear(8, 8), shared, nn.Linear(8, 3))
    off = _offload(ref, num_slices=3, checkpoint_activation=checkpoint_activation, num_microbatches=2)
    slice_of = [k for k, (a, b) in enumerate(off.slice_bounds) for _ in range(a, b)]
    assert slice_of[1] != slice_of[4]  # the two uses are in different slices
    _train_and_compare(ref, off, OPTIMIZERS["sgd_momentum"], steps=3)


# ---------------------------------------------------------------------------- batches, attributes
@pytest.mark.parametrize("checkpoint_activation", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_batch_smaller_than_num_microbatches_uses_one_per_row(
    batch: int, checkpoint_activation: bool
) -> None:
    ref = make_model()
    off = _offload(ref, num_slices=3, checkpoint_activation=checkpoint_activation, num_microbatches=4)
    rows: list[int] = []
    off.module[0].register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    _train_and_compare(ref, off, OPTIMIZERS["adam"], steps=2, batch=batch)
    # one micro-batch per row, in forward (and in the recompute), for each of the two steps
    assert rows == [1] * batch * 2 * (2 if checkpoint_activation else 1)
    with torch.no_grad():
        empty = torch.randn(0, 6)
        assert_close(off(empty), ref(empty))


def test_fairscale_attributes_read_the_options() -> None:
    off = OffloadModel(make_model(), "cpu", num_slices=2, checkpoint_activation=True, num_microbatches=3)
    assert (off.device, off.offload_device) == (CPU, CPU)
    assert (off.num_slices, off.num_microbatches, off.checkpoint_activation) == (2, 3, True)
    with pytest.raises(AttributeError):
        off.num_slices = 3  # type: ignore[misc]


def test_meta_devices_and_meta_models_are_refused() -> None:
    with pytest.raises(ValueError, match="`device`=meta holds no values"):
        OffloadModel(make_model(), "meta")
    with pytest.raises(ValueError, match="`offload_device`=meta holds no values"):
        OffloadModel(make_model(), CPU, offload_device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"'0\.weight' \(and 10 more\) is on the meta device.*to_empty"):
        OffloadModel(make_model().to("meta"), CPU)


# ---------------------------------------------------------------------------- pickling
@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_save_and_load_after_training_gives_a_working_model(checkpoint_activation: bool) -> None:
    ref = make_model()
    off = _offload(ref, num_slices=3, checkpoint_activation=checkpoint_activation, num_microbatches=2)
    _train_and_compare(ref, off, OPTIMIZERS["sgd_momentum"], steps=1)  # device copies exist, size 0
    buf = io.BytesIO()
    torch.save(off, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    twin = copy.deepcopy(off)
    for model in (loaded, twin):
        assert isinstance(model, OffloadModel) and model.slice_bounds == off.slice_bounds
        assert all(sl.device_params == [None] * len(sl.param_names) for sl in model._engine.slices)
        x = torch.randn(5, 6)
        with torch.no_grad():
            assert_close(model(x), off(x), rtol=0, atol=0)
    assert all(t.untyped_storage().size() == 0 for sl in off._engine.slices for t in sl.device_tensors())
    ref_loaded, ref_twin = copy.deepcopy(ref), copy.deepcopy(ref)
    _train_and_compare(ref, off, OPTIMIZERS["adam"], steps=2)  # the saved model still trains
    _train_and_compare(ref_loaded, loaded, OPTIMIZERS["adam"], steps=2)
    _train_and_compare(ref_twin, twin, OPTIMIZERS["adam"], steps=2)


# ---------------------------------------------------------------------------- partial backward
@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_partial_backward_frees_the_slice_it_prefetched(checkpoint_activation: bool) -> None:
    """autograd.grad over the last slice's parameters never reaches slice 1, which the last slice's
    backward copied in; it is freed at the end of that backward, not at the next forward."""
    ref = make_model()
    off = _offload(ref, num_slices=3, checkpoint_activation=checkpoint_activation)
    last = off.slice_bounds[-1][0]
    x = torch.randn(4, 6)
    g_ref = torch.autograd.grad(_loss(ref(x)), list(ref[last:].parameters()))
    g_off = torch.autograd.grad(_loss(off(x)), list(off.module[last:].parameters()))
    for a, b in zip(g_off, g_ref, strict=True):
        assert_close(a, b, **TOL)
    for sl in off._engine.slices:
        assert sl.residency is Residency.OFFLOADED, sl.describe()
        assert all(t.untyped_storage().size() == 0 for t in sl.device_tensors())
    assert all(p.grad is None for p in off.parameters())
    _train_and_compare(ref, off, OPTIMIZERS["sgd_momentum"], steps=2)


def test_exported_from_package() -> None:
    assert fsdp.OffloadModel is OffloadModel
    assert "OffloadModel" in fsdp.__all__


# ---------------------------------------------------------------------------- benchmark script
def test_benchmark_script_runs_a_cpu_smoke_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU the script measures the full model; run it by hand")
    out = tmp_path / "offload.json"
    monkeypatch.setattr(sys, "argv", ["offload_memory.py", "--out", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "benchmarks" / "offload_memory.py"), run_name="__main__")
    assert exit_info.value.code == 0
    assert "needs CUDA" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["cuda"] is False
    names = {row["name"] for row in report["rows"]}
    assert "plain" in names and any(name.startswith("offload") for name in names)
    assert {"fsdp ws=1", "fsdp ws=1 move_params_to_cpu"} <= names
    assert all(row["max_abs_diff_vs_plain"] <= 1e-5 for row in report["rows"])


# ---------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint_activation", [False, True])
def test_cuda_parity_and_peak_memory(checkpoint_activation: bool) -> None:
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    ref = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())])
    off = OffloadModel(
        copy.deepcopy(ref),
        cuda,
        num_slices=4,
        checkpoint_activation=checkpoint_activation,
        num_microbatches=2,
    )
    ref = ref.to(cuda)
    assert all(p.device == CPU and p.is_pinned() for p in off.parameters())
    x = torch.randn(64, 1024, device=cuda)

    def peak_of_step(model: nn.Module) -> tuple[int, torch.Tensor]:
        _loss(model(x)).backward()  # warm-up: cuBLAS workspaces etc. are allocated once, here
        model.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = model(x)
        _loss(y).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, y.detach()

    peak_off, y = peak_of_step(off)
    peak_ref, y_ref = peak_of_step(ref)
    assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    for p_ref, p_off in zip(ref.parameters(), off.parameters()):
        assert p_off.grad is not None and p_off.grad.device == CPU and p_ref.grad is not None
        assert_close(p_off.grad, p_ref.grad.cpu(), atol=1e-4, rtol=1e-4)
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    slice_bytes = param_bytes // 4
    activation_bytes = 16 * x.numel() * x.element_size()  # every Linear and ReLU output
    # Two slices of parameters and one of gradients, plus activations (and their grads); half a slice
    # of slack for a micro-batch's weight gradient before it is added and the allocator's rounding.
    assert peak_off < 3.5 * slice_bytes + 2 * activation_bytes, (peak_off, slice_bytes, activation_bytes)
    assert peak_off < 0.6 * (param_bytes + peak_ref), (peak_off, param_bytes, peak_ref)
