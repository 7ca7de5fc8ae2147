"""Calls into a wrapped module that bypass its wrapper gather what they need, mixed into the wrapper.

[Note: calls past the wrapper]
Code often calls a wrapped module without going through its wrapper: Hugging Face's
``model.generate()`` (forwarded by the wrapper's ``__getattr__`` to the inner module) calls the inner
module's own ``__call__``; a method of the wrapped module calls ``self(...)`` or a submodule; a user
calls ``model.module(x)``. Between forwards the parameters there are sharded placeholders (see
[Note: sharded placeholders] in ``fsdp/core/flat_param.py``), so such a call used to fail. torch's
``fully_shard`` hooks the module itself; here every wrapper puts a forward pre-hook and an
always-called forward hook on the modules of its *region* (its wrapped module, and every module
below it, up to the inner wrappers, that owns or contains one of its parameters). A hook does
nothing while its wrapper is not IDLE (its own forward, a recomputation in backward, a summon: the
module attributes are real then), so in training it costs one state check per hooked call. When a
call enters an IDLE wrapper's region, the pre-hook runs the wrapper's own forward preamble (lazy
init, the input casts, the all-gather, the schedule) with that module as the *entry*, and the hook
after the entry module's call runs the wrapper's forward epilogue: it reshards as a forward does and
hooks the outputs for backward, so training through these calls works as through the wrapper.
Only the wrappers whose regions a call enters are gathered, and each only for that call: inner
units gather in their own forwards as usual. A call of the entry module inside itself (recursion)
is counted, and only the outermost one ends the forward. A module wrapped again while its first
wrapper lives (inference after training) carries the hooks of both; a hook does nothing while
another wrapper hooked on the module is in a step, so the wrapper that runs the module (or, called
directly, the newer one, whose hook comes first) gathers. Reading ``layer.weight`` outside any call
still meets the placeholder's error: nothing is gathered for a read.

The hooks hold their wrapper weakly (the module is the wrapper's child: a strong reference would be
a reference cycle); a hook whose wrapper is gone does nothing. A deep copy of the wrapper gives the
copied modules hooks on the copied wrapper; a pickle keeps the wrapper with its modules.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp.api import TrainingState
from fsdp.core.flat_param import IgnoredStates
from fsdp.core.grad_hooks import GraphToken
from fsdp.core.wrapper_protocol import WrapperMixin

__all__ = ["DirectCallHooks", "DirectCallMethods", "OpenForward", "region_modules"]


class DirectCallHooks:
    """The forward pre-hook and forward hook one wrapper puts on the modules of its region.

    See [Note: calls past the wrapper]."""

    __slots__ = ("_wrapper",)

    _wrapper: Callable[[], DirectCallMethods | None]

    def __init__(self, wrapper: DirectCallMethods | None) -> None:
        self._wrapper = weakref.ref(wrapper) if wrapper is not None else lambda: None

    def before(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if torch.compiler.is_compiling():  # a compiled forward: called from the wrapper's (eager) forward
            return None
        w = self._wrapper()
        if w is None:
            return None
        call = w._direct_call
        if call is not None:
            if module is call.entry:  # the entry module called inside itself
                call.depth += 1
            return None
        if w.training_state is not TrainingState.IDLE:  # its forward, a recomputation, a summon
            return None
        if self._another_wrapper_runs(module):  # a module wrapped again: the newer wrapper called it
            return None
        args, kwargs = w._enter_direct_call(module, args, kwargs)
        # the entry module's end: a forward hook for this call only (torch runs the hooks registered
        # by the time forward returns, and an always-called one when the call raises), so modules carry
        # no forward hook otherwise (torch.compile would specialize on every module's hook ids)
        assert w._direct_call is not None
        w._direct_call.end = module.register_forward_hook(self.after, with_kwargs=True, always_call=True)
        return args, kwargs

    def _another_wrapper_runs(self, module: nn.Module) -> bool:
        """Whether another live wrapper hooked on ``module`` is in a forward (or any step) now: a
        module wrapped a second time (fairscale's test_fsdp_multiple_wrapping) carries the hooks of
        both wrappers, and only the one running it gathers. Checked on the rare entry path only."""
        for hook in module._forward_pre_hooks.values():
            other = getattr(hook, "__self__", None)
            if isinstance(other, DirectCallHooks) and other is not self:
                w = other._wrapper()
                if w is not None and w.training_state is not TrainingState.IDLE:
                    return True
        return False

    def after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        w = self._wrapper()
        call = w._direct_call if w is not None else None
        if call is None or module is not call.entry:
            return None
        call.depth -= 1
        if call.depth > 0:
            return None
        assert w is not None
        return w._exit_direct_call(output)

    def __deepcopy__(self, memo: dict[int, Any]) -> DirectCallHooks:
        # the copy of the wrapper when the wrapper is being copied (it is in the memo by now)
        w = self._wrapper()
        return DirectCallHooks(memo.get(id(w)) if w is not None else None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (DirectCallHooks, (self._wrapper(),))


class OpenForward:
    """A forward of a wrapper between its start and its end (``_begin_forward`` / ``_end_forward``)."""

    __slots__ = ("range", "saved", "token")

    def __init__(self, token: GraphToken | None, range: contextlib.AbstractContextManager[Any]) -> None:
        self.token = token  # the forward's GraphToken (None under no_grad: no backward follows)
        self.range = range  # the profiler range FSDP::forward, entered
        self.saved: Any = None  # the root's RootForwardWatch (fsdp/core/saved_views.py), entered


class DirectCall:
    """A forward entered past the wrapper: where it entered and what ends it."""

    __slots__ = ("depth", "end", "entry", "opened")

    def __init__(self, entry: nn.Module, opened: OpenForward) -> None:
        self.entry = entry  # the module whose call entered the region
        self.depth = 1  # calls of the entry module still running (recursion)
        self.opened = opened
        self.end: RemovableHandle | None = None  # the forward hook on the entry module that ends the call


def region_modules(
    root: nn.Module, owning: set[int], is_wrapper: Callable[[nn.Module], bool], ignored: IgnoredStates
) -> list[nn.Module]:
    """``root`` and every module below it, not entering wrappers or ignored modules, that is in
    ``owning`` (ids of the modules holding the wrapper's parameters) or contains one."""
    order: list[nn.Module] = []
    stack = [root]
    seen: set[int] = set()
    while stack:  # pre-order; children after their parent
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        order.append(m)
        stack.extend(
            c for c in m.children() if not is_wrapper(c) and not ignored.has_module(c) and id(c) not in seen
        )
    wanted = {id(root)}
    for m in reversed(order):  # children before parents
        if id(m) in owning or any(id(c) in wanted for c in m.children()):
            wanted.add(id(m))
    return [m for m in order if id(m) in wanted]


class DirectCallMethods(WrapperMixin):
    """Hooks the wrapper's region so calls past the wrapper gather. See [Note: calls past the wrapper]."""

    _direct_call: DirectCall | None = None  # the forward entered past the wrapper, while it runs
    _direct_hooks: list[RemovableHandle]  # the forward pre-hooks on the modules of the region

    def _hook_direct_calls(self, is_wrapper: Callable[[nn.Module], bool]) -> None:
        """Put the hooks on the modules of this wrapper's region (at construction)."""
        owning = {id(m) for h in self.handles for m in (*h.modules, *h.shared_modules)}
        hooks = DirectCallHooks(self)
        self._direct_hooks = []
        for m in region_modules(self._fsdp_wrapped_module, owning, is_wrapper, self._ignored):
            # first among the pre-hooks, so the parameters are real for any hook registered before
            self._direct_hooks.append(
                m.register_forward_pre_hook(hooks.before, prepend=True, with_kwargs=True)
            )

    def _enter_direct_call(self, entry: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self._lazy_init()
        args, kwargs, opened = self._begin_forward(args, kwargs)
        self._direct_call = DirectCall(entry, opened)
        return args, kwargs

    def _exit_direct_call(self, output: Any) -> Any:
        call, self._direct_call = self._direct_call, None
        assert call is not None and call.end is not None
        call.end.remove()
        self._end_forward(call.opened)  # (also when the call raised: torch runs this hook, then raises)
        return self._after_forward(output, call.opened.token)
