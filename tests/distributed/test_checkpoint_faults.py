"""Checkpoint faults: damaged bytes found by the checksums on every rank, the newest good checkpoint
found by rank 0 for every rank, a full disk, and a job killed in the middle of a save."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp import latest_checkpoint, load_checkpoint, save_checkpoint
from fsdp.checkpoints.files import COMMIT_MARKER, MANIFEST, CheckpointError, marker_text, read_dcp_metadata
from fsdp.consolidate import consolidate_checkpoint
from fsdp.consolidate import main as consolidate_main
from tests.checkpointing import expect_error, flat_snapshot, make, same, state_diff, train
from tests.rank_pool import RankPool

ROOT = Path(__file__).resolve().parents[2]
CASE = "nested"


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


# ---------------------------------------------------------------------- damaging a copy
def _resign(ckpt: Path, **changes: Any) -> None:
    """Rewrite the commit marker with ``changes`` (``None`` drops a field) and a valid marker checksum."""
    fields = json.loads((ckpt / COMMIT_MARKER).read_text())
    fields.pop("marker_crc32", None)
    for key, value in changes.items():
        if value is None:
            fields.pop(key, None)
        else:
            fields[key] = value
    (ckpt / COMMIT_MARKER).write_text(marker_text(fields, None))


def _copy(good: Path, name: str, newer_by: int) -> Path:
    """A copy of ``good`` saved ``newer_by`` ns later (negative: earlier), as latest_checkpoint orders them."""
    dst = good.parent / name
    shutil.copytree(good, dst)
    saved_at = json.loads((good / COMMIT_MARKER).read_text())["saved_at_ns"]
    _resign(dst, saved_at_ns=saved_at + newer_by)
    return dst


def _flip(path: Path, offsets: list[int], mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    for offset in offsets:
        data[offset] ^= mask
    path.write_bytes(bytes(data))


def _tensor_byte(ckpt: Path) -> tuple[str, int]:
    """(data file, offset) of the second byte of the largest model tensor's values in a checkpoint:
    DCP writes each tensor as a torch.save zip record, whose values are its ``data/0`` member."""
    storage = read_dcp_metadata(ckpt).storage_data
    _, info = max(
        ((i, s) for i, s in storage.items() if i.fqn.startswith("model.")), key=lambda item: item[1].length
    )
    record = (ckpt / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    member = next(m for m in zipfile.ZipFile(io.BytesIO(record)).infolist() if m.filename.endswith("data/0"))
    header = member.header_offset
    name_len, extra_len = (
        int.from_bytes(record[header + 26 : header + 28], "little"),
        int.from_bytes(record[header + 28 : header + 30], "little"),
    )
    return info.relative_path, info.offset + header + 30 + name_len + extra_len + 1


def _integrity(tmp: str) -> dict[str, Any]:
    rank = dist.get_rank()
    root = Path(tmp) / "ckpts"
    _, model = make(CASE, seed=6)
    opt = _adam(model)
    train(model, opt, CASE, range(1))
    good = save_checkpoint(root / "good", model, opt, extra={"step": 1})
    saved = model.state_dict()
    box: list[Any] = [None]
    if rank == 0:  # damaged copies, each newer than the good one; one older without checksums
        _flip(_copy(good, "metadata", 1) / ".metadata", [6, 7, 8])  # the pickle's frame length: MemoryError
        manifest = _copy(good, "manifest", 2) / MANIFEST
        _flip(manifest, [manifest.stat().st_size // 2], 0x01)
        data_file, offset = _tensor_byte(good)
        _flip(_copy(good, "data", 3) / data_file, [offset], 0x40)
        _resign(_copy(good, "unverified", -1), checksum=None, checksums=None)
        (Path(tmp) / "elsewhere").mkdir()
        box = [data_file]
    dist.broadcast_object_list(box, src=0)
    before = flat_snapshot(model, opt)
    messages = {
        k: expect_error(CheckpointError, load_checkpoint, root / k, model, opt)
        for k in ("metadata", "manifest", "data")
    }
    messages["metadata_unverified"] = expect_error(
        CheckpointError, load_checkpoint, root / "metadata", model, opt, verify=False
    )
    unchanged = same(before, flat_snapshot(model, opt))
    # rank 0 decides for every rank, which may see the directory under another path (here: an empty one)
    mine = root if rank == 0 else Path(tmp) / "elsewhere"
    out = {
        "data_file": box[0],
        "messages": messages,
        "unchanged": unchanged,
        "latest": latest_checkpoint(root).name,  # type: ignore[union-attr]
        "latest_unverified": latest_checkpoint(root, verify=False).name,  # type: ignore[union-attr]
        "local_latest": latest_checkpoint(mine),
        "group_latest": latest_checkpoint(mine, group=dist.group.WORLD),
        "mine": mine,
    }
    # without verification the flipped byte loads silently, as a wrong value
    load_checkpoint(root / "data", model, opt, verify=False)
    out["unverified_diff"] = state_diff(model.state_dict(), saved)
    # a checkpoint without checksums (an earlier fsdp's) loads, with a warning that it is unverified
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["old_extra"] = load_checkpoint(root / "unverified", model, opt)
    out["old_warned"] = any("records no checksums" in str(w.message) for w in caught)
    out["old_diff"] = state_diff(model.state_dict(), saved)
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_damaged_checkpoints_are_refused_on_every_rank(
    pool: RankPool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = pool.run(_integrity, str(tmp_path), timeout=120)
    data_file = results[0]["data_file"]
    for rank, r in enumerate(results):
        m = r["messages"]
        assert f"{data_file} does not match the checksum recorded at the save" in m["data"], m["data"]
        assert ".metadata does not match the checksum" in m["metadata"], m["metadata"]
        assert f"{MANIFEST} does not match the checksum" in m["manifest"], m["manifest"]
        # unverified, the damaged pickle is still our error (the bare one was a MemoryError)
        assert "is damaged: DCP's .metadata cannot be read" in m["metadata_unverified"], m[
            "metadata_unverified"
        ]
        assert r["unchanged"], "a refused load must leave parameters, buffers and optimizer state untouched"
        assert r["latest"] == "good" and r["latest_unverified"] == "data"
        if rank == 0:
            assert r["group_latest"] == r["local_latest"] == tmp_path / "ckpts" / "good"
        else:
            assert r["local_latest"] is None and r["group_latest"] == tmp_path / "elsewhere" / "good"
        assert r["unverified_diff"] > 0, "the flipped byte must change a value (else the test proves nothing)"
        assert r["old_extra"] == {"step": 1} and r["old_diff"] == 0.0
        assert r["old_warned"] == (rank == 0)

    ckpts = tmp_path / "ckpts"
    out = tmp_path / "model.pt"
    assert consolidate_main([str(ckpts / "data"), str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{data_file} does not match the checksum" in err and not out.exists()
    assert consolidate_main([str(ckpts / "data"), str(out), "--no-verify"]) == 0
    unverified = torch.load(out, weights_only=True)
    good = consolidate_checkpoint(ckpts / "good")
    assert list(unverified) == list(good) and state_diff(unverified, good) > 0


# ---------------------------------------------------------------------- a full disk
class _FullDisk(io.FileIO):
    """A file on a disk with ``room`` bytes free: a write there writes what fits (a short write, as
    write(2) does) and the next one fails with ENOSPC."""

    room = 0

    def write(self, b: Any) -> int:
        room = self.room - self.tell()
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(memoryview(b).cast("B")[:room])


@contextlib.contextmanager
def _full_disk_stream(self: Any, path: Any, mode: str) -> Iterator[io.BufferedWriter]:
    """DCP's stream, buffered as ``open`` makes it, on a full disk. Filling up inside a tensor larger
    than the buffer, ``torch.save`` raises a bare ``RuntimeError`` ("unexpected pos"), with the
    ``OSError`` only as its context (which is lost when DCP sends it to the other ranks)."""
    with io.BufferedWriter(_FullDisk(str(path), mode)) as stream:
        yield stream


def _no_space(tmp: str, where: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.filesystem import FileSystem

    import fsdp.checkpoints.save_load as checkpoint_io
    from fsdp import FullyShardedDataParallel as FSDP

    rank = dist.get_rank()
    root = Path(tmp) / "ckpts"
    torch.manual_seed(0)
    model = FSDP(
        torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 4))
    )  # 32 KB rows per rank
    opt = _adam(model)

    def step() -> None:
        model(torch.randn(4, 128)).square().sum().backward()
        opt.step()

    step()
    save_checkpoint(root / "good", model, opt)
    expected = model.state_dict()
    step()
    original_stream, original_write = FileSystem.create_stream, checkpoint_io._write_atomically

    def write_atomically(path: Path, data: str | bytes) -> None:
        if path.name == COMMIT_MARKER:
            path.with_name(path.name + ".tmp").write_bytes(b"{")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original_write(path, data)

    if where == "data" and rank == 1:  # DCP's writer on one rank fills the disk halfway through its file
        _FullDisk.room = max(p.stat().st_size for p in (root / "good").glob("*.distcp")) // 2
        FileSystem.create_stream = _full_disk_stream  # type: ignore[assignment]
    if where == "marker" and rank == 0:  # our own last write
        checkpoint_io._write_atomically = write_atomically  # type: ignore[assignment]
    try:
        message = expect_error(CheckpointError, save_checkpoint, root / "full", model, opt)
    finally:
        FileSystem.create_stream = original_stream  # type: ignore[method-assign]
        checkpoint_io._write_atomically = original_write  # type: ignore[assignment]
    latest = latest_checkpoint(root)
    assert latest is not None
    load_checkpoint(latest, model, opt)
    return {
        "message": message,
        "left": (root / "full").exists(),
        "latest": latest.name,
        "diff": state_diff(model.state_dict(), expected),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("where", ["data", "marker"])
def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(
    pool: RankPool, tmp_path: Path, where: str
) -> None:
    for r in pool.run(_no_space, str(tmp_path), where, timeout=120):
        assert f"no space left on device while saving {str(tmp_path / 'ckpts' / 'full')!r}" in r["message"], r
        assert not r["left"], "the unfinished save's files are removed, to give the space back"
        assert r["latest"] == "good" and r["diff"] == 0.0


# ---------------------------------------------------------------------- killed while saving
def _read_until(proc: subprocess.Popen[str], token: str, timeout: float) -> None:
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if selector.select(deadline - time.monotonic()):
            line = proc.stdout.readline()
            if line.strip() == token:
                return
            if not line:
                break
    proc.kill()
    raise AssertionError(f"the job never reached its kill point:\n{proc.communicate()[1][-3000:]}")


def _resume(tmp: str) -> dict[str, Any]:
    _, model = make(CASE, seed=9)
    opt = _adam(model)
    latest = latest_checkpoint(tmp, group=dist.group.WORLD)
    assert latest is not None
    extra = load_checkpoint(latest, model, opt)
    expected = torch.load(Path(tmp) / "expected.pt", weights_only=True)
    diff = state_diff(model.state_dict(), expected)
    with warnings.catch_warnings():  # the killed save's leftovers are replaced
        warnings.simplefilter("ignore")
        save_checkpoint(Path(tmp) / "step_2", model, opt, extra={"step": 2})
    return {"latest": latest.name, "extra": extra, "diff": diff, "after": latest_checkpoint(tmp).name}  # type: ignore[union-attr]


def test_a_job_killed_while_saving_keeps_the_previous_checkpoint(
    rank_pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    points = ("data", "commit")
    jobs = {}
    for point in points:  # both at once: starting Python and torch is most of their time
        (tmp_path / point).mkdir()
        cmd = [sys.executable, "-m", "tests.kill_during_save", str(tmp_path / point), point]
        jobs[point] = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    for proc in jobs.values():
        _read_until(proc, "PAUSED", timeout=120)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    for point in points:
        directory = tmp_path / point
        killed = directory / "step_2"
        assert killed.is_dir() and not (killed / COMMIT_MARKER).exists(), sorted(os.listdir(killed))
        assert latest_checkpoint(directory) == directory / "step_1"
        expected = torch.load(directory / "expected.pt", weights_only=True)
        assert state_diff(consolidate_checkpoint(directory / "step_1"), expected) == 0.0
        (r,) = rank_pools(1).run(_resume, str(directory))
        assert r["latest"] == "step_1" and r["extra"] == {"step": 1} and r["diff"] == 0.0, (point, r)
        assert r["after"] == "step_2", "a save at the killed one's path replaces its leftovers and commits"


# ---------------------------------------------------------------------- a disk that turns read-only
def _read_only_midway(tmp: str) -> dict[str, Any]:
    """The disk turns read-only while DCP writes (rank 1's file fails with EROFS), and rank 0's
    clean-up of the save probe fails the same way: the clean-up must not replace the error."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from fsdp import FullyShardedDataParallel as FSDP

    rank = dist.get_rank()
    root = Path(tmp) / "ckpts"
    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)))
    opt = _adam(model)
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    save_checkpoint(root / "good", model, opt)
    expected = model.state_dict()
    read_only = OSError(errno.EROFS, os.strerror(errno.EROFS))
    original_stream, original_unlink, original_rmdir = FileSystem.create_stream, Path.unlink, Path.rmdir

    @contextlib.contextmanager
    def failing_stream(self: Any, path: Any, mode: str) -> Iterator[io.BufferedWriter]:
        raise read_only
        yield  # (a generator: a context manager)

    def failing(self: Path, *args: Any, **kwargs: Any) -> None:
        if root / "broken" in (self, *self.parents):
            raise read_only
        return original_unlink(self, *args, **kwargs)

    def failing_rmdir(self: Path) -> None:
        if self == root / "broken":
            raise read_only
        original_rmdir(self)

    if rank == 1:
        FileSystem.create_stream = failing_stream  # type: ignore[assignment]
    else:
        Path.unlink = failing  # type: ignore[method-assign]
        Path.rmdir = failing_rmdir  # type: ignore[method-assign]
    try:
        save_checkpoint(root / "broken", model, opt)
        raised = "nothing"
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    finally:
        FileSystem.create_stream = original_stream  # type: ignore[method-assign]
        Path.unlink, Path.rmdir = original_unlink, original_rmdir  # type: ignore[method-assign]
    latest = latest_checkpoint(root)
    assert latest is not None
    load_checkpoint(latest, model, opt)
    return {"raised": raised, "latest": latest.name, "diff": state_diff(model.state_dict(), expected)}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_failing_clean_up_never_replaces_the_error_it_handles(pool: RankPool, tmp_path: Path) -> None:
    for r in pool.run(_read_only_midway, str(tmp_path), timeout=120):
        assert r["raised"].startswith("CheckpointError: "), r
        assert os.strerror(errno.EROFS) in r["raised"], r  # the cause, named on every rank
        assert r["latest"] == "good" and r["diff"] == 0.0
