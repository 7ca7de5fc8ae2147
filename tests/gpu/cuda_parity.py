"""Run under torchrun on a CUDA machine: FSDP on NCCL trains like the plain model on the GPU.

    torchrun --standalone --nproc_per_node=1 tests/gpu/cuda_parity.py

Prints one JSON line with the largest differences; exits non-zero when parity fails.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.models import CASES, build, wrap
from tests.parity import compare_training


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    worst: dict[str, float] = {}
    cases = [(name, {}) for name in ("nested", "tiny", "frozen_mixed", "called_twice", "tied")]
    cases += [("nested", {"move_params_to_cpu": True}), ("tied", {"move_params_to_cpu": True})]
    for name, kwargs in cases:
        spec = CASES[name]
        ref = build(name).to(device)
        model = wrap(copy.deepcopy(ref), spec.wrap, **kwargs)
        home = torch.device("cpu") if kwargs else device
        assert all(p.device == home for p in model.parameters()), (
            "shards live on the compute device or the CPU"
        )

        def make_input(g: torch.Generator, n: int, _spec=spec) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return _spec.make_input(g, n).to(device)

        diffs = compare_training(ref, model, make_input, spec.loss, steps=3)
        assert all(p.grad is None or p.grad.device == home for p in model.parameters()), "gradients follow"
        worst[name + ("+offload" if kwargs else "")] = max(diffs.values())
    ok = all(v <= 1e-4 for v in worst.values())
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "max_diff": worst}
            )
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
