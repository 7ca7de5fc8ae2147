"""The state-dict and optimizer-state methods of the wrapper, mixed into it.

Each is a thin call into ``fsdp/state/state_dict.py`` (local ones: ``fsdp/state/local.py``) or
``fsdp/state/optim_state.py`` over the wrapper tree's :class:`~fsdp.core.layout.Layout`
(``_state_layout()``, which the wrapper provides).
``state_dict()`` and ``load_state_dict()`` follow the wrapper's :class:`~fsdp.api.StateDictType`
(torch FSDP's ``state_dict_type`` context); the default is the full state dict.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from fsdp.api import StateDictSettings, StateDictType, TrainingState, from_torch_fsdp
from fsdp.comm.consistency import collective
from fsdp.core.wrapper_protocol import WrapperMixin
from fsdp.state import local as state_local
from fsdp.state import optim_fairscale, optim_sharded
from fsdp.state import optim_state as optim_impl
from fsdp.state import state_dict as sd_impl

__all__ = ["StateDictMethods"]


class StateDictConfigError(TypeError, RuntimeError):
    """A state-dict config of the wrong kind for its state-dict type: a ``TypeError``, and the
    ``RuntimeError`` torch FSDP1 raises there (code written for either catches it)."""


class StateDictMethods(WrapperMixin):
    """Full, local, sharded and consolidated state dicts; optimizer state gathered, sharded or in DCP form."""

    @property
    def _state_dict_type(self) -> StateDictType:
        return self._state_dict_settings.state_dict_type

    def _full_state_dict_options(self) -> tuple[torch.device, bool]:
        """Where the full state dict's tensors go and whether only rank 0 keeps them: the
        constructor's options, unless a ``state_dict_type`` context gave a config."""
        device, rank0_only = self._state_dict_device(), self.fsdp_config.state_dict.state_dict_on_rank_0_only
        config = self._state_dict_settings.state_dict_config
        if config is not None:
            offload, rank0_only = _config_options(config)
            device = torch.device("cpu") if offload else device
        return device, rank0_only

    def _check_one_state_dict_type(self) -> None:
        """Every wrapper in this tree must mean the same kind of state dict (as torch FSDP requires)."""
        kinds = {w._state_dict_settings.state_dict_type for w in self._wrappers()}
        if len(kinds) > 1:
            raise ValueError(
                "FullyShardedDataParallel: the wrappers in this model have different state dict types "
                f"({', '.join(sorted(k.name for k in kinds))}), as when set_state_dict_type() was called on an "
                "inner wrapper; set it on the outermost module, FSDP.set_state_dict_type(model, kind) or "
                "FSDP.state_dict_type(model, kind), which sets every wrapper in it"
            )

    # ------------------------------------------------------------------ torch FSDP's state_dict_type
    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> Iterator[None]:
        """Inside, ``state_dict()`` and ``load_state_dict()`` of every wrapper in ``module`` mean
        ``state_dict_type``; each wrapper's own setting comes back on exit. As in torch FSDP; a
        ``state_dict_config`` with ``offload_to_cpu`` / ``rank0_only`` (torch's
        ``FullStateDictConfig``) applies to the full state dict. ``module`` may be any module: a
        wrapper, a plain module holding wrappers, or one without any (then nothing changes)."""
        wrappers = _wrappers_in(module)
        before = [(w, w._state_dict_settings) for w in wrappers]
        StateDictMethods.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            for w, settings in before:
                w._state_dict_settings = settings

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> StateDictSettings:
        """Make ``state_dict()`` / ``load_state_dict()`` of every wrapper in ``module`` mean
        ``state_dict_type`` from now on; return the previous :class:`~fsdp.StateDictSettings` (of the
        first wrapper; the default full state dict where ``module`` holds no wrapper), which
        ``FSDP.set_state_dict_type(module, *previous)`` restores."""
        state_dict_type = from_torch_fsdp(state_dict_type)
        if not isinstance(state_dict_type, StateDictType):
            raise TypeError(
                f"FullyShardedDataParallel.state_dict_type: expected a fsdp.StateDictType, got {state_dict_type!r}"
            )
        if (
            optim_state_dict_config is not None
            and state_dict_type is not StateDictType.FULL_STATE_DICT
            and getattr(optim_state_dict_config, "rank0_only", False)
        ):
            raise NotImplementedError(
                f"FullyShardedDataParallel.state_dict_type: the optimizer config's rank0_only applies to FULL_STATE_DICT only, not "
                f"{state_dict_type.name}"
            )
        wrappers = _wrappers_in(module)
        if state_dict_config is not None and state_dict_type is not StateDictType.FULL_STATE_DICT:
            offload, rank0_only = _config_options(state_dict_config)
            on_gpu = any(w.compute_device.type != "cpu" for w in wrappers)
            if rank0_only or (offload and on_gpu):  # (on the CPU the shards are there already)
                raise NotImplementedError(
                    f"FullyShardedDataParallel.state_dict_type: rank0_only, and offload_to_cpu on a GPU, apply to "
                    f"FULL_STATE_DICT only, not {state_dict_type.name}"
                )
        for config, suffix in (
            (state_dict_config, "StateDictConfig"),
            (optim_state_dict_config, "OptimStateDictConfig"),
        ):
            expected = f"{_KIND_PREFIX[state_dict_type]}{suffix}"
            if config is not None and type(config).__name__ not in (expected, suffix):
                what = "state_dict_config" if suffix == "StateDictConfig" else "optim_state_dict_config"
                raise StateDictConfigError(  # (torch's first sentence, which its tests match)
                    f"FullyShardedDataParallel.state_dict_type: Expected {what} of type {expected} but got "
                    f"{type(config)}: {state_dict_type.name} takes a {expected}, got {type(config).__name__}"
                )
        previous = (
            wrappers[0]._state_dict_settings if wrappers else StateDictSettings(StateDictType.FULL_STATE_DICT)
        )
        for w in wrappers:
            w._state_dict_settings = StateDictSettings(
                state_dict_type, state_dict_config, optim_state_dict_config
            )
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The :class:`~fsdp.StateDictSettings` of the wrappers in ``module``, which must all agree (the
        default full state dict where it holds no wrapper)."""
        settings = [w._state_dict_settings for w in _wrappers_in(module)] or [
            StateDictSettings(StateDictType.FULL_STATE_DICT)
        ]
        if any(other != settings[0] for other in settings[1:]):
            raise ValueError(
                "FullyShardedDataParallel.get_state_dict_type: the wrappers in this module have different "
                "state dict settings; set them with FSDP.set_state_dict_type(module, kind)"
            )
        return settings[0]

    @collective("state_dict()", when=lambda w: w._state_dict_type is not StateDictType.LOCAL_STATE_DICT)
    def state_dict(
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:
        """Full, unsharded state dict with the unwrapped module's keys (under another
        ``state_dict_type``: the local or the sharded one). Collective: all ranks call it.

        Each wrapper gathers only its own parameters while its part is written, so at most one
        unit (and its ancestors) is full at a time. Inside ``summon_full_params()`` the shown full
        parameters are used as they are (in-place changes not yet written back included), as in
        fairscale. ``destination, prefix, keep_vars`` may also come positionally (with torch's
        deprecation warning), as ``nn.Module.state_dict`` still allows.
        """
        if args:
            destination, prefix, keep_vars = sd_impl.positional_args(args, destination, prefix, keep_vars)
        outermost = not sd_impl.own_call_running("save")
        if outermost:
            self._check_one_state_dict_type()
        if self._state_dict_type is StateDictType.LOCAL_STATE_DICT:
            return self.local_state_dict(destination, prefix, keep_vars)
        if self._state_dict_type is StateDictType.SHARDED_STATE_DICT:
            out = destination if destination is not None else OrderedDict()
            out.update((prefix + k, v) for k, v in self.sharded_state_dict().items())
            return out
        top = destination is None
        if top:
            destination = OrderedDict()
            destination._metadata = OrderedDict()  # type: ignore[attr-defined]
        written_before = set() if top or not outermost else set(destination)  # a parent's own entries
        device, rank0_only = self._full_state_dict_options()
        keep = not rank0_only or self.rank == 0
        with sd_impl.own_call("save"), self._full_params_shown():
            self._fsdp_wrapped_module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
            sd_impl.own_full_values(
                self._fsdp_wrapped_module,
                self.handles,
                self._buffer_dtypes,
                destination,
                prefix,
                device,
                keep,
            )
        if outermost:  # the options apply to every entry of this tree, buffers too
            mine = [k for k in destination if k not in written_before]
            for key in mine:
                value = destination[key]
                if not keep:
                    del destination[key]
                elif device != self.compute_device and isinstance(value, torch.Tensor):
                    destination[key] = value.to(device)
        return destination

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any],
        strict: bool = True,  # type: ignore[override]
        assign: bool = False,
    ) -> NamedTuple:
        """Load a full state dict with the unwrapped module's keys (under another ``state_dict_type``:
        the local or the sharded one). Collective: all ranks call it.

        Like ``state_dict()``, each wrapper gathers its parameters only while its part loads.
        """
        if assign:
            raise NotImplementedError(
                "FullyShardedDataParallel.load_state_dict(assign=True) is not supported"
            )
        return self._load(state_dict, strict)

    @collective("load_state_dict()", when=lambda w: w._state_dict_type is not StateDictType.LOCAL_STATE_DICT)
    def _load(
        self,
        state_dict: Mapping[str, Any],
        strict: bool,
        errors_out: list[str] | None = None,
        prefix: str = "",
    ) -> NamedTuple:
        if not sd_impl.own_call_running("load"):
            self._check_one_state_dict_type()
        with sd_impl.own_call("load"):
            if self._state_dict_type is StateDictType.LOCAL_STATE_DICT:
                return self.load_local_state_dict(state_dict, strict)
            if self._state_dict_type is StateDictType.SHARDED_STATE_DICT:
                return self.load_sharded_state_dict(state_dict, strict)
            wrappers = self._wrappers()
            for w in wrappers:
                w.assert_state(TrainingState.IDLE)
            layout = self._state_layout()
            return sd_impl.load_full_state_dict(
                self, wrappers, layout, state_dict, strict, errors_out, prefix
            )

    # [Note: loading through a plain parent]
    # ``parent.load_state_dict(sd)`` on a plain module that holds a wrapper never calls the
    # wrapper's ``load_state_dict``: torch walks the tree calling ``_load_from_state_dict`` (and the
    # load hooks) of every module, under the raw names (``0._fsdp_wrapped_module.1.weight``), while
    # the state dict has the plain ones (``0.1.weight``) of whichever kind ``state_dict()`` wrote.
    # So the first wrapper on the walk loads its whole part with its own loader (which follows the
    # state dict type, and runs the hooks inside it once), reports missing, unexpected and
    # mismatched keys under the parent's names, and has the walk skip its children, which would
    # otherwise run their hooks a second time over an empty dict. Saving needs nothing of the kind:
    # a parent's ``state_dict()`` calls the wrapper's, and the outermost wrapper on a call applies
    # ``rank0_only`` and the state dict device to the entries of its tree.
    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if sd_impl.own_call_running("load"):  # the walk inside our own full load: torch's default
            nn.Module._load_from_state_dict(
                self,  # type: ignore[arg-type]
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
            return
        if local_metadata.get("assign_to_params_buffers", False):
            raise NotImplementedError(
                "FullyShardedDataParallel: load_state_dict(assign=True) is not supported, also from a parent module"
            )
        mine: dict[str, Any] = OrderedDict(
            (k[len(prefix) :], v) for k, v in state_dict.items() if k.startswith(prefix)
        )
        mine._metadata = OrderedDict({"": dict(local_metadata)})  # type: ignore[attr-defined]  # (the local identity)
        if not mine and self._state_dict_type is StateDictType.LOCAL_STATE_DICT:
            missing_keys.extend(prefix + k for k in self.local_state_dict())  # nothing of its own: not a load
        else:
            result = self._load(mine, False, error_msgs, prefix)
            missing_keys.extend(prefix + k for k in result.missing_keys)  # type: ignore[attr-defined]
            unexpected_keys.extend(prefix + k for k in result.unexpected_keys)  # type: ignore[attr-defined]
        sd_impl.skip_children_once(self)  # type: ignore[arg-type]

    def local_state_dict(
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """This rank's flat shards and buffers: the fast path to resume at the same world size and wrap plan.

        Keys ``"<wrapper path>.flat_param_<i>"`` and the buffers' names; the identity that
        :meth:`load_local_state_dict` checks (world size, rank, wrap plan) is in the dict's ``_metadata``. Values are detached references (as in
        ``nn.Module.state_dict``), or the parameters themselves with ``keep_vars``. As in fairscale,
        entries go into ``destination`` if given, under ``prefix``.
        """
        layout = self._state_layout()
        local = state_local.local_state_dict(layout, keep_vars)
        out = destination if destination is not None else OrderedDict()
        out.update((prefix + k, v) for k, v in local.items())
        # the identity load_local_state_dict checks, where torch keeps such information: the state dict's
        # _metadata, under this wrapper's prefix (torch.save keeps it; a dict comprehension drops it)
        metadata = getattr(out, "_metadata", None)
        if metadata is None and isinstance(out, OrderedDict):
            metadata = out._metadata = OrderedDict()  # type: ignore[attr-defined]
        if metadata is not None:
            entry = metadata.setdefault(prefix.rstrip("."), {})
            entry[state_local.LOCAL_STATE_KEY] = state_local.local_identity(layout)
        return out

    def load_local_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> NamedTuple:
        """Load this rank's :meth:`local_state_dict`. Another world size, rank or wrap plan raises
        ``ValueError`` saying which; nothing is written unless every entry fits. Not collective."""
        return state_local.load_local_state_dict(self._state_layout(), state_dict, strict)

    def local_metadata_dict(self) -> dict[str, Any]:
        """What :meth:`consolidate_shard_weights` needs besides every rank's :meth:`local_state_dict`."""
        return state_local.local_metadata_dict(self._state_layout())

    @staticmethod
    def consolidate_shard_weights(
        shard_weights: list[dict[str, torch.Tensor]],
        shard_metadata: list[dict[str, Any]],
        with_module_buffers: bool = True,
        strict: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The unwrapped model's full state dict from every rank's local state and metadata dicts, offline
        (no process group). See :func:`fsdp.state.local.consolidate_shard_weights`."""
        return state_local.consolidate_shard_weights(
            shard_weights, shard_metadata, with_module_buffers, strict
        )

    @collective("sharded_state_dict()")
    def sharded_state_dict(self) -> dict[str, Any]:
        """Every parameter as a row-sharded ``DTensor`` and every buffer, keyed by its name in the unwrapped
        model, for ``torch.distributed.checkpoint.save`` / ``load`` (which reshard it to any world size).
        Collective. See [Note: sharded state dict layout] in fsdp/state/state_dict.py."""
        return sd_impl.sharded_state_dict(self._state_layout())

    @collective("load_sharded_state_dict()")
    def load_sharded_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> NamedTuple:
        """Load a :meth:`sharded_state_dict` (e.g. filled by ``torch.distributed.checkpoint.load``). Collective;
        the ranks agree that names and shapes fit before anything is written."""
        return sd_impl.load_sharded_state_dict(self._state_layout(), state_dict, strict)

    @collective("gather_full_optim_state_dict()", agreed=("ignored",))
    def gather_full_optim_state_dict(
        self, optim: torch.optim.Optimizer, **ignored: Any
    ) -> dict[str, Any] | None:
        """The optimizer state per original parameter (a plain optimizer's state dict over the unwrapped
        model, plus ``"param_names"`` and fairscale's ``"param_id_map"`` and ``"uncollected_local_ids"``,
        readable by fairscale's ``get_shard_from_optim_state_dict``), on rank 0 only
        (``recipient_rank=r``: on rank r); None on the other ranks. Collective. ``fairscale_form=False``
        leaves fairscale's keys out (and ``step`` a tensor). Other keyword arguments are ignored, as in
        fairscale."""
        recipient_rank = int(ignored.pop("recipient_rank", 0))
        fairscale_form = bool(ignored.pop("fairscale_form", True))
        return optim_impl.gather_full_optim_state_dict(
            self._state_layout(), optim, recipient_rank, fairscale_form=fairscale_form
        )

    def get_shard_from_optim_state_dict(
        self, full_optim_state_dict: dict[str, Any], optim: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """This rank's part of a full optimizer state dict (from any world size), for ``optim.load_state_dict``.
        Pass ``optim`` when its param groups list the flat parameters in another order than
        ``model.parameters()``. As in fairscale, the argument becomes the shard and is returned: its
        full state is dropped from it (the tensors inside are not changed); pass a copy to keep it."""
        shard = optim_impl.get_shard_from_optim_state_dict(self._state_layout(), full_optim_state_dict, optim)
        return optim_fairscale.become_shard_(full_optim_state_dict, shard)

    @collective("sharded_optim_state_dict()")
    def sharded_optim_state_dict(self, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, per-element state as row-sharded ``DTensor``s, for
        ``torch.distributed.checkpoint``: it reshards without being gathered on one rank. Collective."""
        return optim_sharded.sharded_optim_state_dict(self._state_layout(), optim)

    @collective("load_sharded_optim_state_dict()")
    def load_sharded_optim_state_dict(
        self, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any]
    ) -> None:
        """Load a :meth:`sharded_optim_state_dict` (saved at any world size) into ``optim``. Collective."""
        optim_sharded.load_sharded_optim_state_dict(self._state_layout(), optim, state_dict)


def _config_options(config: Any) -> tuple[bool, bool]:
    """``(offload_to_cpu, rank0_only)`` of a torch ``FullStateDictConfig`` (read by duck typing)."""
    return bool(getattr(config, "offload_to_cpu", False)), bool(getattr(config, "rank0_only", False))


_KIND_PREFIX = {
    StateDictType.FULL_STATE_DICT: "Full",
    StateDictType.LOCAL_STATE_DICT: "Local",
    StateDictType.SHARDED_STATE_DICT: "Sharded",
}


def _wrappers_in(module: nn.Module) -> list[StateDictMethods]:
    """Every wrapper in ``module`` (none for a plain module: torch's functions change nothing there)."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"FullyShardedDataParallel.state_dict_type: `module` must be an nn.Module, got {type(module).__name__}"
        )
    return [m for m in module.modules() if isinstance(m, StateDictMethods)]
