"""fairscale's experimental MEVO under the wrapper, as fairscale's shared-weight MEVO test uses it: an
embedding and a MEVO output sharing its weight, each in an unflattened wrapper, the output wrapper
told of the shared weight with ``append_shared_param``, the middle layer wrapped flat, unflattened or
not at all, under a root that owns the tie. MEVO reads the weight through its trigger's
``_linked_param`` in forward and writes the weight's gradient by hand in backward (see
[Note: linked parameters] in fsdp/core/param_attrs.py).
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from tests.rank_pool import RankPool
from tests.unit.conftest import single_rank_group  # noqa: F401  (the fixture, for the one-rank test)

VOCAB, D_MODEL, BATCH, SEQ, TILE = 64, 8, 2, 5, 4


class _Model(nn.Module):
    def __init__(
        self, with_fsdp: bool = False, wrap_middle: str = "none", dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        from fairscale.experimental.nn import MEVO

        torch.manual_seed(0)
        self.l0 = nn.Embedding(VOCAB, D_MODEL).to(dtype)
        nn.init.uniform_(self.l0.weight, -1.0e-1, 1.0e-1)
        self.l1 = MEVO(self.l0.weight, tile_factor=TILE, reduction="sum")
        self.middle = nn.Linear(D_MODEL, D_MODEL).to(dtype)
        self.ln1 = nn.LayerNorm(D_MODEL).to(dtype)
        self.ln2 = nn.LayerNorm(D_MODEL).to(dtype)
        if with_fsdp:
            kwargs: dict[str, Any] = {"mixed_precision": False, "compute_dtype": dtype}
            self.l0 = FSDP(self.l0, flatten_parameters=False, **kwargs)
            self.l1 = FSDP(self.l1, flatten_parameters=False, **kwargs)
            self.l1.append_shared_param(self.l0.module.weight)
            if wrap_middle != "none":
                self.middle = FSDP(self.middle, flatten_parameters=wrap_middle == "flat", **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = x + 1
        x = self.ln2(self.middle(self.ln1(self.l0(x))))
        return self.l1(x, target)  # type: ignore[no-any-return]


def _data() -> torch.Tensor:
    return (torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(3)) * (VOCAB - 1)).long()


def _train(model: nn.Module) -> list[float]:
    """Three SGD steps on the same batch: every rank has it, so the ranks' mean gradient is the
    plain model's (fairscale's test sums as many backwards as ranks, then divides: not the same bits)."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        out = model(_data())
        out.backward()
        losses.append(out.item())
        optim.step()
        model.zero_grad(set_to_none=True)
    return losses


def _mevo(test_fn: str, wrap_middle: str) -> dict[str, Any]:
    plain = _Model()
    before = copy.deepcopy(plain.state_dict())
    model = FSDP(
        _Model(with_fsdp=True, wrap_middle=wrap_middle),
        flatten_parameters=test_fn == "optim_state",
        mixed_precision=False,
        compute_dtype=torch.float32,
    )
    model.load_state_dict(before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (MEVO reads .grad of the weight's view: torch warns, once)
        if test_fn == "train":
            losses = _train(model)
            plain_losses = _train(plain)
            after = model.state_dict()
            return {
                "moved": any(not torch.equal(before[k], after[k]) for k in before),
                "same": {k: torch.equal(v, after[k]) for k, v in plain.state_dict().items()},
                "losses": (losses, plain_losses),
            }
        if test_fn == "eval":
            model.eval()
            plain.eval()
            outs = [model(_data()) for _ in range(2)]
            with torch.no_grad():
                outs += [model(_data()) for _ in range(2)]
            return {"same": all(torch.equal(out, plain(_data())) for out in outs)}
        # (momentum: torch's SGD keeps no state without it now; fairscale's test counted None buffers)
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            model(_data()).backward()
            optim.step()
        sd = model.gather_full_optim_state_dict(optim)
        return {"keys": None if sd is None else len(sd["state"])}


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("wrap_middle", ["none", "flat", "nonflat"])
def test_mevo_with_a_shared_weight_trains_as_the_plain_model(pool: RankPool, wrap_middle: str) -> None:
    """The weight's gradient MEVO writes by hand is added to the embedding's and reduced: the
    parameters after three SGD steps equal the plain model's, bit for bit (they raised before)."""
    for r in pool.run(_mevo, "train", wrap_middle):
        assert r["moved"], "training changed the parameters"
        assert all(r["same"].values()), r["same"]
        assert r["losses"][0] == r["losses"][1], r["losses"]


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("wrap_middle", ["none", "flat", "nonflat"])
def test_mevo_with_a_shared_weight_evaluates_as_the_plain_model(pool: RankPool, wrap_middle: str) -> None:
    for r in pool.run(_mevo, "eval", wrap_middle):
        assert r["same"], r


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_mevo_optimizer_state_has_one_entry_per_original_parameter(pool: RankPool) -> None:
    """fairscale's check: eight momentum buffers (one per parameter of the plain model), gathered on
    rank 0 only (flat root and middle)."""
    assert pool.run(_mevo, "optim_state", "flat") == [{"keys": 8}, {"keys": None}]


class _HandSet(torch.autograd.Function):
    """Gives autograd no edge to the weight, and sets the weight's gradient by hand."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, owner: nn.Module) -> torch.Tensor:
        ctx.owner = owner
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.owner.weight.grad = torch.ones_like(ctx.owner.weight)
        return grad * 2, None


class _Linked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        self.trigger = nn.Parameter(torch.ones(1))
        self.trigger._linked_param = self.weight  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _HandSet.apply(x * self.trigger, self)  # type: ignore[no-any-return]


def _hand_set_only() -> str:
    model = FSDP(_Linked(), flatten_parameters=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(torch.ones(4)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_gradient_set_by_hand_that_nothing_reduces_raises(pool: RankPool) -> None:
    """A linked parameter autograd never reaches gets its hand-set gradient reduced by nobody: the
    end of backward says so on every rank, and what to do, instead of dropping it."""
    for message in pool.run(_hand_set_only):
        assert "set by hand on 'weight'" in message and "nothing reduced it" in message, message


@pytest.mark.usefixtures("single_rank_group")
def test_a_copy_of_a_model_with_a_link_drops_it() -> None:
    """A deep copy or a pickle of the wrapped model keeps the attribute, without its place (it pointed
    into the original's modules): MEVO's forward on the copy raises, saying why; the original trains."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (world size 1: NO_SHARD; MEVO's reads of .grad)
        model = FSDP(_Model(with_fsdp=True), mixed_precision=False)
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            with pytest.raises(RuntimeError, match=r"refers to another parameter.*copied or unpickled"):
                other(_data())
        model(_data()).backward()
