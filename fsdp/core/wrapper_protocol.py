"""What the wrapper's mixins and the modules below it may use of a wrapper: a typed ``Protocol``.

``FullyShardedDataParallel`` is assembled from mixins (``wrapper/state_methods.py``, ``wrapper/stats_methods.py``,
``wrapper/fairscale_attrs.py``, ``wrapper/summon_methods.py``, ``wrapper/direct_call.py``, ``wrapper/torch_methods.py``,
``wrapper/module_ops.py``), and
modules below it in the layering (``state/state_dict.py``, ``wrapper/shared_params.py``, ``wrapper/torch_compat.py``)
act on wrappers they are given. None of them may import the wrapper (it imports them), so they
reach it through :class:`Wrapper`, which declares, with their types, exactly the members they use
that another class defines (the wrapper itself, or another mixin). The modules' functions take
``Wrapper`` arguments. Each mixin derives from :data:`WrapperMixin`, which mypy reads as
``Wrapper`` (inside a mixin ``self`` has every declared member) and which is ``object`` at run
time (a mixin defines only its own members). The wrapper derives from the mixins, so mypy checks
each of its definitions against the declared type and refuses to construct it while a declared
member is missing. No mixin holds a stand-in for a member another class defines, so the order of
the wrapper's bases cannot change what a name resolves to (``tests/unit/test_layout.py`` checks it).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from fsdp.api import FSDPConfig, StateDictSettings, TorchOptions, TrainingState
from fsdp.comm.collectives import CommStats
from fsdp.core.flat_param import IgnoredStates, PendingTie
from fsdp.core.grad_hooks import GraphToken
from fsdp.core.handle import FlatParamHandle, MemoryStats
from fsdp.core.layout import Layout

__all__ = ["TreeContext", "Wrapper", "WrapperMixin", "as_module"]


class TreeContext(Protocol):
    """The state a root shares with every wrapper of its tree (``fsdp.wrapper.root_context.RootContext``)."""

    stats: CommStats  # collective calls and bytes of every wrapper in the tree
    memory: MemoryStats  # unshard buffers of every wrapper in the tree, now and at the peak
    sync: bool  # False inside the root's no_sync()
    keep_full: bool  # inside no_sync(keep_full_params=True): every unit keeps its full parameters

    @property
    def wrappers(self) -> Sequence[Wrapper]:
        """Root first, then the nested wrappers in module order."""


class Wrapper(Protocol):
    """A ``FullyShardedDataParallel``, as its mixins and helper modules see it."""

    # ------------------------------------------------------------------ state
    fsdp_config: FSDPConfig
    handles: list[FlatParamHandle]  # this wrapper's flat parameters
    training_state: TrainingState
    _fsdp_wrapped_module: nn.Module
    _module_param_order: dict[nn.Module, list[str]]  # original parameter order per owned module
    _buffer_dtypes: dict[str, torch.dtype]  # owned buffer name -> its dtype before wrapping
    _ignored: IgnoredStates  # ignored_modules / ignored_states
    _torch_options: TorchOptions  # built torch FSDP1's way or fairscale's
    _state_dict_settings: StateDictSettings  # what state_dict() / load_state_dict() mean
    _summon_rank0_only: bool  # inside a summon_full_params(rank0_only=True)
    _is_root: bool | None  # None until lazy init
    _reshard_after_forward: bool  # effective value (the root may override the config)
    _frozen: bool  # .to() / to_empty() pass this wrapper by (while an outer one materializes)
    _original_params: weakref.WeakValueDictionary[int, nn.Parameter]  # the parameters it flattened
    _original_names: dict[int, str]  # id of an original parameter -> its first name
    _pending_ties: list[PendingTie]  # places of parameters owned by a wrapper outside this one

    @property
    def _ctx(self) -> TreeContext | None:
        """The context shared by the tree, set at the root's lazy init."""

    @property
    def _inside_another(self) -> bool:
        """Whether a live wrapper was built around this one."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def rank(self) -> int: ...

    @property
    def compute_device(self) -> torch.device: ...

    # ------------------------------------------------------------------ the wrapper's own methods
    def _wrappers(self) -> Sequence[Wrapper]:
        """This wrapper and every wrapper inside it, outermost first."""

    def assert_state(self, state: TrainingState | list[TrainingState]) -> None: ...

    def _state(self, state: TrainingState) -> contextlib.AbstractContextManager[None]: ...

    def _lazy_init(self) -> None: ...

    def _context_is_idle(self) -> bool: ...

    def _release_context(self) -> None: ...

    def _state_layout(self, root: nn.Module | None = None) -> Layout: ...

    def _build_handles(
        self, owned: list[tuple[str, nn.Parameter]], module_of: dict[str, nn.Module]
    ) -> None: ...

    def _make_post_backward_hook(self, handle: FlatParamHandle) -> Callable[[], None]: ...

    def _register_live(self) -> None: ...

    # a forward in three steps (also entered past the wrapper, see fsdp/wrapper/direct_call.py); the opened
    # forward is an ``fsdp.wrapper.direct_call.OpenForward``, which a module above that one cannot name
    def _begin_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any, Any]: ...

    def _end_forward(self, opened: Any) -> None: ...

    def _after_forward(self, outputs: Any, token: GraphToken | None) -> Any: ...

    # ------------------------------------------------------------------ one mixin's, used by others
    def _require_groups(self, what: str) -> None: ...

    def _bind(self, group: Any) -> None: ...

    def _bind_reduce_scatter(self, group: Any) -> None: ...

    def _state_dict_device(self) -> torch.device: ...

    def _full_params_shown(self) -> contextlib.AbstractContextManager[None]: ...

    def _show_full_params(self, show: bool = True, with_grads: bool = False) -> None: ...

    def _hide_full_params(self, write_back: bool) -> None: ...

    def memory_stats(self) -> dict[str, int]: ...

    def _check_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor], caller: Wrapper) -> None: ...

    def summon_full_params(self, recurse: bool = True) -> contextlib.AbstractContextManager[None]: ...


def as_module(wrapper: Wrapper) -> nn.Module:
    """``wrapper`` as the ``nn.Module`` it is (a protocol cannot derive from a class to say so)."""
    return cast(nn.Module, wrapper)


if TYPE_CHECKING:  # for mypy a mixin is a Wrapper: it may use every member the protocol declares
    WrapperMixin = Wrapper
else:  # at run time a plain base: the mixins define only their own members
    WrapperMixin = object
