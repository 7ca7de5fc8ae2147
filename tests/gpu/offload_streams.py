"""Run under torchrun on a CUDA machine: FSDP's CPU-offload copies run on a side stream.

    torchrun --standalone --nproc_per_node=1 tests/gpu/offload_streams.py

With ``move_params_to_cpu=True`` every host->device copy of a shard and every device->host copy of
a gradient must run on a stream other than the one the matrix products run on, so that they can
overlap compute. Gradients accumulated over two backwards (copies finished asynchronously) must
equal those of the same model without offload, in fp32 and in mixed precision.

Prints one JSON line; exits non-zero when a check fails.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fsdp import FullyShardedDataParallel as FSDP


def build(device: torch.device, **kwargs: object) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(1024, 1024) for _ in range(4)]
    model = nn.Sequential(*[FSDP(layer.to(device), **kwargs) for layer in layers])  # type: ignore[arg-type]
    return FSDP(model, **kwargs)  # type: ignore[arg-type]


def accumulated_grads(model: nn.Module, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # two backwards, no step: the second adds to the first
        x = torch.randn(64, 1024, generator=g).to(device)
        model(x).float().pow(2).mean().backward()
    return [p.grad.detach().cpu().float().clone() for p in model.parameters() if p.grad is not None]


def streams_of(trace: dict, kind: str, names: tuple[str, ...]) -> set[int]:
    """Streams of the trace's events of category ``kind`` whose name contains one of ``names``."""
    return {
        int(e["args"]["stream"])
        for e in trace["traceEvents"]
        if e.get("cat") == kind
        and "stream" in e.get("args", {})
        and any(n in e.get("name", "").lower() for n in names)
    }


def main() -> int:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    report: dict[str, object] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    ok = True
    for name, extra in (("fp32", {}), ("fp16", {"mixed_precision": True})):
        plain = accumulated_grads(build(device, **extra), device)
        offloaded_model = build(device, move_params_to_cpu=True, **extra)
        offloaded = accumulated_grads(offloaded_model, device)
        on_cpu = all(p.grad is not None and p.grad.device.type == "cpu" for p in offloaded_model.parameters())
        diff = max((a - b).abs().max().item() for a, b in zip(plain, offloaded, strict=True))
        report[f"{name}_max_diff"] = diff
        report[f"{name}_grads_on_cpu"] = on_cpu
        ok = ok and on_cpu and diff <= 1e-6

    model = build(device, move_params_to_cpu=True)
    x = torch.randn(64, 1024, device=device)
    model(x).pow(2).mean().backward()  # warm-up: streams and pinned buffers exist
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(x).pow(2).mean().backward()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    # cuBLAS names its matrix-product kernels *gemm*, or nvjet_* / *xmma* / cutlass_* on recent GPUs
    gemm_streams = streams_of(trace, "kernel", ("gemm", "nvjet", "xmma", "cutlass"))
    copy_streams = streams_of(trace, "gpu_memcpy", ("htod", "dtoh"))  # host<->device only
    report["gemm_streams"] = sorted(gemm_streams)
    report["copy_streams"] = sorted(copy_streams)
    side = bool(copy_streams) and bool(gemm_streams) and not (copy_streams & gemm_streams)
    report["copies_on_a_side_stream"] = side
    ok = ok and side
    print(json.dumps(report))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
