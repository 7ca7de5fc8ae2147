"""Checkpoint directories: save and load a wrapped model (and optimizer) at any world size.

A checkpoint is one directory written by ``torch.distributed.checkpoint`` (DCP) from the sharded
state dicts (see [Note: sharded state dict layout] in state/state_dict.py), so it loads at any world size
and into any wrap plan. See [Note: checkpoint commit] for how a save becomes visible.

[Note: checkpoint commit]
Each save goes into a fresh directory and becomes a checkpoint only when its commit marker
``COMMITTED`` exists. The marker is written last: rank 0 writes it after every rank has finished
writing (DCP's own final step, then an agreement between ranks), to a temporary name first and then
renamed, so it is either complete or absent. It records the size and the checksum of every file,
which the ranks check before loading (see [Note: checkpoint integrity] in checkpoints/files.py). A
crash at any point before the rename therefore leaves a directory without a
marker, which :func:`load_checkpoint` rejects on every rank, while the previous checkpoint is
untouched and loadable. Every phase of a save or a load ends with :func:`fsdp.state.state_dict.agree`: a
failure on one rank becomes the same error on all of them instead of leaving them blocked in the
next collective. Loading reads into fresh buffers and checks every name and shape before anything
is written into the model or the optimizer, so a failed load changes nothing.

Files: ``.metadata`` and ``__<rank>_<n>.distcp`` (DCP; each rank's application state is in its own
file, see [Note: application state] in checkpoints/app_state.py), ``fsdp_manifest.json`` (format, world size,
the unwrapped model's state-dict keys and tied names, the application state's names), ``extra.pt``
(the ``extra`` object, from rank 0) and ``COMMITTED``. The directory must be on a file system that
every rank sees (it may be mounted at different paths on different nodes): before writing
anything, rank 0 leaves a random token in
``.fsdp_save_probe`` and every rank must read it back at its own path. A load compares the
checkpoint id (random, in the marker) that each rank read.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fsdp.checkpoints import app_state as _app_state
from fsdp.checkpoints.files import (
    COMMIT_MARKER,
    FORMAT,
    MANIFEST,
    NO_SPACE_LEFT,
    VERSION,
    CheckpointError,
    check_checkpoint,
    file_checksum,
    gather_checksums,
    is_committed,
    latest_checkpoint,
    marker_text,
    out_of_space,
    read_checkpoint_info,
    read_dcp_metadata,
    read_marker,
    recording_writer,
    verify_share,
)
from fsdp.comm.consistency import collective
from fsdp.core.layout import Layout, agree
from fsdp.state.optim_sharded import (
    OptimLoadPlan,
    apply_sharded_optim_state_dict,
    check_sharded_optim_state_dict,
    sharded_optim_state_dict,
    sharded_optim_state_dict_template,
)
from fsdp.state.state_dict import (
    ShardedLoadPlan,
    apply_sharded_state_dict,
    check_sharded_state_dict,
    sharded_state_dict,
    sharded_state_dict_template,
)
from fsdp.wrapper.fully_sharded import FullyShardedDataParallel

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

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

EXTRA = "extra.pt"
PROBE = ".fsdp_save_probe"  # rank 0's random token: every rank must read it back at its own path
_MODEL, _OPTIM = "model", "optim"


_SAME_PATH = (
    "the ranks passed different checkpoint directories, or read different checkpoints, or the directory "
    "is not on a file system every rank sees; pass every rank the same directory on a shared file system "
    "(for a resume: rank 0's latest_checkpoint(), sent with dist.broadcast_object_list)"
)


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


# ---------------------------------------------------------------------- writing
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
    try:
        return _app_state.to_bytes(extra, "extra")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


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


def _save_error(e: BaseException, root: Path) -> str:
    """The message of a failed save phase; a full disk says so (with the directory) whatever raised it."""
    full = out_of_space(e)
    if full is not None:
        return (
            f"{NO_SPACE_LEFT} while saving {str(root)!r} ({full.strerror or full}); free space or save "
            "elsewhere. The files of this unfinished save are removed; earlier checkpoints are untouched"
        )
    return str(e) if isinstance(e, CheckpointError) else _error(e)


def _remove_unfinished(root: Path) -> None:
    """Free the space an unfinished save took (only its own files: the directory holds no marker)."""
    try:
        if root.is_dir() and not is_committed(root) and _looks_like_failed_save(root):
            for p in root.iterdir():
                p.unlink()
    except OSError as e:
        log.warning("could not remove the files of the unfinished save %s: %s", root, e)


def _clean_up_failed_save(root: Path, created: bool, full: bool) -> None:
    """Rank 0's clean-up after a save failed: the probe, the files of a save that filled the disk, and
    a directory this save created for nothing. Best effort: the disk may have turned read-only or the
    directory vanished, and the error being handled is what every rank raises, never this one's."""
    try:
        (root / PROBE).unlink(missing_ok=True)
        if full:
            _remove_unfinished(root)
        if created and root.is_dir() and not any(root.iterdir()):
            root.rmdir()
    except OSError as e:
        log.warning("could not clean up after the failed save %s: %s", root, e)


# ---------------------------------------------------------------------- save
@collective("save_checkpoint()", owner="model")
def save_checkpoint(
    path: str | os.PathLike[str],
    model: FullyShardedDataParallel,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    app_state: Mapping[str, Stateful] | None = None,
    checksums: bool = True,
) -> Path:
    """Save ``model`` (and ``optimizer``) into the fresh directory ``path``. Collective: every rank calls it.

    Each rank writes 1/world_size of the parameters and of the optimizer state; ``extra`` (rank 0's,
    anything ``torch.load(weights_only=True)`` reads back: numbers, strings, tensors, containers of
    them) is stored beside. ``app_state`` maps names to objects with ``state_dict()`` and
    ``load_state_dict()`` (DCP's ``Stateful``: a scheduler, a scaler, a sampler, RNG states); every
    rank's own ``state_dict()`` of each is saved (see [Note: application state] in checkpoints/app_state.py),
    and every rank must pass the same names. The directory counts as a checkpoint once its commit
    marker is written, last (see [Note: checkpoint commit]), with every file's size and, unless
    ``checksums=False``, its checksum (see [Note: checkpoint integrity] in checkpoints/files.py). An
    uncommitted leftover of a crashed save at ``path`` is replaced; a committed checkpoint there is
    refused. A full disk raises "no space left on device while saving <path>" on every rank and
    removes the unfinished save's files. Returns ``path``.
    """
    # torch.distributed.checkpoint is imported where it is used: it costs about 0.5 s to import
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    root = Path(path)
    layout = _describe(model)
    app = _app_state.check_app_state(app_state)
    what = f"save_checkpoint({str(root)!r})"
    error = None
    blob = None
    created = False
    app_blobs: dict[str, bytes] = {}
    try:
        app_blobs = _app_state.state_blobs(app, layout.rank)
    except ValueError as e:
        error = str(e)
    if layout.rank == 0 and error is None:
        try:
            if extra is not None:
                blob = _serialize_extra(extra)
            created = not root.exists()
            _prepare_directory(root)
            if layout.world_size > 1:
                _write_atomically(root / PROBE, secrets.token_hex(16))
        except Exception as e:
            error = _save_error(e, root)
            if out_of_space(e) is not None:
                _clean_up_failed_save(root, created, full=True)
    names = ", ".join(sorted(app))
    agree(
        layout,
        error,
        what,
        names,
        CheckpointError,
        f"the ranks passed app_state with different names ({names!r} here)",
    )
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
        mine: dict[str, str] = {}
        try:
            state: dict[str, Any] = {_MODEL: sharded_state_dict(layout)}
            if optimizer is not None:
                state[_OPTIM] = sharded_optim_state_dict(layout, optimizer)
            state.update(app_blobs)  # this rank's own entries: DCP writes them into this rank's file
            writer = recording_writer(str(root), single_file_per_rank=True, sync_files=True)
            dcp_save(state, storage_writer=writer, process_group=layout.group)
            if checksums:  # this rank's files, still in the page cache
                mine = {name: file_checksum(root / name) for name in sorted(writer.written)}
        except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
            error = _save_error(e, root)
        agree(layout, error, what, exc_type=CheckpointError)
        recorded = gather_checksums(layout, mine) if checksums else None

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
                    "app_state": sorted(app),
                    "wrap_plan": layout.fingerprint(),
                }
                _write_atomically(root / MANIFEST, json.dumps(manifest, indent=1))
            except Exception as e:
                error = _save_error(e, root)
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
                sums = None  # the files rank 0 wrote after DCP's write: .metadata, the manifest, extra
                if recorded is not None:
                    sums = {name: recorded.get(name) or file_checksum(root / name) for name in files}
                _write_atomically(root / COMMIT_MARKER, marker_text(marker, sums))
            except Exception as e:
                error = _save_error(e, root)
        agree(layout, error, what, exc_type=CheckpointError)
    except CheckpointError as e:
        if layout.rank == 0:  # no probe left behind, and no directory this save created for nothing
            _clean_up_failed_save(root, created, full=NO_SPACE_LEFT in str(e))
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
    *,
    app_state: Mapping[str, Stateful] | None = None,
    verify: bool = True,
) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` at any world size and wrap plan. Collective.

    Returns the ``extra`` object that was saved (None if none). Each object of ``app_state`` gets
    its ``load_state_dict()`` called with the state its rank saved under the same name (at another
    world size, the state of rank ``rank % saved_world_size``; see [Note: application state] in
    checkpoints/app_state.py), before the model and the optimizer are loaded. Raises :class:`CheckpointError` on
    every rank, with the model and optimizer unchanged, if the checkpoint is incomplete or damaged
    (with ``verify``, a file whose checksum differs from the one recorded at the save: the ranks
    share the reading, see [Note: checkpoint integrity] in checkpoints/files.py), or does not match
    the model (a key missing, or with ``strict`` unexpected, a shape that differs) or the optimizer
    (other param groups, or no optimizer state saved), holds no state for a name of ``app_state``,
    or an object's ``load_state_dict()`` raised on some rank.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    root = Path(path)
    layout = _describe(model)
    app = _app_state.check_app_state(app_state)
    what = f"load_checkpoint({str(root)!r}) (nothing was loaded)"
    error, digest = None, ""
    state: dict[str, Any] = {}
    manifest: dict[str, Any] = {}
    app_keys: dict[str, str] = {}  # name -> the DCP key this rank reads
    try:
        files: dict[str, int] = read_marker(root).get("files", {})
        share = verify_share(files, files, layout.rank, layout.world_size) if verify else False
        manifest, verified = check_checkpoint(root, share)
        if verify and not verified and layout.rank == 0:
            warnings.warn(
                f"checkpoint {str(root)!r} records no checksums (saved by an earlier fsdp, or with "
                "checksums=False): its content is loaded unverified",
                RuntimeWarning,
                stacklevel=2,
            )
        storage = read_dcp_metadata(root).state_dict_metadata
        problems = _match_model(layout, storage, strict)
        problems += _match_app_state(app, manifest, storage, layout.rank, app_keys)
        state.update((k, b"") for k in app_keys.values())  # DCP replaces each with the saved bytes
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
    app_loaded: dict[str, Any] = {}
    try:
        dcp_load(state, storage_reader=FileSystemReader(str(root)), process_group=layout.group)
        if manifest.get("has_extra"):
            extra = torch.load(root / EXTRA, map_location="cpu", weights_only=True)
        for name, k in app_keys.items():
            app_loaded[name] = _app_state.from_bytes(state[k], f"app_state[{name!r}] ({k})")
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

    # the user's objects first: one that refuses its state leaves the model and the optimizer as they were
    if app:
        error = None
        for name, obj in app.items():
            try:
                obj.load_state_dict(app_loaded[name])
            except Exception as e:
                error = f"app_state[{name!r}].load_state_dict() failed: {_error(e)}"
                break
        agree(
            layout,
            error,
            f"load_checkpoint({str(root)!r}) (the model and the optimizer were not loaded)",
            exc_type=CheckpointError,
        )
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


def _match_app_state(
    app: dict[str, Stateful],
    manifest: dict[str, Any],
    storage: dict[str, Any],
    rank: int,
    keys: dict[str, str],
) -> list[str]:
    """Check that the checkpoint holds state for every name of ``app``; fill ``keys`` (name -> DCP key)."""
    saved = list(manifest.get("app_state", []))
    source = _app_state.source_rank(rank, int(manifest.get("world_size", 1)))
    problems = []
    for name in app:
        k = _app_state.key(name, source)
        if name not in saved:
            problems.append(
                f"the checkpoint holds no application state {name!r} (it holds "
                f"{', '.join(repr(n) for n in saved) or 'none'}); pass only names given to save_checkpoint(app_state=...)"
            )
        elif k not in storage:
            problems.append(f"the checkpoint lacks {k!r}, the application state {name!r} of rank {source}")
        else:
            keys[name] = k
    return problems


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
