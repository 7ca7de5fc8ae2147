"""Checkpoint directories: save and load a wrapped model (and optimizer) at any world size.

A checkpoint is one directory written by ``torch.distributed.checkpoint`` (DCP) from the sharded
state dicts (see [Note: sharded state dict layout] in state_dict.py), so it loads at any world size
and into any wrap plan. See [Note: checkpoint commit] for how a save becomes visible.

[Note: checkpoint commit]
Each save goes into a fresh directory and becomes a checkpoint only when its commit marker
``COMMITTED`` exists. The marker is written last: rank 0 writes it after every rank has finished
writing (DCP's own final step, then an agreement between ranks), to a temporary name first and then
renamed, so it is either complete or absent. It records the size of every file, which each rank
checks before loading. A crash at any point before the rename therefore leaves a directory without a
marker, which :func:`load_checkpoint` rejects on every rank, while the previous checkpoint is
untouched and loadable. Every phase of a save or a load ends with :func:`fsdp.state_dict.agree`: a
failure on one rank becomes the same error on all of them instead of leaving them blocked in the
next collective. Loading reads into fresh buffers and checks every name and shape before anything
is written into the model or the optimizer, so a failed load changes nothing.

Files: ``.metadata`` and ``__<rank>_<n>.distcp`` (DCP), ``fsdp_manifest.json`` (format, world size,
the unwrapped model's state-dict keys and tied names), ``extra.pt`` (the ``extra`` object, from rank
0) and ``COMMITTED``. The directory must be on a file system that every rank sees (it may be mounted
at different paths on different nodes): before writing anything, rank 0 leaves a random token in
``.fsdp_save_probe`` and every rank must read it back at its own path. A load compares the
checkpoint id (random, in the marker) that each rank read.
"""

from __future__ import annotations

import io
import json
import logging
import os
import secrets
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fsdp.consistency import collective
from fsdp.fully_sharded import FullyShardedDataParallel
from fsdp.optim_state import (
    OptimLoadPlan,
    apply_sharded_optim_state_dict,
    check_sharded_optim_state_dict,
    sharded_optim_state_dict,
    sharded_optim_state_dict_template,
)
from fsdp.state_dict import (
    ShardedLoadPlan,
    apply_sharded_state_dict,
    check_sharded_state_dict,
    sharded_state_dict,
    sharded_state_dict_template,
)
from fsdp.state_layout import Layout, agree

__all__ = [
    "COMMIT_MARKER",
    "CheckpointError",
    "is_committed",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint_info",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
MANIFEST = "fsdp_manifest.json"
EXTRA = "extra.pt"
PROBE = ".fsdp_save_probe"  # rank 0's random token: every rank must read it back at its own path
FORMAT = "fsdp-checkpoint"
VERSION = 1
_MODEL, _OPTIM = "model", "optim"


_SAME_PATH = (
    "the ranks passed different checkpoint directories, or read different checkpoints, or the directory "
    "is not on a file system every rank sees; pass every rank the same directory on a shared file system "
    "(for a resume: rank 0's latest_checkpoint(), sent with dist.broadcast_object_list)"
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank with the same message."""


def _describe(model: FullyShardedDataParallel) -> Layout:
    if not isinstance(model, FullyShardedDataParallel):
        raise TypeError(f"expected the root FullyShardedDataParallel wrapper, got {type(model).__name__}")
    if model.is_root is False or model._inside_another:
        raise ValueError(
            "checkpoints are saved and loaded through the root FullyShardedDataParallel wrapper, not an inner "
            "one (it would cover only its own subtree); pass the outermost wrapper"
        )
    layout: Layout = model._state_layout()
    return layout


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------- markers and manifest
def is_committed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a complete checkpoint (its commit marker exists)."""
    return (Path(path) / COMMIT_MARKER).is_file()


def read_checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check that ``path`` is a complete, undamaged checkpoint; return its manifest. Reads no tensor data.

    Raises :class:`CheckpointError` if the commit marker is missing (the save never finished), a
    file is missing or has another size than when it was saved, or the format is unknown.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {str(root)!r} does not exist (or is not a directory)")
    marker = root / COMMIT_MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {str(root)!r} has no commit marker {COMMIT_MARKER!r}: its save did not finish (the job "
            "crashed or was stopped while writing it). Load an earlier checkpoint (fsdp.latest_checkpoint finds "
            "the newest complete one)"
        )
    try:
        committed = json.loads(marker.read_text())
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(root)!r} is damaged: {_error(e)}") from e
    if manifest.get("format") != FORMAT or int(manifest.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{str(root)!r} is not an fsdp checkpoint of a version this fsdp reads (format "
            f"{manifest.get('format')!r}, version {manifest.get('version')!r}; this fsdp reads {FORMAT!r} up to "
            f"version {VERSION})"
        )
    for name, size in committed.get("files", {}).items():
        file = root / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            state = "is missing" if actual is None else f"has {actual} bytes"
            raise CheckpointError(
                f"checkpoint {str(root)!r} is damaged: {name} {state}, the commit marker recorded {size} bytes "
                "(truncated or changed after the save). Load an earlier checkpoint"
            )
    manifest["saved_at_ns"] = committed.get("saved_at_ns", 0)
    manifest["checkpoint_id"] = committed.get("checkpoint_id", "")
    return dict(manifest)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The most recently committed checkpoint directory directly under ``root`` that passes
    :func:`read_checkpoint_info` (complete, files of their recorded sizes), or None."""
    base = Path(root)
    if not base.is_dir():
        return None
    found: list[tuple[int, str, Path]] = []
    for child in base.iterdir():
        marker = child / COMMIT_MARKER
        if not marker.is_file():
            continue
        try:
            found.append((int(json.loads(marker.read_text()).get("saved_at_ns", 0)), child.name, child))
        except Exception:  # unreadable, or not the marker's format
            continue
    for _, _, path in sorted(found, reverse=True):
        try:
            read_checkpoint_info(path)
        except Exception as e:
            log.warning("latest_checkpoint: skipping %s: %s", path, e)
            continue
        return path
    return None


def _write_atomically(path: Path, data: str | bytes) -> None:
    """Write a temporary file, fsync it, rename it over ``path`` and fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def _serialize_extra(extra: Any) -> bytes:
    """``extra`` as ``torch.save`` writes it, after checking that ``torch.load(weights_only=True)``
    (what :func:`load_checkpoint` uses) reads it back; else a checkpoint would commit that never loads."""
    buffer = io.BytesIO()
    try:
        torch.save(extra, buffer)
    except Exception as e:
        raise CheckpointError(f"extra cannot be saved: {_error(e)}") from None
    try:
        torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)
    except Exception as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = next((line for line in lines if "WeightsUnpickler" in line), lines[0] if lines else "")
        raise CheckpointError(
            f"extra holds something torch.load(weights_only=True) cannot read back ({type(e).__name__}: "
            f"{detail}); keep to numbers, strings, tensors and lists / tuples / dicts of them (e.g. numpy's "
            "RNG state as a list, torch.get_rng_state() as a tensor)"
        ) from None
    return buffer.getvalue()


def _looks_like_failed_save(root: Path) -> bool:
    ours = {
        PROBE,
        PROBE + ".tmp",
        ".metadata",
        ".metadata.tmp",
        MANIFEST,
        EXTRA,
        EXTRA + ".tmp",
        MANIFEST + ".tmp",
        COMMIT_MARKER + ".tmp",
    }
    return all(p.is_file() and (p.name in ours or p.suffix == ".distcp") for p in root.iterdir())


def _prepare_directory(root: Path) -> None:
    if root.exists():
        if not root.is_dir():
            raise CheckpointError(f"{str(root)!r} exists and is not a directory; save into a fresh directory")
        if is_committed(root):
            raise CheckpointError(
                f"{str(root)!r} already holds a committed checkpoint; save each checkpoint into a fresh directory "
                "(e.g. one per step) so that the previous one stays loadable"
            )
        if any(root.iterdir()):
            if not _looks_like_failed_save(root):
                raise CheckpointError(
                    f"{str(root)!r} exists and holds files that are not from a checkpoint; save into a fresh directory"
                )
            warnings.warn(
                f"{root}: removing the files of an earlier save that never committed",
                RuntimeWarning,
                stacklevel=4,
            )
            for p in root.iterdir():
                p.unlink()
    root.mkdir(parents=True, exist_ok=True)


# ---------------------------------------------------------------------- save
@collective("save_checkpoint()", owner="model")
def save_checkpoint(
    path: str | os.PathLike[str],
    model: FullyShardedDataParallel,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
) -> Path:
    """Save ``model`` (and ``optimizer``) into the fresh directory ``path``. Collective: every rank calls it.

    Each rank writes 1/world_size of the parameters and of the optimizer state; ``extra`` (rank 0's,
    anything ``torch.load(weights_only=True)`` reads back: numbers, strings, tensors, containers of
    them) is stored beside. The directory counts as a checkpoint once its commit marker is written,
    last (see [Note: checkpoint commit]). An uncommitted leftover of a crashed save at ``path`` is
    replaced; a committed checkpoint there is refused. Returns ``path``.
    """
    root = Path(path)
    layout = _describe(model)
    what = f"save_checkpoint({str(root)!r})"
    error = None
    blob = None
    created = False
    if layout.rank == 0:
        try:
            if extra is not None:
                blob = _serialize_extra(extra)
            created = not root.exists()
            _prepare_directory(root)
            if layout.world_size > 1:
                _write_atomically(root / PROBE, secrets.token_hex(16))
        except Exception as e:
            error = str(e) if isinstance(e, CheckpointError) else _error(e)
    agree(layout, error, what, exc_type=CheckpointError)
    try:
        # every rank must see the directory rank 0 prepared (a per-rank name, or a disk only one node
        # sees, would commit rank 0's files only); mount points may differ
        if layout.world_size > 1:
            try:
                seen = (root / PROBE).read_text()
            except OSError as e:
                seen = f"unreadable: {type(e).__name__}"
            agree(layout, None, what, seen, CheckpointError, _SAME_PATH)

        error = None
        try:
            state: dict[str, Any] = {_MODEL: sharded_state_dict(layout)}
            if optimizer is not None:
                state[_OPTIM] = sharded_optim_state_dict(layout, optimizer)
            writer = FileSystemWriter(str(root), single_file_per_rank=True, sync_files=True)
            dcp_save(state, storage_writer=writer, process_group=layout.group)
        except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
            error = _error(e)
        agree(layout, error, what, exc_type=CheckpointError)

        error = None
        if layout.rank == 0:
            try:
                if blob is not None:
                    _write_atomically(root / EXTRA, blob)
                manifest = {
                    "format": FORMAT,
                    "version": VERSION,
                    "world_size": layout.world_size,
                    "torch_version": torch.__version__,
                    "model_keys": list(layout.keys),
                    "aliases": {alias: s.name for s in layout.every_param() for alias in s.aliases},
                    "has_optimizer": optimizer is not None,
                    "optimizer": _class_name(optimizer) if optimizer is not None else None,
                    "has_extra": extra is not None,
                    "wrap_plan": layout.fingerprint(),
                }
                _write_atomically(root / MANIFEST, json.dumps(manifest, indent=1))
            except Exception as e:
                error = _error(e)
        agree(layout, error, what, exc_type=CheckpointError)  # every rank's data is on disk: the barrier

        error = None
        if layout.rank == 0:
            try:
                (root / PROBE).unlink(missing_ok=True)
                files = {p.name: p.stat().st_size for p in sorted(root.iterdir()) if p.is_file()}
                marker = {
                    "format": FORMAT,
                    "checkpoint_id": secrets.token_hex(16),
                    "saved_at_ns": time.time_ns(),
                    "world_size": layout.world_size,
                    "files": files,
                }
                _write_atomically(root / COMMIT_MARKER, json.dumps(marker, indent=1))
            except Exception as e:
                error = _error(e)
        agree(layout, error, what, exc_type=CheckpointError)
    except CheckpointError:
        if layout.rank == 0:  # no probe left behind, and no directory this save created for nothing
            (root / PROBE).unlink(missing_ok=True)
            if created and root.is_dir() and not any(root.iterdir()):
                root.rmdir()
        raise
    log.info("saved checkpoint %s at world size %d", root, layout.world_size)
    return root


# ---------------------------------------------------------------------- load
@collective("load_checkpoint()", owner="model")
def load_checkpoint(
    path: str | os.PathLike[str],
    model: FullyShardedDataParallel,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` at any world size and wrap plan. Collective.

    Returns the ``extra`` object that was saved (None if none). Raises :class:`CheckpointError` on
    every rank, with the model and optimizer unchanged, if the checkpoint is incomplete or damaged,
    or does not match the model (a key missing, or with ``strict`` unexpected, a shape that differs)
    or the optimizer (other param groups, or no optimizer state saved).
    """
    root = Path(path)
    layout = _describe(model)
    what = f"load_checkpoint({str(root)!r}) (nothing was loaded)"
    error, digest = None, ""
    state: dict[str, Any] = {}
    manifest: dict[str, Any] = {}
    try:
        manifest = read_checkpoint_info(root)
        storage = FileSystemReader(str(root)).read_metadata().state_dict_metadata
        problems = _match_model(layout, storage, strict)
        state[_MODEL] = {
            k: v for k, v in sharded_state_dict_template(layout).items() if f"{_MODEL}.{k}" in storage
        }
        if optimizer is not None:
            saved_type = manifest.get("optimizer")
            if not manifest.get("has_optimizer"):
                problems.append("the checkpoint holds no optimizer state (it was saved without an optimizer)")
            elif saved_type is not None and saved_type != _class_name(optimizer):
                problems.append(
                    f"the checkpoint holds optimizer state saved from {saved_type}, and the optimizer passed is "
                    f"{_class_name(optimizer)}; build the same optimizer class as at the save"
                )
            else:
                state[_OPTIM], more = sharded_optim_state_dict_template(layout, storage, f"{_OPTIM}.")
                problems += more
        error = "\n  ".join(problems) or None
    except Exception as e:
        error = str(e) if isinstance(e, CheckpointError) else _error(e)
    # every rank must read the same checkpoint (mount points may differ; the id is the save's)
    which = f"{manifest.get('checkpoint_id', '')}@{manifest.get('saved_at_ns', 0)}"
    agree(layout, error, what, which, CheckpointError, _SAME_PATH)

    extra = None
    error = None
    model_plan: ShardedLoadPlan | None = None
    optim_plan: OptimLoadPlan | None = None
    try:
        dcp_load(state, storage_reader=FileSystemReader(str(root)), process_group=layout.group)
        if manifest.get("has_extra"):
            extra = torch.load(root / EXTRA, map_location="cpu", weights_only=True)
        model_plan = check_sharded_state_dict(layout, state[_MODEL], strict)
        problems = list(model_plan.errors)
        digest = model_plan.digest
        if optimizer is not None:
            optim_plan = check_sharded_optim_state_dict(layout, optimizer, state[_OPTIM])
            problems += optim_plan.errors
            digest += optim_plan.digest
        error = "\n  ".join(problems) or None
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        error = _error(e)
    agree(layout, error, what, digest, exc_type=CheckpointError)

    assert model_plan is not None
    apply_sharded_state_dict(layout, model_plan)
    if optimizer is not None:
        assert optim_plan is not None
        apply_sharded_optim_state_dict(layout, optimizer, optim_plan)
    log.info(
        "loaded checkpoint %s (saved at world size %s) at world size %d",
        root,
        manifest.get("world_size"),
        layout.world_size,
    )
    return extra


def _match_model(layout: Layout, storage: dict[str, Any], strict: bool) -> list[str]:
    """Names and shapes of the model's entries against the checkpoint's metadata."""
    problems = []
    expected = {s.name: s.shape for s in layout.params}
    expected.update((s.name, s.shape) for s in layout.ignored)
    expected.update((b.name, tuple(b.tensor.shape)) for b in layout.buffers)
    head = f"{_MODEL}."
    missing = [name for name in expected if head + name not in storage]
    if missing:
        problems.append("key(s) missing from the checkpoint: " + ", ".join(repr(k) for k in missing))
    for name, shape in expected.items():
        md = storage.get(head + name)
        size = getattr(md, "size", None)
        if md is not None and (size is None or tuple(size) != shape):
            problems.append(f"{name!r}: shape {tuple(size or ())} in the checkpoint, {shape} in the model")
    aliases = {a for s in layout.every_param() for a in s.aliases}
    unexpected = [k[len(head) :] for k in storage if k.startswith(head) and k[len(head) :] not in expected]
    unexpected = [k for k in unexpected if k not in aliases]
    if strict and unexpected:
        problems.append(
            "key(s) in the checkpoint that the model does not have: " + ", ".join(repr(k) for k in unexpected)
        )
    return problems
