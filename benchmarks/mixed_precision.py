"""fp32 vs bf16 mixed precision FSDP on the example's GPT: step time and bytes all-gathered per step.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.mixed_precision [--rounds 20] [--out out/mp.json]

Both variants are built in the same rank processes and run in interleaved rounds (fp32, bf16,
fp32, bf16, ... with a barrier around every step), because separate runs on a shared 2-core machine
differ by far more than the effect measured. Reported: the median over rounds of the paired ratio
bf16 / fp32 step time, the median step times, and the bytes all-gathered and reduce-scattered per
step per rank (counted at the collective).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._example import add_gpt_args, timed_step, wrap_blocks
from examples.gpt import GPT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    add_gpt_args(p)
    p.add_argument("--out", type=str, default="out/mixed_precision.json")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    vocab = 101
    torch.manual_seed(0)
    base = GPT(vocab, args.block_size, args.n_layer, args.n_embd, 4, 0.0)
    variants = {
        "fp32": wrap_blocks(copy.deepcopy(base)),
        "bf16": wrap_blocks(copy.deepcopy(base), mixed_precision=True, compute_dtype=torch.bfloat16),
    }
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in variants.items()}
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {k: [] for k in variants}
    comm: dict[str, dict[str, Any]] = {}
    for r in range(args.warmup + args.rounds):
        x = torch.randint(0, vocab, (args.batch_size, args.block_size), generator=gen)
        y = torch.randint(0, vocab, (args.batch_size, args.block_size), generator=gen)
        for name, model in variants.items():
            model.reset_comm_stats()
            seconds = timed_step(model, x, y, optims[name])
            if r >= args.warmup:
                times[name].append(seconds)
            comm[name] = model.comm_stats()
    ratios = [b / f for f, b in zip(times["fp32"], times["bf16"])]
    result = {
        "world_size": dist.get_world_size(),
        "params": sum(p.numel() for p in base.parameters()),
        "rounds": args.rounds,
        "median_step_ms": {k: round(1000 * statistics.median(v), 2) for k, v in times.items()},
        "median_ratio_bf16_over_fp32": round(statistics.median(ratios), 3),
        "all_gather_bytes_per_step": {k: c["all_gather"]["bytes"] for k, c in comm.items()},
        "reduce_scatter_bytes_per_step": {k: c["reduce_scatter"]["bytes"] for k, c in comm.items()},
        "wire_dtypes": {k: c["all_gather"]["dtypes"] for k, c in comm.items()},
    }
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"{'variant':8} {'median step ms':>15} {'all-gather B/step':>18} {'reduce-scatter B/step':>22}")
        for k in variants:
            print(
                f"{k:8} {result['median_step_ms'][k]:15.2f} {result['all_gather_bytes_per_step'][k]:18,d} "
                f"{result['reduce_scatter_bytes_per_step'][k]:22,d}"
            )
        print(f"median paired ratio bf16/fp32 step time: {result['median_ratio_bf16_over_fp32']}")
    dist.barrier()  # all ranks are done with their collectives
    time.sleep(0.1)  # let gloo release them before teardown (see getting-started.md, "Finishing")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
