"""The state-dict and optimizer-state methods of the wrapper, mixed into it.

Each is a thin call into ``fsdp/state_dict.py`` or ``fsdp/optim_state.py`` over the wrapper tree's
:class:`~fsdp.state_layout.Layout` (``_state_layout()``, which the wrapper provides).
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

from fsdp import optim_state as optim_impl
from fsdp import state_dict as sd_impl
from fsdp.api import StateDictType, TrainingState
from fsdp.consistency import WRAPPED

__all__ = ["StateDictMethods"]


class StateDictMethods:
    """Full, local, sharded and consolidated state dicts; optimizer state gathered, sharded or in DCP form."""

    # provided by the wrapper
    _state_dict_type: StateDictType  # what state_dict() / load_state_dict() mean; see state_dict_type()
    _state_dict_options: tuple[torch.device | None, bool] | None  # a torch FullStateDictConfig's, while set
    _fsdp_wrapped_module: nn.Module
    _buffer_dtypes: dict[str, torch.dtype]
    handles: list[Any]
    fsdp_config: Any

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def compute_device(self) -> torch.device:
        raise NotImplementedError

    def _state_layout(self) -> Any:
        """Where every original parameter and buffer of this wrapper tree lives (the wrapper's)."""
        raise NotImplementedError

    def _wrappers(self) -> list[Any]:
        raise NotImplementedError

    def _full_params_shown(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    def _state_dict_device(self) -> torch.device:
        raise NotImplementedError

    def _full_state_dict_options(self) -> tuple[torch.device, bool]:
        """Where the full state dict's tensors go and whether only rank 0 keeps them: the
        constructor's options, unless a ``state_dict_type`` context gave a config."""
        device, rank0_only = self._state_dict_device(), self.fsdp_config.state_dict.state_dict_on_rank_0_only
        if self._state_dict_options is not None:
            given, rank0_only = self._state_dict_options
            device = given or device
        return device, rank0_only

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
        ``FullStateDictConfig``) applies to the full state dict."""
        wrappers = _wrappers_in(module)
        before = [(w, w._state_dict_type, w._state_dict_options) for w in wrappers]
        StateDictMethods.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            for w, kind, options in before:
                w._state_dict_type, w._state_dict_options = kind, options

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> StateDictType:
        """Make ``state_dict()`` / ``load_state_dict()`` of every wrapper in ``module`` mean
        ``state_dict_type`` from now on; return the previous type (of the first wrapper)."""
        if not isinstance(state_dict_type, StateDictType):
            raise TypeError(
                f"FullyShardedDataParallel.state_dict_type: expected a fsdp.StateDictType, got {state_dict_type!r}"
            )
        if optim_state_dict_config is not None:
            raise NotImplementedError(
                "FullyShardedDataParallel.state_dict_type: optim_state_dict_config is not supported; the "
                "optimizer state comes from gather_full_optim_state_dict() or sharded_optim_state_dict()"
            )
        options = None
        if state_dict_config is not None:
            offload = bool(getattr(state_dict_config, "offload_to_cpu", False))
            rank0_only = bool(getattr(state_dict_config, "rank0_only", False))
            if state_dict_type is not StateDictType.FULL_STATE_DICT and (offload or rank0_only):
                raise NotImplementedError(
                    f"FullyShardedDataParallel.state_dict_type: offload_to_cpu / rank0_only apply to "
                    f"FULL_STATE_DICT only, not {state_dict_type.name}"
                )
            options = (torch.device("cpu") if offload else None, rank0_only)
        wrappers = _wrappers_in(module)
        previous = wrappers[0]._state_dict_type
        for w in wrappers:
            w._state_dict_type, w._state_dict_options = state_dict_type, options
        return previous

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
        device, rank0_only = self._full_state_dict_options()
        keep = not rank0_only or self.rank == 0
        with self._full_params_shown():
            self._fsdp_wrapped_module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
            sd_impl.own_full_values(self.handles, self._buffer_dtypes, destination, prefix, device, keep)
        if top:
            if not keep:
                destination.clear()
            elif device != self.compute_device:  # buffers too
                for key, value in destination.items():
                    if isinstance(value, torch.Tensor):
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
        with sd_impl.own_load():
            return self._load_state_dict(state_dict, strict)

    def _load_state_dict(self, state_dict: Mapping[str, Any], strict: bool) -> NamedTuple:
        if self._state_dict_type is StateDictType.LOCAL_STATE_DICT:
            return self.load_local_state_dict(state_dict, strict)
        if self._state_dict_type is StateDictType.SHARDED_STATE_DICT:
            return self.load_sharded_state_dict(state_dict, strict)
        wrappers = self._wrappers()
        for w in wrappers:
            w.assert_state(TrainingState.IDLE)
        return sd_impl.load_full_state_dict(self, wrappers, self._state_layout(), state_dict, strict)

    # [Note: loading through a plain parent]
    # ``parent.load_state_dict(sd)`` on a plain module that holds a wrapper never calls the
    # wrapper's ``load_state_dict``: torch walks the tree calling ``_load_from_state_dict`` on every
    # module, under the raw names (``0._fsdp_wrapped_module.1.weight``), while the state dict uses
    # the plain ones (``0.1.weight``) of whichever kind ``state_dict()`` wrote. So the outermost
    # wrapper on the walk loads its whole part with its own ``load_state_dict`` (which follows the
    # state dict type), wrappers inside it do nothing, and a post hook drops what the walk then
    # reports as missing under raw names inside the wrapper (buffers of inner modules): that part
    # was loaded, and any key really missing is reported under its plain name.
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
        if sd_impl.own_load_running():  # the walk of our own full load: torch's default
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
        if WRAPPED + "." in prefix:
            return  # an outer wrapper on this walk loaded this one's part
        if local_metadata.get("assign_to_params_buffers", False):
            raise NotImplementedError(
                "FullyShardedDataParallel: load_state_dict(assign=True) is not supported, also from a parent module"
            )
        mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        result = self.load_state_dict(mine, strict=False)
        missing_keys.extend(prefix + k for k in result.missing_keys)  # type: ignore[attr-defined]
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)  # type: ignore[attr-defined]

    def local_state_dict(
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """This rank's flat shards and buffers: the fast path to resume at the same world size and wrap plan.

        Keys ``"<wrapper path>.flat_param_<i>"`` and the buffers' names, plus an identity entry that
        :meth:`load_local_state_dict` checks. Values are detached references (as in
        ``nn.Module.state_dict``), or the parameters themselves with ``keep_vars``. As in fairscale,
        entries go into ``destination`` if given, under ``prefix``.
        """
        local = sd_impl.local_state_dict(self._state_layout(), keep_vars)
        out = destination if destination is not None else OrderedDict()
        out.update((prefix + k, v) for k, v in local.items())
        return out

    def load_local_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> NamedTuple:
        """Load this rank's :meth:`local_state_dict`. Another world size, rank or wrap plan raises
        ``ValueError`` saying which; nothing is written unless every entry fits. Not collective."""
        return sd_impl.load_local_state_dict(self._state_layout(), state_dict, strict)

    def local_metadata_dict(self) -> dict[str, Any]:
        """What :meth:`consolidate_shard_weights` needs besides every rank's :meth:`local_state_dict`."""
        return sd_impl.local_metadata_dict(self._state_layout())

    @staticmethod
    def consolidate_shard_weights(
        shard_weights: list[dict[str, torch.Tensor]],
        shard_metadata: list[dict[str, Any]],
        with_module_buffers: bool = True,
        strict: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The unwrapped model's full state dict from every rank's local state and metadata dicts, offline
        (no process group). See :func:`fsdp.state_dict.consolidate_shard_weights`."""
        return sd_impl.consolidate_shard_weights(shard_weights, shard_metadata, with_module_buffers, strict)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Every parameter as a row-sharded ``DTensor`` and every buffer, keyed by its name in the unwrapped
        model, for ``torch.distributed.checkpoint.save`` / ``load`` (which reshard it to any world size).
        Collective. See [Note: sharded state dict layout] in fsdp/state_dict.py."""
        return sd_impl.sharded_state_dict(self._state_layout())

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> NamedTuple:
        """Load a :meth:`sharded_state_dict` (e.g. filled by ``torch.distributed.checkpoint.load``). Collective;
        the ranks agree that names and shapes fit before anything is written."""
        return sd_impl.load_sharded_state_dict(self._state_layout(), state_dict, strict)

    def gather_full_optim_state_dict(
        self, optim: torch.optim.Optimizer, **ignored: Any
    ) -> dict[str, Any] | None:
        """The optimizer state per original parameter (a plain optimizer's state dict over the unwrapped
        model, plus ``"param_names"``), on rank 0 only (``recipient_rank=r``: on rank r); None on the
        other ranks. Collective. Other keyword arguments are ignored, as in fairscale."""
        recipient_rank = int(ignored.pop("recipient_rank", 0))
        return optim_impl.gather_full_optim_state_dict(self._state_layout(), optim, recipient_rank)

    def get_shard_from_optim_state_dict(
        self, full_optim_state_dict: dict[str, Any], optim: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """This rank's part of a full optimizer state dict (from any world size), for ``optim.load_state_dict``.
        Pass ``optim`` when its param groups list the flat parameters in another order than
        ``model.parameters()``. The argument is not modified."""
        return optim_impl.get_shard_from_optim_state_dict(self._state_layout(), full_optim_state_dict, optim)

    def sharded_optim_state_dict(self, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, per-element state as row-sharded ``DTensor``s, for
        ``torch.distributed.checkpoint``: it reshards without being gathered on one rank. Collective."""
        return optim_impl.sharded_optim_state_dict(self._state_layout(), optim)

    def load_sharded_optim_state_dict(
        self, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any]
    ) -> None:
        """Load a :meth:`sharded_optim_state_dict` (saved at any world size) into ``optim``. Collective."""
        optim_impl.load_sharded_optim_state_dict(self._state_layout(), optim, state_dict)


def _wrappers_in(module: nn.Module) -> list[StateDictMethods]:
    wrappers: list[StateDictMethods] = [m for m in module.modules() if isinstance(m, StateDictMethods)]
    if not wrappers:
        raise ValueError(
            f"FullyShardedDataParallel.state_dict_type: {type(module).__name__} holds no FullyShardedDataParallel"
        )
    return wrappers
