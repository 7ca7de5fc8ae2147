"""The module paths of version 0.1.0, kept importable: pickles and old imports name them.

[Note: legacy module paths]
Version 0.1.0 kept every module directly in ``fsdp/``. A pickled wrapper (``torch.save(model)``,
fairscale's idiom) names the classes it holds by module path (``fsdp.fully_sharded.
FullyShardedDataParallel``, ``fsdp.handle.FlatParamHandle``), and programs may import modules that
have since moved (``from fsdp.checkpoint import checkpoint_wrapper``). A finder at the end of
``sys.meta_path`` answers each old name with the module that now holds its code: the same module
object under both names, so a class, a patch or a logger is one thing whichever name reached it. A
class that moved to another module when a module was split stays importable from the module the old
name maps to. ``fsdp.wrap`` is a package now and still the public path. The test is
``tests/distributed/test_earlier_versions.py`` (fixtures written by 0.1.0) and
``tests/unit/test_public_paths.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

__all__ = ["MOVED", "install"]

# old module path (0.1.0) -> where the code lives now
MOVED: dict[str, str] = {
    "fsdp._device": "fsdp.common.device",
    "fsdp._compile": "fsdp.common.torch_compile",
    "fsdp.nest": "fsdp.common.nest",
    "fsdp.guards": "fsdp.common.guards",
    "fsdp.lost_ranks": "fsdp.comm.lost_ranks",
    "fsdp.collectives": "fsdp.comm.collectives",
    "fsdp.consistency": "fsdp.comm.consistency",
    "fsdp.topology": "fsdp.comm.topology",
    "fsdp.schedule": "fsdp.comm.schedule",
    "fsdp.buckets": "fsdp.comm.buckets",
    "fsdp.sharding": "fsdp.core.sharding",
    "fsdp.deferred_init": "fsdp.core.deferred_init",
    "fsdp.flat_param": "fsdp.core.flat_param",
    "fsdp.grad_hooks": "fsdp.core.grad_hooks",
    "fsdp.handle": "fsdp.core.handle",
    "fsdp.no_shard_buckets": "fsdp.core.no_shard_buckets",
    "fsdp.state_layout": "fsdp.core.layout",
    "fsdp._wrapper_protocol": "fsdp.core.wrapper_protocol",
    "fsdp.state_local": "fsdp.state.local",
    "fsdp.state_dict": "fsdp.state.state_dict",
    "fsdp.optim_fairscale": "fsdp.state.optim_fairscale",
    "fsdp.optim_state": "fsdp.state.optim_state",
    "fsdp.mixed_precision": "fsdp.wrapper.mixed_precision",
    "fsdp.clip_grad": "fsdp.wrapper.clip_grad",
    "fsdp.shared_params": "fsdp.wrapper.shared_params",
    "fsdp._state_methods": "fsdp.wrapper.state_methods",
    "fsdp._stats_methods": "fsdp.wrapper.stats_methods",
    "fsdp._grad_methods": "fsdp.wrapper.grad_methods",
    "fsdp._fairscale_attrs": "fsdp.wrapper.fairscale_attrs",
    "fsdp._summon_methods": "fsdp.wrapper.summon_methods",
    "fsdp._direct_call": "fsdp.wrapper.direct_call",
    "fsdp._torch_compat": "fsdp.wrapper.torch_compat",
    "fsdp._torch_methods": "fsdp.wrapper.torch_methods",
    "fsdp._module_ops": "fsdp.wrapper.module_ops",
    "fsdp._construct": "fsdp.wrapper.construct",
    "fsdp._root_context": "fsdp.wrapper.root_context",
    "fsdp.fully_sharded": "fsdp.wrapper.fully_sharded",
    "fsdp.norm_wrap": "fsdp.wrapper.norm_wrap",
    "fsdp.sharded_grad_scaler": "fsdp.training.sharded_grad_scaler",
    "fsdp._recompute": "fsdp.training.recompute",
    "fsdp.checkpoint": "fsdp.training.activation_checkpoint",
    "fsdp.data_parallel": "fsdp.ddp.data_parallel",
    "fsdp._offload_slice": "fsdp.offload.layer_slice",
    "fsdp._offload_engine": "fsdp.offload.engine",
    "fsdp.offload_model": "fsdp.offload.model",
    "fsdp.checkpoint_files": "fsdp.checkpoints.files",
    "fsdp._app_state": "fsdp.checkpoints.app_state",
    "fsdp.checkpoint_io": "fsdp.checkpoints.save_load",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module that holds the code now (no second copy)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # already executed under its own name


class _LegacyFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Answer the old names (once per process; after every real finder, so real modules win)."""
    if not any(isinstance(f, _LegacyFinder) for f in sys.meta_path):
        sys.meta_path.append(_LegacyFinder())
