"""A one-rank job that saves a checkpoint, trains on, and is killed in the middle of its next save.

    python -m tests.kill_during_save DIR POINT

saves ``DIR/step_1`` (and ``DIR/expected.pt``, the full state dict at that point), trains one more
step and starts saving ``DIR/step_2``; at ``POINT`` it prints ``PAUSED`` and sleeps, for the test
to SIGKILL it there:

- ``data``: this rank's data file is written, DCP's ``.metadata`` is not;
- ``commit``: every file is written, the commit marker too but under its temporary name.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _pause() -> None:
    sys.stdout.write("PAUSED\n")
    sys.stdout.flush()
    time.sleep(600)


def main(directory: str, point: str) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import fsdp.checkpoints.save_load as checkpoint_io
    from fsdp import save_checkpoint
    from tests.checkpointing import make, train

    init = Path(tempfile.mkdtemp()) / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    root = Path(directory)
    _, model = make("nested", seed=6)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, "nested", range(1))
    save_checkpoint(root / "step_1", model, opt, extra={"step": 1})
    torch.save(model.state_dict(), root / "expected.pt")
    train(model, opt, "nested", range(1, 2))

    if point == "data":
        original = FileSystemWriter.write_data

        def write_data(self: Any, *args: Any, **kwargs: Any) -> Any:
            original(self, *args, **kwargs)
            _pause()

        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    elif point == "commit":
        replace = os.replace

        def replace_marker(src: Any, dst: Any) -> None:
            if Path(dst).name == checkpoint_io.COMMIT_MARKER:
                _pause()
            replace(src, dst)

        os.replace = replace_marker
    else:
        raise SystemExit(f"unknown point {point!r}")
    save_checkpoint(root / "step_2", model, opt, extra={"step": 2})
    raise SystemExit("the save finished: the kill point was never reached")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
