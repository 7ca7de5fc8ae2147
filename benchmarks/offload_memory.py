"""Peak device memory and step time: OffloadModel against the plain model on the same GPU.

    python benchmarks/offload_memory.py --out offload_memory.json

The model is ``--layers`` blocks of Linear(width, width) + ReLU (default 24 x 4096: 1.6 GB of fp32
parameters). Each configuration trains ``--steps`` steps (after ``--warmup``) of SGD on a fresh
copy of the same initial weights and reports

- peak device memory above what was allocated before the model was built
  (``torch.cuda.max_memory_allocated``); for the plain model this includes its parameters,
  for OffloadModel only the device copies of at most two slices, gradients and activations;
- the median step time (forward + backward + optimizer step; OffloadModel's optimizer runs on
  the CPU) and the forward + backward time alone;
- the largest difference of the first output from the plain model's;
- the peak page-locked host memory of torch's pinned allocator (``torch.cuda.host_memory_stats``),
  whose blocks are rounded up to powers of two: a 64.02 MiB shard pins 128 MiB.

Ratios are against the plain model in the same run. Without CUDA the script says so, runs a
tiny version on the CPU (device = offload device = CPU, no memory figures) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fsdp import FSDP, OffloadModel

# ---------------------------------------------------------------------------- config
LAYERS, WIDTH, BATCH = 24, 4096, 16  # 24 x Linear(4096, 4096): 1.6 GB fp32 parameters
STEPS, WARMUP = 5, 2
OFFLOAD_CONFIGS = [  # (num_slices, checkpoint_activation, num_microbatches)
    (3, False, 1),
    (6, False, 1),
    (6, True, 1),
    (6, True, 4),
    (12, True, 4),
]
SMOKE = {"layers": 4, "width": 64, "batch": 8, "steps": 2, "warmup": 1}  # CPU-only run


@dataclass
class Row:
    name: str
    num_slices: int | None
    checkpoint_activation: bool | None
    num_microbatches: int | None
    peak_mib: float | None  # None on the CPU
    step_ms: float
    fwd_bwd_ms: float
    max_abs_diff_vs_plain: float
    peak_vs_plain: float | None = None
    step_vs_plain: float | None = None
    # page-locked host memory held by torch's pinned allocator at the peak (its blocks are rounded up
    # to powers of two); None on the CPU or where torch has no host_memory_stats
    pinned_peak_mib: float | None = None


def build(layers: int, width: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    name: str,
    make: Callable[[], nn.Module],
    x: torch.Tensor,
    reference: torch.Tensor | None,
    steps: int,
    warmup: int,
    options: tuple[int, bool, int] | None,
) -> tuple[Row, torch.Tensor]:
    """Train a fresh model for warmup + steps steps; return its row and its first output (on CPU)."""
    device = x.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        host_stats = getattr(torch.cuda, "host_memory_stats", None)
        if host_stats is not None and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()
    model = make()
    optim = torch.optim.SGD(model.parameters(), lr=1e-4)
    step_times, fwd_bwd_times = [], []
    first: torch.Tensor | None = None
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        y = model(x)
        if first is None:
            first = y.detach().float().cpu()
        y.float().square().mean().backward()
        sync(device)
        t1 = time.perf_counter()
        optim.step()
        optim.zero_grad(set_to_none=True)
        sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd_bwd_times.append((t1 - t0) * 1e3)
            step_times.append((t2 - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if cuda else None
    pinned = None
    if cuda and getattr(torch.cuda, "host_memory_stats", None) is not None:
        active = torch.cuda.host_memory_stats().get("active_bytes.peak")
        pinned = None if active is None else active / 2**20
    assert first is not None
    diff = 0.0 if reference is None else float((first - reference).abs().max())
    del model, optim
    num_slices, ckpt, mb = options if options is not None else (None, None, None)
    row = Row(
        name=name,
        num_slices=num_slices,
        checkpoint_activation=ckpt,
        num_microbatches=mb,
        peak_mib=peak,
        step_ms=statistics.median(step_times),
        fwd_bwd_ms=statistics.median(fwd_bwd_times),
        max_abs_diff_vs_plain=diff,
        pinned_peak_mib=pinned,
    )
    return row, first


def run(layers: int, width: int, batch: int, steps: int, warmup: int, device: torch.device) -> list[Row]:
    torch.manual_seed(0)
    initial = build(layers, width).state_dict()  # one set of initial weights, on the CPU
    x = torch.randn(batch, width, device=device)

    def plain() -> nn.Module:
        model = build(layers, width)
        model.load_state_dict(initial)
        return model.to(device)

    def offload(options: tuple[int, bool, int]) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            model = build(layers, width)
            model.load_state_dict(initial)
            num_slices, ckpt, mb = options
            return OffloadModel(
                model, device, num_slices=num_slices, checkpoint_activation=ckpt, num_microbatches=mb
            )

        return make

    def fsdp(move_params_to_cpu: bool) -> Callable[[], nn.Module]:
        """FSDP at world size 1, one unit per Linear, optionally with the shards kept on the CPU."""

        def make() -> nn.Module:
            model = build(layers, width)
            model.load_state_dict(initial)
            if not move_params_to_cpu:
                model = model.to(device)
            kwargs = {"compute_device": device, "move_params_to_cpu": move_params_to_cpu}
            for i, layer in enumerate(model):
                if isinstance(layer, nn.Linear):
                    model[i] = FSDP(layer, **kwargs)
            return FSDP(model, **kwargs)

        return make

    plain_row, reference = measure("plain", plain, x, None, steps, warmup, None)
    rows = [plain_row]
    for offload_params in (False, True):
        name = "fsdp ws=1" + (" move_params_to_cpu" if offload_params else "")
        row, _ = measure(name, fsdp(offload_params), x, reference, steps, warmup, None)
        rows.append(row)
    for options in OFFLOAD_CONFIGS:
        num_slices, ckpt, mb = options
        if num_slices > 2 * layers:
            continue
        name = f"offload s={num_slices} ckpt={int(ckpt)} mb={mb}"
        row, _ = measure(name, offload(options), x, reference, steps, warmup, options)
        rows.append(row)
    for row in rows:
        if row.peak_mib is not None and plain_row.peak_mib:
            row.peak_vs_plain = row.peak_mib / plain_row.peak_mib
        row.step_vs_plain = row.step_ms / plain_row.step_ms
    return rows


def table(rows: list[Row]) -> str:
    def num(v: float | None, fmt: str) -> str:
        width = int(fmt.split(".")[0])
        return "-".rjust(width) if v is None else format(v, fmt)

    lines = [
        f"{'config':<28} {'peak MiB':>9} {'x plain':>8} {'step ms':>9} {'x plain':>8} {'fwd+bwd ms':>11} "
        f"{'max |diff|':>11} {'pinned MiB':>11}"
    ]
    for r in rows:
        lines.append(
            f"{r.name:<28} {num(r.peak_mib, '9.1f')} {num(r.peak_vs_plain, '8.2f')} {r.step_ms:9.1f} "
            f"{num(r.step_vs_plain, '8.2f')} {r.fwd_bwd_ms:11.1f} {r.max_abs_diff_vs_plain:11.2e} "
            f"{num(r.pinned_peak_mib, '11.1f')}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        sizes = {k: getattr(args, k) for k in ("layers", "width", "batch", "steps", "warmup")}
        device_name = torch.cuda.get_device_name(device)
    else:
        print("offload_memory: this benchmark needs CUDA; running a tiny CPU smoke version instead")
        device = torch.device("cpu")
        sizes = dict(SMOKE)
        device_name = "cpu"
    param_mib = sizes["layers"] * (sizes["width"] + 1) * sizes["width"] * 4 / 2**20
    print(
        f"model: {sizes['layers']} x Linear({sizes['width']}, {sizes['width']}) + ReLU, "
        f"{param_mib:.1f} MiB fp32 parameters; batch {sizes['batch']}; device {device_name}"
    )
    own_group = not dist.is_initialized()
    if own_group:  # FSDP rows run at world size 1
        store = dist.HashStore()
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    if cuda:  # cuBLAS allocates its workspace at the first matrix product: not the plain row's
        torch.ones(8, 8, device=device).mm(torch.ones(8, 8, device=device))
        sync(device)
    rows = run(device=device, **sizes)
    print(table(rows))
    if args.out is not None:
        report = {
            "cuda": cuda,
            "device": device_name,
            "torch": torch.__version__,
            "config": sizes,
            "param_mib": param_mib,
            "rows": [asdict(r) for r in rows],
        }
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    if own_group:
        dist.barrier()  # all ranks are done with their collectives
        time.sleep(0.1)  # let gloo release them before teardown (see getting-started.md, "Finishing")
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
