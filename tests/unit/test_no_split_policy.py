"""``no_split_modules_auto_wrap_policy``: a model's own declaration of its blocks picks the units.

Hugging Face models list their block classes by name in ``_no_split_modules``; these stand-ins do
the same, so the tests need no ``transformers`` (tests/distributed/test_hf.py runs real models).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import no_split_modules_auto_wrap_policy
from fsdp.wrap import auto_wrap, enable_wrap


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.tanh(self.attn(x)))


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.words(ids))


class Body(nn.Module):
    """A sub-model that declares its own blocks, as a Hugging Face base model does."""

    _no_split_modules = ["Block", "Embeddings"]

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = Embeddings()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return h


class LM(nn.Module):
    """A head over the body; ``tied`` shares the head's weight with the word embeddings."""

    def __init__(self, tied: bool, declare: Any = None) -> None:
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.body.embeddings.words.weight
        if declare is not None:
            self._no_split_modules = declare

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(ids))


def _units(model: nn.Module) -> list[str]:
    return [
        n.replace("_fsdp_wrapped_module.", "") for n, m in model.named_modules() if isinstance(m, FSDP) and n
    ]


def test_the_blocks_a_model_declares_become_units(single_rank_group: None) -> None:
    plain = LM(tied=False)
    model = FSDP(copy.deepcopy(plain), auto_wrap_policy=no_split_modules_auto_wrap_policy(plain))
    assert _units(model) == ["body.embeddings", "body.layers.0", "body.layers.1"]
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(model(ids), plain(ids), rtol=0, atol=0)


def test_a_block_tied_to_a_module_outside_it_is_left_to_its_parent(single_rank_group: None) -> None:
    model = LM(tied=True)
    wrapped = FSDP(model, auto_wrap_policy=no_split_modules_auto_wrap_policy(model))
    # the embeddings share their weight with the head: wrapping them alone would split the tie
    assert _units(wrapped) == ["body.layers.0", "body.layers.1"]
    assert wrapped.module.head.weight.shape == (16, 8)


@pytest.mark.parametrize(
    "blocks",
    [
        "Block",
        ["Block"],
        {"tests.unit.test_no_split_policy.Block"},  # with its module
        (Block,),  # classes work too
    ],
    ids=["name", "list", "qualified", "class"],
)
def test_blocks_given_by_name_or_class(single_rank_group: None, blocks: Any) -> None:
    model = FSDP(LM(tied=True), auto_wrap_policy=no_split_modules_auto_wrap_policy(blocks))
    assert _units(model) == ["body.layers.0", "body.layers.1"]


def test_the_declaration_may_be_a_set_on_the_instance_and_works_with_auto_wrap() -> None:
    model = LM(tied=False, declare={"Block"})  # the root's own declaration joins the body's
    with enable_wrap(wrapper_cls=_Recorder):
        auto_wrap(model, no_split_modules_auto_wrap_policy(model))
    assert sorted(_Recorder.built) == ["Block", "Block", "Embeddings"]
    _Recorder.built.clear()


class _Recorder(nn.Module):
    built: list[str] = []

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.inner = module
        _Recorder.built.append(type(module).__name__)


def test_mistakes_are_named() -> None:
    with pytest.raises(ValueError, match=r"Sequential declares no _no_split_modules.*pass the block classes"):
        no_split_modules_auto_wrap_policy(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"class names \(str\) or nn.Module subclasses, got 3"):
        no_split_modules_auto_wrap_policy(["Block", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one"):
        no_split_modules_auto_wrap_policy([])
    misspelt = no_split_modules_auto_wrap_policy("Blok")
    with pytest.raises(
        ValueError, match=r"no module of the classes \['Blok'\] in LM \(its classes: .*'Block'"
    ):
        with enable_wrap(wrapper_cls=_Recorder):
            auto_wrap(LM(tied=False), misspelt)  # not the whole model in one unit, silently
    assert (
        repr(no_split_modules_auto_wrap_policy({"B", "A"})) == "no_split_modules_auto_wrap_policy(['A', 'B'])"
    )
