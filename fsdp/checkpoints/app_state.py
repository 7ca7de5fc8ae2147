"""The training loop's own state in a checkpoint: every rank's, through DCP's ``Stateful`` protocol.

[Note: application state]
``save_checkpoint(..., app_state={"name": obj})`` takes any object with ``state_dict()`` and
``load_state_dict()`` (``torch.distributed.checkpoint.stateful.Stateful``: an LR scheduler, a grad
scaler, a sampler, an RNG holder) and stores ``obj.state_dict()`` *of every rank*: rank r's goes,
serialized with ``torch.save``, into one bytes entry ``app_state/<name>/<r>`` of the DCP checkpoint,
which rank r writes into its own file in the same save as the model, under the same commit marker.
The serialized state must read back with ``torch.load(weights_only=True)``; the save checks that
on every rank before anything is written.

``load_checkpoint(..., app_state=...)`` gives each object the state its rank saved. At another world
size, rank r receives the state that rank ``r % N`` saved (N the saving world size): state that is
the same on every rank (a step count, a scheduler, a scaler, a global data position) is then
complete, while state that is each rank's own (RNG streams) is another rank's, which the object
can detect from its saved content (store the rank and world size in it).

Why one bytes entry per rank rather than DCP's own flattening of the state dicts: DCP treats plain
tensors and objects as replicated and keeps one rank's copy, so every rank would get rank 0's RNG
state back; and a DCP load target must hold every key of the saved structure, which a state dict
whose shape changes between runs (a list that grows, an entry present only on CUDA) cannot give.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["PREFIX", "check_app_state", "from_bytes", "key", "source_rank", "state_blobs", "to_bytes"]

PREFIX = "app_state/"  # the DCP keys of application state: app_state/<name>/<rank>


def check_app_state(app_state: Mapping[str, Stateful] | None) -> dict[str, Stateful]:
    """``app_state`` as a dict, after checking its names and that every value is ``Stateful``."""
    if app_state is None:
        return {}
    if not isinstance(app_state, Mapping):
        raise TypeError(
            f"app_state must be a mapping from names to objects with state_dict() and load_state_dict(), got "
            f"{type(app_state).__name__}; e.g. app_state={{'scheduler': scheduler, 'rng': rng_state}}"
        )
    for name, obj in app_state.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"app_state names must be non-empty strings without '/', got {name!r}")
        if not (
            callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"app_state[{name!r}] is a {type(obj).__name__}, which lacks state_dict() or load_state_dict() "
                "(torch.distributed.checkpoint's Stateful protocol); pass an object that has both, e.g. a "
                "small class whose state_dict() returns the values to keep"
            )
    return dict(app_state)


def key(name: str, rank: int) -> str:
    """The DCP key under which ``rank`` saves the state of ``name``."""
    return f"{PREFIX}{name}/{rank}"


def source_rank(rank: int, saved_world_size: int) -> int:
    """Whose saved state ``rank`` loads: its own at the same world size, else rank ``rank % N``."""
    return rank % saved_world_size


def to_bytes(obj: Any, what: str) -> bytes:
    """``obj`` as ``torch.save`` writes it, after checking that ``torch.load(weights_only=True)`` reads it
    back (what loading uses); else a checkpoint would commit that never loads. ValueError otherwise."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
    except Exception as e:
        raise ValueError(f"{what} cannot be saved: {type(e).__name__}: {e}") from None
    try:
        torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)
    except Exception as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = next((line for line in lines if "WeightsUnpickler" in line), lines[0] if lines else "")
        raise ValueError(
            f"{what} holds something torch.load(weights_only=True) cannot read back ({type(e).__name__}: "
            f"{detail}); keep to numbers, strings, tensors and lists / tuples / dicts of them (e.g. numpy's "
            "RNG state as a list, torch.get_rng_state() as a tensor)"
        ) from None
    return buffer.getvalue()


def from_bytes(blob: Any, what: str) -> Any:
    """The state that :func:`to_bytes` serialized (ValueError if ``blob`` is not such bytes)."""
    if not isinstance(blob, bytes):
        raise ValueError(f"{what} in the checkpoint is a {type(blob).__name__}, not serialized state")
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{what} in the checkpoint cannot be read: {type(e).__name__}: {e}") from None


def state_blobs(app_state: Mapping[str, Stateful], rank: int) -> dict[str, bytes]:
    """``{key(name, rank): serialized obj.state_dict()}`` for this rank; ValueError naming the entry."""
    blobs = {}
    for name, obj in app_state.items():
        what = f"app_state[{name!r}]"
        try:
            state = obj.state_dict()
        except Exception as e:
            raise ValueError(f"{what}.state_dict() failed: {type(e).__name__}: {e}") from None
        blobs[key(name, rank)] = to_bytes(state, f"{what}.state_dict()")
    return blobs
