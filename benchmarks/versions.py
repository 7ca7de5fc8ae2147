"""This checkout's step time against earlier commits of the library, paired in the same rank processes.

    python -m benchmarks.versions --commits 95bd224,981d1e7 [--size 35M] [--rounds 12] [--nproc 2] \
        [--extra pp,in_backward,in_backward_pp] [--out out/versions]

Separate runs on a shared machine are not comparable (see docs/performance.md), so a suspected
regression is measured the way peer ratios are: each earlier commit's ``fsdp/`` is extracted with
``git archive`` into a temporary folder as a package of its own (``fsdp_<commit>``, its imports
renamed), and one pair of rank processes builds, from the same initial weights, this checkout's
wrapper, each earlier commit's, and a plain ``local`` copy (no communication). Every round runs one
step of each (order rotating, a barrier before each step); a step's time is the slower rank's; the
report gives each variant's median ratio to this checkout and to ``local`` over the rounds, with the
quartiles. The model and batch are ``benchmarks.peers``' (the example's GPT, one wrapper per block
plus the root, FULL_SHARD, fp32, AdamW, 8 sequences of 64 tokens per rank). ``--extra`` adds
variants of this checkout: ``pp`` (the root with ``flatten_parameters=False``), ``in_backward``
(``fsdp.optimizer_in_backward``) and ``in_backward_pp`` (both), and, to find what a step's time goes
to, ``nocheck`` (no per-unit handshakes, as ``FSDP_CHECK_UNITS=0``) and ``norelease`` (the root keeps
its full parameters through backward), each reported against ``this``; ``ddp`` adds torch's
``DistributedDataParallel`` (its ratio to ``local`` is what communication costs any variant here).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def extract(commit: str, into: Path) -> str:
    """``fsdp/`` of ``commit`` as the package ``fsdp_<commit>`` under ``into``; returns its name."""
    name = f"fsdp_{commit}"
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "fsdp"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    tmp = into / f".{name}.tar"
    tmp.write_bytes(archive)
    with tarfile.open(tmp) as tar:
        tar.extractall(into / name, filter="data")
    tmp.unlink()
    (into / name / "fsdp").rename(into / f"{name}.pkg")
    (into / name).rmdir()
    (into / f"{name}.pkg").rename(into / name)
    pattern = re.compile(r"\b(from|import) fsdp([ .])")
    for path in (into / name).rglob("*.py"):
        path.write_text(pattern.sub(rf"\1 {name}\2", path.read_text()))
    return name


def _rank(args: argparse.Namespace, packages: list[str]) -> None:
    from benchmarks.peers import SIZES, blocks
    from examples.gpt import GPT

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    n_layer, n_embd, n_head = SIZES[args.size]
    torch.manual_seed(1337)
    base = GPT(96, 64, n_layer, n_embd, n_head, 0.0)

    def wrapped(package: str, **root: Any) -> nn.Module:
        cls = importlib.import_module(package).FullyShardedDataParallel
        model = copy.deepcopy(base)
        for i, block in enumerate(blocks(model)):
            blocks(model)[i] = cls(block)
        return cls(model, **root)  # type: ignore[no-any-return]

    models: dict[str, nn.Module] = {"this": wrapped("fsdp")}
    for p in packages:
        models[p.removeprefix("fsdp_")] = wrapped(p)
    extra = [x for x in args.extra.split(",") if x]
    for x in extra:
        if x == "ddp":  # torch's DistributedDataParallel: what any communicating variant pays here
            models["ddp"] = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        else:
            models[f"this_{x}"] = wrapped("fsdp", flatten_parameters=not x.endswith("pp"))
    if "norelease" in extra:  # the root keeps its full parameters through backward, as before
        models["this_norelease"]._releases_kept_full = lambda ctx: False  # type: ignore[assignment]
    models["local"] = copy.deepcopy(base)
    optims: dict[str, torch.optim.Optimizer] = {}
    for n, m in models.items():
        if n.startswith("this_in_backward"):
            import fsdp

            optims[n] = fsdp.optimizer_in_backward(m, torch.optim.AdamW, lr=1e-3)
        else:
            optims[n] = torch.optim.AdamW(m.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1338 + rank)
    times: dict[str, list[float]] = {n: [] for n in models}

    def step(name: str, x: torch.Tensor, y: torch.Tensor) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        loss = models[name](x, y)[1]
        loss.backward()
        optims[name].step()
        optims[name].zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    names = list(models)
    for r in range(args.rounds + 1):
        t = torch.randint(96, (8, 65), generator=gen)
        x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds = step(name, x, y)
            if r > 0:  # round 0 warms up (lazy init, optimizer state)
                times[name].append(seconds)
            elif name == "this_nocheck":  # no per-unit handshakes (FSDP_CHECK_UNITS=0) from now on
                models[name]._ctx.check_units = False  # type: ignore[union-attr]
        if rank == 0:
            print(f"round {r}/{args.rounds}", flush=True)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    if rank == 0:
        slower = {n: [max(rt[n][i] for rt in everyone) for i in range(args.rounds)] for n in names}
        lines = [
            f"{args.size}, {args.rounds} rounds, world size {dist.get_world_size()}",
            "| variant | median step ms | / this (quartiles) | / local (quartiles) |",
            "| --- | --- | --- | --- |",
        ]
        for n in names:
            cells = [n, f"{statistics.median(slower[n]) * 1e3:.1f}"]
            for den in ("this", "local"):
                ratios = [a / b for a, b in zip(slower[n], slower[den], strict=True)]
                q = statistics.quantiles(ratios, n=4)
                cells.append(f"{statistics.median(ratios):.3f} ({q[0]:.3f}-{q[2]:.3f})")
            lines.append("| " + " | ".join(cells) + " |")
        print("\n".join(lines), flush=True)
        if args.out:
            report = {
                n: {
                    "median_step_s": statistics.median(slower[n]),
                    "per_round_s": slower[n],
                    **{
                        f"over_{den}": statistics.median(
                            a / b for a, b in zip(slower[n], slower[den], strict=True)
                        )
                        for den in ("this", "local")
                    },
                }
                for n in names
            }
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "versions.json").write_text(json.dumps(report, indent=1))
            (Path(args.out) / "versions.md").write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commits", default="", help="comma-separated commits to compare against")
    p.add_argument("--size", default="35M")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default="", help="also write OUT/versions.json and OUT/versions.md")
    p.add_argument(
        "--extra",
        default="",
        help="variants of this checkout: pp, in_backward, in_backward_pp, nocheck, norelease",
    )
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--packages", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        _rank(args, [x for x in args.packages.split(",") if x])
        return
    with tempfile.TemporaryDirectory() as tmp:
        packages = [extract(c, Path(tmp)) for c in args.commits.split(",") if c]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([tmp, str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={args.nproc}", "-m", "benchmarks.versions", "--rank"]
        cmd += ["--commits", args.commits, "--size", args.size, "--rounds", str(args.rounds)]
        cmd += ["--extra", args.extra, "--out", args.out]
        cmd += ["--packages", ",".join(packages)]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)


if __name__ == "__main__":
    main()
