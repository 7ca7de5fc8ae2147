"""The state machines: a wrapper's training state, a handle's gradient state.

Each changes through one function that checks the change against its transition table; these tests
walk the tables (every illegal change raises) and check that a real step follows them.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

from fsdp import FSDP, TrainingState
from fsdp.api import TRAINING_TRANSITIONS, check_transition
from fsdp.handle import GRAD_TRANSITIONS, FlatParamHandle, GradState

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
