"""File checksums of checkpoint directories over files larger than one read (several chunks)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from fsdp.checkpoints import files


def test_a_checksum_covers_every_chunk_of_a_large_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "_CHUNK", 1024)  # small chunks: the same code path as a file over 8 MiB
    data = bytearray(range(256)) * 13  # 3328 bytes: four chunks, the last one short
    path = tmp_path / "shard.distcp"
    path.write_bytes(bytes(data))
    whole = files.file_checksum(path)
    assert whole == f"{zlib.crc32(bytes(data)):08x}"
    for where in (5, 1500, len(data) - 1):  # a byte flipped in the first, a middle and the last chunk
        damaged = bytearray(data)
        damaged[where] ^= 0x40
        path.write_bytes(bytes(damaged))
        assert files.file_checksum(path) != whole, where
