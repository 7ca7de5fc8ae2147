"""The state machines: a wrapper's training state, a handle's gradient and memory states.

Each changes through one function that checks the change against its transition table; these tests
walk the tables (every illegal change raises) and check that a real step follows them.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import nn

from fsdp import FSDP, TrainingState
from fsdp.api import MEMORY_TRANSITIONS, TRAINING_TRANSITIONS, MemoryState, check_transition
from fsdp.core.handle import GRAD_TRANSITIONS, FlatParamHandle, GradState

S = TrainingState


def test_training_table_covers_every_state_and_refuses_the_rest() -> None:
    assert set(TRAINING_TRANSITIONS) == set(TrainingState)
    for old, new in itertools.product(TrainingState, TrainingState):
        if new in TRAINING_TRANSITIONS[old]:
            check_transition("training state", old, new, TRAINING_TRANSITIONS)
        else:
            with pytest.raises(
                RuntimeError, match=f"illegal training state transition {old.name} -> {new.name}"
            ):
                check_transition("training state", old, new, TRAINING_TRANSITIONS)


def test_an_illegal_training_state_change_raises_and_changes_nothing(single_rank_group: None) -> None:
    model = FSDP(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="IDLE -> BACKWARD_POST"):
        model.training_state = S.BACKWARD_POST  # a post-backward without a pre-backward
    assert model.training_state is S.IDLE
    with model._state(S.FORWARD):
        with pytest.raises(RuntimeError, match="FORWARD -> SUMMON_FULL_PARAMS"):
            model.training_state = S.SUMMON_FULL_PARAMS
        assert model.training_state is S.FORWARD
    assert model.training_state is S.IDLE


def test_a_step_follows_the_training_table(single_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    inner = FSDP(nn.Linear(4, 4))
    model = FSDP(nn.Sequential(inner, nn.Linear(4, 2)))
    seen: list[tuple[str, str, str]] = []
    setter: Any = FSDP.training_state.fset

    def record(self: FSDP, state: TrainingState) -> None:
        seen.append(("root" if self is model else "inner", self.training_state.name, state.name))
        setter(self, state)

    monkeypatch.setattr(FSDP, "training_state", property(FSDP.training_state.fget, record))
    model(torch.randn(3, 4)).sum().backward()
    assert [(w, a, b) for w, a, b in seen if w == "root"] == [
        ("root", "IDLE", "FORWARD"),
        ("root", "FORWARD", "IDLE"),
        ("root", "IDLE", "BACKWARD_PRE"),
        ("root", "BACKWARD_PRE", "BACKWARD_POST"),
        ("root", "BACKWARD_POST", "IDLE"),
    ]
    assert [(a, b) for w, a, b in seen if w == "inner"] == [
        ("IDLE", "FORWARD"),
        ("FORWARD", "IDLE"),
        ("IDLE", "BACKWARD_PRE"),
        ("BACKWARD_PRE", "BACKWARD_POST"),
        ("BACKWARD_POST", "IDLE"),
    ]


def test_the_temporary_state_restores_the_previous_one(single_rank_group: None) -> None:
    model = FSDP(nn.Linear(2, 2))
    model.training_state = S.BACKWARD_PRE
    model.training_state = S.BACKWARD_POST
    with model._state(S.BACKWARD_POST):
        pass
    assert model.training_state is S.BACKWARD_POST, "back to the state before, not to IDLE"
    model.training_state = S.IDLE
    with pytest.raises(ValueError, match="inside"), model._state(S.SUMMON_FULL_PARAMS):
        raise ValueError("inside")
    assert model.training_state is S.IDLE


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    real = FlatParamHandle._set_grad_state

    def record(self: FlatParamHandle, state: GradState) -> None:
        seen.append((self.grad_state.name, state.name))
        real(self, state)

    monkeypatch.setattr(FlatParamHandle, "_set_grad_state", record)
    return seen


def test_grad_table_covers_every_state_and_refuses_the_rest(single_rank_group: None) -> None:
    assert set(GRAD_TRANSITIONS) == set(GradState)
    h = FSDP(nn.Linear(2, 2), mixed_precision=True).handles[0]
    assert h.grad_state is GradState.IDLE
    for new in set(GradState) - GRAD_TRANSITIONS[GradState.IDLE]:
        with pytest.raises(RuntimeError, match=f"illegal gradient state transition IDLE -> {new.name}"):
            h._set_grad_state(new)
        assert h.grad_state is GradState.IDLE


def test_a_step_and_no_sync_follow_the_grad_table(
    single_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mixed precision: the full parameter is a copy even at world size 1, so gradients are reduced
    model = FSDP(nn.Linear(4, 4), mixed_precision=True)
    (h,) = model.handles
    seen = _recording(monkeypatch)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    assert seen == [("IDLE", "REDUCING"), ("REDUCING", "REDUCED"), ("REDUCED", "IDLE")]
    assert h.flat_param.grad is not None and not h.reduced_this_backward
    seen.clear()
    with model.no_sync():
        model(x).sum().backward()
        model(x).sum().backward()
        assert h.grad_state is GradState.UNSYNCED and h._grad_acc is not None
    model(x).sum().backward()  # the sum of three is reduced once
    assert seen == [
        ("IDLE", "UNSYNCED"),
        ("UNSYNCED", "UNSYNCED"),
        ("UNSYNCED", "REDUCING"),
        ("REDUCING", "REDUCED"),
        ("REDUCED", "IDLE"),
    ]
    seen.clear()
    with model.no_sync():
        model(x).sum().backward()
    model.zero_grad()  # drops what no_sync accumulated
    assert seen == [("IDLE", "UNSYNCED"), ("UNSYNCED", "IDLE")] and h._grad_acc is None


def test_memory_table_covers_every_state_and_refuses_the_rest(single_rank_group: None) -> None:
    assert set(MEMORY_TRANSITIONS) == set(MemoryState)
    h = FSDP(nn.Linear(2, 2), mixed_precision=True).handles[0]
    with pytest.raises(RuntimeError, match="illegal memory state transition SHARDED -> FULL_KEPT"):
        h._set_memory_state(MemoryState.FULL_KEPT)  # keeping a full parameter never gathered
    assert h.state is MemoryState.SHARDED


def test_kept_full_parameters_are_a_memory_state(
    single_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the root keeps its full parameters from forward to backward (disable_reshard_on_root); mixed
    # precision makes the full parameter a buffer of its own at world size 1
    model = FSDP(nn.Linear(4, 4), mixed_precision=True)
    (h,) = model.handles
    seen: list[str] = []
    real = FlatParamHandle._set_memory_state

    def record(self: FlatParamHandle, state: MemoryState) -> None:
        seen.append(f"{self.state.name}>{state.name}")
        real(self, state)

    monkeypatch.setattr(FlatParamHandle, "_set_memory_state", record)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen.clear()  # (the state dict was a summon)
    x = torch.randn(3, 4)
    loss = model(x).sum()
    assert (
        h.state is MemoryState.FULL_KEPT
        and h.holds_full
        and h.flat_param.data_ptr() == h.sharded_data().data_ptr()
    )
    assert copy.deepcopy(model).handles[0].state is MemoryState.SHARDED  # a copy keeps nothing
    loss.backward()
    assert seen == ["SHARDED>UNSHARDED", "UNSHARDED>FULL_KEPT", "FULL_KEPT>UNSHARDED", "UNSHARDED>SHARDED"]
    assert h._full.untyped_storage().size() == 0, "the end of backward frees it"
    model(x)
    with torch.no_grad():
        h.flat_param.add_(1.0)  # an optimizer step: the kept gather is stale now
    assert h.state is MemoryState.FULL_KEPT and not h.holds_full
    out = model(x)  # gathers the updated shard again
    weight, bias = (before[k].add(1.0).half() for k in ("weight", "bias"))  # (fairscale's fp16)
    assert torch.equal(out, nn.functional.linear(x.half(), weight, bias))
