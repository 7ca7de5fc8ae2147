"""The running wrapper: its state machine, lazy init, forward and backward hooks.

:class:`WrapperBase` is everything of :class:`~fsdp.wrapper.fully_sharded.FullyShardedDataParallel`
that runs in a training step, with the typed list of the wrapper's attributes;
``fully_sharded.py`` adds construction and the public class. The lifecycle of one training step:

1. forward: unshard (all-gather) -> point module attributes at views -> run -> reshard (free the
   full parameter unless this wrapper keeps it) -> hook every output tensor for backward.
2. pre-backward (first output gradient): unshard again if freed; stash shard gradients.
3. post-backward (gradient accumulated into the full flat parameter): reduce-scatter it, reshard.
4. end of backward (one callback queued by the first pre-backward hook): check that every rank
   reduced the same flat parameters, wait for every reduction, set shard gradients, return every
   wrapper to IDLE.

See [Note: flat parameter data] in core/handle.py for what ``flat_param.data`` is in each state.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.profiler import record_function as _record_function

from fsdp.api import (
    TRAINING_TRANSITIONS,
    FSDPConfig,
    TorchOptions,
    TrainingState,
    check_transition,
)
from fsdp.comm.collectives import set_activity
from fsdp.comm.consistency import (
    BACKWARD,
    FORWARD,
    FORWARD_END,
    agree_on_entry,
    agree_on_step,
    agree_on_unit,
    check_hybrid_grids,
    check_same_reductions_on_all_ranks,
    check_same_wrappers_on_all_ranks,
    wrapper_path,
    wrapper_paths,
)
from fsdp.common.device import DeviceHandle, SideCopies
from fsdp.common.guards import registrations
from fsdp.common.nest import visit_tensors
from fsdp.common.torch_compile import queue_end_of_backward
from fsdp.core.flat_param import (
    IgnoredStates,
    PendingTie,
    attached_after_wrapping,
    check_no_parameters_added,
)
from fsdp.core.grad_hooks import GraphToken, OutputHook
from fsdp.core.handle import FlatParamHandle, GradState, free_unused_prefetches
from fsdp.core.no_shard_buckets import finish_no_shard_buckets
from fsdp.core.placeholders import resharded_in_backward
from fsdp.core.saved_views import watch_root_forward
from fsdp.wrapper.direct_call import DirectCallMethods, OpenForward
from fsdp.wrapper.fairscale_attrs import FairscaleAttributes
from fsdp.wrapper.grad_methods import GradientMethods
from fsdp.wrapper.mixed_precision import buffers_for_mode, cast_inputs
from fsdp.wrapper.module_ops import ModuleOps
from fsdp.wrapper.root_context import RootContext, clear_aborted_backward, end_backward_states
from fsdp.wrapper.shared_params import check_no_pending_ties
from fsdp.wrapper.state_methods import StateDictMethods
from fsdp.wrapper.stats_methods import StatsMethods
from fsdp.wrapper.summon_methods import SummonMethods
from fsdp.wrapper.torch_compat import (
    adopt_attached,
    adopt_torch_optimizer_in_backward,
    check_full_prec_in_eval,
    full_precision_in_eval,
)
from fsdp.wrapper.torch_methods import TorchFSDPMethods

__all__ = ["WrapperBase", "get_fsdp_instances"]

log = logging.getLogger(__name__)


def _is_wrapper(module: nn.Module) -> bool:
    return isinstance(module, WrapperBase)


# every wrapper alive: a parameter tied to one wrapped before (a sibling) is refused at construction
_LIVE: weakref.WeakSet[WrapperBase] = weakref.WeakSet()
_Context = RootContext["WrapperBase"]  # the context a root shares with its tree
_profiling: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


def record_function(name: str) -> contextlib.AbstractContextManager[Any]:
    """A profiler range named ``name`` (``FSDP::<phase>``); free when no profiler is recording."""
    return _record_function(name) if _profiling() else contextlib.nullcontext()


class WrapperBase(
    FairscaleAttributes,
    SummonMethods,
    StateDictMethods,
    StatsMethods,
    GradientMethods,
    TorchFSDPMethods,
    ModuleOps,
    DirectCallMethods,
    nn.Module,
):
    """The wrapper without its constructor: see :class:`~fsdp.wrapper.fully_sharded.FullyShardedDataParallel`."""

    _fsdp_wrapped_module: nn.Module
    fsdp_config: FSDPConfig
    handles: list[FlatParamHandle]
    # training_state: a property (below) whose setter checks every change; kept in __dict__ under its name
    _own_ctx: _Context | None  # the root's context (the root holds it)
    _ctx_ref: weakref.ref[_Context] | None  # a nested wrapper's reference to its root's context
    _is_root: bool | None  # None until lazy init
    _outer: weakref.ref[WrapperBase] | None  # the live wrapper built around this one
    _frozen: bool  # .to() / to_empty() pass this wrapper by (while an outer one materializes)
    _reshard_after_forward: bool  # effective value (the root may override the config)
    _pre_backward_done: bool  # this wrapper's pre-backward ran in the current backward
    _views_tracked: bool = (
        False  # its last forward counted saved views: See [Note: releasing kept full parameters]
    )
    _module_param_order: dict[nn.Module, list[str]]  # original parameter order per owned module
    _buffer_dtypes: dict[str, torch.dtype]  # owned buffer name -> its dtype before wrapping
    _ignored: IgnoredStates  # ignored_modules / ignored_states: left alone (See [Note: ignored modules])
    _pending_ties: list[PendingTie]  # places of parameters owned by a wrapper outside this one
    _torch_options: TorchOptions  # built torch FSDP1's way or fairscale's; torch's options as given
    _paths_at_wrap: frozenset[
        str
    ]  # the wrapped module's submodule paths at construction (ignored ones left out)

    _tstart: float  # time.time() at construction, or at the last _print_r0(restart=True)
    _path: str  # the path under the root, for messages (set at the root's lazy init)

    # ------------------------------------------------------------------ state machine
    @property
    def training_state(self) -> TrainingState:
        """Where this wrapper is in the training step (fairscale's attribute)."""
        return cast(TrainingState, self.__dict__["training_state"])

    @training_state.setter
    def training_state(self, state: TrainingState) -> None:
        """The one way the training state changes: ``old -> state`` must be in
        :data:`fsdp.api.TRAINING_TRANSITIONS` (a new wrapper starts IDLE). The value lives in the
        instance ``__dict__`` under its own name, so copies and pickles carry it like any attribute."""
        old = self.__dict__.get("training_state")
        if old is None:
            assert state is TrainingState.IDLE, "a wrapper starts IDLE"
        else:
            check_transition("training state", old, state, TRAINING_TRANSITIONS)
        self.__dict__["training_state"] = state

    def assert_state(self, state: TrainingState | list[TrainingState]) -> None:
        """Raise if this wrapper is not in (one of) ``state``."""
        states = state if isinstance(state, list) else [state]
        if self.training_state not in states:
            raise RuntimeError(
                f"FullyShardedDataParallel: expected training state {' or '.join(s.name for s in states)}, "
                f"but it is {self.training_state.name}"
            )

    @contextlib.contextmanager
    def _state(self, state: TrainingState) -> Iterator[None]:
        """This wrapper in ``state`` for the duration; then back in the state it was in before."""
        previous = self.training_state
        self.training_state = state
        try:
            yield
        finally:
            self.training_state = previous

    def _wrappers(self) -> list[WrapperBase]:
        return [m for m in self.modules() if isinstance(m, WrapperBase)]

    @property
    def _ctx(self) -> _Context | None:
        """The context shared by the tree, set at the root's lazy init. Nested wrappers refer to it
        weakly, so a deleted root is freed and its inner wrappers may go under a new one."""
        if self._own_ctx is not None:
            return self._own_ctx
        return self._ctx_ref() if self._ctx_ref is not None else None

    @property
    def _inside_another(self) -> bool:
        return self._outer is not None and self._outer() is not None

    # ------------------------------------------------------------------ lazy init
    def _context_is_idle(self) -> bool:
        """This root's tree is between steps: every wrapper IDLE, no backward pending, not in no_sync()."""
        ctx = self._ctx
        assert ctx is not None
        return (
            ctx.sync
            and not ctx.callback_queued
            and all(w.training_state is TrainingState.IDLE for w in ctx.wrappers)
        )

    def _release_context(self) -> None:
        """Undo this root's lazy init: its wrappers drop the shared context and any full parameters
        kept from the last forward, and wait for the next forward to find their root."""
        ctx = self._ctx
        assert ctx is not None and self._is_root
        for w in ctx.wrappers:
            for h in w.handles:
                h.reshard(free_full=True)
                h.leave_root()
            w._is_root, w._own_ctx, w._ctx_ref = None, None, None
            w._reshard_after_forward = w.fsdp_config.sharding.reshard_after_forward

    def _lazy_init(self) -> None:
        """On the first forward of the outermost wrapper: become root, share one context, check ranks."""
        if self._ctx is not None:
            if self._is_root and self._ctx.registrations != registrations():
                self._check_modules(
                    self._ctx.wrappers_as_built()
                )  # See [Note: parameters added after wrapping]
            return
        self._require_groups("the first forward")
        wrappers = self._wrappers()
        for w in wrappers[1:]:
            # It ran alone first (an evaluation, say), or under another outer wrapper that holds it too
            # (wrapped again for inference after training): it becomes one of this root's units, and
            # the tree it belonged to is set up again at its next forward.
            other = w._ctx
            if other is None:
                continue
            if not other.wrappers[0]._context_is_idle():
                raise RuntimeError(
                    f"FullyShardedDataParallel: the inner wrapper {wrapper_path(self, w)!r} ran a forward as a "
                    "root of its own and is not done with it (it is inside its own no_sync()), or belongs to "
                    "another wrapper tree in the middle of a step. Finish that step before the outer wrapper's "
                    "first forward"
                )
            other.wrappers[0]._release_context()
        check_no_pending_ties(wrappers, _LIVE)
        ctx = RootContext(DeviceHandle(self.compute_device), wrappers)
        self._check_modules(wrappers, ctx)
        paths = wrapper_paths(self, wrappers)
        for w in wrappers:
            w._path = paths[id(w)]
            w._is_root = w is self
            w._own_ctx = ctx if w._is_root else None
            w._ctx_ref = None if w._is_root else weakref.ref(ctx)
            for h in w.handles:
                ctx.share_with(h)  # (the bytes it holds now are counted from here on)
        sharding = self.fsdp_config.sharding
        self._reshard_after_forward = sharding.reshard_after_forward and not sharding.disable_reshard_on_root
        ctx.fingerprint = check_same_wrappers_on_all_ranks(self, wrappers)
        check_hybrid_grids(self, wrappers)
        check_full_prec_in_eval(wrappers)
        ctx.make_bucketer(self)

    def _check_modules(self, built: Sequence[WrapperBase | None], ctx: _Context | None = None) -> None:
        """Refuse parameters or wrappers added under this root after wrapping. See [Note: parameters
        added after wrapping]."""
        ctx = ctx or self._ctx
        assert ctx is not None
        count = registrations()
        wrappers = self._wrappers()
        if len(wrappers) != len(built) or any(w is not old for w, old in zip(wrappers, built)):
            changed = [wrapper_path(self, w) for w in wrappers if all(w is not old for old in built)]
            raise RuntimeError(
                "FullyShardedDataParallel: the wrappers under this root changed after its first forward"
                + (f" (new: {changed})" if changed else " (one was removed)")
                + "; the root's schedule and rank checks were made for the wrappers it had. Change the model "
                "before wrapping it"
            )
        for w in wrappers:
            if w.training_state is TrainingState.IDLE:  # (a summon shows the full parameters as such)
                for h in w.handles:
                    if h._placeholders_set:  # a replaced attribute gets its own, sharper message
                        h._check_placeholders()
                w._adopt_attached(wrapper_path(self, w) or "<root>")
                check_no_parameters_added(
                    w._fsdp_wrapped_module,
                    lambda m: isinstance(m, WrapperBase),
                    wrapper_path(self, w) or "<root>",
                    w._ignored,
                )
        ctx.registrations = count

    def _adopt_attached(self, where: str) -> None:
        """Ignore the modules attached inside this wrapper after wrapping (torch's skip idiom)."""
        is_wrapper: Callable[[nn.Module], bool] = lambda m: isinstance(m, WrapperBase)  # noqa: E731
        found = attached_after_wrapping(
            self._fsdp_wrapped_module, is_wrapper, self._paths_at_wrap, self._ignored
        )
        if found:
            self._ignored = adopt_attached(self._ignored, found, self._fsdp_wrapped_module, where)

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training_state is TrainingState.SUMMON_FULL_PARAMS:
            return self._forward_in_summon(*args, **kwargs)
        self._lazy_init()
        ctx = self._ctx
        if (
            self._is_root
            and ctx is not None
            and ctx.callback_queued
            and torch._C._current_graph_task_id() == -1
        ):
            clear_aborted_backward(ctx)  # (a backward that raised never reached its end)
        if self.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
            return self._recompute_forward(*args, **kwargs)
        args, kwargs, opened = self._begin_forward(args, kwargs)
        try:
            outputs = self._fsdp_wrapped_module(*args, **kwargs)
            ctx = self._ctx
            if self._is_root and ctx is not None and ctx.check_units:  # every rank ran the same units
                agree_on_entry(
                    self.fsdp_config.comm.dp_group, FORWARD_END
                )  # (See [Note: agreement before communication])
        finally:
            self._end_forward(opened)
        return self._after_forward(outputs, opened.token)

    # (plain methods, not a context manager: under torch.compile the compiler would trace contextlib's
    # frames called from this skipped file)
    def _begin_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any, OpenForward]:
        """Gather for a forward of the wrapped module; return the cast inputs and what
        :meth:`_end_forward` closes. Also run by a call past the wrapper (See [Note: calls past the
        wrapper] in fsdp/wrapper/direct_call.py)."""
        self.assert_state(TrainingState.IDLE)
        assert self._ctx is not None
        if self._is_root:  # See [Note: agreement before communication]
            agree_on_step(self, FORWARD)
            adopt_torch_optimizer_in_backward(self._ctx.wrappers)
        elif self._ctx.check_units:  # a unit, inside the root's forward or called past it
            agree_on_unit(self._ctx.wrappers[0], self)
        set_activity("the forward", self._path)
        grad_enabled = torch.is_grad_enabled()
        precision = self.fsdp_config.precision
        full = self._full_precision_now()
        if not full:
            args, kwargs = self._cast_forward_inputs(args, kwargs)
        scheduler = self._ctx.scheduler
        if self._is_root:
            scheduler.start_iteration()
            for h in self.handles:  # (a backward that raised left them armed)
                h.saved_views.armed = False
        # lives as long as this forward's graph: see [Note: gradient accumulators] in fsdp/core/grad_hooks.py
        token = GraphToken() if grad_enabled else None
        opened = OpenForward(token, record_function("FSDP::forward"))
        self.training_state = TrainingState.FORWARD
        opened.range.__enter__()
        try:
            with record_function("FSDP::all_gather"):
                scheduler.throttle()
                for h in self.handles:
                    h.prefetch(full)
                scheduler.on_forward(self)  # See [Note: prefetch]
                hook = self._ctx.finish_reductions if grad_enabled and self._ctx.sync else None
                for h in self.handles:
                    h.unshard(full)
                    h.use_full_views(as_parameters=False, before_concat=hook)
            if token is not None:
                self._register_post_backward_hooks(token)
            if precision.mixed and self._torch_options.full_prec_in_eval:  # the buffers follow the mode
                buffers_for_mode(self._fsdp_wrapped_module, self._buffer_dtypes, precision.buffer_dtype, full)
            if token is not None and self._releases_kept_full(self._ctx):
                opened.saved = watch_root_forward(self.handles, self._own_region())
                if opened.saved is not None:
                    opened.saved.__enter__()
                    self._views_tracked = True
        except BaseException:
            self._end_forward(opened)
            raise
        return args, kwargs, opened

    def _end_forward(self, opened: OpenForward) -> None:
        """Reshard after a forward (also one that raised) and return to IDLE."""
        ctx = self._ctx
        assert ctx is not None
        try:
            if opened.saved is not None:
                opened.saved.__exit__(None, None, None)
            # Under no_grad no backward follows: nothing is worth keeping. Inside
            # no_sync(keep_full_params=True) the full parameters stay until the next forward.
            # See [Note: no_sync].
            grad_enabled = opened.token is not None
            keep_full = grad_enabled and (not self._reshard_after_forward or (not ctx.sync and ctx.keep_full))
            if keep_full:
                for h in self.handles:
                    h.reshard(free_full=False)
            else:
                self._free_full_params()
            if not keep_full and any(h.gathers for h in self.handles):
                ctx.scheduler.freed()  # See [Note: limit_all_gathers]
            if self._is_root and not grad_enabled:  # (inner wrappers may offload, the root not)
                free_unused_prefetches([h for w in ctx.wrappers for h in w.handles])
                SideCopies.synchronize_all()  # no backward follows to wait for the host copies
        finally:
            self.training_state = TrainingState.IDLE
            opened.range.__exit__(None, None, None)

    def _after_forward(self, outputs: Any, token: GraphToken | None) -> Any:
        if token is not None:
            self._register_pre_backward_hooks(outputs, token)
        if self.fsdp_config.precision.clear_autocast_cache:
            torch.clear_autocast_cache()
        return outputs

    def _recompute_forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward run again during backward: activation checkpointing around this wrapper.

        The parameters are already gathered by the pre-backward hook and are freed by the
        post-backward hook, so this only points the module at them and runs it.
        """
        full = self._full_precision_now()
        if not full:
            args, kwargs = self._cast_forward_inputs(args, kwargs)
        for h in self.handles:
            h.unshard(full)
            h.use_full_views(as_parameters=False)
            if torch.is_grad_enabled():
                h.accumulators.note(None)
        return self._fsdp_wrapped_module(*args, **kwargs)

    def _full_precision_now(self) -> bool:
        """Whether this wrapper's forward (and so its backward and a recomputation) runs in full
        precision now: ``FSDP_USE_FULL_PREC_IN_EVAL=1``, mixed precision, eval mode."""
        mixed = self.fsdp_config.precision.mixed
        return full_precision_in_eval(self._torch_options, mixed, self._fsdp_wrapped_module.training)

    def _cast_forward_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Inputs to the compute dtype: under a ``MixedPrecision`` every floating one, recorded by autograd
        (torch's way); under ``mixed_precision=True`` fp32 ones, the root's cast unrecorded (fairscale's),
        to fp16 when the compute dtype is fp32 (fairscale's rule, for fp32 compute under autocast).
        Or low precision inputs to fp32 under ``force_input_to_fp32``."""
        precision = self.fsdp_config.precision
        if precision.mixed and (
            precision.cast_forward_inputs or (self._is_root and precision.cast_root_forward_inputs)
        ):
            assert precision.param_dtype is not None
            torch_way = precision.torch_input_casts
            target = precision.param_dtype
            if not torch_way and target == torch.float32:
                target = torch.float16
            args, kwargs = cast_inputs(
                (args, kwargs),
                None if torch_way else torch.float32,
                target,
                detach=bool(self._is_root) and not torch_way,
            )
        if precision.force_input_to_fp32:
            for low in (torch.float16, torch.bfloat16):
                args, kwargs = cast_inputs((args, kwargs), low, torch.float32, detach=False)
        return args, kwargs

    def _register_pre_backward_hooks(self, outputs: Any, token: Any = None) -> None:
        hooked = 0
        opaque: list[Any] = []
        pre_backward = OutputHook(self._pre_backward_hook, token)

        def hook(t: torch.Tensor) -> None:
            nonlocal hooked
            if t.requires_grad:
                t.register_hook(pre_backward)  # type: ignore[no-untyped-call]
                hooked += 1

        visit_tensors(outputs, hook, opaque)
        if hooked == 0 and opaque and any(h.requires_grad for h in self.handles):
            raise TypeError(
                f"FullyShardedDataParallel: cannot find the tensors in the output of {type(self._fsdp_wrapped_module).__name__} "
                f"(found {', '.join(sorted({type(o).__name__ for o in opaque}))}); return tensors in a tuple, list, "
                "dict, namedtuple or dataclass so that backward can be hooked"
            )

    # ------------------------------------------------------------------ backward
    def _pre_backward_hook(self, grad: torch.Tensor) -> torch.Tensor:
        """Runs when the first gradient of one of this wrapper's outputs is computed."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                "FullyShardedDataParallel does not support backward with create_graph=True (higher-order "
                "gradients): the full parameters are freed during backward. Use create_graph=False"
            )
        ctx = self._ctx
        assert ctx is not None
        if not ctx.callback_queued:
            agree_on_step(ctx.wrappers[0], BACKWARD)  # (the first hook of this backward)
            ctx.callback_queued = True
            root = ctx.wrappers[0]
            queue_end_of_backward(root._finalize_backward, "FullyShardedDataParallel")
            if ctx.sync and ctx.bucketer is not None:
                ctx.bucketer.begin_backward()
        for h in [h for h in ctx.in_flight if h.finish_soon and h.reduction_finishable]:
            ctx.in_flight.remove(h)
            h.finish_soon = False
            h.finalize_gradient()
        if self._pre_backward_done:
            return grad
        self.assert_state([TrainingState.IDLE, TrainingState.BACKWARD_PRE])
        self.training_state = TrainingState.BACKWARD_PRE
        self._pre_backward_done = True
        set_activity("the backward", self._path)
        # Views with autograd history, for a forward recomputed inside this backward (activation
        # checkpointing inside the wrapper reads the module's attributes again).
        # as its forward did: a full-precision one (eval mode still) saved views of the fp32 full buffer
        full = self._full_precision_now()
        with torch.enable_grad(), record_function("FSDP::pre_backward"):
            for h in self.handles:
                h.prefetch(full)
            ctx.scheduler.on_backward(self)  # the next unit's gather overlaps this backward
            for h in self.handles:
                h.unshard(full)
                h.prepare_gradient_for_backward()
                h.use_full_views(as_parameters=False)
                h.accumulators.note(None)  # (a forward recomputed in this backward reads these views)
        if self._views_tracked:  # See [Note: releasing kept full parameters] in fsdp/core/saved_views.py
            for h in self.handles:
                h.saved_views.arm()
        return grad

    def _own_region(self) -> set[int]:
        """Ids of the modules below this wrapper and not below an inner wrapper."""
        region: set[int] = set()
        stack: list[nn.Module] = [self._fsdp_wrapped_module]
        while stack:
            m = stack.pop()
            region.add(id(m))
            stack.extend(c for c in m.children() if not isinstance(c, WrapperBase))
        return region

    def _releases_kept_full(self, ctx: _Context) -> bool:
        """Whether this forward counts the saved views of full parameters kept into backward, to free
        them once used: the root's, when it keeps them (``reshard_after_forward=False``, its default),
        outside ``no_sync()``. See [Note: releasing kept full parameters]."""
        return bool(self._is_root) and ctx.sync and not self._reshard_after_forward

    def _keeps_full_in_no_sync(self, ctx: _Context) -> bool:
        """Whether this wrapper keeps its full parameters between micro-batches inside no_sync():
        the root and ``reshard_after_forward=False`` do (as outside), every unit does with
        ``keep_full_params=True``."""
        return ctx.keep_full or not self._reshard_after_forward

    def _make_post_backward_hook(self, handle: FlatParamHandle) -> Callable[[], None]:
        # weak references: the handle keeps this alive, and the AccumulateGrad nodes' hooks reach it;
        # holding the wrapper here would keep the wrapper (and its shards) alive for good
        wrapper, unit = weakref.ref(self), weakref.ref(handle)

        def post_backward_hook() -> None:
            w, h = wrapper(), unit()
            if w is not None and h is not None:
                w._post_backward(h)

        return post_backward_hook

    def _post_backward(self, handle: FlatParamHandle) -> None:
        if self.training_state not in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
            raise RuntimeError(
                f"FullyShardedDataParallel: a gradient reached the parameters of {type(self._fsdp_wrapped_module).__name__} "
                f"outside of its backward (state {self.training_state.name}); its outputs were not hooked. "
                "Compute the loss from the outputs of the FSDP forward"
            )
        ctx = self._ctx
        assert ctx is not None
        if handle.reduced_this_backward:  # (a part of its gradient came after the reduction)
            raise RuntimeError(
                resharded_in_backward(
                    f"a gradient reached the parameters of {wrapper_path(ctx.wrappers[0], self)!r}"
                )
            )
        self.training_state = TrainingState.BACKWARD_POST
        set_activity("the gradient reduction", self._path)
        index = ctx.bucket_index.get(id(handle)) if ctx.sync and ctx.bucketer is not None else None
        released = handle.released  # (its full parameter freed in this backward: it steps at once)
        with record_function("FSDP::post_backward"):
            if handle.linked_views:  # See [Note: linked parameters] in fsdp/core/param_attrs.py
                handle.fold_hand_set_grads()
            handle.reduce_grad(
                sync=ctx.sync, bucketed=index is not None, keep_full=self._keeps_full_in_no_sync(ctx)
            )
            # (its full parameter was freed early: it steps at the next pre-backward, when autograd
            # has let go of its full gradient; See [Note: releasing kept full parameters])
            handle.finish_soon = released and handle.reduction_pending
            # Finish older reductions as backward goes on, freeing their full gradients now rather
            # than at the end of backward: at most one sent reduction stays in flight.
            if handle.reduction_pending:
                ctx.in_flight.append(handle)
            # (one queued in a bucket, not sent yet, holds up none sent after it)
            for h in [h for h in list(ctx.in_flight)[:-1] if h.reduction_launched]:
                ctx.in_flight.remove(h)
                h.finalize_gradient(asynchronous=True)
        if handle.gathers:
            ctx.scheduler.freed()
        if index is not None:
            assert ctx.bucketer is not None
            ctx.bucketer.grad_ready(index)
        if all(h.reduced_this_backward for h in self.handles if h.requires_grad):
            for h in self.handles:
                if not h.requires_grad:
                    h.reshard(free_full=True)
            ctx.scheduler.after_backward(self)  # backward_prefetch_post (torch's BACKWARD_POST)

    def _finalize_backward(self) -> None:
        """End-of-backward callback (queued once per backward). Runs on the root."""
        with record_function("FSDP::finalize_backward"):
            self._finalize_backward_body()

    def _finalize_backward_body(self) -> None:
        ctx = self._ctx
        assert ctx is not None
        ctx.callback_queued = False
        set_activity("the end of backward")
        try:
            if ctx.sync:  # inside no_sync nothing was reduced, and nothing may be communicated
                if ctx.bucketer is not None:
                    # first, so a rank that skipped a unit sends its bucket too (see the function)
                    finish_no_shard_buckets(ctx.bucketer, ctx.bucket_index, ctx.wrappers)
                check_same_reductions_on_all_ranks(self, ctx.wrappers, ctx.stats)
            handles = [h for w in ctx.wrappers for h in w.handles]
            for h in handles:  # queue every host copy (offload on CUDA) before waiting for any
                h.finalize_gradient(asynchronous=True)
            for w in ctx.wrappers:
                free = ctx.sync or not w._keeps_full_in_no_sync(ctx)
                for h in w.handles:
                    if h.linked_views:
                        h.check_no_hand_set_grads(wrapper_path(ctx.wrappers[0], w))
                    # shard first: a handle that got no gradient in this backward (an unused parameter,
                    # alone in its flat parameter) gets its earlier shard gradient back, shard-shaped
                    h.reshard(free_full=free)
                    h.finalize_gradient()
                    if h.on_reduced is not None and h.grad_state is GradState.REDUCED:
                        h.on_reduced(h)  # (reduced while its full parameter was still in use)
        finally:
            end_backward_states(ctx)


def get_fsdp_instances(module: nn.Module, skip_empty: bool = False) -> list[WrapperBase]:
    """Every FullyShardedDataParallel inside ``module`` (itself included), outermost first; with
    ``skip_empty``, only those that own parameters."""
    found = [m for m in module.modules() if isinstance(m, WrapperBase)]
    return [m for m in found if m.handles] if skip_empty else found
