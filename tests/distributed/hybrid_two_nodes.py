"""One 'node' of the two-node HYBRID_SHARD test (launched by torchrun --nnodes=2; see test_strategies).

Shards within the node (LOCAL_WORLD_SIZE ranks), replicates across nodes, trains beside a plain
model and writes this rank's result to DIR/rank{RANK}.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp import ShardingStrategy
from tests.models import CASES, build, wrap
from tests.parity import compare_training


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    spec = CASES["nested"]
    ref = build("nested")
    model = wrap(copy.deepcopy(ref), spec.wrap, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    diffs = compare_training(ref, model, spec.make_input, spec.loss, steps=3)
    comm = model.fsdp_config.comm
    result = {
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "shard_size": comm.world_size,
        "replicated": comm.replicate_group is not None,
        "max_diff": max(diffs.values()),
    }
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
