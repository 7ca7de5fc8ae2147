"""The engine of :class:`~fsdp.offload.model.OffloadModel`: the schedule of copies and compute, the
streams, and one autograd Function per slice. A slice's tensors and residency are in
``fsdp/offload/layer_slice.py`` (see [Note: offload residency] there).

[Note: offload schedule]
Forward, slice k: wait until slice k is on the device -> queue the copy of slice k+1 (prefetch)
-> run slice k over every micro-batch -> write buffers back -> free slice k. Backward runs the
slices' autograd functions in reverse order, so slice k's backward prefetches slice k-1 (only if
slice k-1's backward will run, i.e. its output needs a gradient). So at most two slices are on
the device at once: the one computing and the one being copied in.

A backward that does not reach slice k-1 although its output needs a gradient (a partial one:
``torch.autograd.grad(loss, params_of_later_slices)``) leaves the prefetched slice k-1 unused. The
first slice backward of each backward queues a callback at the end of its graph task that frees
every slice still on the device (nothing can use one then), so no slice outlives a backward.

A buffer belongs to one slice only (the model refuses a buffer shared by two slices at
construction): the prefetch of slice k+1 reads its masters before slice k writes its buffers
back, so a buffer in both would be copied in stale. A parameter may be shared (tied) across
slices: forward does not change it, and each slice has its own device copy.

[Note: offload streams]
On CUDA, host->device copies of slices run on ``copy_stream`` and device->host copies (buffers,
boundary activations, gradients) on ``offload_stream``; compute runs on the current stream.

- Compute waits for a slice through the event recorded after its copy (not ``wait_stream``, which
  would also wait for the prefetch queued after it).
- Device copies are allocated on ``copy_stream``, so the caching allocator reuses their memory
  only for later ``copy_stream`` allocations. Before allocating, ``copy_stream`` waits for the
  compute and offload work queued so far; that work includes every read of a freed slice, because
  a slice is freed only after its compute and write-back are queued. The prefetch of slice k+1 is
  queued before slice k's compute, so it overlaps that compute.
- Boundary activations and buffer values written back, read by ``offload_stream``, are marked
  with ``record_stream`` (a buffer's value may be a tensor a layer allocated on the current
  stream, freed when the forward drops it).
- The end-of-backward callback frees only slices that no backward used: the only work on their
  copies is their own host->device copy on ``copy_stream``, which later ``copy_stream``
  allocations follow in stream order anyway, so freeing them needs no wait. That copy may still
  read the masters when backward returns (an optimizer step may then change them under it); its
  values are never used.
- Gradients are handed to autograd as host tensors, which CPU code (``AccumulateGrad``) reads at
  once, so backward blocks the host on the gradient copies of its slice before returning; the
  prefetch of the next slice keeps the copy engine busy meanwhile. Forward likewise waits for its
  copies before it returns, so every host tensor it wrote holds its values and no queued copy
  still reads a master that the host may then update in place (an optimizer step).

On the CPU every stream and event call is a no-op and activations and gradients need no copy;
device copies of the parameters are still made (cheap), so the residency logic runs as on CUDA.

[Note: offload activations]
With ``checkpoint_activation=True`` a slice runs its forward under ``no_grad``; its input (the
activation at the slice boundary, on ``offload_device`` from the second slice on) is saved
together with the RNG states and autocast state of each micro-batch, and a snapshot of the
slice's buffers. Backward recomputes one micro-batch at a time from them. Device memory: about
two slices + one micro-batch's activations of one slice.

Without checkpointing, each slice keeps the autograd graph of its micro-batches; the activations
inside it (boundaries included) stay on ``device``, only the parameters leave (through the
aliases of [Note: offload residency]). Offloading the boundaries would save nothing, since the
next slice's graph already holds them on the device. The buffers each slice runs with are clones
of its device copies (see [Note: offload residency]), kept by the graph where it saved them.
Device memory: about two slices + the activations of the whole model.
Backward then frees each slice's graph as it goes, so backward through an ``OffloadModel`` forward
can run only once (``retain_graph=True`` is refused with an error).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from fsdp.common.device import DeviceHandle
from fsdp.common.torch_compile import queue_end_of_backward
from fsdp.offload.layer_slice import Residency, _Slice

__all__ = ["OffloadModelConfig"]


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"OffloadModel: `{name}` must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"OffloadModel: `{name}` must be >= 1, got {value}")


@dataclass(frozen=True, kw_only=True)
class OffloadModelConfig:
    """The validated options of an :class:`OffloadModel`.

    ``num_slices`` is checked against the number of layers by the model, which knows it.
    """

    device: torch.device
    offload_device: torch.device
    num_slices: int
    checkpoint_activation: bool
    num_microbatches: int

    def __post_init__(self) -> None:
        _check_positive_int("num_slices", self.num_slices)
        _check_positive_int("num_microbatches", self.num_microbatches)
        if not isinstance(self.checkpoint_activation, bool):
            raise TypeError(
                f"OffloadModel: `checkpoint_activation` must be a bool, got {self.checkpoint_activation!r}"
            )


def _rows(batch: int, num_microbatches: int) -> list[int]:
    """Micro-batch sizes for ``batch`` rows: as even as possible, larger ones first (like tensor_split).

    A batch of fewer rows than ``num_microbatches`` gets one micro-batch per row (fairscale's
    ``torch.chunk`` makes fewer chunks too); an empty batch gets one empty micro-batch.
    Example: ``_rows(7, 4) == [2, 2, 2, 1]``, ``_rows(3, 4) == [1, 1, 1]``, ``_rows(0, 4) == [0]``.
    """
    num_microbatches = max(1, min(num_microbatches, batch))
    q, r = divmod(batch, num_microbatches)
    return [q + 1] * r + [q] * (num_microbatches - r)


@dataclass
class _RngState:
    cpu: torch.Tensor
    device: torch.Tensor | None  # None where the CPU generator is the only one


@dataclass
class _AutocastState:
    enabled: bool
    dtype: torch.dtype


@dataclass
class _SliceRecord:
    """What one slice's forward keeps for its backward (one per forward call, on the autograd ctx)."""

    index: int
    rows: list[int]  # micro-batch sizes; [batch] for one micro-batch
    generation: int  # slice.generation at forward; the aliases below point at that storage
    # checkpoint_activation=True (the input itself is in ctx.saved_tensors)
    rng: list[_RngState] = field(default_factory=list)  # state before each micro-batch
    autocast: _AutocastState | None = None
    buffer_snapshot: list[torch.Tensor] | None = None  # buffers before forward, on offload_device
    # checkpoint_activation=False
    graph_output: torch.Tensor | None = None  # (batch, ...) on device, with the slice's graph
    graph_input: torch.Tensor | None = None  # leaf on device when the input needs a gradient
    graph_params: list[torch.Tensor] = field(default_factory=list)  # leaf aliases, one per param
    consumed: bool = False


class _Engine:
    """Owns the slices, the streams and the schedule. See [Note: offload schedule]."""

    config: OffloadModelConfig
    handle: DeviceHandle  # for config.device
    slices: list[_Slice]
    pin: bool  # host buffers that feed the device are pinned (CUDA device, CPU offload)
    _copy_stream: Any  # host->device slice copies; created at first use
    _offload_stream: Any  # device->host copies of buffers, boundary activations, gradients
    _boundary: tuple[torch.Tensor, torch.Tensor] | None  # (offload copy, device tensor) of the last output
    _end_backward_queued: bool  # the current backward has queued _end_backward

    def __init__(self, config: OffloadModelConfig, slices: list[_Slice]) -> None:
        self.config = config
        self.handle = DeviceHandle(config.device)
        self.slices = slices
        self.pin = self.handle.should_pin(config.offload_device)
        self._copy_stream = None
        self._offload_stream = None
        self._boundary = None
        self._end_backward_queued = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without streams or per-call state (the slices drop their device copies)."""
        state = self.__dict__.copy()
        state.update(_copy_stream=None, _offload_stream=None, _boundary=None, _end_backward_queued=False)
        return state

    # ------------------------------------------------------------------ streams
    def _streams(self) -> tuple[Any, Any]:
        if self._copy_stream is None:
            self._copy_stream = self.handle.new_stream()
            self._offload_stream = self.handle.new_stream()
        return self._copy_stream, self._offload_stream

    def _empty_offload(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(
            like.shape, dtype=like.dtype, device=self.config.offload_device, pin_memory=self.pin
        )

    def _to_offload(
        self, tensors: Sequence[torch.Tensor | None], target: torch.device
    ) -> list[torch.Tensor | None]:
        """Device tensors copied to ``target`` on offload_stream (identity where already there).

        Post: the copies are queued after the work queued so far on the current stream; the caller
        synchronizes (``_sync_offload``) or marks the sources with ``record_stream`` before the host
        reads the copies or the sources are released.
        """
        _, offload = self._streams()
        out: list[torch.Tensor | None] = []
        waited = False
        for t in tensors:
            if t is None or t.device == target:
                out.append(t)
                continue
            if not waited:
                self.handle.wait_stream(offload, self.handle.current_stream())
                waited = True
            dst = (
                self._empty_offload(t)
                if target == self.config.offload_device
                else torch.empty(t.shape, dtype=t.dtype, device=target)
            )
            with self.handle.stream(offload):
                dst.copy_(t, non_blocking=True)
            out.append(dst)
        return out

    def _sync_offload(self) -> None:
        """Block the host until the device->host copies queued so far are done (no-op on CPU)."""
        _, offload = self._streams()
        self.handle.synchronize_event(self.handle.record_event(offload))

    # ------------------------------------------------------------------ residency
    def reload(self, sl: _Slice) -> None:
        """Queue the copy of ``sl``'s masters into its device copies on copy_stream.

        Pre: OFFLOADED; masters on offload_device. Post: ON_DEVICE, ``loaded_event`` marks the copy.
        See [Note: offload streams] for why copy_stream first waits for compute and offload work.
        """
        assert sl.residency is Residency.OFFLOADED, f"{sl.describe()} reloaded while on the device"
        masters = [*sl.master_params(), *sl.master_buffers()]
        names = sl.param_names + sl.buffer_names
        offload_device = self.config.offload_device
        for name, m in zip(names, masters):
            if m.device != offload_device:
                raise RuntimeError(
                    f"OffloadModel: {name!r} of {sl.describe()} is on {m.device}, but OffloadModel keeps "
                    f"every parameter and buffer on offload_device={offload_device} and moves copies "
                    "itself; do not call .to()/.cuda() on an OffloadModel or its module"
                )
        copy, offload = self._streams()
        self.handle.wait_stream(copy, self.handle.current_stream())
        self.handle.wait_stream(copy, offload)
        copies = sl.device_params + sl.device_buffers
        with self.handle.stream(copy), torch.no_grad():
            for i, m in enumerate(masters):
                dev = copies[i]
                if dev is None or dev.shape != m.shape or dev.dtype != m.dtype or dev.stride() != m.stride():
                    with torch.inference_mode(False):  # a normal tensor even when first used for inference
                        dev = torch.empty_like(m, device=self.config.device)
                    copies[i] = dev
                    sl.generation += 1
                else:
                    dev.untyped_storage().resize_(dev.numel() * dev.element_size())
                dev.copy_(m, non_blocking=True)
            sl.loaded_event = self.handle.record_event(copy)
        n = len(sl.device_params)
        sl.device_params, sl.device_buffers = copies[:n], copies[n:]
        sl.residency = Residency.ON_DEVICE

    def wait_loaded(self, sl: _Slice) -> None:
        """Make the current stream wait for ``sl``'s copy, loading it now if nobody prefetched it."""
        if sl.residency is Residency.OFFLOADED:
            self.reload(sl)
        self.handle.wait_event(self.handle.current_stream(), sl.loaded_event)

    def prefetch(self, index: int) -> None:
        if 0 <= index < len(self.slices) and self.slices[index].residency is Residency.OFFLOADED:
            self.reload(self.slices[index])

    def free(self, sl: _Slice) -> None:
        """Release ``sl``'s device copies (storage resized to zero; aliases stay valid objects).

        Pre: ON_DEVICE and every use of the copies already queued. Post: OFFLOADED.
        """
        assert sl.residency is Residency.ON_DEVICE, f"{sl.describe()} freed while offloaded"
        for t in sl.device_tensors():
            t.untyped_storage().resize_(0)
        sl.loaded_event = None
        sl.residency = Residency.OFFLOADED

    def free_all(self) -> None:
        """Drop prefetched slices that no backward consumed (their values may be stale)."""
        for sl in self.slices:
            if sl.residency is Residency.ON_DEVICE:
                self.free(sl)

    def write_back_buffers(self, sl: _Slice, values: Sequence[torch.Tensor]) -> None:
        """Queue the copy of ``values`` (the buffers after the slice's last micro-batch, per
        ``buffer_names``) into the masters: forward may update buffers in place or assign new ones.
        See [Note: offload residency] and, for ``record_stream``, [Note: offload streams].
        """
        masters = sl.master_buffers()
        if not masters:
            return
        _, offload = self._streams()
        self.handle.wait_stream(offload, self.handle.current_stream())
        with self.handle.stream(offload), torch.no_grad():
            for m, value in zip(masters, values, strict=True):
                m.copy_(value, non_blocking=True)
                self.handle.record_stream(value, offload)

    # ------------------------------------------------------------------ forward
    def begin_forward(self) -> None:
        self.free_all()
        self._boundary = None
        self._end_backward_queued = False  # a backward that raised never ran its callback

    def end_forward(self, failed: bool = False) -> None:
        """Finish a forward (or clean up after one that raised).

        Post: every slice OFFLOADED; the host tensors forward wrote hold their values, and no queued
        copy still reads a master (so the host may update the masters in place).
        """
        self._boundary = None
        copy, _ = self._streams()
        self.handle.synchronize_event(self.handle.record_event(copy))
        self._sync_offload()
        if failed:
            self.free_all()
        assert all(sl.residency is Residency.OFFLOADED for sl in self.slices)

    def input_on_device(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` on the device; the previous slice's output is reused from the device, not re-copied."""
        if self._boundary is not None and self._boundary[0] is x:
            dev = self._boundary[1]
            self._boundary = None
            return dev
        return x.to(self.config.device, non_blocking=True)

    def rows_of(self, x: torch.Tensor) -> list[int]:
        """Micro-batch sizes for ``x``: ``min(num_microbatches, rows)`` of them, see ``_rows``."""
        m = self.config.num_microbatches
        if m == 1 or x.dim() == 0:
            return [x.shape[0] if x.dim() > 0 else 1]  # one micro-batch: only the count matters
        return _rows(x.shape[0], m)

    def _split(self, t: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
        return [t] if len(rows) == 1 else list(torch.split(t, rows))

    def _join(self, sl: _Slice, outs: list[torch.Tensor], rows: list[int]) -> torch.Tensor:
        if len(outs) == 1:
            return outs[0]
        for out, n in zip(outs, rows):
            if out.dim() == 0 or out.shape[0] != n:
                raise ValueError(
                    f"OffloadModel: {sl.describe()} turned a micro-batch of {n} rows into shape "
                    f"{tuple(out.shape)}; with num_microbatches > 1 every layer must keep the batch in "
                    "dim 0 (use num_microbatches=1 for layers that mix or reduce the batch)"
                )
        return torch.cat(outs)

    def run_no_grad(
        self, sl: _Slice, x_dev: torch.Tensor, rows: list[int], rng: list[_RngState] | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``sl`` over every micro-batch without a graph; the RNG state before each goes to ``rng``.

        Returns the output and the buffers' values after the last micro-batch.
        """
        params = sl.param_aliases([False] * len(sl.param_names))
        buffers = sl.buffer_aliases()
        outs = []
        with torch.no_grad():
            for x_mb in self._split(x_dev, rows):
                if rng is not None:
                    rng.append(_RngState(torch.get_rng_state(), self.handle.get_rng_state()))
                outs.append(sl.run(x_mb, params, buffers))
        return self._join(sl, outs, rows), buffers

    def forward_slice(
        self, index: int, x: torch.Tensor, needs_x_grad: bool, needs_param_grads: Sequence[bool]
    ) -> tuple[torch.Tensor, _SliceRecord]:
        """Run slice ``index`` on ``x`` for a forward that backward will follow.

        Pre: called in slice order within one forward (begin_forward .. end_forward).
        Post: the slice is OFFLOADED, the next one is being copied in; returns the output (on
        offload_device for a checkpointed slice that is not the last, else on device) and the
        record its backward needs. See [Note: offload activations].
        """
        sl = self.slices[index]
        last = index == len(self.slices) - 1
        self.wait_loaded(sl)
        self.prefetch(index + 1)
        x_dev = self.input_on_device(x)
        rows = self.rows_of(x)
        record = _SliceRecord(index=index, rows=rows, generation=sl.generation)
        if self.config.checkpoint_activation:
            if sl.buffer_names:
                # pinned on CUDA, so the recompute's copy to the device does not block the host
                record.buffer_snapshot = [self._empty_offload(b).copy_(b) for b in sl.master_buffers()]
            device_type = self.config.device.type
            record.autocast = _AutocastState(
                torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
            )
            y, buffers = self.run_no_grad(sl, x_dev, rows, record.rng)
        else:
            params = sl.param_aliases(needs_param_grads)
            # the graph's own buffers, not aliases: see [Note: offload residency]
            buffers = [b.clone() for b in sl.buffer_aliases()]
            x_in = x_dev.detach().requires_grad_(needs_x_grad)
            with torch.enable_grad():
                outs = [sl.run(x_mb, params, buffers) for x_mb in self._split(x_in, rows)]
                y = self._join(sl, outs, rows)
            if y.requires_grad:
                record.graph_output = y
                record.graph_input = x_in if needs_x_grad else None
                record.graph_params = params
            y = y.detach()
        self.write_back_buffers(sl, buffers)
        self.free(sl)
        if self.config.checkpoint_activation and not last:
            (y_off,) = self._to_offload([y], self.config.offload_device)
            assert y_off is not None
            if y_off is not y:
                _, offload = self._streams()
                self.handle.record_stream(y, offload)
            self._boundary = (y_off, y)
            y = y_off
        return y, record

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        """Forward without autograd: each slice in turn over every micro-batch, nothing saved."""
        self.begin_forward()
        try:
            h = x.to(self.config.device, non_blocking=True)
            for index, sl in enumerate(self.slices):
                self.wait_loaded(sl)
                self.prefetch(index + 1)
                h, buffers = self.run_no_grad(sl, h, self.rows_of(h), None)
                self.write_back_buffers(sl, buffers)
                self.free(sl)
        except BaseException:
            self.end_forward(failed=True)
            raise
        self.end_forward()
        return h

    # ------------------------------------------------------------------ backward
    def backward_slice(
        self,
        record: _SliceRecord,
        saved_input: torch.Tensor | None,
        grad_y: torch.Tensor,
        x_device: torch.device,
        needs_x_grad: bool,
        needs_param_grads: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Gradients of slice ``record.index``: (input grad on ``x_device``, grads on offload_device).

        Pre: the backward of every later slice has run. Post: the slice is OFFLOADED, slice
        index-1 is being copied in if its backward follows, and the returned host tensors hold
        their values (the host waited for the copies).
        """
        sl = self.slices[record.index]
        if not self._end_backward_queued:
            self._end_backward_queued = True
            queue_end_of_backward(self._end_backward, "OffloadModel")
        try:
            self.wait_loaded(sl)
            if not self.config.checkpoint_activation and record.generation != sl.generation:
                raise RuntimeError(
                    f"OffloadModel: the parameters of {sl.describe()} were replaced between forward and "
                    "backward, so the graph saved in forward no longer matches them; run forward again"
                )
            if needs_x_grad:
                self.prefetch(record.index - 1)
            g_dev = grad_y.to(self.config.device, non_blocking=True)
            if self.config.checkpoint_activation:
                assert saved_input is not None
                grad_x, grads = self._recompute_grads(
                    sl, record, saved_input, g_dev, needs_x_grad, needs_param_grads
                )
            else:
                grad_x, grads = self._graph_grads(sl, record, g_dev, needs_x_grad, needs_param_grads)
        except BaseException:
            # autograd runs no end-of-backward callback after an error
            self._end_backward_queued = False
            self.free_all()
            raise
        self.free(sl)
        (grad_x_out,) = self._to_offload([grad_x], x_device)
        grads_out = self._to_offload(grads, self.config.offload_device)
        self._sync_offload()
        return grad_x_out, grads_out

    def _end_backward(self) -> None:
        """End of a backward's graph task: free the slices prefetched for a backward that did not
        come (a partial backward). See [Note: offload schedule]."""
        self._end_backward_queued = False
        self.free_all()

    def _graph_grads(
        self,
        sl: _Slice,
        record: _SliceRecord,
        g_dev: torch.Tensor,
        needs_x_grad: bool,
        needs_param_grads: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        if record.consumed:
            raise RuntimeError(
                f"OffloadModel: backward reached {sl.describe()} a second time; without "
                "checkpoint_activation each slice's graph is freed by its first backward. Run forward "
                "again, or construct OffloadModel with checkpoint_activation=True"
            )
        record.consumed = True
        y = record.graph_output
        grads: list[torch.Tensor | None] = [None] * len(sl.param_names)
        if y is None:
            return None, grads
        wanted = [i for i, needs in enumerate(needs_param_grads) if needs]
        inputs = [record.graph_params[i] for i in wanted]
        if needs_x_grad:
            assert record.graph_input is not None
            inputs.append(record.graph_input)
        result = torch.autograd.grad(y, inputs, g_dev, allow_unused=True)
        record.graph_output = record.graph_input = None
        record.graph_params = []
        for i, g in zip(wanted, result):
            grads[i] = g
        return (result[-1] if needs_x_grad else None), grads

    def _recompute_grads(
        self,
        sl: _Slice,
        record: _SliceRecord,
        x: torch.Tensor,
        g_dev: torch.Tensor,
        needs_x_grad: bool,
        needs_param_grads: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Recompute each micro-batch from the saved input and sum its parameter gradients."""
        device = self.config.device
        # copies (also on the CPU), which the recompute may update: a second backward starts afresh
        buffers = [b.to(device, non_blocking=True, copy=True) for b in record.buffer_snapshot or []]
        leaves = sl.param_aliases(needs_param_grads)
        wanted = [i for i, needs in enumerate(needs_param_grads) if needs]
        grad_x_parts: list[torch.Tensor] = []
        x_dev = x.to(device, non_blocking=True)
        assert record.autocast is not None
        for i, (x_mb, g_mb) in enumerate(
            zip(self._split(x_dev, record.rows), self._split(g_dev, record.rows))
        ):
            x_leaf = x_mb.detach().requires_grad_(needs_x_grad)
            with (
                _rng_restored(self.handle, record.rng[i]),
                torch.autocast(device.type, dtype=record.autocast.dtype, enabled=record.autocast.enabled),
                torch.enable_grad(),
            ):
                out = sl.run(x_leaf, leaves, buffers)
            inputs = [leaves[j] for j in wanted] + ([x_leaf] if needs_x_grad else [])
            if out.requires_grad and inputs:
                # into the leaves' .grad (fresh aliases: None before the first micro-batch), which
                # autograd adds each later micro-batch's gradient into in place: the device holds one
                # slice of gradients, not one per micro-batch plus their sum
                torch.autograd.backward(out, g_mb, inputs=inputs)
            if needs_x_grad:
                gx = x_leaf.grad
                grad_x_parts.append(gx if gx is not None else torch.zeros_like(x_mb))
        grads: list[torch.Tensor | None] = [None] * len(sl.param_names)
        for j in wanted:
            grads[j] = leaves[j].grad
        grad_x = None
        if needs_x_grad:
            grad_x = grad_x_parts[0] if len(grad_x_parts) == 1 else torch.cat(grad_x_parts)
        return grad_x, grads


@contextlib.contextmanager
def _rng_restored(handle: DeviceHandle, state: _RngState) -> Iterator[None]:
    """Run with the RNG states a micro-batch's forward saw; restore the current ones after."""
    cpu_now, device_now = torch.get_rng_state(), handle.get_rng_state()
    torch.set_rng_state(state.cpu)
    handle.set_rng_state(state.device)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_now)
        handle.set_rng_state(device_now)


class _SliceFunction(torch.autograd.Function):
    """One slice as one autograd node: inputs (x, *master params), output the slice's output.

    Autograd runs the nodes of a forward in reverse, which is what brings the slices back to the
    device in reverse order; the gradients it receives for the master params are on
    offload_device, so ``AccumulateGrad`` sums them into ``param.grad`` there.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, engine: _Engine, index: int, x: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:
        needs = ctx.needs_input_grad
        y, record = engine.forward_slice(index, x, needs[2], needs[3:])
        ctx.engine = engine
        ctx.record = record
        ctx.x_device = x.device
        if engine.config.checkpoint_activation:
            ctx.save_for_backward(x)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        engine: _Engine = ctx.engine
        saved = ctx.saved_tensors[0] if engine.config.checkpoint_activation else None
        needs = ctx.needs_input_grad
        grad_x, grads = engine.backward_slice(ctx.record, saved, grad_y, ctx.x_device, needs[2], needs[3:])
        return (None, None, grad_x, *grads)
