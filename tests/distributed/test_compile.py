"""torch.compile of a wrapped model: the wrappers run eagerly, the modules' own forwards compile.

See [Note: torch.compile] in fsdp/common/torch_compile.py. The reference is the same model wrapped the same way
and run eagerly: with the ``aot_eager`` backend (torch's ops, no code generation, so no compiler is
needed on the test machine) the results must be bitwise equal.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from tests.rank_pool import RankPool


class Block(nn.Module):
    """A module whose forward is user code (torch's own modules are not compiled as frames)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def wrap_net(base: Net, **kw: Any) -> FSDP:
    """A copy of ``base`` with one wrapper per block and a root."""
    m = copy.deepcopy(base)
    for i in range(len(m.blocks)):
        m.blocks[i] = FSDP(m.blocks[i], **kw)
    return FSDP(m, **kw)


def _counting_backend(graphs: list[int]) -> Any:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(len(gm.graph.nodes))
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def _train(
    model: nn.Module, run: Any, steps: int, after_first: list[int], graphs: list[int], width: int = 8
) -> list[float]:
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for step in range(steps):
        loss = run(torch.randn(8, width, generator=g)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        if step == 0:
            after_first.append(len(graphs))
    return losses


def _compiled_fsdp(kind: str) -> dict[str, Any]:
    torch._dynamo.reset()
    kw: dict[str, Any] = {}
    if kind == "bf16":
        kw = {"mixed_precision": True, "compute_dtype": torch.bfloat16}
    if kind == "keep_full":
        kw = {"reshard_after_forward": False}
    torch.manual_seed(0)
    base = Net()
    if kind == "checkpointed":
        base.blocks[1] = fsdp.checkpoint_wrapper(base.blocks[1])

    eager, comp = wrap_net(base, **kw), wrap_net(base, **kw)
    graphs: list[int] = []
    compiled = torch.compile(comp, backend=_counting_backend(graphs))
    ignored: list[int] = []
    eager_losses = _train(eager, eager, 4, ignored, [])
    after_first: list[int] = []
    compiled_losses = _train(comp, compiled, 4, after_first, graphs)
    torch._dynamo.reset()
    return {
        "losses": (eager_losses, compiled_losses),
        "params_equal": all(torch.equal(a, b) for a, b in zip(eager.parameters(), comp.parameters())),
        "graphs": graphs,
        "after_first": after_first[0],
        "comm": (eager.comm_stats(), comp.comm_stats()),
    }


@pytest.mark.parametrize("kind", ["fp32", "bf16", "keep_full", "checkpointed"])
@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_compiled_wrapped_model_trains_as_the_eager_one(pool: RankPool, kind: str) -> None:
    for r in pool.run(_compiled_fsdp, kind):
        eager_losses, compiled_losses = r["losses"]
        assert eager_losses == compiled_losses
        assert r["params_equal"], (
            "the compiled model's parameters after 4 steps are the eager model's, bit for bit"
        )
        assert r["graphs"], "the blocks' forward was compiled, not run eagerly"
        assert max(r["graphs"]) >= 5, "a compiled graph holds the block's arithmetic"
        assert len(r["graphs"]) == r["after_first"], (
            "the parameter views made at every forward cause no recompile"
        )
        eager_comm, compiled_comm = r["comm"]
        assert eager_comm == compiled_comm, "the same gathers and reductions, in the same dtypes"


def _compiled_offload_model() -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block(), Block(), Block())
    cpu = torch.device("cpu")
    eager = fsdp.OffloadModel(copy.deepcopy(base), device=cpu, num_slices=2)
    comp = fsdp.OffloadModel(copy.deepcopy(base), device=cpu, num_slices=2)
    graphs: list[int] = []
    compiled = torch.compile(comp, backend=_counting_backend(graphs))
    eager_losses = _train(eager, eager, 3, [], [], width=16)
    after_first: list[int] = []
    compiled_losses = _train(comp, compiled, 3, after_first, graphs, width=16)
    torch._dynamo.reset()
    return {
        "same": eager_losses == compiled_losses
        and all(torch.equal(a, b) for a, b in zip(eager.parameters(), comp.parameters())),
        "graphs": len(graphs),
        "after_first": after_first[0],
    }


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_a_compiled_offload_model_trains_as_the_eager_one(pool: RankPool) -> None:
    for r in pool.run(_compiled_offload_model):
        assert r["same"]
        assert r["graphs"] >= 1 and r["graphs"] == r["after_first"]


_MODEL: list[nn.Module] = []


def _step(x: torch.Tensor) -> torch.Tensor:
    loss = _MODEL[0](x).sum()
    loss.backward()
    return loss


def _compiled_autograd_is_refused() -> list[str]:
    torch._dynamo.reset()
    messages = []
    for build in (
        lambda: FSDP(nn.Sequential(FSDP(nn.Linear(8, 8)), nn.Linear(8, 2))),
        lambda: fsdp.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))),
    ):
        _MODEL[:] = [build()]
        torch._dynamo.config.compiled_autograd = True  # before torch.compile, which reads it
        try:
            torch.compile(_step, backend="aot_eager")(torch.randn(4, 8))
            messages.append("trained")
        except Exception as e:  # torch may wrap it in its own error type
            messages.append(str(e))
        finally:
            torch._dynamo.config.compiled_autograd = False
            torch._dynamo.reset()
    return messages


@pytest.mark.parametrize("pool", [1], indirect=True)
def test_compiled_autograd_is_refused_not_silently_ignored(pool: RankPool) -> None:
    (messages,) = pool.run(_compiled_autograd_is_refused)
    assert len(messages) == 2
    for who, text in zip(("FullyShardedDataParallel", "DistributedDataParallel"), messages):
        assert f"{who} does not support compiled autograd" in text, text


class NormBlock(nn.Module):
    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.norm(h)


def _compiled_checkpointed_norms(order: str) -> dict[str, Any]:
    def build() -> FSDP:
        torch.manual_seed(0)
        m = nn.Sequential(NormBlock(), NormBlock(), nn.Linear(8, 2))
        if order == "checkpoint_outside_the_wrapper":
            m[0] = fsdp.checkpoint_wrapper(FSDP(m[0]))
        elif order == "checkpoint_inside_the_wrapper":
            m[0] = FSDP(fsdp.checkpoint_wrapper(m[0]))
        elif order == "graph_break_inside_the_checkpoint":
            m[0].graph_break = True
            m[0] = FSDP(fsdp.checkpoint_wrapper(m[0]))
        elif order == "offloading_checkpoint_nested_in_another":
            m[0] = FSDP(
                fsdp.checkpoint_wrapper(nn.Sequential(fsdp.checkpoint_wrapper(m[0], offload_to_cpu=True)))
            )
        else:
            m[0] = FSDP(fsdp.checkpoint_wrapper(m[0], offload_to_cpu=True))
        return FSDP(m)

    torch._dynamo.reset()
    eager, comp = build(), build()
    graphs: list[int] = []
    compiled = torch.compile(comp, backend=_counting_backend(graphs))
    _train(eager, eager, 3, [], [])
    _train(comp, compiled, 3, [], graphs)
    torch._dynamo.reset()
    return {
        "graphs": len(graphs),
        "batches_tracked": [int(b) for n, b in comp.named_buffers() if n.endswith("num_batches_tracked")],
        "buffers_equal": all(torch.equal(a, b) for a, b in zip(eager.buffers(), comp.buffers())),
        "params_equal": all(torch.equal(a, b) for a, b in zip(eager.parameters(), comp.parameters())),
    }


@pytest.mark.parametrize(
    "order",
    [
        "checkpoint_outside_the_wrapper",
        "checkpoint_inside_the_wrapper",
        "checkpoint_offloaded",
        "graph_break_inside_the_checkpoint",
        "offloading_checkpoint_nested_in_another",
    ],
)
@pytest.mark.parametrize("pool", [2], indirect=True)
def test_compiled_checkpointing_updates_norm_statistics_once(pool: RankPool, order: str) -> None:
    for r in pool.run(_compiled_checkpointed_norms, order):
        assert r["graphs"] >= 1
        assert r["batches_tracked"] == [3, 3], "one update per forward, none in the recomputation"
        assert r["buffers_equal"] and r["params_equal"], "the compiled run is the eager run, bit for bit"
