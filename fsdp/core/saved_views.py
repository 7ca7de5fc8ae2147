"""Free a full parameter kept through backward once autograd has used every view of it that it saved.

[Note: releasing kept full parameters]
A unit that keeps its full parameter from forward into backward (the root, whose backward starts as
soon as its forward ends; ``reshard_after_forward=False``) holds it until the end of backward. For a
GPT's root (the embedding and the output head) that is the largest unit, held while every block runs
its backward, although the head's backward, which reads it, runs first, and an embedding's backward
reads no weight at all. At the end of backward, where the root's gradients are concatenated beside
every other unit's gradient shard, and through the whole backward when the optimizer steps in it,
that memory sits at the peak.

So the root's forward (when it keeps its full parameters: ``reshard_after_forward=False``, its
default; outside ``no_sync()``) counts the tensors autograd saves that are views of its full buffers: a ``saved_tensors_hooks`` pair wraps each such tensor in a :class:`_Saved`
(the same tensor, nothing copied) whose end is counted. Autograd drops a saved tensor once its node
has run (``retain_graph=False``). When the count is back to zero after the unit's pre-backward hook,
nothing autograd holds reads the full buffer any more: the handle frees it
(:meth:`FlatParamHandle.release_full_early`), the module attributes become placeholders, and the
gradient still flows into the flat parameter (a split's backward reads no data). Anything that needs
the full parameter again in this backward (another pre-backward hook, a forward recomputed under
activation checkpointing) gathers it again.

Nothing is released early where the count cannot be trusted: under hooks of the user's own
(``save_on_cpu``; only the innermost pair of hooks runs, so ours would replace theirs), inside a
``torch.compile``d call (a compiled backward may rebuild views of a parameter from its storage),
after a module of the root's own region ran checkpointed (see :class:`RootForwardWatch`), and while
a graph kept with ``retain_graph=True`` holds its saved tensors. A view the user holds outside
autograd and reads after the release raises (the storage is empty), it is never stale.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp.api import MemoryState
from fsdp.core.flat_param import set_module_tensor
from fsdp.core.param_attrs import carry_attributes

if TYPE_CHECKING:
    from fsdp.core.handle import FlatParamHandle

__all__ = ["RootForwardWatch", "SavedViews", "watch_root_forward"]


class SavedViews:
    """How many views of one handle's full buffer autograd holds; frees the buffer when none is left
    after :meth:`arm` (the handle's backward has begun)."""

    def __init__(self, handle: FlatParamHandle) -> None:
        self._handle = weakref.ref(handle)
        self.count = 0
        self.armed = False
        self.unsure = False  # a call in the forward the count cannot follow: nothing released

    def dropped(self) -> None:
        self.count -= 1
        if self.count == 0 and self.armed:
            self._release()

    def arm(self) -> None:
        """The handle's backward has begun: release as soon as no saved view is left (now if none is)."""
        self.armed = not self.unsure
        if self.armed and self.count == 0:
            self._release()

    def _release(self) -> None:
        self.armed = False
        handle = self._handle()
        if handle is not None:
            handle.release_full_early()


class _Saved:
    """A saved view of a tracked full buffer: the tensor itself, and a count of its end."""

    __slots__ = ("tensor", "views")

    def __init__(self, tensor: torch.Tensor, views: SavedViews) -> None:
        self.tensor, self.views = tensor, views
        views.count += 1

    def __del__(self) -> None:
        self.views.dropped()


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved  # type: ignore[no-any-return]


class RootForwardWatch:
    """What the root's forward installs while it runs (``with``): the saved-tensor hooks counting
    the saved views of ``handles``' full buffers, and a hook on every module call that (1) notes a
    call the count cannot follow, and (2) gives a module owning the one parameter of a handle a view
    made as it is called.

    (1) A call of a module of the root's own region (``region``: below the root, not below an inner
    wrapper) under hooks other than ours (an activation-checkpointed region: its own hooks save the
    tensors, and its backward runs the forward again, reading the module attributes), of a module
    whose ``forward`` was replaced on the instance (checkpoint wrappers that patch it in place), or
    with gradients disabled inside a forward that records them (reentrant checkpointing) makes the
    handles *unsure*: nothing is released in the backward that follows. Inner wrappers gather their
    own parameters again for a recomputation, so their checkpointed blocks change nothing.

    (2) A view made at the wrapper's pre-forward carries the sequence number of that moment, and
    autograd runs the ready node with the highest number first: under a root whose forward calls
    the blocks in between, the root head's gradient would wait for every block's backward before it
    reaches its flat parameter. A view made as its module is called is ordered with that module's
    own operations. Only handles of one parameter (``flatten_parameters=False``): a slice of a larger
    flat parameter would have a backward the size of the whole flat parameter.
    """

    def __init__(self, handles: list[FlatParamHandle], region: set[int]) -> None:
        self._views = [h.saved_views for h in handles]
        self._region = region
        by_storage: dict[int, SavedViews] = {}
        for h in handles:
            if h._full.untyped_storage().nbytes() != 0:  # (keyed by the storage itself: also on meta)
                by_storage[h._full.untyped_storage()._cdata] = h.saved_views

        def pack(t: torch.Tensor) -> Any:
            try:
                views = by_storage.get(t.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):  # (a tensor without a storage of its own)
                return t
            return t if views is None else _Saved(t, views)

        self._pack = pack
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        self._owners: dict[int, list[tuple[FlatParamHandle, str, torch.Size]]] = {}
        for h in handles:
            if len(h.meta.params) == 1 and not h.meta.shared and not h.aliased and not h.linked_views:
                info = h.meta.params[0]
                self._owners.setdefault(id(h.modules[0]), []).append((h, info.param_name, info.shape))
        self._module_hook: RemovableHandle | None = None

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if id(module) not in self._region:
            return
        top = _TOP(False)
        # (a forward replaced on the instance: fairscale's and this library's checkpoint_wrapper
        # patch it so, and push their hooks inside it, after this hook ran)
        patched = "forward" in module.__dict__
        if patched or top is None or top[0] is not self._pack or not torch.is_grad_enabled():
            for views in self._views:
                views.unsure = True
            return
        for h, name, shape in self._owners.get(id(module), ()):
            if h.state is MemoryState.UNSHARDED and not h.released:
                flat = h.flat_param
                part = flat if flat.numel() == shape.numel() else flat[: shape.numel()]
                view = carry_attributes(part.view(shape), h.meta.params[0])
                set_module_tensor(module, name, view, as_parameter=False)

    def __enter__(self) -> RootForwardWatch:
        self._hooks.__enter__()
        self._module_hook = nn.modules.module.register_module_forward_pre_hook(self._pre_forward)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._module_hook is not None:
            self._module_hook.remove()
            self._module_hook = None
        self._hooks.__exit__(None, None, None)


_TOP: Callable[[bool], Any] = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: ())


def _under_compile() -> bool:
    """Whether this forward runs inside a ``torch.compile``d call (the compiler's frame callback is
    set; our frames run eagerly but the modules' forwards are compiled): their backward may rebuild
    views of the parameters from their storage, which the count cannot follow. True when torch does
    not say."""
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    get = getattr(frames, "get_eval_frame_callback", None)
    return get is None or get() is not None


def watch_root_forward(handles: list[FlatParamHandle], region: set[int]) -> RootForwardWatch | None:
    """A :class:`RootForwardWatch` over ``handles`` and the ids of the modules of the root's own
    ``region`` (not entered), or None when nothing can be
    tracked: no full buffer allocated, saved-tensor hooks disabled, or hooks of someone else's
    active (``save_on_cpu``: only the innermost pair runs, so ours would replace them)."""
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    if enabled is None or not enabled() or _TOP(False) is not None or _under_compile():
        return None
    if all(h._full.untyped_storage().nbytes() == 0 for h in handles):
        return None
    return RootForwardWatch(handles, region)
