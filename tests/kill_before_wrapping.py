"""Run under torchrun with two ranks: rank 1 stops (SIGKILL) after ``init_process_group`` and before
any wrapper exists, while rank 0 waits in its first collective (the construction's handshake).
Rank 0 writes the error it got to ``OUT/error0.json``; rank 1 its process id to ``OUT/death.json``.

    torchrun --standalone --monitor-interval 5 --nproc_per_node=2 -m tests.kill_before_wrapping OUT
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch.distributed as dist
from torch import nn

import fsdp


def main(out: str) -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(1.0)  # rank 0 waits in its first handshake by then
        with open(os.path.join(out, "death.json"), "w") as f:
            json.dump({"pid": os.getpid()}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        fsdp.FullyShardedDataParallel(nn.Linear(4, 4))
    except RuntimeError as e:
        with open(os.path.join(out, "error0.json"), "w") as f:
            json.dump({"message": str(e)}, f)


if __name__ == "__main__":
    main(sys.argv[1])
