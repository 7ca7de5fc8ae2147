"""This library against its peers on the example's GPT: step-time ratios, peak memory, bytes per step.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.peers [--sizes 7M,35M] [--rounds N] \
        [--out out/peers]

Variants, all built in the same rank processes from the same initial weights, trained on the same
per-rank batches with AdamW (one step = forward, backward, ``optimizer.step()``, ``zero_grad``):

- ``ours_full``, ``ours_grad_op``, ``ours_no_shard``: this library, ``FULL_SHARD``, ``SHARD_GRAD_OP``,
  ``NO_SHARD``, fp32; ``ours_full_bf16``: ``FULL_SHARD`` with ``mixed_precision=True,
  compute_dtype=torch.bfloat16``. One wrapper per transformer ``Block`` plus the root.
- ``fsdp2``, ``fsdp2_bf16``: torch's ``fully_shard`` with the same wrapping (one unit per ``Block``
  plus the root), fp32 and ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``.
- ``ddp``: torch ``DistributedDataParallel`` (fp32, default buckets).
- ``local``: no communication at all; each rank trains its own plain copy on its local batch.
- On CUDA (``--fairscale auto``, when it is installed): ``fairscale``, ``fairscale_bf16``: fairscale
  0.4.13's FSDP with the same wrapping. Its FSDP runs only on CUDA; a peer that fails to build or to
  train is left out of the run, with the error in the report, and the other variants go on.

How it is measured (see docs/performance.md):

- **Time.** Separate runs on a shared 2-core machine are not comparable, so every round runs one step
  of every variant (the order rotates each round), with a barrier before each step. A step's time is
  the slower rank's. For a pair (A, B) each round gives the ratio A/B of the same round; the report
  gives the median over rounds (and the quartiles).
- **Memory.** After the timed rounds each variant runs one more step alone under torch's
  ``MemTracker`` (a dispatch mode that follows every tensor storage: the variant's parameters and
  optimizer state registered beforehand, everything allocated or resized during the step). The peak of
  live tracked bytes is that variant's alone, although all variants share the process. Process RSS
  (``VmHWM``, reset before the step through ``/proc/self/clear_refs``) is shown beside it; it counts the
  whole process, so it says little about one variant. On CUDA, each variant is also rebuilt alone
  after the rounds and its peak ``torch.cuda.max_memory_allocated`` over one step is reported.
- **Bytes.** ``model.comm_stats()`` over the first timed step of each of our variants, against what
  the padded flat parameter sizes predict and against the formula ``f P (2 b_param + b_reduce)``
  (full shard; see docs/performance.md).

Writes ``OUT/peers.json``, ``OUT/peers.md`` (rank 0 also prints it) and ``OUT/peers.png``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from examples.gpt import GPT
from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy, get_fsdp_instances

ROOT = Path(__file__).resolve().parent.parent

# name -> (n_layer, n_embd, n_head); parameter counts at vocab 96, context 64 are in the report
SIZES: dict[str, tuple[int, int, int]] = {
    "1M": (2, 128, 4),  # for quick checks of the script itself
    "7M": (4, 384, 6),
    "35M": (11, 512, 8),
}

# (numerator, denominator): the paired ratios reported; the targets where it sets one
RATIOS: list[tuple[str, str]] = [
    ("ours_full", "fsdp2"),
    ("ours_full", "ddp"),
    ("ours_full", "local"),
    ("ours_full_bf16", "fsdp2_bf16"),
    ("ours_grad_op", "ddp"),
    ("ours_no_shard", "ddp"),
    ("ours_full_bf16", "ours_full"),
    ("fsdp2", "ddp"),
    ("ddp", "local"),
    ("ours_full", "fairscale"),
    ("ours_full_bf16", "fairscale_bf16"),
]


def time_target(num: str, den: str, size: str, cuda: bool) -> float | None:
    """The issue's upper bound for the median ratio num/den, if it sets one."""
    if num != "ours_full":
        return None
    if den == "fsdp2" and not cuda:
        return {"7M": 0.9, "35M": 0.7}.get(size)
    if den == "ddp" and not cuda:
        return 1.15
    if den == "local":
        return 1.05 if cuda else 1.3  # on a GPU at world size 1: within 5% of the unwrapped model
    if den == "fairscale":
        return 1.0
    return None


# ------------------------------------------------------------------------------------------ set-up
# Sequences per rank and step. On a GPU, 8 x 64 tokens of these small models take well under a
# millisecond of device time, so every variant would measure its host overhead (kernel launches,
# hooks) rather than training; 256 sequences keep the device busy for milliseconds per step.
CPU_BATCH, CUDA_BATCH = 8, 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--sizes", type=str, default="7M,35M", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--rounds", type=int, default=8, help="timed, interleaved rounds per size")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"sequences per rank (default {CPU_BATCH} on the CPU, {CUDA_BATCH} on CUDA)",
    )
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=96)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out", type=str, default="out/peers")
    p.add_argument(
        "--fairscale",
        choices=("auto", "yes", "no"),
        default="auto",
        help="compare with fairscale's FSDP: auto = on CUDA when installed (it is CUDA-only)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return p.parse_args()


@dataclass
class Variant:
    name: str
    model: nn.Module
    optim: torch.optim.Optimizer
    ours: bool = False
    strategy: str | None = None
    dtype: str = "fp32"
    times: list[float] = field(default_factory=list)  # this rank's step time per timed round (s)
    cpu: list[float] = field(default_factory=list)  # this rank's process CPU time per timed round (s)


def blocks(model: nn.Module) -> nn.ModuleList:
    return cast(nn.ModuleList, model.blocks)


def wrap_ours(model: nn.Module, **kwargs: Any) -> nn.Module:
    for i, block in enumerate(blocks(model)):
        blocks(model)[i] = FSDP(block, **kwargs)
    return FSDP(model, **kwargs)


def wrap_fsdp2(model: nn.Module, device: torch.device, bf16: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
    kwargs: dict[str, Any] = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def wrap_fairscale(model: nn.Module, **kwargs: Any) -> nn.Module:
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    for i, block in enumerate(blocks(model)):
        blocks(model)[i] = FairscaleFSDP(block, **kwargs)
    return cast(nn.Module, FairscaleFSDP(model, **kwargs))


BF16 = {"mixed_precision": True, "compute_dtype": torch.bfloat16}

# Peers that are not ours to fix: one that fails to build or to train is left out of the run (the
# error is reported) rather than ending it, so the other variants are still measured.
OPTIONAL = ("fairscale", "fairscale_bf16")


def builders(
    device: torch.device, cuda: bool, fairscale: str = "auto"
) -> dict[str, Callable[[nn.Module], Variant]]:
    """name -> function building that variant from a copy of the base model (already on device)."""

    def make(
        name: str, wrap: Callable[[nn.Module], nn.Module], **info: Any
    ) -> Callable[[nn.Module], Variant]:
        def build(base: nn.Module) -> Variant:
            model = wrap(copy.deepcopy(base))
            return Variant(name, model, torch.optim.AdamW(model.parameters(), lr=1e-3), **info)

        return build

    S = ShardingStrategy
    out: dict[str, Callable[[nn.Module], Variant]] = {
        "ours_full": make(
            "ours_full",
            lambda m: wrap_ours(m, sharding_strategy=S.FULL_SHARD),
            ours=True,
            strategy="FULL_SHARD",
        ),
        "ours_grad_op": make(
            "ours_grad_op",
            lambda m: wrap_ours(m, sharding_strategy=S.SHARD_GRAD_OP),
            ours=True,
            strategy="SHARD_GRAD_OP",
        ),
        "ours_no_shard": make(
            "ours_no_shard",
            lambda m: wrap_ours(m, sharding_strategy=S.NO_SHARD),
            ours=True,
            strategy="NO_SHARD",
        ),
        "ours_full_bf16": make(
            "ours_full_bf16",
            lambda m: wrap_ours(m, sharding_strategy=S.FULL_SHARD, **BF16),
            ours=True,
            strategy="FULL_SHARD",
            dtype="bf16",
        ),
        "fsdp2": make("fsdp2", lambda m: wrap_fsdp2(m, device, bf16=False)),
        "fsdp2_bf16": make("fsdp2_bf16", lambda m: wrap_fsdp2(m, device, bf16=True), dtype="bf16"),
        "ddp": make("ddp", lambda m: TorchDDP(m, device_ids=[device.index] if cuda else None)),
        "local": make("local", lambda m: m),
    }
    wanted = fairscale == "yes" or (fairscale == "auto" and cuda)
    if wanted and importlib.util.find_spec("fairscale") is None:
        print("fairscale is not installed: no fairscale variants (pip install fairscale==0.4.13)")
    elif wanted:
        out["fairscale"] = make("fairscale", wrap_fairscale)
        out["fairscale_bf16"] = make("fairscale_bf16", lambda m: wrap_fairscale(m, **BF16), dtype="bf16")
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(v: Variant, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = v.model(x, y)[1]
    loss.backward()
    v.optim.step()
    v.optim.zero_grad(set_to_none=True)
    return loss.detach()


# ------------------------------------------------------------------------------------------ memory
def read_status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def tracked_step(v: Variant, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """One step of ``v`` under MemTracker: peak live tensor bytes of this variant, with RSS beside it."""
    gc.collect()
    # MemTracker warns about None outputs (e.g. of c10d ops); harmless
    warnings.filterwarnings("ignore", message="Expected a tensor or a traceable", category=UserWarning)
    tracker = MemTracker()
    tracker.track_external(v.model, v.optim)
    before = tracker.get_tracker_snapshot("current")
    dist.barrier()
    rss_before = read_status_kib("VmRSS")
    hwm_reset = reset_peak_rss()
    with tracker:
        train_step(v, x, y)
        sync(device)
    hwm = read_status_kib("VmHWM")
    peak = tracker.get_tracker_snapshot("peak")
    dev = next((d for d in peak if torch.device(d).type == device.type), None)
    snap = {str(k): int(b) for k, b in peak[dev].items()} if dev is not None else {}
    start = {str(k): int(b) for k, b in before[dev].items()} if dev is not None and dev in before else {}
    return {
        "tracked_peak_bytes": snap.get("Total", 0),
        "tracked_peak_breakdown": snap,
        "tracked_before_step_bytes": start.get("Total", 0),
        "rss_before_kib": rss_before,
        "rss_peak_kib": hwm if hwm_reset else None,
    }


def cuda_isolated_peak(
    build: Callable[[nn.Module], Variant], base: nn.Module, batch: Any, warmup: int
) -> int:
    """Peak torch.cuda.max_memory_allocated of one step of a variant built alone on the GPU."""
    gc.collect()
    torch.cuda.empty_cache()
    floor = torch.cuda.memory_allocated()  # the base model (on the device) and the batch
    v = build(base)
    for _ in range(warmup):
        train_step(v, *batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(v, *batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - floor
    del v
    gc.collect()
    torch.cuda.empty_cache()
    return peak


# ------------------------------------------------------------------------------------------ bytes
def expected_comm(
    model: nn.Module, strategy: str, wire: int, world: int, n_buckets: int = 0
) -> dict[str, Any]:
    """What one step should count, from the padded flat sizes (comm_stats counts the full tensor).

    Inner wrappers all-gather twice under FULL_SHARD (forward, backward), the root once (it keeps its
    parameters from forward to backward); SHARD_GRAD_OP gathers each once. Every flat parameter is
    reduce-scattered once, gradients smaller than ``bucket_cap_mb`` several in one collective, so the
    reduce-scatter *calls* are only bounded (at most one per flat parameter; ``calls_max``). NO_SHARD
    all-reduces all of them in ``n_buckets`` fp32 buckets, each with one flag element more. Every
    backward ends with the consistency check: one all-reduce of 2 int32 per flat parameter.
    """
    root_padded = inner_padded = n_root = n_inner = 0
    shard_size = 1 if strategy == "NO_SHARD" else world
    for w in get_fsdp_instances(model):
        own = list(w.parameters(recurse=False))
        padded = sum(p.numel() for p in own) * shard_size
        if w is model:
            root_padded, n_root = padded, len(own)
        else:
            inner_padded += padded
            n_inner += len(own)
    total, n_flat = root_padded + inner_padded, n_root + n_inner
    if world == 1:  # nothing to gather or reduce, and no consistency check: no collective at all
        none = {"calls": 0, "numel": 0, "bytes": 0}
        return {k: dict(none) for k in ("all_gather", "reduce_scatter", "all_reduce")} | {
            "padded_total": total,
            "padded_root": root_padded,
            "flat_params": n_flat,
        }
    check = {"calls": 1, "numel": 2 * n_flat, "bytes": 8 * n_flat}
    gathers = {"FULL_SHARD": (root_padded + 2 * inner_padded, n_root + 2 * n_inner)}
    gathers["SHARD_GRAD_OP"] = (total, n_flat)
    if strategy == "NO_SHARD":
        # each bucket carries one extra fp32 element, its missing-gradient flag
        flags = n_buckets
        return {
            "all_gather": {"calls": 0, "numel": 0, "bytes": 0},
            "reduce_scatter": {"calls": 0, "numel": 0, "bytes": 0},
            "all_reduce": {
                "calls": n_buckets + 1,
                "numel": total + flags + 2 * n_flat,
                "bytes": 4 * (total + flags) + 8 * n_flat,
            },
            "padded_total": total,
            "padded_root": root_padded,
            "flat_params": n_flat,
            "buckets": n_buckets,
        }
    ag_numel, ag_calls = gathers[strategy]
    return {
        "all_gather": {"calls": ag_calls, "numel": ag_numel, "bytes": wire * ag_numel},
        "reduce_scatter": {"numel": total, "bytes": wire * total},
        "reduce_scatter_calls_max": n_flat,
        "all_reduce": check,
        "padded_total": total,
        "padded_root": root_padded,
        "flat_params": n_flat,
    }


def comm_report(v: Variant, stats: dict[str, Any], n_params: int, world: int) -> dict[str, Any]:
    assert v.strategy is not None
    wire = 2 if v.dtype == "bf16" else 4
    counted = {k: {kk: stats[k][kk] for kk in ("calls", "numel", "bytes", "dtypes")} for k in stats}
    # NO_SHARD's bucket count is learned in the first backward: take it from the calls (minus the check)
    exp = expected_comm(v.model, v.strategy, wire, world, n_buckets=counted["all_reduce"]["calls"] - 1)
    matches = all(counted[k][kk] == exp[k][kk] for k in exp if isinstance(exp[k], dict) for kk in exp[k])
    if "reduce_scatter_calls_max" in exp:
        matches = matches and 1 <= counted["reduce_scatter"]["calls"] <= exp["reduce_scatter_calls_max"]
    f = (world - 1) / world
    if v.strategy == "NO_SHARD":
        # a ring all-reduce sends 2f of the tensor; the consistency check's few bytes left out
        moved = 2 * f * (counted["all_reduce"]["bytes"] - 8 * exp["flat_params"])
        formula = 2 * f * n_params * 4  # reduction in fp32 (see docs/api.md)
    else:
        # an all-gather or reduce-scatter of a full tensor of S bytes sends f*S per rank (ring)
        moved = f * (counted["all_gather"]["bytes"] + counted["reduce_scatter"]["bytes"])
        gathers = 2 if v.strategy == "FULL_SHARD" else 1
        formula = f * n_params * (gathers * wire + wire)
    return {
        "counted": counted,
        "expected_from_padded_flat_sizes": exp,
        "counted_matches_expected": bool(matches),
        "sent_per_rank_bytes": round(moved),
        "formula_bytes": round(formula),
        "sent_over_formula": moved / formula if formula else None,
    }


# ------------------------------------------------------------------------------------------ one size
def run_size(size: str, args: argparse.Namespace, device: torch.device, cuda: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    n_layer, n_embd, n_head = SIZES[size]
    phases: dict[str, float] = {}
    t_phase = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t_phase
        now = time.perf_counter()
        phases[name] = now - t_phase
        t_phase = now

    torch.manual_seed(args.seed)
    base = GPT(args.vocab, args.block_size, n_layer, n_embd, n_head, 0.0).to(device)
    n_params = sum(p.numel() for p in base.parameters())
    build = builders(device, cuda, args.fairscale)
    dropped: dict[str, str] = {}  # optional peer -> why it was left out

    def drop(name: str, e: Exception) -> None:
        if name not in OPTIONAL:
            raise e
        dropped[name] = f"{type(e).__name__}: {e}"
        if rank == 0:
            print(f"[{size}] {name} left out: {dropped[name]}", flush=True)

    variants: dict[str, Variant] = {}
    for name, b in build.items():
        try:
            variants[name] = b(base)
        except Exception as e:  # an optional peer's failure is reported, not fatal
            drop(name, e)
    phase("build")
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # per-rank batches, the same for every variant

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(args.vocab, (args.batch_size, args.block_size + 1), generator=gen)
        return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)

    # ---- warm-up (lazy initialization, DDP's bucket rebuild); the first step's losses show that all
    # variants start from the same weights
    first_loss: dict[str, float] = {}
    for w in range(args.warmup):
        x, y = batch()
        for v in list(variants.values()):
            try:
                loss = train_step(v, x, y)
                sync(device)
            except Exception as e:
                drop(v.name, e)
                del variants[v.name]
                continue
            if w == 0:
                first_loss[v.name] = float(loss)
    names = list(variants)
    phase("warmup")

    # ---- interleaved timed rounds; round 0 also counts our collectives (outside the timed window)
    last_loss: dict[str, float] = {}
    comm: dict[str, Any] = {}
    for r in range(args.rounds):
        x, y = batch()
        for name in names[r % len(names) :] + names[: r % len(names)]:
            v = variants[name]
            if v.ours and r == 0:
                v.model.reset_comm_stats()  # type: ignore[operator]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                loss = train_step(v, x, y)
                sync(device)
            except Exception as e:
                drop(name, e)
                del variants[name]
                continue
            v.times.append(time.perf_counter() - t0)
            v.cpu.append(time.process_time() - c0)
            last_loss[name] = float(loss)
            if v.ours and r == 0:
                comm[name] = comm_report(v, v.model.comm_stats(), n_params, world)  # type: ignore[operator]
        names = [n for n in names if n in variants]
        if rank == 0:
            print(f"[{size}] round {r + 1}/{args.rounds}", flush=True)

    phase("rounds")

    # ---- memory: one step per variant, alone under the tracker
    x, y = batch()
    memory: dict[str, Any] = {}
    for name in list(names):
        try:
            memory[name] = tracked_step(variants[name], x, y, device)
        except Exception as e:
            drop(name, e)
            del variants[name]
    names = [n for n in names if n in variants]
    phase("memory")

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, ({n: (v.times, v.cpu) for n, v in variants.items()}, memory))
    # a step's time is the slower rank's; its CPU time the sum over the ranks (all threads)
    slowest = {n: [max(g[0][n][0][r] for g in gathered) for r in range(args.rounds)] for n in names}
    cpu = {n: [sum(g[0][n][1][r] for g in gathered) for r in range(args.rounds)] for n in names}
    ratios: dict[str, Any] = {}
    for num, den in RATIOS:
        if num in slowest and den in slowest:
            per_round = [a / b for a, b in zip(slowest[num], slowest[den])]
            q = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else [per_round[0]] * 3
            cpu_round = [a / b for a, b in zip(cpu[num], cpu[den])]
            target = time_target(num, den, size, cuda)
            med = statistics.median(per_round)
            ratios[f"{num}/{den}"] = {
                "median": med,
                "q1": q[0],
                "q3": q[2],
                "per_round": per_round,
                "cpu_median": statistics.median(cpu_round),
                "cpu_per_round": cpu_round,
                "target_max": target,
                "met": None if target is None else med <= target,
            }
    mem = {
        n: {
            "tracked_peak_bytes_per_rank": [g[1][n]["tracked_peak_bytes"] for g in gathered],
            "rss_peak_kib_per_rank": [g[1][n]["rss_peak_kib"] for g in gathered],
            "rss_before_kib_per_rank": [g[1][n]["rss_before_kib"] for g in gathered],
            "tracked_before_step_bytes_per_rank": [g[1][n]["tracked_before_step_bytes"] for g in gathered],
            "tracked_peak_breakdown_rank0": gathered[0][1][n]["tracked_peak_breakdown"],
        }
        for n in names
    }

    # ---- CUDA: each variant rebuilt alone, peak max_memory_allocated over one step
    if cuda:
        for v in variants.values():
            v.optim.state.clear()
        del variants, v, loss
        gc.collect()
        for name in names:
            try:
                mem[name]["cuda_peak_bytes"] = cuda_isolated_peak(build[name], base, (x, y), args.warmup)
            except Exception as e:
                if name not in OPTIONAL:
                    raise
                mem[name]["cuda_peak_error"] = f"{type(e).__name__}: {e}"  # its timings stand
    else:
        del variants
        gc.collect()

    fp32 = [n for n in names if n in first_loss and not n.endswith("bf16")]
    return {
        "size": size,
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": n_head,
        "params": n_params,
        "variants": names,
        "left_out": dropped,
        "median_step_ms": {n: 1000 * statistics.median(t) for n, t in slowest.items()},
        "per_round_step_s": slowest,
        "median_cpu_ms": {n: 1000 * statistics.median(t) for n, t in cpu.items()},
        "per_round_cpu_s": cpu,
        "ratios": ratios,
        "memory": mem,
        "comm": comm,
        "first_step_loss_rank0": first_loss,
        "first_step_loss_max_diff_fp32": max(first_loss[n] for n in fp32) - min(first_loss[n] for n in fp32),
        "last_step_loss_rank0": last_loss,
        "phase_s_rank0": phases,
    }


# ------------------------------------------------------------------------------------------ report
def library_version() -> str:
    """The commit of this checkout, and whether fsdp/ differs from it (the code measured)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "fsdp"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes under fsdp/" if dirty else "")


def mib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f}"


def markdown(result: dict[str, Any]) -> str:
    cuda = result["cuda"]
    lines = [
        f"# Peers benchmark: {result['date']}, {result['machine']}",
        "",
        f"Library at {result['library']}. World size {result['world_size']}, backend {result['backend']}, "
        f"torch {result['torch']}, "
        f"{result['config']['batch_size']} x {result['config']['block_size']} tokens per rank and step, "
        f"{result['config']['rounds']} interleaved rounds after {result['config']['warmup']} warm-up steps. "
        "Step time: the slower rank's wall clock. Ratios: median over rounds of the ratio within a round; "
        "the CPU-time ratio compares process CPU time (all threads, both ranks summed) the same way.",
        "",
    ]
    for s in result["sizes"]:
        lines += [
            f"## {s['size']}: {s['params']:,} parameters ({s['n_layer']} layers x {s['n_embd']} wide, "
            f"{s['n_head']} heads)",
            "",
            "| step time A/B | median of per-round ratios | quartiles | target | met | CPU-time ratio |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for key, r in s["ratios"].items():
            target = "-" if r["target_max"] is None else f"<= {r['target_max']}"
            met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
            lines.append(
                f"| {key} | {r['median']:.3f} | {r['q1']:.3f}-{r['q3']:.3f} | {target} | {met} | "
                f"{r['cpu_median']:.3f} |"
            )
        cuda_col = " peak CUDA MiB (alone) |" if cuda else ""
        lines += [
            "",
            "| variant | median step ms | / ddp | CPU ms per step (ranks summed) | "
            "peak tracked MiB per rank | "
            f"tracked before step MiB | RSS MiB before step -> peak (whole process) |{cuda_col}",
            "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if cuda else ""),
        ]
        for n in s["variants"]:
            m = s["memory"][n]
            paired = [a / b for a, b in zip(s["per_round_step_s"][n], s["per_round_step_s"]["ddp"])]
            vs_ddp = statistics.median(paired)
            peaks = m["rss_peak_kib_per_rank"]
            befores = m["rss_before_kib_per_rank"]
            worst = max(range(len(peaks)), key=lambda i: peaks[i] or 0)  # the rank with the higher peak
            rss = (
                f"{mib(befores[worst] * 1024)} -> {mib(peaks[worst] * 1024)}"
                if peaks[worst] is not None and befores[worst] is not None
                else "-"
            )
            row = (
                f"| {n} | {s['median_step_ms'][n]:,.1f} | {vs_ddp:.3f} | {s['median_cpu_ms'][n]:,.0f} | "
                f"{mib(max(m['tracked_peak_bytes_per_rank']))} | "
                f"{mib(max(m['tracked_before_step_bytes_per_rank']))} | "
                f"{rss} |"
            )
            if cuda:
                row += f" {mib(m.get('cuda_peak_bytes'))} |"
            lines.append(row)
        lines += [
            "",
            "| ours: bytes per step per rank | flat params | all-gather calls / numel | "
            "reduce-scatter calls / numel | "
            "all-reduce calls / numel | counted = padded flat sizes | sent (f x counted) | formula | "
            "sent / formula |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for n, c in s["comm"].items():
            k = c["counted"]
            flat = c["expected_from_padded_flat_sizes"]["flat_params"]
            over = "-" if c["sent_over_formula"] is None else f"{c['sent_over_formula']:.4f}"
            lines.append(
                f"| {n} | {flat} | {k['all_gather']['calls']} / {k['all_gather']['numel']:,} | "
                f"{k['reduce_scatter']['calls']} / {k['reduce_scatter']['numel']:,} | "
                f"{k['all_reduce']['calls']} / {k['all_reduce']['numel']:,} | "
                f"{'exact' if c['counted_matches_expected'] else '**differs**'} | "
                f"{c['sent_per_rank_bytes']:,} | {c['formula_bytes']:,} | {over} |"
            )
        lines.append("")
        for n, why in s.get("left_out", {}).items():
            lines += [f"Left out: {n} ({why}).", ""]
        ours = max(s["memory"]["ours_full"]["tracked_peak_bytes_per_rank"])
        theirs = max(s["memory"]["fsdp2"]["tracked_peak_bytes_per_rank"])
        verdict = (
            ("met" if ours <= theirs else "**not met**") if s["size"] == "35M" else "no target at this size"
        )
        lines += [
            f"Peak tracked memory per rank, ours_full / fsdp2: {mib(ours)} / {mib(theirs)} MiB = "
            f"{ours / theirs:.3f} (target at 35M: at most 1; {verdict}).",
            "",
        ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    keys = list(dict.fromkeys(k for s in sizes for k in s["ratios"]))  # a left-out peer: no bar
    width = 0.8 / len(sizes)
    for i, s in enumerate(sizes):
        present = [(j, k) for j, k in enumerate(keys) if k in s["ratios"]]
        xs = [j + i * width for j, _ in present]
        med = [s["ratios"][k]["median"] for _, k in present]
        iqr = [
            [m - s["ratios"][k]["q1"] for m, (_, k) in zip(med, present)],
            [s["ratios"][k]["q3"] - m for m, (_, k) in zip(med, present)],
        ]
        ax1.bar(xs, med, width, yerr=iqr, capsize=2, label=s["size"])
        for xpos, (_, k) in zip(xs, present):
            t = s["ratios"][k]["target_max"]
            if t is not None:
                ax1.plot([xpos - width / 2, xpos + width / 2], [t, t], color="k", lw=2)
    ax1.axhline(1.0, color="0.5", lw=0.8, ls="--")
    ax1.set_xticks([k + width * (len(sizes) - 1) / 2 for k in range(len(keys))])
    ax1.set_xticklabels(keys, rotation=45, ha="right", fontsize=8)
    ax1.set_ylabel("median paired step-time ratio")
    ax1.set_title("step-time ratios, median and quartiles (black bars: targets)")
    ax1.legend()
    names = list(dict.fromkeys(n for s in sizes for n in s["variants"]))
    for i, s in enumerate(sizes):
        here = [(j, n) for j, n in enumerate(names) if n in s["memory"]]
        ax2.bar(
            [j + i * width for j, _ in here],
            [max(s["memory"][n]["tracked_peak_bytes_per_rank"]) / 2**20 for _, n in here],
            width,
            label=s["size"],
        )
    ax2.set_xticks([k + width * (len(sizes) - 1) / 2 for k in range(len(names))])
    ax2.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    ax2.set_ylabel("MiB")
    ax2.set_title("peak tracked tensor memory per rank (one step, MemTracker)")
    ax2.legend()
    fig.suptitle(f"benchmarks/peers.py, {result['machine']}, world size {result['world_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:  # plain `python -m benchmarks.peers`: one rank
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown sizes {unknown}; choose from {list(SIZES)}")
    if args.batch_size is None:
        args.batch_size = CUDA_BATCH if cuda else CPU_BATCH
    if args.rounds < 1 or args.warmup < 1:
        raise SystemExit("--rounds and --warmup must be at least 1")
    t0 = time.perf_counter()
    results = [run_size(s, args, device, cuda) for s in sizes]
    if dist.get_rank() == 0:
        machine = (
            f"{torch.cuda.get_device_name(device)}, nccl"
            if cuda
            else f"{os.cpu_count()} vCPU {platform.machine()}, gloo, torch {torch.__version__}"
        )
        result = {
            "date": datetime.date.today().isoformat(),
            "machine": machine,
            "cuda": cuda,
            "backend": dist.get_backend(),
            "torch": torch.__version__,
            "library": library_version(),
            "world_size": world,
            "threads_per_rank": torch.get_num_threads(),
            "config": vars(args),
            "wall_s": time.perf_counter() - t0,
            "sizes": results,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "peers.json").write_text(json.dumps(result, indent=1))
        table = markdown(result)
        (out / "peers.md").write_text(table)
        if not args.no_plot:
            plot(result, out / "peers.png")
        print(table)
        print(
            f"wrote {out / 'peers.json'}, {out / 'peers.md'}"
            + ("" if args.no_plot else f", {out / 'peers.png'}")
        )
        print(f"wall time {result['wall_s']:.0f} s")
    dist.barrier()  # all ranks are done with their collectives
    time.sleep(0.1)  # let gloo release them before teardown (see getting-started.md, "Finishing")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
