"""torch FSDP1's ``ignored_modules`` / ``ignored_states`` leniency, as torch's ``test_fsdp_ignored_modules.py`` uses it.

An ignored module may hold wrappers (they stay managed; the rest of it is ignored), modules and
parameters outside the wrapped module are passed over silently, parameters a wrapper already
flattened are passed over, and policies leave the ignored parts alone.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy
from tests.rank_pool import RankPool


class Model(nn.Module):
    """torch's test model: layer0, a Sequential layer1 of three linears, layer2, layer3."""

    def __init__(self, extra: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer0 = nn.Linear(3, 5)
        self.layer1 = nn.Sequential(
            nn.Linear(5, 4), nn.Linear(4, 4), *[Ignored(4, 4) for _ in range(extra)], nn.Linear(4, 4)
        )
        self.layer2 = nn.Linear(4, 2)
        self.layer3 = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.layer0, self.layer1, self.layer2, self.layer3):
            x = torch.relu(layer(x))
        return x


class Ignored(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def _managed(w: FSDP) -> int:
    """The elements this wrapper's own flat parameters hold (padding left out)."""
    return sum(h.meta.numel for h in w.handles)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = model(torch.randn(8, 3, generator=torch.Generator().manual_seed(step))).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _nested(use_orig_params: bool, by: str) -> dict[str, Any]:
    """torch's ``test_ignored_modules_nested``: ``layer1[1]`` is wrapped first; the root then ignores
    the whole ``layer1`` (a module holding a wrapper), by module or by its parameters (the wrapper's
    flat parameter among them)."""
    model = Model()
    make = functools.partial(FSDP, use_orig_params=use_orig_params)
    model.layer1[1] = make(model.layer1[1])
    if by == "modules":
        wrapped = make(model, ignored_modules=[model.layer1])
    else:
        wrapped = make(model, ignored_states=list(model.layer1.parameters()))
    inner = model.layer1[1]
    plain = Model()
    return {
        "root": _managed(wrapped),
        "expected_root": _numel(plain) - _numel(plain.layer1),
        "inner": _managed(inner),
        "inner_is_in_the_tree": inner in FSDP.fsdp_modules(wrapped),
        "losses": _train(wrapped),
        "inner_gathers": inner.comm_stats()["all_gather"]["calls"] > 0,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("by", ["modules", "states"])
def test_an_ignored_module_may_hold_a_wrapper(pool: RankPool, use_orig_params: bool, by: str) -> None:
    for r in pool.run(_nested, use_orig_params, by):
        assert r["root"] == r["expected_root"] and r["inner"] == 20, r
        assert r["inner_is_in_the_tree"] and r["inner_gathers"]
        assert all(math.isfinite(x) for x in r["losses"])


def _outside_the_root() -> tuple[list[int], float, float]:
    """torch's ``test_ignored_modules_not_under_wrapped_root``: the same list given to the wrappers of
    ``layer1`` and ``layer3``; for ``layer3`` the modules are outside and passed over silently (its
    gradient norm counts its own parameters only, not the outside modules' gradients)."""
    model = Model()
    ignored = list(model.layer1.children())[1:]
    model.layer1 = FSDP(model.layer1, ignored_modules=ignored)  # type: ignore[assignment]
    model.layer3 = FSDP(model.layer3, ignored_modules=ignored)  # type: ignore[assignment]
    _train(model)
    for m in ignored:  # gradients that must not count towards layer3's norm
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    model.layer3(torch.randn(4, 2, generator=torch.Generator().manual_seed(5))).pow(2).sum().backward()
    norm = model.layer3.clip_grad_norm_(1e6).item()  # type: ignore[operator]
    with FSDP.summon_full_params(model.layer3, with_grads=True):
        own = sum(p.grad.pow(2).sum().item() for p in model.layer3.parameters()) ** 0.5
    return [_managed(model.layer1), _managed(model.layer3)], norm, own  # type: ignore[arg-type]


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_modules_outside_the_wrapped_module_are_passed_over(pool: RankPool) -> None:
    for managed, norm, own in pool.run(_outside_the_root):
        assert managed == [24, 6] and norm > 0 and norm == pytest.approx(own), (norm, own)


def _policy_and_ignored_states(policy: Any, ignore_bias: bool) -> list[tuple[int, int]]:
    """torch's ``test_ignored_states_auto_wrap``: one weight (and bias) of ``layer1[1]`` ignored, the
    policy wrapping ``layer1``: each wrapper's flat parameter leaves them out."""
    model = Model()
    ignored = [model.layer1[1].weight] + ([model.layer1[1].bias] if ignore_bias else [])
    wrapped = FSDP(model, auto_wrap_policy=policy, ignored_states=ignored)
    plain = Model()
    layer1 = _numel(plain.layer1) - plain.layer1[1].weight.numel() - (4 if ignore_bias else 0)
    root = _numel(plain) - _numel(plain.layer1)
    _train(wrapped, 1)
    return [(_managed(wrapped.layer1), layer1), (_managed(wrapped), root)]


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("policy", ["transformer", "module"])
@pytest.mark.parametrize("ignore_bias", [False, True])
def test_policy_wrappers_leave_ignored_parameters_out(pool: RankPool, policy: str, ignore_bias: bool) -> None:
    chosen = (
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Sequential})
        if policy == "transformer"
        else ModuleWrapPolicy((nn.Sequential,))
    )
    for pairs in pool.run(_policy_and_ignored_states, chosen, ignore_bias):
        assert all(got == want for got, want in pairs), pairs


def _errors() -> dict[str, str]:
    """torch's ``test_ignored_modules_invalid`` and ``test_ignored_states_check``."""
    out = {}

    def attempt(name: str, build: Any) -> None:
        try:
            build()
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        else:
            out[name] = "no error"

    def a_wrapper() -> None:
        model = Model()
        model.layer1 = FSDP(model.layer1)  # type: ignore[assignment]
        FSDP(model, ignored_modules=[model.layer1])

    def parameters_as_modules() -> None:
        model = Model()
        FSDP(model, ignored_modules=list(model.layer1[1].parameters()))

    def both() -> None:
        model = Model()
        FSDP(model, ignored_modules=[model.layer1[1]], ignored_states=list(model.layer1[1].parameters()))

    def mixed() -> None:
        model = Model()
        FSDP(model, ignored_states=[model.layer1[1], model.layer1[2].weight])

    for name, build in list(locals().items()):
        if callable(build) and name != "attempt":
            attempt(name, build)
    return out


# the patterns torch's test_ignored_states_check matches (its own wording, in its type order)
_TORCH_PATTERNS = {
    "parameters_as_modules": r"ignored_modules expects nn.Module list elements but got types "
    r"\[<class 'torch.nn.parameter.Parameter'>\]",
    "both": "Cannot pass both ignored_modules and ignored_states at the same time",
    "mixed": r"ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
    r"\[<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.parameter.Parameter'>\]",
}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_what_stays_refused(pool: RankPool) -> None:
    """A wrapper cannot be ignored (as torch); wrong types and both arguments (as torch, in words its
    tests match, followed by what to do)."""
    for r in pool.run(_errors):
        assert r["a_wrapper"].startswith("ValueError") and "a wrapper cannot be ignored" in r["a_wrapper"]
        assert (
            r["parameters_as_modules"].startswith("ValueError") and "nn.Modules" in r["parameters_as_modules"]
        )
        assert r["both"].startswith("ValueError") and "not both" in r["both"]
        assert r["mixed"].startswith("ValueError") and "all nn.Parameters or all nn.Modules" in r["mixed"]
        for name, pattern in _TORCH_PATTERNS.items():
            assert re.search(pattern, r[name]), (name, r[name])


def _different_per_rank(by: str) -> str:
    """torch's ``test_diff_ignored_modules_across_ranks``: rank r builds r + 1 ignored modules into
    ``layer1``, which shifts the names of the managed parameters after them: refused on every rank."""
    model = Model(extra=dist.get_rank() + 1)
    ignored = [m for m in model.layer1.modules() if isinstance(m, Ignored)]
    kwargs = (
        {"ignored_modules": ignored} if by == "modules" else {"ignored_states": [m.weight for m in ignored]}
    )
    try:  # the construction of layer1's wrapper already tells the ranks apart (its parameters differ)
        model.layer1 = FSDP(model.layer1, **kwargs)  # type: ignore[assignment]
        model.layer3 = FSDP(model.layer3)  # type: ignore[assignment]
        wrapped = FSDP(model, **kwargs)  # (given again to the root: already ignored inside layer1)
        _train(wrapped, 1)
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("by", ["modules", "states"])
def test_ranks_that_build_different_models_fail_together(pool: RankPool, by: str) -> None:
    for message in pool.run(_different_per_rank, by):
        assert message.startswith("ValueError") and "different" in message, message
        assert "7 parameters" in message and "8 parameters" in message, message


_TORCH_ROOT_IGNORED = (  # what torch's test_ignored_modules_invalid matches
    "Trying to ignore the top-level module passed into the FSDP constructor itself will result in all "
    "parameters being ignored"
)


def _the_wrapped_module_itself() -> dict[str, Any]:
    """torch's ``test_ignored_modules_invalid`` and the state-dict tests' ``ignore_inner``: a wrapper
    told to ignore the module it wraps warns and leaves every parameter alone; nested in an outer
    wrapper, the model trains and saves as the plain one does (the ignored parameters on each rank's
    own gradients, as torch)."""
    import warnings

    ref = Model()
    model = Model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.layer1 = FSDP(model.layer1, ignored_modules=[model.layer1])  # type: ignore[assignment]
    inner = model.layer1
    wrapped = FSDP(model)
    data = torch.randn(4, 3, generator=torch.Generator().manual_seed(dist.get_rank()))
    same_output = torch.equal(wrapped(data), ref(data))
    sd, plain = wrapped.state_dict(), ref.state_dict()
    return {
        "warned": any(
            "wrapped module itself" in str(w.message)
            and re.search(_TORCH_ROOT_IGNORED, str(w.message))
            and w.category is UserWarning
            for w in caught
        ),
        "inner_manages": _managed(inner),
        "left_alone": all(p is q for p, q in zip(inner.parameters(), inner.module.parameters(), strict=True))
        and sum(1 for _ in inner.parameters()) == 6,
        "same_output": same_output,
        "same_state": list(sd) == list(plain) and all(torch.equal(sd[k], v) for k, v in plain.items()),
        "losses": _train(wrapped),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_ignoring_the_wrapped_module_itself_leaves_it_alone(pool: RankPool) -> None:
    for r in pool.run(_the_wrapped_module_itself):
        assert r["warned"] and r["inner_manages"] == 0 and r["left_alone"], r
        assert r["same_output"] and r["same_state"], r
        assert all(math.isfinite(v) for v in r["losses"]), r
