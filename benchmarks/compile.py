"""torch.compile of FSDP on the example's GPT: step time of the compiled wrapped model against the
eager one, beside the same pair for the unwrapped local model (no communication).

    torchrun --standalone --nproc_per_node=2 -m benchmarks.compile [--backend inductor] [--rounds 12]

All four variants are built in the same rank processes and run in interleaved rounds with a barrier
around every step. Reported: median step times, the median paired ratios compiled / eager for
each, and the largest parameter difference between our compiled and eager models after the run.
The first ``--warmup`` rounds (compilation included) are not timed.
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
    p.add_argument("--backend", default="inductor")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    add_gpt_args(p)
    p.add_argument("--out", type=str, default="out/compile.json")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # one core per rank on a 2-core machine, as the other benchmarks
    rank = dist.get_rank()
    vocab = 101
    torch.manual_seed(0)
    base = GPT(vocab, args.block_size, args.n_layer, args.n_embd, 4, 0.0)
    local, ours_eager, ours_compiled = (
        copy.deepcopy(base),
        wrap_blocks(copy.deepcopy(base)),
        wrap_blocks(copy.deepcopy(base)),
    )
    local_compiled = copy.deepcopy(base)
    variants: dict[str, tuple[torch.nn.Module, Any]] = {
        "local": (local, local),
        "local_compiled": (local_compiled, torch.compile(local_compiled, backend=args.backend)),
        "ours": (ours_eager, ours_eager),
        "ours_compiled": (ours_compiled, torch.compile(ours_compiled, backend=args.backend)),
    }
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, (m, _) in variants.items()}
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {k: [] for k in variants}
    rounds = range(args.warmup + args.rounds)
    try:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="rounds", disable=rank != 0)  # type: ignore[assignment]
    except ImportError:
        pass
    for r in rounds:
        x = torch.randint(0, vocab, (args.batch_size, args.block_size), generator=gen)
        y = torch.randint(0, vocab, (args.batch_size, args.block_size), generator=gen)
        for name, (_, call) in variants.items():
            seconds = timed_step(call, x, y, optims[name])
            if r >= args.warmup:
                times[name].append(seconds)
    diff = max(
        (a - b).abs().max().item() for a, b in zip(ours_eager.parameters(), ours_compiled.parameters())
    )
    result = {
        "world_size": dist.get_world_size(),
        "backend": args.backend,
        "torch": torch.__version__,
        "params": sum(p.numel() for p in base.parameters()),
        "rounds": args.rounds,
        "median_step_ms": {k: round(1000 * statistics.median(v), 2) for k, v in times.items()},
        "median_ratio_compiled_over_eager": {
            "local": round(
                statistics.median(c / e for e, c in zip(times["local"], times["local_compiled"])), 3
            ),
            "ours": round(statistics.median(c / e for e, c in zip(times["ours"], times["ours_compiled"])), 3),
        },
        "median_ratio_ours_compiled_over_local_compiled": round(
            statistics.median(o / c for c, o in zip(times["local_compiled"], times["ours_compiled"])), 3
        ),
        "max_param_diff_compiled_vs_eager": diff,
    }
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    dist.barrier()  # all ranks are done with their collectives
    time.sleep(0.1)  # let gloo release them before teardown (see getting-started.md, "Finishing")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
