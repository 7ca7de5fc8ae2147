"""When a flat parameter's gradient is complete: hooks on its AccumulateGrad nodes.

[Note: gradient accumulators]
Autograd adds a leaf's gradient into ``.grad`` in its AccumulateGrad node, and the post-backward
(reduce the full gradient, free the full parameter) must run once that gradient is complete.
Setting ``flat_param.data`` to a tensor of another dtype or device (the compute-dtype full buffer
under mixed precision, the device buffer under CPU offload, and back to the shard) makes autograd
give the parameter a new AccumulateGrad node, so two forwards before one backward (``loss =
f(model(a)) + f(model(b))``) reach ``.grad`` through two nodes, each running after its own part of
the gradient. Each node the forwards' views lead to is hooked (:meth:`AccumulatorHooks.note`), with
the forward that made it (a :class:`GraphToken` held by the hooks on that forward's outputs, so it
dies with the graph); when a node has run, the post-backward runs only if no other hooked node of a
live graph is still to run in this backward (``torch._C._will_engine_execute_node``). Nodes made in
backward (the views a recomputed forward reads) count for that backward only; a node of a graph
still alive after its backward stays hooked (``retain_graph=True`` runs it again); nodes of graphs
dropped are let go at the next forward or backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

__all__ = ["AccumulatorHooks", "GraphToken", "OutputHook"]


class GraphToken:
    """Stands for one forward's graph: held by the hooks on its outputs, so it dies with the graph."""


class OutputHook:
    """A hook on a forward's outputs (the pre-backward), holding that forward's token."""

    __slots__ = ("fn", "token")

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], token: GraphToken | None) -> None:
        self.fn, self.token = fn, token

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return self.fn(grad)


class _Accumulator:
    """One hooked AccumulateGrad node of a flat parameter."""

    __slots__ = ("fired", "hook", "in_backward", "node", "tokens")

    def __init__(self, node: Any) -> None:
        self.node = node
        self.hook: Any = None
        self.fired = False
        self.in_backward = False  # made during a backward: counts for that backward only
        self.tokens: list[weakref.ref[GraphToken]] = []  # the forwards whose graphs may reach it

    def may_run(self) -> bool:
        """Not run yet, and a live graph (or the backward that made it) may still reach it."""
        return not self.fired and (self.in_backward or self.alive())

    def alive(self) -> bool:
        """A forward's graph that reaches it is alive; the tokens of dead ones are let go (a node
        every step's forward reaches, as in fp32, would otherwise collect one per step)."""
        self.tokens = [t for t in self.tokens if t() is not None]
        return bool(self.tokens)


class AccumulatorHooks:
    """The hooked AccumulateGrad nodes of one flat parameter, and the post-backward they run
    (``on_accumulated``, set by the wrapper). See [Note: gradient accumulators]."""

    def __init__(self, flat_param: torch.nn.Parameter) -> None:
        self.flat_param = flat_param
        self.on_accumulated: Callable[[], None] | None = None
        self._nodes: dict[int, _Accumulator] = {}  # by id(node), while it is held here

    def __len__(self) -> int:
        return len(self._nodes)

    def tokens(self) -> int:
        """How many forwards' tokens the hooked nodes hold."""
        return sum(len(a.tokens) for a in self._nodes.values())

    def note(self, token: GraphToken | None) -> None:
        """Views for compute were just made from the flat parameter with grad enabled: hook the
        AccumulateGrad node they lead to, on behalf of the forward ``token`` stands for (``None``:
        made in backward)."""
        if not self.flat_param.requires_grad or self.on_accumulated is None:
            return
        for key in [k for k, a in self._nodes.items() if not a.may_run()]:
            self._drop(key)  # (a graph dropped without a backward)
        node = get_gradient_edge(self.flat_param).node
        acc = self._nodes.get(id(node))
        if acc is None:
            acc = self._nodes[id(node)] = _Accumulator(node)
            me, key = weakref.ref(self), id(node)

            def ran(grad_inputs: Any, grad_outputs: Any) -> None:
                hooks = me()
                if hooks is not None:
                    hooks._accumulated(key)

            acc.hook = node.register_hook(ran)
        if token is None:
            acc.in_backward = True
        else:
            acc.tokens.append(weakref.ref(token))

    def _accumulated(self, key: int) -> None:
        """A hooked node added its part of the gradient: run the post-backward unless another part
        is still to come in this backward."""
        acc = self._nodes.get(key)
        if acc is not None:
            acc.fired = True
        for other in self._nodes.values():
            if other.may_run() and torch._C._will_engine_execute_node(other.node):
                return
        if self.on_accumulated is not None:
            self.on_accumulated()

    def end_backward(self) -> None:
        """End of backward: let go of the nodes made in it and of those no live graph reaches; keep
        the others, ready to run again (a graph still alive, for its own backward or for another
        backward through it with ``retain_graph=True``)."""
        for key, acc in list(self._nodes.items()):
            acc.in_backward = False
            if acc.alive():
                acc.fired = False
            else:
                self._drop(key)

    def _drop(self, key: int) -> None:
        acc = self._nodes.pop(key)
        if acc.hook is not None:
            acc.hook.remove()
