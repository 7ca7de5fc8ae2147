"""The hooks that make calls past a wrapper gather: which modules carry them, and how they copy.

See [Note: calls past the wrapper] in fsdp/wrapper/direct_call.py; tests/distributed/test_direct_calls.py
runs the calls themselves.
"""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp.wrapper.direct_call import DirectCallHooks


class Stand:
    """Stands in for a wrapper: the hooks only hold it weakly."""


def test_the_region_is_the_modules_holding_or_containing_the_wrappers_parameters(
    single_rank_group: None,
) -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Linear(2, 2), nn.ReLU()),  # holds a root parameter: hooked, with the Linear
        nn.Sequential(nn.ReLU(), nn.Dropout()),  # no parameters at all: not hooked
        nn.Sequential(nn.Linear(2, 2)),  # becomes an inner unit: its own wrapper hooks it
    )
    model[2] = FSDP(model[2])
    root = FSDP(model)
    hooked = {name for name, m in root.module.named_modules() if m._forward_pre_hooks}
    assert hooked == {"", "0", "0.0", "2._fsdp_wrapped_module", "2._fsdp_wrapped_module.0"}
    assert len(root._direct_hooks) == 3 and len(model[2]._direct_hooks) == 2
    assert not any(m._forward_hooks for m in root.modules())  # an end hook exists only during a call
    with torch.no_grad():
        root.module[0](torch.ones(1, 2))
    assert not any(m._forward_hooks for m in root.modules())  # ... and is removed after it


def test_the_hooks_follow_a_copied_wrapper_and_die_with_theirs() -> None:
    wrapper, twin = Stand(), Stand()
    hooks = DirectCallHooks(wrapper)  # type: ignore[arg-type]
    copied = copy.deepcopy(hooks.before, {id(wrapper): twin})  # the wrapper copied with its modules
    assert copied.__self__._wrapper() is twin
    alone = copy.deepcopy(hooks.before)  # a module copied without its wrapper: nothing to gather for
    assert alone.__self__._wrapper() is None
    again = pickle.loads(pickle.dumps([wrapper, hooks.before]))  # pickled with the wrapper
    assert again[1].__self__._wrapper() is again[0]
    del wrapper
    assert hooks._wrapper() is None  # held weakly: the hook does nothing once the wrapper is gone
    assert hooks.before(nn.Linear(1, 1), (), {}) is None
