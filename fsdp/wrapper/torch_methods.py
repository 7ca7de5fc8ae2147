"""torch FSDP1's whole-model functions on the wrapper class, for any model.

torch FSDP1's static methods (``FSDP.summon_full_params(model)``, ``FSDP.optim_state_dict(model,
optim)``, ``FSDP.full_optim_state_dict``, ...) take the model being trained, whatever it is: the
outermost wrapper, a plain module holding wrapped blocks (its own parameters are then plain ones,
which no wrapper manages: their optimizer state is kept as it is, as for ignored parameters), or a
module without any wrapper (nothing to gather: the functions work as on a plain model, and
``summon_full_params`` / ``state_dict_type`` change nothing). :class:`WholeModel` is that model
seen from here. Where fairscale has an instance method of the same name with another signature
(``summon_full_params(recurse, volatile)``, ``sharded_optim_state_dict(optim)``),
:class:`InstanceOrStatic` gives the class torch's static function and instances fairscale's
method. What cannot be honoured is refused with an error that says what to use instead.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import BackwardPrefetch, StateDictSettings, StateDictType, TrainingState
from fsdp.comm.consistency import CHECKPOINT_WRAPPED, collective, plain_name
from fsdp.core.layout import Layout, describe
from fsdp.core.wrapper_protocol import Wrapper, WrapperMixin
from fsdp.state import optim_given, optim_sharded
from fsdp.state import optim_state as optim_impl
from fsdp.wrapper.state_methods import StateDictMethods
from fsdp.wrapper.summon_methods import SummonMethods

__all__ = ["InstanceOrStatic", "TorchFSDPMethods", "WholeModel"]


class WholeModel:
    """The ``model`` a torch FSDP1 static method was given: a wrapper, a plain module holding
    wrappers, or a module without any. ``group``, if given, must hold the ranks the model trains over."""

    model: nn.Module
    wrappers: list[Wrapper]  # every wrapper inside, outermost first
    what: str  # the method's name, for messages

    def __init__(self, model: nn.Module, what: str, group: Any = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"FullyShardedDataParallel.{what}: `model` must be an nn.Module, got {type(model).__name__}"
            )
        self.model, self.what = model, what
        self.wrappers = [m for m in model.modules() if isinstance(m, TorchFSDPMethods)]
        ranks = {tuple(dist.get_process_group_ranks(self._dp_group(w))) for w in self.outermost()}
        if len(ranks) > 1:
            raise ValueError(
                f"FullyShardedDataParallel.{what}: the wrappers in {type(model).__name__} train over different ranks "
                f"({sorted(ranks)}); pass a module whose wrappers all share one data-parallel group"
            )
        if group is not None and dist.get_process_group_ranks(group) != list(self._ranks()):
            raise ValueError(
                f"FullyShardedDataParallel.{what}: `group` must hold the ranks the model trains over "
                f"({list(self._ranks())}); leave it unset"
            )

    @staticmethod
    def _dp_group(wrapper: Wrapper) -> dist.ProcessGroup:
        comm = wrapper.fsdp_config.comm
        return comm.dp_group or comm.process_group

    def _ranks(self) -> tuple[int, ...]:
        if self.wrappers:
            return tuple(dist.get_process_group_ranks(self._dp_group(self.wrappers[0])))
        self._require_group()
        return tuple(range(dist.get_world_size()))

    def _require_group(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"FullyShardedDataParallel.{self.what}: needs torch.distributed; call "
                "torch.distributed.init_process_group() first"
            )

    def outermost(self) -> list[Wrapper]:
        return TorchFSDPMethods.fsdp_modules(self.model, root_only=True)

    def layout(self) -> Layout:
        """Where every parameter of the model lives (parameters above the wrappers: plain ones)."""
        if isinstance(self.model, TorchFSDPMethods) or self.wrappers:
            return self.wrappers[0]._state_layout(self.model)
        self._require_group()
        devices = {p.device for p in self.model.parameters()}
        device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        group = dist.group.WORLD
        assert group is not None
        return describe(self.model, {}, group, dist.get_world_size(), dist.get_rank(), device)

    @property
    def settings(self) -> StateDictSettings:
        """The wrappers' state dict settings (they must agree); the full state dict without wrappers."""
        if not self.wrappers:
            return StateDictSettings(StateDictType.FULL_STATE_DICT)
        return StateDictMethods.get_state_dict_type(self.model)

    def optim_rank0_only(self) -> bool:
        return bool(getattr(self.settings.optim_state_dict_config, "rank0_only", False))


class InstanceOrStatic:
    """A method that is torch FSDP1's static function when reached through the class, or through
    an instance with a module as its first argument (``model.summon_full_params(model)``, as torch
    code writes it), and the wrapper's own method otherwise (fairscale's ``model.summon_full_params()``)."""

    def __init__(self, method: Callable[..., Any], static: Callable[..., Any]) -> None:
        self.method, self.static = method, static
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable[..., Any]:
        if obj is None:
            return self.static
        method, static = self.method, self.static

        @functools.wraps(method)
        def bound(*args: Any, **kwargs: Any) -> Any:
            if (args and isinstance(args[0], nn.Module)) or "module" in kwargs or "model" in kwargs:
                return static(*args, **kwargs)
            return method(obj, *args, **kwargs)

        return bound


def _full_named(layout: Layout, optim: torch.optim.Optimizer, rank0_only: bool) -> dict[str, Any]:
    """The full optimizer state keyed by parameter name (torch's full form), on rank 0 or on every
    rank; ``{}`` on the others. Collective."""
    # (on every rank without rank0_only: each keeps its own state of the parameters no wrapper manages,
    # as torch does for rank-local modules outside any wrapper)
    full = optim_impl.gather_full_optim_state_dict(layout, optim, 0 if rank0_only else None)
    if full is None:
        return {}
    names = full["param_names"]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in full["param_groups"]]
    for g in groups:
        g.pop("param_names", None)
    extras = {k: v for k, v in full.items() if k not in ("state", "param_groups", "param_names")}
    return {**extras, "state": {names[i]: v for i, v in full["state"].items()}, "param_groups": groups}


def _broadcast_object(obj: Any, layout: Layout) -> Any:
    """``obj`` of the layout's first rank, on every rank of its group. Collective."""
    if layout.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(
        box, src=dist.get_global_rank(layout.group, 0), group=layout.group, device=layout.device
    )
    return box[0]


def _param_groups_of(optim_input: Any) -> list[list[nn.Parameter]]:
    """torch's deprecated ``optim_input``: the parameters, or param-group dicts, the optimizer was built on."""
    items = list(optim_input)
    if items and all(isinstance(g, Mapping) for g in items):
        return [list(g["params"]) for g in items]
    if all(isinstance(p, torch.Tensor) for p in items):
        return [items]
    raise TypeError(
        "FullyShardedDataParallel: `optim_input` must be the parameters the optimizer was built on, or its "
        f"param-group dicts; got {[type(x).__name__ for x in items[:3]]}"
    )


def _optimizer_from(
    what: str, optim: torch.optim.Optimizer | None, optim_input: Any
) -> torch.optim.Optimizer | None:
    """``optim``, or a stand-in built from torch's deprecated ``optim_input`` (accepted with torch's
    ``FutureWarning``); given both, they must hold the same parameters."""
    if optim_input is None:
        return optim
    warnings.warn(
        f"FullyShardedDataParallel.{what}: the `optim_input` argument is deprecated (as in torch) and will be "
        "removed; pass the optimizer as `optim` instead",
        FutureWarning,
        stacklevel=3,
    )
    groups = _param_groups_of(optim_input)
    if optim is None:
        stand_in = types.SimpleNamespace(param_groups=[{"params": g} for g in groups])
        return cast(torch.optim.Optimizer, stand_in)
    given = [[id(p) for p in g["params"]] for g in optim.param_groups]
    if sorted(map(sorted, given)) != sorted(sorted(id(p) for p in g) for g in groups):
        raise ValueError(
            f"FullyShardedDataParallel.{what}: `optim_input` holds other parameters than `optim`'s param groups; "
            "leave optim_input unset (the optimizer's own param groups are used)"
        )
    return optim


_DCP_MODULE = "torch.distributed.checkpoint.state_dict"


def _refuse_torchs_dcp_optimizer_state() -> None:
    """Raise when ``torch.distributed.checkpoint.state_dict``'s functions are given this library's
    model together with optimizers: torch recognizes only its own wrappers, and would key the
    optimizer state by the flat parameters' internal names with this world size's shards, silently.
    Its walk of the model (``_iterate_valid_model_state``, inside ``_verify_options``) reaches here."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(256):  # (the walk recurses once per module level)
        if frame is None or frame.f_globals.get("__name__") != _DCP_MODULE:
            return
        if frame.f_code.co_name == "_verify_options":
            if frame.f_locals.get("optims"):
                raise NotImplementedError(
                    "torch.distributed.checkpoint.state_dict's get_state_dict / get_optimizer_state_dict / "
                    "set_state_dict / set_optimizer_state_dict cannot read this library's optimizer state: torch "
                    "recognizes only its own FSDP and would key it by internal flat-parameter names, valid at this "
                    "world size only. Import them from fsdp.dcp_state instead (from fsdp.dcp_state import "
                    "get_state_dict, set_state_dict): they take the same arguments and key the state by parameter name"
                )
            return
        frame = frame.f_back


class TorchFSDPMethods(WrapperMixin):
    """torch FSDP1's methods on the wrapper class. The static ones take any model (see the module docstring)."""

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        """torch FSDP1's attribute: ``BackwardPrefetch.BACKWARD_PRE`` (this library's default,
        ``backward_prefetch=True``), ``BACKWARD_POST``, or ``None`` when off (``False``)."""
        schedule = self.fsdp_config.schedule
        if not schedule.backward_prefetch:
            return None
        return (
            BackwardPrefetch.BACKWARD_POST
            if schedule.backward_prefetch_post
            else BackwardPrefetch.BACKWARD_PRE
        )

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers``, and as torch FSDP1's: inside ``summon_full_params`` under the plain
        module's names (no ``_fsdp_wrapped_module`` levels), the names ``state_dict()`` gives them.
        Refuses torch's DCP state-dict functions given optimizers (see
        :func:`_refuse_torchs_dcp_optimizer_state`)."""
        _refuse_torchs_dcp_optimizer_state()
        named = nn.Module.named_buffers(self, prefix, recurse, remove_duplicate)  # type: ignore[arg-type]
        if self.training_state is not TrainingState.SUMMON_FULL_PARAMS:
            return named
        return ((plain_name(name), b) for name, b in named)

    # torch FSDP1's private names for a wrapper's flat-parameter handles, read by code that inspects
    # flat parameters (``model._handle.flat_param``). The objects are this library's handles: their
    # ``flat_param`` is the flat parameter, with torch's attributes on it (See [Note: torch's flat
    # parameter attributes] in fsdp/core/param_attrs.py); torch's other handle attributes are not there.
    @property
    def _handles(self) -> list[Any]:
        """This wrapper's flat-parameter handles (torch's older private list)."""
        return list(self.handles)

    @property
    def _handle(self) -> Any:
        """This wrapper's flat-parameter handle (torch's private attribute), None without parameters."""
        if len(self.handles) > 1:
            raise RuntimeError(
                f"FullyShardedDataParallel._handle: this wrapper holds {len(self.handles)} flat parameters (frozen "
                "and trainable ones, or several dtypes, are flattened apart), torch's one handle cannot stand for "
                "them; read model._handles or model.params"
            )
        return self.handles[0] if self.handles else None

    def check_is_root(self) -> bool:
        """torch FSDP1's: whether this wrapper is the root (outermost) one. Before the first forward
        the outermost wrapper becomes the root here, as the first forward would make it (collective
        then: the ranks compare their wrapper trees)."""
        if self._is_root is None and not self._inside_another:
            self._lazy_init()
        return bool(self._is_root)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch FSDP1's gradient communication hook: not supported."""
        raise NotImplementedError(
            "FullyShardedDataParallel.register_comm_hook is not supported: gradients are reduced by this library's "
            "own reduce-scatter (all-reduce under NO_SHARD). For communication in lower precision pass "
            "mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16); to change how gradients are averaged use "
            "set_gradient_divide_factors"
        )

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[Any]:
        """Every wrapper in ``module`` (itself included), outermost first; with ``root_only`` the
        outermost ones only."""
        found = [m for m in module.modules() if isinstance(m, TorchFSDPMethods)]
        if not root_only:
            return found
        inner = {id(w) for m in found for w in m.modules() if w is not m and isinstance(w, TorchFSDPMethods)}
        return [m for m in found if id(m) not in inner]

    @staticmethod
    @contextlib.contextmanager
    def _summon_any(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """torch FSDP1's static ``FSDP.summon_full_params(module, ...)``: every outermost wrapper in
        ``module`` shows its full parameters (with ``recurse=False`` only ``module`` itself, if it is a
        wrapper); a module without wrappers is left as it is. Collective."""
        if isinstance(module, TorchFSDPMethods):
            targets: Iterable[Any] = [module]
        else:
            targets = TorchFSDPMethods.fsdp_modules(module, root_only=True) if recurse else []
        with contextlib.ExitStack() as stack:
            for w in targets:
                stack.enter_context(
                    SummonMethods.summon_full_params(  # fairscale's method, by keyword
                        w,
                        recurse=recurse,
                        writeback=writeback,
                        rank0_only=rank0_only,
                        offload_to_cpu=offload_to_cpu,
                        with_grads=with_grads,
                    )
                )
            yield

    @staticmethod
    def _sharded_optim_state_dict_any(
        model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
    ) -> dict[str, Any]:
        """torch FSDP1's static ``FSDP.sharded_optim_state_dict(model, optim)``: the optimizer state keyed
        by parameter name, per-element state as row-sharded DTensors. Collective."""
        whole = WholeModel(model, "sharded_optim_state_dict", group)
        return optim_sharded.sharded_optim_state_dict(whole.layout(), optim)

    @staticmethod
    @collective("full_optim_state_dict()", agreed=("rank0_only",), owner="model")
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: Any = None,
    ) -> dict[str, Any]:
        """The optimizer state a plain optimizer over the unwrapped model would have, keyed by
        parameter name as torch's is, on rank 0 (with ``rank0_only``, the other ranks get ``{}``)
        or on every rank. Collective."""
        whole = WholeModel(model, "full_optim_state_dict", group)
        optim = cast(torch.optim.Optimizer, _optimizer_from("full_optim_state_dict", optim, optim_input))
        return _full_named(whole.layout(), optim, rank0_only)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """This rank's state dict for ``optim.load_state_dict`` from a full one held by every rank."""
        whole = WholeModel(model, "shard_full_optim_state_dict")
        optim = _optimizer_from("shard_full_optim_state_dict", optim, optim_input)
        return optim_impl.get_shard_from_optim_state_dict(whole.layout(), full_optim_state_dict, optim)

    @staticmethod
    @collective("scatter_full_optim_state_dict()", owner="model")
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """As :meth:`shard_full_optim_state_dict`, with the full state dict on rank 0 alone (the
        other ranks may pass None): rank 0 sends it to the others. Collective."""
        whole = WholeModel(model, "scatter_full_optim_state_dict", group)
        optim = _optimizer_from("scatter_full_optim_state_dict", optim, optim_input)
        layout = whole.layout()
        if layout.rank == 0 and full_optim_state_dict is None:
            raise ValueError(
                "FullyShardedDataParallel.scatter_full_optim_state_dict: rank 0 must pass the full state dict"
            )
        full = _broadcast_object(full_optim_state_dict if layout.rank == 0 else None, layout)
        return optim_impl.get_shard_from_optim_state_dict(layout, full, optim)

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """The optimizer state keyed by parameter name (the formats are described in
        fsdp/state/optim_state.py), as the model's state dict type says: under
        ``FULL_STATE_DICT`` full tensors (on every rank, or rank 0 alone with
        ``FullOptimStateDictConfig(rank0_only=True)``: the others get ``{}``); under
        ``SHARDED_STATE_DICT`` row-sharded DTensors. Collective.

        ``optim_state_dict``, if given, is converted instead of the optimizer's current state, as in
        torch: a state dict of ``optim`` (its ids) or of a named optimizer (keyed by the names the
        model gives its parameters), saved at any time, with entries of any type; without
        ``"param_groups"`` the result has none (see fsdp/state/optim_given.py)."""
        whole = WholeModel(model, "optim_state_dict", group)
        kind = whole.settings.state_dict_type
        if kind not in (StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT):
            raise NotImplementedError(
                f"FullyShardedDataParallel.optim_state_dict: {kind.name} has no optimizer state form; use "
                "FULL_STATE_DICT or SHARDED_STATE_DICT"
            )
        where = "FullyShardedDataParallel.optim_state_dict"
        view = (
            None if optim_state_dict is None else optim_given.view_of(optim, optim_state_dict, model, where)
        )
        source = optim if view is None else cast(torch.optim.Optimizer, view)
        if kind is StateDictType.SHARDED_STATE_DICT:
            out = optim_sharded.sharded_optim_state_dict(whole.layout(), source)
        else:
            out = _full_named(whole.layout(), source, whole.optim_rank0_only())
        if view is None or optim_state_dict is None:
            return out
        return optim_given.finish(out, optim_state_dict, view, where)

    @staticmethod
    @collective("optim_state_dict_to_load()", owner="model")
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        """What ``optim.load_state_dict`` takes, from an :meth:`optim_state_dict` saved at any world
        size (under the same state dict type). Under ``FULL_STATE_DICT`` every rank passes the whole
        dict, or, with ``FullOptimStateDictConfig(rank0_only=True)``, rank 0 does and rank 0 sends it
        to the others. ``load_directly=True`` loads it into ``optim`` too. With
        ``is_named_optimizer=True`` (``optim`` is torch's ``_NamedOptimizer`` or TorchRec's
        ``KeyedOptimizer``) the result is keyed by the names ``model.named_parameters()`` gives the
        optimizer's parameters, what such an optimizer loads. Collective under
        ``SHARDED_STATE_DICT`` and with ``rank0_only``."""
        whole = WholeModel(model, "optim_state_dict_to_load", group)
        where = "FullyShardedDataParallel.optim_state_dict_to_load"
        kind = whole.settings.state_dict_type
        layout = whole.layout()

        def keyed(shard: dict[str, Any]) -> dict[str, Any]:
            return optim_given.keyed_by_name(shard, optim, model, where) if is_named_optimizer else shard

        if kind is StateDictType.SHARDED_STATE_DICT:
            return optim_sharded.load_sharded_optim_state_dict(layout, optim, optim_state_dict, keyed)
        if kind is not StateDictType.FULL_STATE_DICT:
            raise NotImplementedError(
                f"{where}: {kind.name} has no optimizer state form; use FULL_STATE_DICT or SHARDED_STATE_DICT"
            )
        if whole.optim_rank0_only():
            optim_state_dict = _broadcast_object(optim_state_dict if layout.rank == 0 else None, layout)
        shard = keyed(optim_impl.get_shard_from_optim_state_dict(layout, optim_state_dict, optim))
        if load_directly:
            optim.load_state_dict(shard)
        return shard

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: Any,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Re-key a full optimizer state dict between parameter names (``OptimStateKeyType.PARAM_NAME``:
        the form :meth:`full_optim_state_dict` returns) and parameter ids (``PARAM_ID``: positions in
        ``optim``'s parameter groups, else in ``model.parameters()``: what a plain optimizer's
        ``state_dict()`` holds). ``model`` is the unwrapped model (or one wrapped with
        ``use_orig_params=True``). Each param group's keys come sorted, as in torch (ids then equal
        a plain optimizer's own ``state_dict()``). A dict already keyed so is returned as it is.
        Not collective."""
        optim = _optimizer_from("rekey_optim_state_dict", optim, optim_input)
        kind = getattr(optim_state_key_type, "name", optim_state_key_type)
        if kind not in ("PARAM_NAME", "PARAM_ID"):
            raise ValueError(
                "FullyShardedDataParallel.rekey_optim_state_dict: optim_state_key_type must be "
                f"OptimStateKeyType.PARAM_NAME or OptimStateKeyType.PARAM_ID, got {optim_state_key_type!r}"
            )
        if any(
            isinstance(w, TorchFSDPMethods) and w.fsdp_config.sharding.flatten_parameters
            for w in model.modules()
        ):
            raise ValueError(
                "FullyShardedDataParallel.rekey_optim_state_dict: the model holds flattened parameters, whose ids "
                "name no original parameter. Pass the unwrapped model (or one wrapped with use_orig_params=True); "
                "to load a full optimizer state dict into the wrapped model use shard_full_optim_state_dict"
            )
        name_of: dict[int, str] = {}
        for name, p in model.named_parameters():  # a tied parameter goes by its first name
            name_of.setdefault(id(p), plain_name(name).replace(CHECKPOINT_WRAPPED + ".", ""))
        params = (
            [p for g in optim.param_groups for p in g["params"]]
            if optim is not None
            else list(model.parameters())
        )
        names = optim_given.names_of(params, name_of, "FullyShardedDataParallel.rekey_optim_state_dict")
        groups = optim_state_dict["param_groups"]
        keys = [k for g in groups for k in g["params"]]
        if len({type(k) for k in [*keys, *optim_state_dict["state"]]} & {str, int}) > 1:
            raise ValueError(
                "FullyShardedDataParallel.rekey_optim_state_dict: the state dict mixes parameter names and ids as keys "
                f"({sorted(map(str, optim_state_dict['state']))[:4]}); pass one keyed by either"
            )
        if kind == "PARAM_NAME":
            if all(isinstance(k, str) for k in keys):
                return optim_state_dict
            table: Mapping[Any, Any] = dict(enumerate(names))
        else:
            if all(isinstance(k, int) for k in keys):
                return optim_state_dict
            table = {n: i for i, n in enumerate(names)}
        unknown = [k for k in [*keys, *optim_state_dict["state"]] if k not in table]
        if unknown:
            raise ValueError(
                f"FullyShardedDataParallel.rekey_optim_state_dict: keys {unknown[:4]} name no parameter of the model "
                f"(it has {len(names)}, e.g. {names[:3]}); the state dict and the model must come from the same "
                "architecture"
            )
        extras = {k: v for k, v in optim_state_dict.items() if k not in ("state", "param_groups")}
        return {
            **extras,
            "state": {table[k]: v for k, v in optim_state_dict["state"].items()},
            "param_groups": [{**g, "params": sorted(table[k] for k in g["params"])} for g in groups],
        }

    @staticmethod
    @collective("flatten_sharded_optim_state_dict()", owner="model")
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """torch FSDP1's deprecated reader of :meth:`sharded_optim_state_dict` (saved at any world
        size): what ``optim.load_state_dict`` takes. As :meth:`optim_state_dict_to_load` under
        ``SHARDED_STATE_DICT`` does, the state is loaded into ``optim`` too. Collective."""
        whole = WholeModel(model, "flatten_sharded_optim_state_dict", None)
        return optim_sharded.load_sharded_optim_state_dict(whole.layout(), optim, sharded_optim_state_dict)
