"""The optimizer step inside backward: each unit's shard is updated as soon as its reduced gradient is
ready, and the gradient is freed at once.

[Note: optimizer in backward]
A usual step holds every unit's gradient shard until ``optimizer.step()``, and the step itself
allocates temporaries over the whole shard (AdamW's ``foreach`` intermediates): together about the
size of the parameter shards again, at the peak of the step. :func:`optimizer_in_backward` gives each
flat parameter an optimizer of its own and hooks its handle (``FlatParamHandle.on_reduced``): when the
handle's gradient of this backward is reduced and set on the shard, and the shard is what
``flat_param.data`` is (the handle resharded), the inner optimizer steps that one flat parameter and
``.grad`` is set to None. A unit that keeps its full parameter through backward (the root,
``reshard_after_forward=False``) steps at the end of backward, right after it reshards, and so do
small gradients that share a reduce-scatter bucket (``bucket_cap_mb``; only gradients under 1 MiB are
bucketed) or a NO_SHARD bucket, which are reduced at the end. So at most a unit's gradient (plus
those whose reduction is in flight, and the small ones) and one flat parameter's optimizer
temporaries are alive at a time.

What the user holds is one ``torch.optim.Optimizer`` over ``model.parameters()`` (the same parameters
a usual optimizer gets), so LR schedulers, ``state_dict()`` and this library's checkpoint and
optimizer-state functions work on it. Its ``param_groups`` hold the hyperparameters: before each
inner step they are copied into the inner optimizer (a scheduler's learning rate applies at the next
step), and every inner optimizer shares the outer one's ``state`` (keyed by parameter, so one dict
holds all). Its ``step()`` steps only what backward did not: parameters no wrapper manages
(``ignored_modules``) and any gradient set by hand. Inside ``no_sync()`` nothing is reduced, so
nothing steps; the backward that reduces steps the accumulated gradient.

The math per parameter is the inner optimizer's: for SGD, Adam and AdamW on the CPU it is bit for bit
the usual step's (both run the single-tensor implementation); on CUDA the usual step over many
tensors takes torch's ``foreach`` path and this one over one tensor at a time, which torch computes
with the same kernels. What needs every gradient before any step cannot work: ``clip_grad_norm_()``
over the shards and ``ShardedGradScaler`` (its check for inf skips a step that has already happened)
raise a ``RuntimeError`` naming this.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fsdp.common import memory_tags
from fsdp.core.handle import FlatParamHandle
from fsdp.wrapper.base import WrapperBase

__all__ = ["OptimizerInBackward", "any_optimizer_in_backward", "optimizer_in_backward"]

# every live optimizer stepping in backward (ShardedGradScaler and clip_grad_norm_ refuse to run beside one)
_LIVE: weakref.WeakSet[OptimizerInBackward] = weakref.WeakSet()


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer over the model's parameters whose flat parameters step in backward.
    Made by :func:`optimizer_in_backward`; see [Note: optimizer in backward]."""

    _inner: dict[nn.Parameter, torch.optim.Optimizer]  # one per parameter, over that parameter alone
    _group_of: dict[nn.Parameter, int]  # parameter -> index of its group in param_groups
    _handles: list[FlatParamHandle]  # the handles hooked (on_reduced)
    _constructed: bool  # past the constructor: a further add_param_group() is refused

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        handles: list[FlatParamHandle],
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
    ) -> None:
        self._constructed = False  # (torch's constructor adds the one group through add_param_group)
        params = list(params)
        if not params:
            raise ValueError("optimizer_in_backward: the model has no parameters to optimize")
        self._inner = {p: optimizer_class([p], **optimizer_kwargs) for p in params}
        defaults = dict(next(iter(self._inner.values())).defaults)
        super().__init__(params, defaults)
        self._optimizer_class = optimizer_class
        self._group_of = {p: 0 for p in params}
        self._handles = handles
        self._constructed = True
        for h in handles:
            h.on_reduced = self._on_reduced
        _LIVE.add(self)

    def _step_one(self, p: nn.Parameter) -> None:
        """Step ``p`` with its own optimizer, the current hyperparameters and the shared state; free its gradient."""
        inner = self._inner[p]
        group = self.param_groups[self._group_of[p]]
        inner.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        inner.state = self.state  # (load_state_dict() replaces the outer one's dict)
        with memory_tags.stepping():
            inner.step()
        p.grad = None

    def _on_reduced(self, handle: FlatParamHandle) -> None:
        """The handle's gradient of this backward is reduced: step now if the shard is the parameter's
        data (resharded); the end of backward calls again once it is."""
        p = handle.flat_param
        if p not in self._inner or not handle.reduced_onto_shard():
            return  # (none, or the full parameter still shown: stepped at the end of backward)
        with torch.no_grad():
            self._step_one(p)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step what backward did not (parameters no wrapper manages, gradients set by hand)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p)
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._constructed:
            raise RuntimeError(
                "optimizer_in_backward: add_param_group() is not supported; call optimizer_in_backward again "
                "for the new parameters' model, or use a usual optimizer"
            )
        super().add_param_group(param_group)

    def detach_(self) -> None:
        """Stop stepping in backward (the handles' hooks removed); ``step()`` then steps everything."""
        for h in self._handles:
            if h.on_reduced == self._on_reduced:
                h.on_reduced = None
        _LIVE.discard(self)


def any_optimizer_in_backward() -> bool:
    """Whether an optimizer that steps in backward is alive in this process."""
    return len(_LIVE) > 0


def optimizer_in_backward(
    model: nn.Module, optimizer_class: type[torch.optim.Optimizer], **optimizer_kwargs: Any
) -> OptimizerInBackward:
    """An optimizer over ``model.parameters()`` whose update of each unit's shard runs in backward, as
    soon as that unit's reduced gradient is ready, after which the gradient is freed.

    ``model`` holds wrappers (a wrapper, or a plain module around some); ``optimizer_class(params,
    **optimizer_kwargs)`` is what a usual optimizer would be (``torch.optim.AdamW, lr=1e-3``). The
    result is a ``torch.optim.Optimizer``: pass it to LR schedulers and checkpoints as usual; its
    ``step()`` has nothing left to do after a backward (call it anyway: it steps parameters no
    wrapper manages). Example::

        model = FSDP(net)
        optim = fsdp.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3)
        for x in data:
            model(x).sum().backward()  # each unit's shard is updated here
            optim.step()  # (nothing left for wrapped parameters)
            optim.zero_grad()

    See [Note: optimizer in backward] for what it composes with and what it refuses.
    """
    if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer_in_backward takes an optimizer class (torch.optim.AdamW), got {optimizer_class!r}; "
            "pass its arguments as keywords: optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3)"
        )
    wrappers = [m for m in model.modules() if isinstance(m, WrapperBase)]
    if not wrappers:
        raise ValueError(
            "optimizer_in_backward: the model holds no FullyShardedDataParallel wrapper; wrap it first "
            "(a plain model steps in backward with torch's own hooks: register_post_accumulate_grad_hook)"
        )
    handles = [h for w in wrappers for h in w.handles]
    taken = [h for h in handles if h.on_reduced is not None]
    if taken:
        raise ValueError(
            "optimizer_in_backward: the model's parameters already step in backward (an earlier "
            "optimizer_in_backward); call .detach_() on that optimizer first"
        )
    return OptimizerInBackward(model.parameters(), handles, optimizer_class, dict(optimizer_kwargs))
