"""The wrapper's summon methods, mixed into it: full parameters shown under their original names.

``summon_full_params`` (fairscale's and torch FSDP's keywords), the internal read-only form used by
the state-dict methods, and the methods that run user code on the full parameters (``apply``,
``reset_parameters``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
from torch import nn

from fsdp.api import MemoryState, TrainingState
from fsdp.comm.consistency import collective
from fsdp.core.wrapper_protocol import Wrapper, WrapperMixin, as_module

__all__ = ["SummonDuringStepError", "SummonMethods"]


class SummonDuringStepError(RuntimeError, AssertionError):
    """``summon_full_params()`` called during a forward or backward of the wrappers it would gather:
    the ``RuntimeError`` this library raises for misuse, and the ``AssertionError`` torch FSDP1
    raises there (code written for either catches it)."""


_IN_A_STEP = (TrainingState.FORWARD, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)


class SummonMethods(WrapperMixin):
    """``summon_full_params()``, ``apply()`` and ``reset_parameters()``."""

    _summon_rank0_only = False  # inside a summon_full_params(rank0_only=True)
    _summon_kept: frozenset[int] = frozenset()  # handles (indices) that held their full parameter before it

    @contextlib.contextmanager
    @collective("summon_full_params()", agreed=("recurse", "rank0_only", "with_grads"))
    def summon_full_params(
        self,
        recurse: bool = True,
        volatile: bool = False,
        writeback: bool | None = None,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Generator[None, None, None]:
        """Gather the full parameters and show them under their original names and shapes.

        Collective: every rank must enter. Inside the context ``named_parameters()`` yields the
        original parameters (under the plain module's names), full size. On exit, in-place changes to them
        are written back to the shards unless ``volatile=True`` (torch's ``writeback=False``).
        torch FSDP's ``FSDP.summon_full_params(model, ...)`` works too, with ``model`` the wrapper.

        ``with_grads``: each shown parameter's ``.grad`` is its full gradient (the reduced one the
        optimizer steps on; ``None`` where no rank has one); changes to it are written back like
        the parameters. ``rank0_only``: only rank 0 of the data-parallel group shows the full
        parameters; the others take part in the gathers and keep their shards (needs
        ``writeback=False``, as in torch). ``offload_to_cpu`` is accepted where compute runs on the
        CPU (where it changes nothing) and refused on a GPU.
        """
        if not isinstance(self, SummonMethods):
            raise TypeError(
                "FullyShardedDataParallel.summon_full_params: pass a FullyShardedDataParallel, got "
                f"{type(self).__name__}; call it on the outermost wrapper"
            )
        if writeback is not None:
            if volatile and writeback:
                raise ValueError(
                    "FullyShardedDataParallel.summon_full_params: volatile=True contradicts writeback=True"
                )
            volatile = not writeback
        if rank0_only and not volatile:
            raise NotImplementedError(  # (torch's words, which its tests match)
                "FullyShardedDataParallel.summon_full_params: writeback=True and rank0_only=True is not supported: "
                "rank0_only=True writes nothing back (the other ranks see no full parameters to change); pass "
                "writeback=False (or volatile=True) with it"
            )
        if offload_to_cpu and self.compute_device.type != "cpu":
            raise NotImplementedError(
                "FullyShardedDataParallel.summon_full_params: offload_to_cpu=True is not supported on a GPU; for "
                "the values on rank 0's CPU use state_dict() under FSDP.state_dict_type(model, "
                "StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True))"
            )
        wrappers = self._wrappers() if recurse else [self]
        busy = [w for w in wrappers if w.training_state in _IN_A_STEP]
        if busy:
            raise SummonDuringStepError(
                "FullyShardedDataParallel.summon_full_params: Cannot manually unshard parameters during "
                f"forward/backward (a wrapper is in {busy[0].training_state.name}); call it between steps, "
                "after backward"
            )
        for w in wrappers:
            w.assert_state(TrainingState.IDLE)
        self._require_groups("summon_full_params()")
        show = not rank0_only or self.fsdp_config.comm.dp_rank == 0
        entered: list[Wrapper] = []
        # At world size 1 the full parameter is the shard itself: keep a copy to discard volatile writes.
        snapshots = [
            (h, h.sharded_data().clone()) for w in wrappers for h in w.handles if volatile and h.aliased
        ]
        try:
            for w in wrappers:
                w.training_state = TrainingState.SUMMON_FULL_PARAMS
                w._summon_rank0_only = rank0_only
                entered.append(w)
                w._show_full_params(show, with_grads)
            yield
        finally:
            for w in reversed(entered):
                w._hide_full_params(write_back=not volatile)
                w.training_state = TrainingState.IDLE
                w._summon_rank0_only = False
            with torch.no_grad():
                for h, saved in snapshots:
                    h.sharded_data().copy_(saved)

    def _forward_in_summon(self, *args: Any, **kwargs: Any) -> Any:
        """A forward inside ``summon_full_params()``, the way fairscale and torch FSDP1 users run
        ``generate``: the module runs on the full parameters shown (in full precision); nothing is
        gathered, freed or hooked for backward. Not for training: the gradients would reach the shown
        parameters, which the context discards."""
        if torch.is_grad_enabled() and any(h.requires_grad for h in self.handles):
            raise RuntimeError(
                "FullyShardedDataParallel: a forward inside summon_full_params() with gradients enabled: its "
                "gradients would reach the full parameters shown, which the context discards on exit. Run it "
                "under torch.no_grad(), or call the model outside the context (calls of the wrapper or of the "
                "wrapped module gather what they need by themselves)"
            )
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def _full_params_shown(self) -> Iterator[None]:
        """This wrapper's full parameters, shown for a read: as the user's summon left them, or
        gathered for the duration (and discarded after)."""
        if self.training_state is TrainingState.SUMMON_FULL_PARAMS:
            if self._summon_rank0_only:  # (every rank raises: none gathers)
                raise RuntimeError(
                    "FullyShardedDataParallel: state_dict() inside summon_full_params(rank0_only=True) is not "
                    "supported: the other ranks hold no full parameters. Call it outside the context; "
                    "FullStateDictConfig(rank0_only=True) gives rank 0 alone the values"
                )
            yield
            return
        self.assert_state(TrainingState.IDLE)
        with self._state(TrainingState.SUMMON_FULL_PARAMS):
            self._show_full_params()
            try:
                yield
            finally:
                self._hide_full_params(write_back=False)

    def _show_full_params(self, show: bool = True, with_grads: bool = False) -> None:
        # a full parameter kept from a forward (the root between forward and backward), still the
        # gather of the shards, is shown as it is and kept after, as torch's: the summon costs no gather
        # then, nor one more in backward. (Under mixed precision the summon shows the fp32 masters,
        # gathered apart, and the kept buffer is freed; so is one the shards changed under.)
        self._summon_kept = frozenset(
            i for i, h in enumerate(self.handles) if h.kept_full_valid and not h.mixed
        )
        for i, h in enumerate(self.handles):
            h.unshard(full_precision=True)
            if with_grads:
                h.gather_grad()
            if not show:  # (rank0_only on another rank) it took part in the gathers: back to the shard
                h.release_grad(write_back=False)
                h.reshard(free_full=i not in self._summon_kept)
                continue
            h.use_full_views(as_parameters=True)
            # torch FSDP1's flat parameter while shown: unpadded (one per original: padded, as torch's)
            if self.fsdp_config.sharding.flatten_parameters:
                h.flat_param.data = h.flat_param.data[: h.meta.numel]
            if with_grads:
                h.show_grad()
        if not show:
            return
        for m, order in self._module_param_order.items():  # registration order as before wrapping
            params = dict(m._parameters)
            m._parameters.clear()
            m._parameters.update((n, params.pop(n)) for n in order if n in params)
            m._parameters.update(params)
        registered = as_module(self)._parameters  # (the wrapper's own: its flat parameters)
        for i in range(len(self.handles)):
            registered.pop(f"flat_param_{i}", None)

    def _hide_full_params(self, write_back: bool) -> None:
        registered = as_module(self)._parameters
        for i, h in enumerate(self.handles):
            h.release_grad(write_back)
            if write_back and h.state is MemoryState.UNSHARDED:
                h.write_back_()
            h.reshard(free_full=i not in self._summon_kept)
            registered[f"flat_param_{i}"] = h.flat_param
        self._summon_kept = frozenset()

    def apply(self, fn: Callable[[nn.Module], None]) -> Any:
        """``nn.Module.apply`` with this wrapper's full parameters visible to ``fn`` (collective)."""
        with self.summon_full_params(recurse=False):
            return nn.Module.apply(self, fn)  # type: ignore[arg-type, type-var]

    def reset_parameters(self) -> None:
        """Re-initialize the wrapped module (only with ``allow_reset_parameters=True``) on its full
        parameters: inside ``summon_full_params()`` (fairscale's way) on those shown, written back on
        exit; outside, inside a summon of this wrapper of its own (collective)."""
        if not self.fsdp_config.allow_reset_parameters:
            raise RuntimeError(
                "FullyShardedDataParallel: reset_parameters() after wrapping is not allowed; pass "
                "allow_reset_parameters=True if the module's reset_parameters() is safe to run on full parameters"
            )
        module: Any = self._fsdp_wrapped_module
        if self.training_state is TrainingState.SUMMON_FULL_PARAMS:
            if self._summon_rank0_only:
                raise RuntimeError(
                    "FullyShardedDataParallel: reset_parameters() inside summon_full_params(rank0_only=True): the other "
                    "ranks hold no full parameters and nothing is written back; call it inside summon_full_params()"
                )
            module.reset_parameters()
            return
        with self.summon_full_params(recurse=False):
            module.reset_parameters()
