"""Where a training step's time goes: forward, backward and optimizer, per variant, on the CPU.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.phases [--size 35M] [--rounds 5] \
        [--warm 1] [--variants ours_full,ddp,local,fsdp2] [--out out/phases]

For each phase of a step it reports the wall time, the CPU time of the whole rank process (every
thread: autograd, gloo's workers, the kernel's socket copies) and their difference, the time the
process was not running at all: waiting for the other rank or for a free core. It also counts the
process's minor page faults per step (memory that the allocator had handed back to the OS and
touches again). The variants are those of ``benchmarks/peers.py`` (same model, wrapping, batches
and optimizer), plus ``ours_full_nofp``: ``ours_full`` with ``forward_prefetch=False`` (on by default
when computing on the CPU).

Rounds are interleaved like ``peers.py``'s; ``--warm K`` first runs K untimed steps of the same
variant inside each round, so the timed step starts from that variant's own heap rather than from
the one the previous variant left (``--warm 0`` is what ``peers.py`` measures). Figures are the
median over rounds of the slower rank's value. Writes ``OUT/phases.json`` and ``OUT/phases.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import peers
from examples.gpt import GPT

PHASES = ("forward", "backward", "optimizer")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--size", default="35M", choices=list(peers.SIZES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warm", type=int, default=1, help="untimed steps of a variant before its timed one")
    p.add_argument("--variants", default="ours_full,ddp,local,fsdp2")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", default="out/phases")
    return p.parse_args()


def usage() -> tuple[float, int]:
    """(CPU seconds of every thread of this process, minor page faults so far)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def timed_step(v: peers.Variant, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """One step, split at the phase boundaries: wall and CPU seconds per phase, faults per step."""
    marks = [(time.perf_counter(), *usage())]
    loss = v.model(x, y)[1]
    marks.append((time.perf_counter(), *usage()))
    loss.backward()
    marks.append((time.perf_counter(), *usage()))
    v.optim.step()
    v.optim.zero_grad(set_to_none=True)
    marks.append((time.perf_counter(), *usage()))
    out: dict[str, float] = {}
    for phase, a, b in zip(PHASES, marks[:-1], marks[1:]):
        out[f"{phase}_wall"] = b[0] - a[0]
        out[f"{phase}_cpu"] = b[1] - a[1]
    out["faults"] = marks[-1][2] - marks[0][2]
    return out


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = dist.get_rank()
    n_layer, n_embd, n_head = peers.SIZES[args.size]
    torch.manual_seed(1337)
    base = GPT(96, 64, n_layer, n_embd, n_head, 0.0)
    build = peers.builders(torch.device("cpu"), cuda=False)
    build["ours_full_nofp"] = lambda m: peers.Variant(
        "ours_full_nofp",
        (model := peers.wrap_ours(copy.deepcopy(m), forward_prefetch=False)),
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        ours=True,
    )
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(build))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {sorted(build)}")
    variants = {n: build[n](base) for n in names}
    gen = torch.Generator().manual_seed(1 + rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(96, (args.batch_size, 65), generator=gen)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    x, y = batch()
    for v in variants.values():
        peers.train_step(v, x, y)
    records: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        x, y = batch()
        for n in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(args.warm):
                peers.train_step(variants[n], x, y)
            dist.barrier()
            records[n].append(timed_step(variants[n], x, y))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if rank == 0:
        report(args, names, gathered)
    dist.barrier()  # all ranks are done with their collectives
    time.sleep(0.1)  # let gloo release them before teardown (see getting-started.md, "Finishing")
    dist.destroy_process_group()


def ms(seconds: float) -> str:
    return f"{1000 * max(seconds, 0.0):.0f}"  # wall - CPU can dip just below 0 (clock granularity)


def report(args: argparse.Namespace, names: list[str], gathered: list[Any]) -> None:
    rows: dict[str, dict[str, float]] = {}
    for n in names:
        slowest = [
            {k: max(g[n][r][k] for g in gathered) for k in gathered[0][n][r]} for r in range(args.rounds)
        ]
        row = {k: statistics.median(s[k] for s in slowest) for k in slowest[0]}
        row["step_wall"] = statistics.median(sum(s[f"{p}_wall"] for p in PHASES) for s in slowest)
        row["step_cpu"] = statistics.median(sum(s[f"{p}_cpu"] for p in PHASES) for s in slowest)
        rows[n] = row
    lines = [
        f"{args.size}, world size {len(gathered)}, {args.rounds} rounds, {args.warm} warm step(s) per timed step; "
        "ms per step (median over rounds of the slower rank): wall / process CPU / not running",
        "",
        "| variant | " + " | ".join(PHASES) + " | step | minor faults |",
        "| --- | " + " | ".join("---" for _ in PHASES) + " | --- | --- |",
    ]
    for n, row in rows.items():
        cells = [
            f"{ms(row[f'{p}_wall'])} / {ms(row[f'{p}_cpu'])} / {ms(row[f'{p}_wall'] - row[f'{p}_cpu'])}"
            for p in PHASES
        ]
        step = f"{ms(row['step_wall'])} / {ms(row['step_cpu'])} / {ms(row['step_wall'] - row['step_cpu'])}"
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {step} | {row['faults']:.0f} |")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "phases.md").write_text(text + "\n")
    (out / "phases.json").write_text(json.dumps({"args": vars(args), "median": rows}, indent=2))


if __name__ == "__main__":
    main()
