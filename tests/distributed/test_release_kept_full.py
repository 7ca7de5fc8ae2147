"""The root frees the full parameters it keeps from forward once backward has used them (See [Note:
releasing kept full parameters] in fsdp/core/saved_views.py): freed before the blocks' backward,
gathered again if something needs them later in the same backward, left alone where it cannot be
sure (hooks of the user's own); training is unchanged, bit for bit against the plain model. With one
parameter per root handle (``flatten_parameters=False``) the head's gradient reaches its handle as
soon as it is computed, so an optimizer stepping in backward updates the head before the blocks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp
from fsdp import FullyShardedDataParallel as FSDP
from tests.distributed.test_parity import TOL
from tests.parity import compare_training
from tests.rank_pool import RankPool

VOCAB, WIDTH, TOKENS = 64, 16, 6


class LM(nn.Module):
    """An embedding, blocks and an output head of its own: the root keeps the embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


def _tokens(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, TOKENS), generator=g)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _plain() -> LM:
    torch.manual_seed(0)
    return LM()


def _wrapped(model: LM, root_kwargs: dict[str, Any] | None = None, checkpoint: str = "") -> FSDP:
    """Blocks wrapped; ``checkpoint``: "blocks" (each unit's block checkpointed), "norm" (a module of
    the root's own region checkpointed) or "root" (the root's whole module checkpointed)."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(fsdp.checkpoint_wrapper(block) if checkpoint == "blocks" else block)
    if checkpoint == "norm":
        model.norm = fsdp.checkpoint_wrapper(model.norm)
    inner: nn.Module = fsdp.checkpoint_wrapper(model) if checkpoint == "root" else model
    return FSDP(inner, **(root_kwargs or {}))


def _parity(root_kwargs: dict[str, Any], checkpoint: str) -> dict[str, float]:
    ref = _plain()
    model = _wrapped(copy.deepcopy(ref), root_kwargs, checkpoint)
    return compare_training(ref, model, _tokens, _loss, steps=3, per_rank=2)


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(
    "root_kwargs, checkpoint",
    [({}, ""), ({"flatten_parameters": False}, ""), ({}, "root"), ({"flatten_parameters": False}, "root")],
)
def test_training_matches_the_plain_model(
    pool: RankPool, root_kwargs: dict[str, Any], checkpoint: str
) -> None:
    # (a checkpointed root keeps its full parameters: its recomputation in backward reads them)
    for diffs in pool.run(_parity, root_kwargs, checkpoint):
        assert all(v <= TOL for v in diffs.values()), diffs


def _root_full_bytes_during_blocks_backward(
    user_hooks: bool, flat: bool, checkpoint: str = ""
) -> tuple[list[int], list[Any]]:
    """The bytes of the root's full buffers when the gradient reaches the first block's output (the
    head and norm have run their backward, the blocks not yet), over two steps; the state after."""
    model = _wrapped(_plain(), {} if flat else {"flatten_parameters": False}, checkpoint=checkpoint)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[int] = []

    def note(grad: torch.Tensor) -> None:
        seen.append(sum(h._full.untyped_storage().nbytes() for h in model.handles))

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(note)

    model.module.blocks[0].register_forward_hook(hook)
    for step in range(2):
        x = _tokens(torch.Generator().manual_seed(10 * step + dist.get_rank()), 2)
        if user_hooks:  # the user's own hooks: ours would replace them, so nothing is tracked
            with torch.autograd.graph.save_on_cpu():
                loss = _loss(model(x))
        else:
            loss = _loss(model(x))
        loss.backward()
        optim.step()
        optim.zero_grad()
    assert all(h._full.untyped_storage().nbytes() == 0 for h in model.handles)  # (resharded after)
    return seen, list(model.state_dict().values())


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_the_root_frees_its_full_parameters_before_the_blocks_backward(pool: RankPool) -> None:
    for flat in (True, False):
        released = pool.run(_root_full_bytes_during_blocks_backward, False, flat)
        kept = pool.run(_root_full_bytes_during_blocks_backward, True, flat)
        for (seen, state), (seen_kept, state_kept) in zip(released, kept, strict=True):
            assert seen == [0, 0], (flat, seen)
            assert len(seen_kept) == 2 and all(b > 0 for b in seen_kept), (flat, seen_kept)  # as before
            assert all(torch.equal(a, b) for a, b in zip(state, state_kept, strict=True))  # the same bits
    # checkpointed blocks in units of their own gather their own parameters again: released all the
    # same; a checkpointed module of the root's own region would read the root's again: kept
    for seen, _ in pool.run(_root_full_bytes_during_blocks_backward, False, True, "blocks"):
        assert seen == [0, 0], seen
    for seen, _ in pool.run(_root_full_bytes_during_blocks_backward, False, True, "norm"):
        assert len(seen) == 2 and all(b > 0 for b in seen), seen


def _head_steps_before_the_blocks() -> tuple[bool, bool]:
    """With the optimizer in backward: has the head's shard changed when the gradient reaches the
    first block's output? (one flat parameter per root parameter; then one flat root)"""
    out = []
    for flat in (False, True):
        # (bucket_cap_mb=0: no small gradient waits for a bucket sent at the end of backward)
        kwargs: dict[str, Any] = (
            {"bucket_cap_mb": 0} if flat else {"bucket_cap_mb": 0, "flatten_parameters": False}
        )
        model = _wrapped(_plain(), kwargs)
        optim = fsdp.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
        head = next(h for h in model.handles if any(i.fqn == "head.weight" for i in h.meta.params))
        before = head.sharded_data().clone()
        changed: list[bool] = []

        def note(
            grad: torch.Tensor, head: Any = head, before: torch.Tensor = before, changed: list[bool] = changed
        ) -> None:
            changed.append(not torch.equal(head.sharded_data(), before))

        def hook(module: nn.Module, args: Any, y: torch.Tensor, note: Any = note) -> None:
            y.register_hook(note)

        model.module.blocks[0].register_forward_hook(hook)
        _loss(model(_tokens(torch.Generator().manual_seed(dist.get_rank()), 2))).backward()
        optim.step()
        assert not torch.equal(head.sharded_data(), before)  # stepped by the end in any case
        out.append(changed == [True])
    return out[0], out[1]


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_root_of_one_parameter_per_handle_steps_its_head_before_the_blocks(pool: RankPool) -> None:
    for per_parameter, flat in pool.run(_head_steps_before_the_blocks):
        assert per_parameter  # its gradient reached the handle, was reduced and stepped at once
        assert not flat  # one flat root: its gradient exists once the embedding's is there (the end)


def _attribute_seen_in_forward() -> list[Any]:
    plain = _plain()
    plain.head.weight.tag = "head"  # type: ignore[attr-defined]  # (as fairscale's MEVO sets on its weight)
    model = _wrapped(plain, {"flatten_parameters": False})
    seen: list[Any] = []
    inner = model.module.head
    inner.register_forward_hook(lambda m, args, out: seen.append(getattr(m.weight, "tag", None)))
    for _ in range(2):
        _loss(model(_tokens(torch.Generator().manual_seed(0), 2))).backward()
    return seen


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_view_made_as_the_module_is_called_keeps_the_parameters_attributes(pool: RankPool) -> None:
    for seen in pool.run(_attribute_seen_in_forward):
        assert seen == ["head", "head"], seen
