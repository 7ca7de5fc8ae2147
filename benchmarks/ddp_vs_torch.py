"""Step time of fsdp.DistributedDataParallel against torch DDP and a no-communication baseline.

All variants live in the same rank processes and run in interleaved rounds (A, B, C, D, then
B, C, D, A, ...: the order rotates) with a barrier before every step, because separate runs on a shared 2-core machine are not
comparable. Each round yields one paired ratio per variant against torch
DDP; the report gives their medians. It also counts all-reduce calls per step: ours through its
CommStats and a patch of ``torch.distributed.all_reduce``, torch DDP through a counting comm hook
on a separate, untimed copy (a Python hook would slow the timed one down).

    torchrun --standalone --nproc_per_node=2 -m benchmarks.ddp_vs_torch --out ddp_vs_torch.json

Model: the GPT of examples/gpt.py (defaults: 4 layers x 128 wide, context 64, 16 sequences
per rank), on random character ids. One step = forward, backward, AdamW step, zero_grad.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from examples.gpt import GPT
from fsdp import DistributedDataParallel
from fsdp.comm.collectives import CollectiveKind


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=60, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=1, help="timed steps per variant and round (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=96)
    p.add_argument(
        "--small-message-size",
        type=int,
        default=262_144,
        help="message_size of the 'ours-small' variant (262,144 fp32 elements = torch DDP's 1 MiB first bucket)",
    )
    p.add_argument("--out", type=str, default="ddp_vs_torch.json")
    return p.parse_args()


class CallCounter:
    """Counts torch.distributed.all_reduce calls (ours launches through it; torch DDP does not)."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig: Callable[..., Any] = dist.all_reduce

    def __enter__(self) -> CallCounter:
        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._orig


def count_hook(counter: list[int]) -> Callable[..., Any]:
    # No annotations on the hook: torch checks them against dist.GradBucket, and this file's
    # `from __future__ import annotations` would turn them into strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        counter[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    return hook


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))

    torch.manual_seed(1337)
    base = GPT(args.vocab, args.block_size, args.n_layer, args.n_embd, args.n_head, dropout=0.0)
    n_params = sum(p.numel() for p in base.parameters())

    models: dict[str, nn.Module] = {
        "ours": DistributedDataParallel(copy.deepcopy(base)),
        "ours-small": DistributedDataParallel(copy.deepcopy(base), message_size=args.small_message_size),
        "torch": TorchDDP(copy.deepcopy(base)),
        "local": copy.deepcopy(base),
    }
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    gen = torch.Generator().manual_seed(rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(args.vocab, (args.batch_size, args.block_size + 1), generator=gen)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step(name: str) -> None:
        x, y = batch()
        _, loss = models[name](x, y)
        loss.backward()
        optims[name].step()
        optims[name].zero_grad(set_to_none=True)

    for name in models:
        for _ in range(args.warmup):
            step(name)

    # ---- all-reduce calls per step (untimed) -------------------------------------------------------
    calls: dict[str, float] = {}
    for name in ("ours", "ours-small"):
        ddp = models[name]
        assert isinstance(ddp, DistributedDataParallel)
        ddp.comm_stats.reset()
        with CallCounter() as counter:
            for _ in range(args.warmup):
                step(name)
        from_stats = ddp.comm_stats.calls.get(CollectiveKind.ALL_REDUCE, 0)
        # at world size 1 the stats count the all-reduces while nothing reaches torch.distributed
        assert from_stats == counter.calls or dist.get_world_size() == 1, (from_stats, counter.calls)
        calls[name] = counter.calls / args.warmup
    counted = TorchDDP(copy.deepcopy(base))
    torch_calls = [0]
    counted.register_comm_hook(None, count_hook(torch_calls))
    counted_opt = torch.optim.AdamW(counted.parameters(), lr=1e-3)
    for it in range(2 * args.warmup):
        if it == args.warmup:
            torch_calls[0] = 0  # torch DDP rebuilds its buckets after the first iteration
        x, y = batch()
        counted(x, y)[1].backward()
        counted_opt.step()
        counted_opt.zero_grad(set_to_none=True)
    calls["torch"] = torch_calls[0] / args.warmup
    calls["local"] = 0.0
    del counted, counted_opt

    # ---- interleaved timing ------------------------------------------------------------------------
    times: dict[str, list[float]] = {name: [] for name in models}  # per round: median step time (s)
    names = list(models)
    for r in range(args.rounds):
        # rotate the order every round, so that no variant always runs right after the same one
        for name in names[r % len(names) :] + names[: r % len(names)]:
            steps = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                step(name)
                steps.append(time.perf_counter() - t0)
            times[name].append(statistics.median(steps))
    # rank 0's times include waiting for rank 1 inside the all-reduces; take the slower rank per round
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, times)
    slowest = {name: [max(g[name][r] for g in gathered) for r in range(args.rounds)] for name in models}
    ratios = {
        name: [a / b for a, b in zip(slowest[name], slowest["torch"])] for name in models if name != "torch"
    }
    ratio_local = {name: [a / b for a, b in zip(slowest[name], slowest["local"])] for name in models}

    if rank == 0:
        print(
            f"GPT {n_params / 1e6:.2f}M parameters ({args.n_layer} x {args.n_embd}), world size {world}, "
            f"{args.batch_size} x {args.block_size} tokens per rank, {args.rounds} rounds x {args.steps} steps"
        )
        print(
            f"{'variant':<12} {'median ms':>10} {'/ torch DDP':>12} {'(IQR)':>15} {'/ local':>9} "
            f"{'all-reduces/step':>17}"
        )
        for name in models:
            vs_torch = statistics.median(ratios[name]) if name in ratios else 1.0
            q1, _, q3 = _quartiles(ratios[name]) if name in ratios else (1.0, 1.0, 1.0)
            iqr = f"({q1:.3f}-{q3:.3f})"
            print(
                f"{name:<12} {1000 * statistics.median(slowest[name]):>10.1f} {vs_torch:>12.3f} {iqr:>15} "
                f"{statistics.median(ratio_local[name]):>9.3f} {calls[name]:>17.1f}"
            )
        summary = {
            "config": vars(args),
            "world_size": world,
            "n_params": n_params,
            "allreduce_calls_per_step": calls,
            "median_step_s": {k: statistics.median(v) for k, v in slowest.items()},
            "median_ratio_vs_torch_ddp": {k: statistics.median(v) for k, v in ratios.items()},
            "quartiles_ratio_vs_torch_ddp": {k: _quartiles(v) for k, v in ratios.items()},
            "median_ratio_vs_local": {k: statistics.median(v) for k, v in ratio_local.items()},
            "per_round_ratio_vs_torch_ddp": ratios,
            "per_round_step_s": slowest,
            "bucket_layouts": {
                name: [len(b) for b in (models[name].bucket_layout or ())]  # type: ignore[union-attr]
                for name in ("ours", "ours-small")
            },
        }
        Path(args.out).write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.out}")
    dist.barrier()  # all ranks are done with their collectives
    time.sleep(0.1)  # let gloo release them before teardown (see getting-started.md, "Finishing")
    dist.destroy_process_group()


def _quartiles(values: list[float]) -> list[float]:
    """Quartiles; one round has none to speak of, so its value stands for all three."""
    return statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3


if __name__ == "__main__":
    main()
