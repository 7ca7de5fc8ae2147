"""Checkpoint directories on disk: the commit marker, file checksums, verification, and the newest good one.

:func:`save_checkpoint` and :func:`load_checkpoint` (in ``checkpoints/save_load.py``) write and read the
data; this module says whether a directory holds a complete, undamaged checkpoint. See
[Note: checkpoint commit] in checkpoints/save_load.py for how a save becomes one, and
[Note: checkpoint integrity] below for what is recorded and who checks it.

[Note: checkpoint integrity]
The commit marker ``COMMITTED`` records, for every file of the checkpoint, its size and a CRC-32 of
its content (``zlib.crc32``, hex), and a CRC-32 of the marker's own other fields, so that a byte
changed anywhere, the marker included, is found. CRC-32 finds every error of up to 32 consecutive
bits and all but one in 2^32 of the others: enough for disks, copies and truncation, not against
someone forging a file on purpose. It runs at several GB/s, faster than anything else in the
standard library (hashlib's SHA-1 and SHA-256 at about a third of it).

Saving: each rank computes the checksums of the files its own DCP writer wrote (still in the page
cache), right after DCP's write; one small exchange brings them to rank 0, which computes those of
the files it writes itself afterwards (DCP's ``.metadata``, the manifest, ``extra.pt``) when it
writes the marker. So the data is read back once in all, spread over the ranks.

Checking (:func:`check_checkpoint`): the marker's own checksum, then every file's size (cheap),
then the checksums of the files asked for, and only then are ``.metadata`` and the manifest parsed,
so a damaged one is reported as damaged, by name, rather than failing inside the unpickler (a few
flipped bytes there can raise ``MemoryError``). :func:`load_checkpoint` has every rank check the
small files every rank reads whole, and spreads the data files (``*.distcp``) over the ranks by
size (:func:`verify_share`); the ranks agree on the verdict before anything is read, so a damaged
checkpoint is refused on every rank with the message of the rank that found it.
:func:`latest_checkpoint` and ``python -m fsdp.consolidate`` check every file in one process.
Checkpoints saved before checksums were recorded (or with ``checksums=False``) have sizes only:
they load, with a warning that their content is not verified. ``verify=False`` skips the checksums
(sizes are still checked) for users who verify elsewhere.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import zlib
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fsdp.comm.collectives import all_gather, all_gather_ints
from fsdp.core.layout import Layout

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported where it is used (it is slow to import)
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "COMMIT_MARKER",
    "CheckpointError",
    "check_checkpoint",
    "file_checksum",
    "is_committed",
    "latest_checkpoint",
    "read_checkpoint_info",
]

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
MANIFEST = "fsdp_manifest.json"
DATA_SUFFIX = ".distcp"  # DCP's data files; every other file of a checkpoint is small and read whole
FORMAT = "fsdp-checkpoint"
VERSION = 1
CHECKSUM = "crc32"
_SELF = "marker_crc32"  # the marker's checksum of its other fields
_CHUNK = 8 << 20  # bytes read at a time while computing a checksum
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
NO_SPACE_LEFT = "no space left on device"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank with the same message."""


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------- checksums
def file_checksum(path: str | os.PathLike[str]) -> str:
    """The CRC-32 of a file's content, as 8 hex digits."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _marker_checksum(fields: dict[str, Any]) -> str:
    text = json.dumps({k: v for k, v in fields.items() if k != _SELF}, sort_keys=True)
    return f"{zlib.crc32(text.encode()):08x}"


def marker_text(fields: dict[str, Any], checksums: dict[str, str] | None) -> str:
    """The commit marker's JSON: ``fields`` (with ``files``: name -> size), the files' checksums
    unless None, and the marker's own checksum."""
    marker = dict(fields)
    if checksums is not None:
        missing = sorted(set(marker["files"]) - set(checksums))
        assert not missing, f"no checksum for {missing}"
        marker["checksum"] = CHECKSUM
        marker["checksums"] = {name: checksums[name] for name in marker["files"]}
    marker[_SELF] = _marker_checksum(marker)
    return json.dumps(marker, indent=1)


def gather_checksums(layout: Layout, mine: dict[str, str]) -> dict[str, str]:
    """Every rank's ``{file: checksum}``, merged (the same on every rank). Collective: a length
    exchange and one byte all-gather on the compute device."""
    if layout.world_size == 1:
        return dict(mine)
    data = json.dumps(mine).encode()
    lengths = [n for (n,) in all_gather_ints([len(data)], layout.group, layout.device)]
    longest = max(lengths)
    local = torch.zeros(longest, dtype=torch.uint8)
    local[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    everyone = torch.empty(longest * layout.world_size, dtype=torch.uint8, device=layout.device)
    all_gather(everyone, local.to(layout.device), layout.group).wait()
    rows = everyone.view(layout.world_size, longest).cpu()
    merged: dict[str, str] = {}
    for rank, n in enumerate(lengths):
        merged.update(json.loads(bytes(rows[rank, :n].tolist()).decode()))
    return merged


def verify_share(files: Collection[str], sizes: dict[str, int], rank: int, world_size: int) -> set[str]:
    """The files ``rank`` checks at a load: every small file (each rank reads them whole anyway) and
    its part of the data files, dealt out largest first to the rank with the fewest bytes so far."""
    share = {name for name in files if not name.endswith(DATA_SUFFIX)}
    load = [0] * world_size
    for name in sorted((n for n in files if n.endswith(DATA_SUFFIX)), key=lambda n: (-sizes.get(n, 0), n)):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += sizes.get(name, 0)
        if owner == rank:
            share.add(name)
    return share


# ---------------------------------------------------------------------- checking a directory
def is_committed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a complete checkpoint (its commit marker exists)."""
    return (Path(path) / COMMIT_MARKER).is_file()


def _damaged(root: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {str(root)!r} is damaged: {what}. Load an earlier checkpoint (fsdp.latest_checkpoint "
        "finds the newest one that verifies)"
    )


def read_marker(root: Path) -> dict[str, Any]:
    """The commit marker's fields, after checking its own checksum (markers of earlier versions have none)."""
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
        fields = json.loads(marker.read_bytes().decode())
        if not isinstance(fields, dict) or not isinstance(fields.get("files", {}), dict):
            raise ValueError("not a JSON object with a 'files' object")
    except (OSError, ValueError) as e:
        raise _damaged(root, f"its commit marker {COMMIT_MARKER} cannot be read ({_error(e)})") from e
    if _SELF in fields and fields[_SELF] != _marker_checksum(fields):
        raise _damaged(root, f"its commit marker {COMMIT_MARKER} does not match its own checksum")
    return dict(fields)


def check_checkpoint(
    path: str | os.PathLike[str], verify: bool | Collection[str] = True
) -> tuple[dict[str, Any], bool]:
    """Check that ``path`` is a complete, undamaged checkpoint; return (its manifest, whether its
    content was verified against checksums).

    ``verify``: True checks the checksum of every file, a collection of names those files only,
    False none; the marker and every file's size are always checked. Raises :class:`CheckpointError`
    naming the file if one is missing, of another size, or of other content than at the save.
    """
    root = Path(path)
    marker = read_marker(root)
    files: dict[str, int] = marker.get("files", {})
    for name, size in files.items():
        file = root / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            state = "is missing" if actual is None else f"has {actual} bytes"
            raise _damaged(
                root,
                f"{name} {state}, the commit marker recorded {size} bytes (truncated or changed after the save)",
            )
    checksums: dict[str, str] | None = marker.get("checksums")
    verified = False
    if verify is not False and checksums is not None:
        if marker.get("checksum") != CHECKSUM:
            raise CheckpointError(
                f"checkpoint {str(root)!r} records checksums of kind {marker.get('checksum')!r}, which this fsdp "
                f"does not know (it computes {CHECKSUM!r}); load it with verify=False, or with a newer fsdp"
            )
        names = [n for n in files if verify is True or n in verify]
        for name in names:
            if name not in checksums:
                raise _damaged(root, f"its commit marker records no checksum for {name}")
            actual_sum = file_checksum(root / name)
            if actual_sum != checksums[name]:
                raise _damaged(
                    root,
                    f"{name} does not match the checksum recorded at the save ({CHECKSUM} {actual_sum}, "
                    f"recorded {checksums[name]}): its content changed after the save",
                )
        verified = True
    try:
        manifest = json.loads((root / MANIFEST).read_bytes().decode())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise _damaged(root, f"its manifest {MANIFEST} cannot be read ({_error(e)})") from e
    if manifest.get("format") != FORMAT or int(manifest.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{str(root)!r} is not an fsdp checkpoint of a version this fsdp reads (format "
            f"{manifest.get('format')!r}, version {manifest.get('version')!r}; this fsdp reads {FORMAT!r} up to "
            f"version {VERSION})"
        )
    manifest["saved_at_ns"] = marker.get("saved_at_ns", 0)
    manifest["checkpoint_id"] = marker.get("checkpoint_id", "")
    return dict(manifest), verified


def read_checkpoint_info(path: str | os.PathLike[str], verify: bool = True) -> dict[str, Any]:
    """Check that ``path`` is a complete, undamaged checkpoint; return its manifest.

    Raises :class:`CheckpointError` if the commit marker is missing (the save never finished), a
    file is missing, has another size than when it was saved or (with ``verify``, which reads every
    file) another checksum, or the format is unknown. ``verify=False`` reads no tensor data.
    """
    return check_checkpoint(path, verify)[0]


def read_dcp_metadata(path: str | os.PathLike[str]) -> Metadata:
    """DCP's ``.metadata`` of a checkpoint; a file that cannot be unpickled is reported as damaged."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a damaged pickle raises anything: UnpicklingError, MemoryError, EOFError, ...
        raise _damaged(Path(path), f"DCP's .metadata cannot be read ({_error(e)})") from None


# ---------------------------------------------------------------------- the newest good checkpoint
def _newest(base: Path, verify: bool) -> Path | None:
    if not base.is_dir():
        return None
    found: list[tuple[int, str, Path]] = []
    for child in base.iterdir():
        if not (child / COMMIT_MARKER).is_file():
            continue
        try:
            found.append((int(read_marker(child).get("saved_at_ns", 0)), child.name, child))
        except Exception as e:  # unreadable, or not the marker's format
            log.warning("latest_checkpoint: skipping %s: %s", child, e)
    for _, _, path in sorted(found, reverse=True):
        try:
            check_checkpoint(path, verify)
        except Exception as e:
            log.warning("latest_checkpoint: skipping %s: %s", path, e)
            continue
        return path
    return None


def latest_checkpoint(
    root: str | os.PathLike[str], *, group: dist.ProcessGroup | None = None, verify: bool = True
) -> Path | None:
    """The most recently committed checkpoint directly under ``root`` that passes
    :func:`read_checkpoint_info` (complete, files of their recorded sizes and, with ``verify``,
    checksums), or None. Damaged and unfinished ones are skipped with a logged warning.

    Without ``group`` it looks in this process only. With ``group`` it is collective: rank 0 of the
    group decides (verification included) and every rank gets the same answer, as ``root`` joined
    with the name rank 0 found (so ``root`` may be mounted at different paths on different nodes).
    """
    base = Path(root)
    if group is None:
        return _newest(base, verify)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "latest_checkpoint(group=...) is collective and needs torch.distributed initialized; call it after "
            "init_process_group, or without group= to look in this process only"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup (or None), got {type(group).__name__}"
        )
    if dist.get_rank(group) < 0:
        raise ValueError("latest_checkpoint(group=...): this rank is not a member of the group")
    answer: tuple[str, str | None] = ("ok", None)
    if dist.get_rank(group) == 0:
        try:
            newest = _newest(base, verify)
            answer = ("ok", None if newest is None else newest.name)
        except Exception as e:
            answer = ("error", _error(e))
    box: list[Any] = [answer]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(f"latest_checkpoint({str(base)!r}) failed on rank 0 of the group: {value}")
    return None if value is None else base / value


# ---------------------------------------------------------------------- writing
def _chain(e: BaseException) -> Iterator[BaseException]:
    """``e``, the exceptions it was raised from or during, and those DCP collected from the ranks."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
        if isinstance(x, CheckpointException):
            for failure in x.failures.values():
                first = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(first, BaseException):
                    todo.append(first)


def out_of_space(e: BaseException) -> OSError | None:
    """The 'no space left on device' (or 'disk quota exceeded') error behind ``e``, if any."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _NO_SPACE:
            return x
    return None


def recording_writer(path: str, **kwargs: Any) -> Any:
    """A :class:`RecordingWriter` for ``path`` (DCP's writer class is built on first use)."""
    return _recording_writer_class()(path, **kwargs)


@functools.cache
def _recording_writer_class() -> type[Any]:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class RecordingWriter(FileSystemWriter):
        """DCP's file system writer that records the files this rank wrote, and raises a full disk as the
        ``OSError`` it is: ``torch.save`` turns it into a bare ``RuntimeError`` ("unexpected pos"),
        keeping the ``OSError`` only as its context, which is lost when DCP sends the error to the others."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.written: set[str] = set()

        def write_data(self, plan: Any, planner: Any) -> Any:
            try:
                future = super().write_data(plan, planner)
                results = future.wait()
            except Exception as e:
                full = out_of_space(e)
                if full is None or full is e:
                    raise
                raise OSError(full.errno, full.strerror) from e
            for result in results:
                name = getattr(result.storage_data, "relative_path", None)
                if isinstance(name, str):
                    self.written.add(name)
            return future

    return RecordingWriter
