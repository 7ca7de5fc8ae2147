"""Offline consolidation without any process group: the shard arithmetic, its errors, and the command."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import latest_checkpoint
from fsdp.checkpoints.files import (
    COMMIT_MARKER,
    CheckpointError,
    check_checkpoint,
    file_checksum,
    marker_text,
    out_of_space,
    read_checkpoint_info,
    verify_share,
)
from fsdp.consolidate import main


def _shards(
    world: int, old_layout: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, torch.Tensor]]:
    """Local shards and metadata as ``world`` ranks would write them for one wrapper at "block" owning
    ``w`` (2x3) and ``b`` (2), with ``b2`` tied to ``b``, and a buffer ``n`` (long) saved as int32.

    ``old_layout``: the metadata of earlier versions, with ``shard_rank`` / ``shard_world_size`` in the
    flat parameter's entry rather than in the wrapper's."""
    w, b = torch.arange(6.0).view(2, 3), torch.tensor([6.0, 7.0])
    flat = torch.cat([w.reshape(-1), b])  # 8 elements
    chunk = -(-8 // world)
    padded = torch.cat([flat, torch.full((chunk * world - 8,), -1.0)])
    weights, metadata = [], []
    for r in range(world):
        weights.append({"block.flat_param_0": padded[r * chunk : (r + 1) * chunk], "n": torch.tensor(3)})
        place = {"shard_rank": r, "shard_world_size": world}
        metadata.append(
            {
                "rank": r,
                "world_size": world,
                "plan": "p",
                "param_metadata": [
                    {
                        "fsdp_path": "block",
                        "params": {
                            "flat_param_0": {
                                "names": ["w", "b"],
                                "shapes": [(2, 3), (2,)],
                                "numels": [6, 2],
                                "padding": max(0, min((r + 1) * chunk, chunk * world) - max(8, r * chunk)),
                                **(place if old_layout else {}),
                            }
                        },
                        "shared_param_info": [("block.b", "block.b2")],
                        **({} if old_layout else place),
                    }
                ],
                "buffer_names": ["n"],
                "buffer_dtypes": {"n": "int64"},
                "state_dict_keys": ["block.w", "block.b", "block.b2", "n"],
            }
        )
    return weights, metadata, {"block.w": w, "block.b": b, "block.b2": b, "n": torch.tensor(3)}


@pytest.mark.parametrize("old_layout", [False, True])
@pytest.mark.parametrize("world", [1, 3, 5])
def test_consolidate_shard_weights_unpads_and_reassembles(world: int, old_layout: bool) -> None:
    weights, metadata, expected = _shards(world, old_layout)
    # any order: the ranks are in the metadata
    out = FSDP.consolidate_shard_weights(weights[::-1], metadata[::-1])
    assert list(out) == list(expected)
    assert all(torch.equal(out[k], v) and out[k].dtype == v.dtype for k, v in expected.items())
    assert out["block.b2"] is out["block.b"], "tied names share one tensor, as in a plain state dict"
    no_buffers = FSDP.consolidate_shard_weights(weights, metadata, with_module_buffers=False)
    assert "n" not in no_buffers


@pytest.mark.parametrize("old_layout", [False, True])
def test_shard_places_are_read_from_either_layout(old_layout: bool) -> None:
    """The shard places (``shard_rank``, ``shard_world_size``) win over the ranks (they differ under
    NO_SHARD and HYBRID_SHARD), read from the wrapper's entry, or from each flat parameter's entry in
    metadata saved by earlier versions."""
    weights, metadata, expected = _shards(2, old_layout)
    for r, m in enumerate(metadata):  # the file of rank r holds shard r but comes from rank 1 - r
        m["rank"] = 1 - r
    out = FSDP.consolidate_shard_weights(weights, metadata)
    assert all(torch.equal(out[k], v) for k, v in expected.items())
    for m in metadata:
        unit = m["param_metadata"][0]
        (unit["params"]["flat_param_0"] if old_layout else unit)["shard_world_size"] = 3
    with pytest.raises(
        ValueError, match=r"sharded over 3 ranks but the shards of rank\(s\) \[2\] are missing"
    ):
        FSDP.consolidate_shard_weights(weights, metadata)


def test_consolidate_shard_weights_errors_say_what_is_wrong() -> None:
    weights, metadata, _ = _shards(3)
    with pytest.raises(ValueError, match="one metadata dict per shard dict"):
        FSDP.consolidate_shard_weights(weights, metadata[:2])
    with pytest.raises(ValueError, match=r"shards of rank\(s\) \[2\] are missing"):
        FSDP.consolidate_shard_weights(weights[:2], metadata[:2])
    with pytest.raises(ValueError, match="given twice"):
        FSDP.consolidate_shard_weights([weights[0], weights[0]], [metadata[0], metadata[0]])
    other = [dict(m, plan="q") if i == 1 else m for i, m in enumerate(metadata)]
    with pytest.raises(ValueError, match="different wrap plans"):
        FSDP.consolidate_shard_weights(weights, other)
    lacking = [dict(w) for w in weights]
    del lacking[1]["block.flat_param_0"]
    with pytest.raises(KeyError, match=r"rank\(s\) \[1\] has no 'block.flat_param_0'"):
        FSDP.consolidate_shard_weights(lacking, metadata)
    assert list(FSDP.consolidate_shard_weights(lacking, metadata, strict=False)) == ["n"]


def _fake_checkpoint(root: Path, saved_at: int, commit: bool = True) -> Path:
    root.mkdir(parents=True)
    (root / "fsdp_manifest.json").write_text(json.dumps({"format": "fsdp-checkpoint", "version": 1}))
    (root / "__0_0.distcp").write_bytes(b"x" * 10)
    if commit:
        files = {"fsdp_manifest.json": (root / "fsdp_manifest.json").stat().st_size, "__0_0.distcp": 10}
        (root / COMMIT_MARKER).write_text(json.dumps({"saved_at_ns": saved_at, "files": files}))
    return root


def test_latest_checkpoint_and_damage_checks(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "none") is None
    old = _fake_checkpoint(tmp_path / "b_old", 1)
    new = _fake_checkpoint(tmp_path / "a_new", 2)
    _fake_checkpoint(tmp_path / "c_crashed", 3, commit=False)
    assert latest_checkpoint(tmp_path) == new, "the newest committed save, whatever the names"
    assert read_checkpoint_info(old)["saved_at_ns"] == 1
    with pytest.raises(CheckpointError, match="has no commit marker"):
        read_checkpoint_info(tmp_path / "c_crashed")
    (new / "__0_0.distcp").write_bytes(b"x" * 4)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp has 4 bytes, the commit marker recorded 10"):
        read_checkpoint_info(new)
    (old / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        read_checkpoint_info(old)


def test_consolidate_command_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_checkpoint(tmp_path / "crashed", 1, commit=False)
    assert main([str(tmp_path / "crashed"), str(tmp_path / "out.pt")]) == 1
    assert "has no commit marker" in capsys.readouterr().err
    assert main([str(tmp_path / "missing"), str(tmp_path / "out.pt")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


def _checksummed(root: Path, saved_at: int) -> Path:
    """A fake checkpoint whose marker records checksums, as save_checkpoint writes it."""
    _fake_checkpoint(root, saved_at, commit=False)
    names = ["fsdp_manifest.json", "__0_0.distcp"]
    files = {n: (root / n).stat().st_size for n in names}
    fields = {"saved_at_ns": saved_at, "files": files}
    (root / COMMIT_MARKER).write_text(marker_text(fields, {n: file_checksum(root / n) for n in names}))
    return root


def test_checksums_find_a_changed_byte_and_a_changed_marker(tmp_path: Path) -> None:
    good = _checksummed(tmp_path / "good", 1)
    flipped = _checksummed(tmp_path / "flipped", 2)
    assert check_checkpoint(good) == (read_checkpoint_info(good), True)
    (flipped / "__0_0.distcp").write_bytes(b"x" * 5 + b"y" + b"x" * 4)  # same size, one byte changed
    with pytest.raises(
        CheckpointError, match=r"__0_0\.distcp does not match the checksum recorded at the save"
    ):
        read_checkpoint_info(flipped)
    assert read_checkpoint_info(flipped, verify=False)["format"] == "fsdp-checkpoint"  # sizes only
    assert latest_checkpoint(tmp_path) == good, "the newest checkpoint that verifies"
    assert latest_checkpoint(tmp_path, verify=False) == flipped

    # the marker's own fields are checked too: a changed date would reorder the checkpoints
    marker = json.loads((good / COMMIT_MARKER).read_text())
    marker["saved_at_ns"] = 3
    (good / COMMIT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="COMMITTED does not match its own checksum"):
        read_checkpoint_info(good, verify=False)
    assert latest_checkpoint(tmp_path) is None

    # a marker of an earlier version (sizes only) is read, unverified
    old = _fake_checkpoint(tmp_path / "old", 4)
    assert check_checkpoint(old) == (read_checkpoint_info(old), False)
    assert latest_checkpoint(tmp_path) == old


def test_every_data_file_is_verified_by_one_rank_and_small_files_by_all() -> None:
    sizes = {".metadata": 10, "fsdp_manifest.json": 5, "extra.pt": 7}
    sizes.update({f"__{r}_0.distcp": 1000 + 10 * r for r in range(5)})
    shares = [verify_share(sizes, sizes, rank, 3) for rank in range(3)]
    for name in sizes:
        holders = [rank for rank, share in enumerate(shares) if name in share]
        assert holders == ([0, 1, 2] if not name.endswith(".distcp") else holders[:1]) and holders, name
    assert sorted(len(s) - 3 for s in shares) == [1, 2, 2], "data files are spread over the ranks"


def test_latest_checkpoint_with_a_group(tmp_path: Path, single_rank_group: None) -> None:
    import torch.distributed as dist

    good = _checksummed(tmp_path / "good", 1)
    assert latest_checkpoint(tmp_path, group=dist.group.WORLD) == good
    assert latest_checkpoint(tmp_path / "none", group=dist.group.WORLD) is None
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed ProcessGroup"):
        latest_checkpoint(tmp_path, group="world")  # type: ignore[arg-type]


def test_full_disk_is_found_behind_torch_save_and_dcp_errors() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
            ) from None
    except RuntimeError as e:
        bare = e
    assert out_of_space(bare) is full, "torch.save's error keeps the OSError as its context"
    assert out_of_space(CheckpointException("write", {1: (full, [])})) is full
    assert out_of_space(RuntimeError("other")) is None
