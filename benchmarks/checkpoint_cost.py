"""What the checkpoints' checksums cost: save and load with and without them, paired, interleaved.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.checkpoint_cost [--size 35M] [--rounds 6] \
        [--dir out/checkpoint_cost]

The example's GPT at a size of ``benchmarks/peers.py`` (one FSDP unit per block plus the root) and
AdamW after one step (so the checkpoint holds the parameters and both moments). Each round saves
one checkpoint with checksums (``save_checkpoint(..., checksums=True)``, the default) and one
without, into fresh directories under ``--dir``, then loads each (``verify=True``, the default, and
``verify=False``), and times ``latest_checkpoint`` over the directory holding both, with and without
verification; the order of the two variants alternates from round to round. Every time is the
slower rank's, between barriers. For each operation the report gives the median over rounds of the
paired ratio (with / without) and the medians of the times. The files are deleted after each round;
the loads read them from the page cache, so the ratio is an upper bound of what verification adds
to a load from disk (which reads the same bytes once, whether verification or DCP reads them first).
Writes ``DIR/checkpoint_cost.json``; rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdp.checkpoints.files as checkpoint_files
import fsdp.checkpoints.save_load as checkpoint_io
from benchmarks._example import wrap_blocks
from benchmarks.peers import SIZES
from examples.gpt import GPT
from fsdp import latest_checkpoint, load_checkpoint, save_checkpoint

HASHING = [0.0]  # wall seconds this rank spent computing checksums, since the last reset


def _count_hashing(original: Callable[..., str]) -> Callable[..., str]:
    def timed_checksum(path: Any) -> str:
        t0 = time.perf_counter()
        try:
            return original(path)
        finally:
            HASHING[0] += time.perf_counter() - t0

    return timed_checksum


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--size", default="35M", choices=list(SIZES))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--dir", default="out/checkpoint_cost", help="where the checkpoints go (and the report)")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, float, float]:
    """(wall seconds of ``fn(*args, **kwargs)`` on the slower rank, CPU seconds of every rank's
    process summed, the most wall seconds a rank spent computing checksums in it), between barriers."""
    dist.barrier()
    HASHING[0] = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    fn(*args, **kwargs)
    wall, cpu = torch.tensor([time.perf_counter() - t0]), torch.tensor([time.process_time() - c0])
    hashing = torch.tensor([HASHING[0]])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    dist.all_reduce(hashing, op=dist.ReduceOp.MAX)
    return float(wall.item()), float(cpu.item()), float(hashing.item())


def main() -> None:
    args = parse_args()
    # every call computing a checksum, timed (save_checkpoint calls it through checkpoint_io's name)
    checkpoint_files.file_checksum = _count_hashing(checkpoint_files.file_checksum)
    checkpoint_io.file_checksum = _count_hashing(checkpoint_io.file_checksum)  # type: ignore[attr-defined]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    n_layer, n_embd, n_head = SIZES[args.size]
    torch.manual_seed(args.seed)
    model = wrap_blocks(GPT(96, 64, n_layer, n_embd, n_head, 0.0))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(96, (8, 64), generator=torch.Generator().manual_seed(rank))
    _, loss = model(x, x)
    loss.backward()
    optim.step()
    n_params = sum(p.numel() for p in model.parameters()) * dist.get_world_size()  # shards (padded)

    base = Path(args.dir)
    ops = ("save", "load", "latest")
    times: dict[str, dict[str, list[float]]] = {op: {"with": [], "without": []} for op in ops}
    cpu: dict[str, dict[str, list[float]]] = {op: {"with": [], "without": []} for op in ops}
    hashing: dict[str, list[float]] = {op: [] for op in ops}  # in the "with" variant
    sizes: list[int] = []
    recorded: dict[str, list[str]] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up (imports, first allocations) and is not counted
        here = base / f"round_{rnd}"
        order = ("with", "without") if rnd % 2 == 0 else ("without", "with")
        got: dict[str, dict[str, tuple[float, float, float]]] = {op: {} for op in ops}
        for variant in order:
            on = variant == "with"
            path = here / variant
            got["save"][variant] = timed(save_checkpoint, path, model, optim, checksums=on)
        for variant in order:
            on = variant == "with"
            path = here / variant
            got["load"][variant] = timed(load_checkpoint, path, model, optim, verify=on)
            # both checkpoints are under ``here``; the newest of them is verified (with checksums or not)
            got["latest"][variant] = timed(latest_checkpoint, here, group=dist.group.WORLD, verify=on)
        if rank == 0:
            sizes.append(sum(p.stat().st_size for p in (here / "with").iterdir()))
            for variant in ("with", "without"):  # what each variant's commit marker recorded
                marker = json.loads((here / variant / "COMMITTED").read_text())
                recorded[variant] = sorted(marker.get("checksums", {}))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(here)
        if rnd > 0:
            for op in ops:
                for variant in ("with", "without"):
                    times[op][variant].append(got[op][variant][0])
                    cpu[op][variant].append(got[op][variant][1])
                hashing[op].append(got[op]["with"][2])

    if rank == 0:
        report: dict[str, Any] = {
            "size": args.size,
            "parameters": n_params,
            "world_size": dist.get_world_size(),
            "rounds": args.rounds,
            "checkpoint_bytes": sizes[-1],
            "files_with_checksums": recorded,
            "times_s": times,
            "cpu_s": cpu,
            "hashing_s": hashing,
        }
        lines = [
            f"checksums at {args.size} ({n_params:,} parameters with AdamW state, a {sizes[-1] / 2**20:.0f} MiB "
            f"checkpoint), world size {dist.get_world_size()}, {args.rounds} paired rounds",
            "| operation | median with (s) | median without (s) | median paired ratio | quartiles "
            "| CPU s with / without (both ranks) | median paired CPU ratio | checksum time / time without |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for op in ops:
            ratios = [a / b for a, b in zip(times[op]["with"], times[op]["without"], strict=True)]
            cpu_ratios = [a / b for a, b in zip(cpu[op]["with"], cpu[op]["without"], strict=True)]
            share = [h / b for h, b in zip(hashing[op], times[op]["without"], strict=True)]
            report[f"{op}_hashing_share_median"] = statistics.median(share)
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            report[f"{op}_ratio_median"] = statistics.median(ratios)
            report[f"{op}_cpu_ratio_median"] = statistics.median(cpu_ratios)
            report[f"{op}_ratios"] = ratios
            lines.append(
                f"| {op} | {statistics.median(times[op]['with']):.3f} | {statistics.median(times[op]['without']):.3f} "
                f"| {statistics.median(ratios):.3f} | {q[0]:.3f}-{q[2]:.3f} "
                f"| {statistics.median(cpu[op]['with']):.3f} / {statistics.median(cpu[op]['without']):.3f} "
                f"| {statistics.median(cpu_ratios):.3f} | {statistics.median(share):.3f} |"
            )
        base.mkdir(parents=True, exist_ok=True)
        (base / "checkpoint_cost.json").write_text(json.dumps(report, indent=1))
        sys.stdout.write("\n".join(lines) + "\n")
    dist.barrier()
    time.sleep(0.1)  # see "Exit under gloo" in docs/design.md
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
