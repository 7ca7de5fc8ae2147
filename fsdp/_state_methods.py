"""The state-dict and optimizer-state methods of the wrapper beyond the full state dict, mixed into it.

Each is a thin call into ``fsdp/state_dict.py`` or ``fsdp/optim_state.py`` over the wrapper tree's
:class:`~fsdp.state_layout.Layout` (``_state_layout()``, which the wrapper provides).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from fsdp import optim_state as optim_impl
from fsdp import state_dict as sd_impl

__all__ = ["StateDictMethods"]


class StateDictMethods:
    """Local, sharded and consolidated state dicts; optimizer state gathered, sharded or in DCP form."""

    def _state_layout(self) -> Any:
        """Where every original parameter and buffer of this wrapper tree lives (the wrapper's)."""
        raise NotImplementedError

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
