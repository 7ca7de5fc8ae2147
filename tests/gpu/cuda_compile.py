"""Run under torchrun on a CUDA machine: a wrapped model compiled with inductor trains like the eager one.

    torchrun --standalone --nproc_per_node=1 tests/gpu/cuda_compile.py

Prints one JSON line: the largest parameter differences against the eager run (fp32 and bf16),
how many graphs were compiled after the first step and after the last, and the median step
times (compiled / eager, for information); exits non-zero when parity fails.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.distributed.test_compile import Net, wrap_net


def run(device: torch.device, precision: str) -> dict[str, object]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    kw = {"mixed_precision": True, "compute_dtype": torch.bfloat16} if precision == "bf16" else {}
    torch.manual_seed(0)
    base = Net().to(device)

    eager, comp = wrap_net(base, **kw), wrap_net(base, **kw)
    compiled = torch.compile(comp)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    graphs = []
    for name, model, call in (("eager", eager, eager), ("compiled", comp, compiled)):
        optim = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.Generator(device=device).manual_seed(0)
        for step in range(12):
            x = torch.randn(64, 8, device=device, generator=g)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = call(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            torch.cuda.synchronize()
            if step >= 2:
                times[name].append(time.perf_counter() - start)
            if name == "compiled" and step in (0, 11):
                graphs.append(int(counters["stats"]["unique_graphs"]))
    diff = max((a - b).abs().max().item() for a, b in zip(eager.parameters(), comp.parameters()))
    torch._dynamo.reset()
    return {
        "max_param_diff": diff,
        "graphs_after_first_and_last_step": graphs,
        "compiled_over_eager_step_time": statistics.median(times["compiled"])
        / statistics.median(times["eager"]),
    }


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    report = {precision: run(device, precision) for precision in ("fp32", "bf16")}
    ok = report["fp32"]["max_param_diff"] <= 1e-4 and report["bf16"]["max_param_diff"] <= 5e-2
    if dist.get_rank() == 0:
        print(
            json.dumps({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, **report})
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
