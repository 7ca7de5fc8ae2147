"""Turn a checkpoint directory into one plain state dict file, offline: ``python -m fsdp.consolidate``.

    python -m fsdp.consolidate CHECKPOINT_DIR OUT.pt

reads a checkpoint written by :func:`fsdp.save_checkpoint` (at any world size) in one process,
without a process group, and writes with ``torch.save`` the unwrapped model's state dict: every
parameter (fp32 masters, tied ones under each name) and persistent buffer, in ``state_dict()``
order, so ``model.load_state_dict(torch.load(OUT.pt), strict=True)`` works on the plain model. The
optimizer state and ``extra`` are left out. It needs memory for the whole model. It first checks
every file against the checksum recorded at the save and refuses a damaged checkpoint, naming the
file (``--no-verify`` checks the sizes only).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from fsdp.checkpoints.files import CheckpointError, check_checkpoint, read_dcp_metadata

__all__ = ["consolidate_checkpoint", "main"]

log = logging.getLogger(__name__)

_MODEL = "model."


def consolidate_checkpoint(path: str | os.PathLike[str], verify: bool = True) -> dict[str, torch.Tensor]:
    """The unwrapped model's full state dict from a checkpoint directory (CPU tensors). Single process.

    Raises :class:`~fsdp.checkpoints.files.CheckpointError` if the checkpoint is incomplete or
    damaged: with ``verify``, a file whose checksum differs from the one recorded at the save."""
    manifest, verified = check_checkpoint(path, verify)
    if verify and not verified:
        warnings.warn(
            f"checkpoint {str(path)!r} records no checksums (saved by an earlier fsdp, or with checksums=False): "
            "its content is consolidated unverified",
            RuntimeWarning,
            stacklevel=2,
        )
    storage = read_dcp_metadata(path).state_dict_metadata
    template: dict[str, torch.Tensor] = {}
    for key, md in storage.items():
        if key.startswith(_MODEL) and isinstance(md, TensorStorageMetadata):
            template[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp_load(template, storage_reader=FileSystemReader(str(path)), no_dist=True)
    aliases: dict[str, str] = manifest.get("aliases", {})
    out: dict[str, torch.Tensor] = {}
    for key in manifest["model_keys"]:
        stored = _MODEL + aliases.get(key, key)
        if stored not in template:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is damaged: it lists {key!r} but holds no data for it"
            )
        out[key] = template[stored]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp.consolidate",
        description="Write a checkpoint directory saved by fsdp.save_checkpoint (any world size) as one "
        "torch.save state dict that loads into the unwrapped model with strict=True.",
    )
    parser.add_argument("checkpoint_dir", type=Path, help="a committed checkpoint directory")
    parser.add_argument("out", type=Path, help="the .pt file to write")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="do not check the files' checksums (their sizes are still checked); for checkpoints verified "
        "by other means",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        state = consolidate_checkpoint(args.checkpoint_dir, verify=not args.no_verify)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.out)
    except (CheckpointError, OSError) as e:
        sys.stderr.write(f"fsdp.consolidate: {e}\n")
        return 1
    numel = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    size = args.out.stat().st_size
    sys.stdout.write(
        f"wrote {args.out}: {len(state)} entries, {numel:,} elements, {size / 2**20:.1f} MiB "
        f"(from {args.checkpoint_dir})\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
