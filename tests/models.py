"""Small models used across the tests, and the wrap plans applied to them.

Every builder is deterministic given the seed, so every rank and the local reference start from
identical weights. A wrap plan is a list of submodule paths to wrap in FSDP (innermost first is
not required: paths are wrapped deepest first), then the root is wrapped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn


class Nested(nn.Module):
    """Three levels: a block inside a block inside the root, plus root-owned layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.body = nn.Sequential(
            nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 8))
        )
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.body(self.inp(x))))


class Tiny(nn.Module):
    """Uneven and tiny parameters: fewer elements than ranks, a scalar, odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.one = nn.Parameter(torch.tensor([0.5]))  # 1 element: ranks 1..N-1 hold only padding
        self.lin = nn.Linear(6, 3)  # 21 elements
        self.small = nn.Linear(3, 1, bias=False)  # 3 elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.tanh(self.lin(x)) * self.scale) + self.one


class FrozenMixed(nn.Module):
    """Frozen and trainable parameters inside one wrapper (and a frozen bias next to a trainable weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.trunk.requires_grad_(False)
        self.mid.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.trunk(x)))))


class CalledTwice(nn.Module):
    """One block applied twice in a forward (weights used by two graph paths)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.block(self.inp(x))))


class Pair(NamedTuple):
    main: torch.Tensor
    side: torch.Tensor


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    extra: dict[str, Any]


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.relu(self.a(x))
        # "unused" gets no gradient: it is not part of the loss
        return {"h": h, "unused": self.b(h), "pair": Pair(h * 2, h.detach()), "n": 3}


class StructuredOutputs(nn.Module):
    """Outputs as dict, namedtuple and dataclass, some of which get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = DictBlock()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Result:
        d = self.block(self.inp(x))
        return Result(self.out(d["h"] + d["pair"].main), {"aux": d["unused"], "k": d["n"]})


class Tied(nn.Module):
    """An embedding and an output head sharing one weight (stored once by the wrapper)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)
        self.register_buffer("offset", torch.arange(3, dtype=torch.float32))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))  # mutated by forward
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.out(self.norm(self.lin(x))) + self.offset * self.calls


@dataclasses.dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[[], nn.Module]
    wrap: tuple[str, ...]  # submodule paths wrapped in FSDP, besides the root
    make_input: Callable[[torch.Generator, int], Any]
    loss: Callable[[Any], torch.Tensor]


def _vec(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(n, 6, generator=g)


def _mean_sq(out: Any) -> torch.Tensor:
    return out.pow(2).mean()


CASES: dict[str, ModelCase] = {
    c.name: c
    for c in [
        ModelCase("nested", Nested, ("body.2", "body", "inp"), _vec, _mean_sq),
        ModelCase("root_only", Nested, (), _vec, _mean_sq),
        ModelCase("tiny", Tiny, ("small",), _vec, _mean_sq),
        ModelCase("frozen_mixed", FrozenMixed, ("mid",), _vec, _mean_sq),
        ModelCase("called_twice", CalledTwice, ("block",), _vec, _mean_sq),
        ModelCase(
            "structured_outputs", StructuredOutputs, ("block",), _vec, lambda r: r.logits.pow(2).mean()
        ),
        ModelCase("tied", Tied, ("mix",), lambda g, n: torch.randint(0, 11, (n, 5), generator=g), _mean_sq),
        ModelCase("buffers", WithBuffers, ("lin",), _vec, _mean_sq),
    ]
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return CASES[name].build()


def wrap(model: nn.Module, paths: tuple[str, ...], **fsdp_kwargs: Any) -> nn.Module:
    """Wrap the named submodules (deepest first), then the root."""
    from fsdp import FullyShardedDataParallel as FSDP

    for path in sorted(paths, key=lambda p: -p.count(".")):
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, leaf, FSDP(getattr(parent, leaf), **fsdp_kwargs))
    return FSDP(model, **fsdp_kwargs)
