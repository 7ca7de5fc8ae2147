"""A rank's peak tensor memory over one training step, by category, against torch's FSDP2.

    python -m benchmarks.memory [--regimes batch4,ckpt1] [--variants ours,ours_in_backward,fsdp2] \
        [--nproc 2] [--size 34M] [--out out/memory]

The model is the example's GPT (``examples.gpt.GPT``, vocabulary 8192, 8 blocks of width 512, 128
tokens of context), each block one unit, the embeddings and the head in the root, trained with
AdamW. ``34M`` (the default) has an output head of its own (33.6M parameters); ``30M`` ties it to the
token embedding as the example does (29.4M). Two regimes:

- ``batch4``: 4 sequences per rank, no activation checkpointing (activations dominate);
- ``ckpt1``: 1 sequence per rank, every block activation-checkpointed (the large-model regime, where
  the parameters, gradients and optimizer state dominate).

Each variant runs in a pair of rank processes of its own (``torchrun``), as measuring several in one
process would count what an earlier one left behind: one warm-up step (so that the optimizer state
exists), then one step under torch's tracker of live tensors, ``FSDPMemTracker(model, optimizer)``
for FSDP2 and, for this library, ``fsdp.training.memory_tracker.WrapperMemTracker`` (torch's
tracker told which tensors are shards, gathered parameters, full and sharded gradients, reduction
buffers: the same categories as FSDP2's). The peak is the tracker's ``"Total"`` at its peak (max over
the ranks), with the categories it splits that peak into.
Variants: ``ours`` (``backward(); optimizer.step()``), ``ours_in_backward``
(``fsdp.optimizer_in_backward``), the same two with ``_pp`` (the root wrapped with
``flatten_parameters=False``: each of its parameters a flat parameter of its own, reduced as soon as
its gradient exists) and ``fsdp2`` (``fully_shard``). Writes ``OUT/memory.json`` and
``OUT/memory.md``; prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._example import timed_step

ROOT = Path(__file__).resolve().parents[1]
# vocabulary, context, blocks, width, heads ("tiny": a check of the script itself)
SIZES = {"34M": (8192, 128, 8, 512, 8), "30M": (8192, 128, 8, 512, 8), "tiny": (256, 16, 2, 32, 2)}
TIED = {"30M"}  # sizes whose head is the token embedding (the example's weight tying)
REGIMES = {"batch4": (4, False), "ckpt1": (1, True)}
VARIANTS = ("ours", "ours_in_backward", "ours_pp", "ours_in_backward_pp", "fsdp2")


def _model(checkpointed: bool, variant: str, size: str = "34M") -> nn.Module:
    from examples.gpt import GPT

    torch.manual_seed(0)
    model = GPT(*SIZES[size], 0.0)
    if size not in TIED:
        model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    if variant == "fsdp2":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block) if checkpointed else block
            fully_shard(model.blocks[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    import fsdp

    for i, block in enumerate(model.blocks):
        model.blocks[i] = fsdp.FullyShardedDataParallel(
            fsdp.checkpoint_wrapper(block) if checkpointed else block
        )
    # "_pp": the root's parameters each a flat parameter of their own (flatten_parameters=False)
    return fsdp.FullyShardedDataParallel(model, flatten_parameters=not variant.endswith("_pp"))


def _rank(variant: str, regime: str, out: str, size: str) -> None:
    """One variant in this pair of rank processes: a warm-up step, then a tracked one."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    import fsdp
    from fsdp.training.memory_tracker import WrapperMemTracker

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    batch, checkpointed = REGIMES[regime]
    model = _model(checkpointed, variant, size)
    vocab, context = SIZES[size][:2]
    if variant.startswith("ours_in_backward"):
        optim: torch.optim.Optimizer = fsdp.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-4)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(dist.get_rank())

    def step() -> float:
        x = torch.randint(0, vocab, (batch, context), generator=gen)
        return timed_step(model, x, x, optim)

    step()  # warm-up: lazy init, optimizer state
    gc.collect()
    warnings.filterwarnings("ignore", category=UserWarning)  # (the trackers warn about None outputs)
    if variant == "fsdp2":
        tracker: Any = FSDPMemTracker(model, optim)
    else:
        tracker = WrapperMemTracker(model, optim)
    with tracker:
        seconds = step()
    peak = tracker.get_tracker_snapshot("peak")
    dev = next(d for d in peak if torch.device(d).type == "cpu")
    categories = {str(k).split(".")[-1]: int(v) for k, v in peak[dev].items()}
    mine = {"peak": categories.pop("Total", 0), "categories": categories, "step_s": seconds}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.barrier()
    time.sleep(0.1)  # (gloo's workers drop the last collectives' tensors: See design.md, exit under gloo)
    dist.destroy_process_group()


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--regimes", default="batch4,ckpt1")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--size", choices=sorted(SIZES), default="34M")
    p.add_argument("--out", default="out/memory")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for regime in args.regimes.split(","):
        for variant in args.variants.split(","):
            part = out / f"{regime}_{variant}.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={args.nproc}",
            ]
            cmd += ["-m", "benchmarks.memory", "--rank", variant, regime, str(part), args.size]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{regime} {variant} failed:\n{proc.stderr[-4000:]}")
            ranks = json.loads(part.read_text())
            worst = max(ranks, key=lambda r: r["peak"])
            results.setdefault(regime, {})[variant] = {
                "peak_bytes": worst["peak"],
                "peak_bytes_per_rank": [r["peak"] for r in ranks],
                "categories": worst["categories"],
                "step_s": max(r["step_s"] for r in ranks),
            }
            print(f"{regime} {variant}: peak {_mib(worst['peak'])} MiB", flush=True)
    lines = [
        "| regime | variant | peak MiB (max over ranks) | / fsdp2 | breakdown (MiB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for regime, by in results.items():
        ref = by.get("fsdp2", {}).get("peak_bytes")
        for variant, r in by.items():
            parts = ", ".join(f"{k} {_mib(v)}" for k, v in r["categories"].items() if v)
            ratio = f"{r['peak_bytes'] / ref:.3f}" if ref else "-"
            lines.append(f"| {regime} | {variant} | {_mib(r['peak_bytes'])} | {ratio} | {parts} |")
    table = "\n".join(lines)
    (out / "memory.json").write_text(json.dumps(results, indent=1))
    (out / "memory.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        _rank(*sys.argv[2:6])
    else:
        main()
