"""Unit tests run in the pytest process; those that construct a wrapper need a one-rank group."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def single_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        yield
        return
    fd, path = tempfile.mkstemp(prefix="fsdp-unit-")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
