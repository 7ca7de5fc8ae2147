"""Simulate FSDP at 8 to 1024 ranks in one process: per-rank memory of a multi-billion GPT, host bookkeeping.

    python -m benchmarks.simulate_scale [--out out/simulate_scale.json] [--model 3b|7b] [--quick]

torch's fake process group (backend "fake", ``FakeStore``) pretends to be rank 0 of N ranks: every
collective returns at once without communicating (all-gather repeats the local shard N times,
reduce-scatter keeps the local chunk unsummed, all-reduce does nothing). Numerics are therefore
meaningless; what is real is every tensor this rank allocates and every line of host code FSDP runs.
Three measurements, each world in turn initialized and destroyed:

1. **Memory at scale.** A GPT-style model of several billion parameters (the example's ``GPT``, built
   on the meta device, so it costs nothing) is wrapped one FSDP unit per transformer block plus the
   root, with deferred initialization: each unit materializes its own parameters (``param_init_fn``),
   flattens and shards them and drops the full tensors before the next unit is built, so the full
   model never exists. For each world size N it reports the per-rank flat-shard bytes (summed over
   ``model.parameters()``), the gradient and AdamW state bytes a step gives (fp32 grads: the shard
   size; exp_avg + exp_avg_sq: twice it), their sum against ``P x (4 + 4 + 8) / N`` (the padding
   excess is below 16 bytes per unit), the largest unsharded unit, the peak of live tensor bytes
   while wrapping (MemTracker) and the wrap time.
2. **A real training step** (forward, backward, AdamW) at ``--step-world-sizes``: gradients and
   optimizer state are measured after it, not computed, with the peak of live tensor bytes during
   the step. By default the step runs on the first ``--step-layers`` blocks of the same model (same
   width, same units), because a step over every block takes minutes on a 2-core machine;
   ``--step-layers 0`` steps the whole model.
3. **Host bookkeeping per unit.** A tiny-width GPT with 8, 32, 128, 512 blocks (one unit each, plus
   the root) at world size 8: forward + backward of one tiny batch (and freeing its graph),
   interleaved round by round with the same model unwrapped; the median paired difference divided
   by the number of units, and the slope of a line fitted over the unit counts, are the host time
   FSDP adds per unit and step.

``--quick`` runs a tiny model at world sizes 2 and 8 (the unit test calls ``main``). Writes JSON to
``--out`` and prints tables.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from examples.gpt import GPT
from fsdp import FullyShardedDataParallel as FSDP
from fsdp import get_fsdp_instances
from fsdp.core.sharding import chunk_numel, padded_numel

FP32 = 4  # bytes per element of parameters and gradients (fp32 training)
ADAM = 8  # bytes per parameter of AdamW state: exp_avg + exp_avg_sq in fp32


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    block_size: int


MODELS = {
    # about 3.05B parameters: one block is 113M (453 MB in fp32), the root (embeddings, head) 105M
    "3b": GPTConfig(n_layer=26, n_embd=3072, n_head=24, vocab=32000, block_size=2048),
    # about 6.6B parameters: one block is 201M (805 MB in fp32)
    "7b": GPTConfig(n_layer=32, n_embd=4096, n_head=32, vocab=32000, block_size=2048),
    "quick": GPTConfig(n_layer=3, n_embd=36, n_head=4, vocab=97, block_size=16),  # sizes that need padding,
}


# ------------------------------------------------------------------------------------------ worlds
_old_worlds: list[Any] = []  # destroyed default groups, kept alive so that no new one reuses their id()
_old_groups: list[Any] = []  # groups FSDP used in destroyed worlds
_groups: list[Any] = []  # groups FSDP uses in the current world


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """Be rank 0 of ``world_size`` ranks on the fake process group; destroy the group on exit.

    FSDP caches its extra groups (``fsdp.comm.collectives._group_cache`` / ``_hybrid_cache``) keyed by
    ``id(dist.group.WORLD)``, so every new world gets new groups; the old world objects are kept
    alive here so that CPython cannot hand a new world the id of a destroyed one.
    """
    if dist.is_initialized():
        raise RuntimeError("simulate_scale: a default process group already exists; run in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        _old_worlds.append(dist.group.WORLD)
        _old_groups.extend(_groups)
        _groups.clear()
        dist.destroy_process_group()


def check_groups(root: FSDP, world_size: int) -> None:
    """Every wrapper communicates over groups of this world (a stale cached group would not match)."""
    world = dist.group.WORLD
    for w in get_fsdp_instances(root):
        comm = w.fsdp_config.comm
        assert comm.process_group is world, "a wrapper shards over a group of another world"
        rs = comm.process_group_reduce_scatter
        assert dist.get_world_size(rs) == world_size, (
            f"reduce-scatter group has {dist.get_world_size(rs)} ranks"
        )
        assert not any(rs is g for g in _old_groups), "a cached group of a destroyed world was reused"
        _groups.append(rs)


# ------------------------------------------------------------------------------------------ models
def param_init(kind: str) -> Callable[[nn.Module], None]:
    """The ``param_init_fn`` of deferred init. ``empty`` keeps what ``to_empty`` allocated (values
    undefined, no write pass: the memory sweep only counts bytes); ``zero`` / ``normal`` fill."""

    def init(module: nn.Module) -> None:
        if kind == "empty":
            return
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                if kind == "zero" or p.dim() == 1:
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)

    return init


def meta_gpt(cfg: GPTConfig, n_layer: int | None = None) -> nn.Module:
    with torch.device("meta"):
        return GPT(
            cfg.vocab, cfg.block_size, n_layer if n_layer else cfg.n_layer, cfg.n_embd, cfg.n_head, 0.0
        )


def unit_numels(model: nn.Module) -> list[int]:
    """Parameters of each FSDP unit of ``wrap_gpt``: every block, then the root (tied weights once)."""
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]  # type: ignore[union-attr]
    total = sum(p.numel() for p in model.parameters())
    return [*blocks, total - sum(blocks)]


def wrap_gpt(model: nn.Module, init: Callable[[nn.Module], None] | None) -> FSDP:
    """One unit per transformer block, the root owns the rest; deferred init when on the meta device."""
    # on the CPU even where CUDA is present: the fake group moves nothing, and the accounting
    # (and the inputs of the timed steps) are host memory
    kwargs: dict[str, Any] = {"compute_device": torch.device("cpu")}
    if init is not None:
        kwargs["param_init_fn"] = init
    for i, block in enumerate(model.blocks):  # type: ignore[arg-type]
        model.blocks[i] = FSDP(block, **kwargs)  # type: ignore[index, operator]
    return FSDP(model, **kwargs)


# ------------------------------------------------------------------------------------------ accounting
def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def expected(numels: list[int], world_size: int) -> dict[str, int]:
    """What one rank should hold: shard sizes from the padding rule, the formula, the largest unit."""
    params = sum(chunk_numel(n, world_size) for n in numels) * FP32
    return {
        "num_params": sum(numels),
        "units": len(numels),
        "param_bytes": params,
        "grad_bytes": params,
        "optim_bytes": params // FP32 * ADAM,
        "formula_bytes": sum(numels) * (FP32 + FP32 + ADAM) // world_size,  # P x 16 / N
        "padding_bound_bytes": len(numels) * (FP32 + FP32 + ADAM),  # < 1 element per unit and rank
        "largest_unit_bytes": max(padded_numel(n, world_size) for n in numels) * FP32,
        "largest_block_bytes": max(padded_numel(n, world_size) for n in numels[:-1]) * FP32,
        "root_unit_bytes": padded_numel(numels[-1], world_size) * FP32,
    }


class Tracker:
    """Peak of live tensor bytes on the CPU (torch's MemTracker: a dispatch mode over storages)."""

    def __init__(self, *external: Any) -> None:
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable", category=UserWarning)
        self.mt = MemTracker()
        if external:
            self.mt.track_external(*external)
        self.peak = 0
        self.breakdown: dict[str, int] = {}

    def __enter__(self) -> Tracker:
        self.mt.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mt.__exit__(*exc)
        snap = self.mt.get_tracker_snapshot("peak")
        cpu = [v for d, v in snap.items() if torch.device(d).type == "cpu"]
        # at the peak, by MemTracker's category: full parameters gathered in forward count as
        # activations; those re-gathered and the gradients made in backward as temporaries
        self.breakdown = {str(getattr(k, "value", k)): int(b) for k, b in cpu[0].items()} if cpu else {}
        self.peak = self.breakdown.get("Total", 0)


def rss_bytes(field: str = "VmRSS") -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------ 1. memory
def memory_at(cfg: GPTConfig, world_size: int, init: str) -> dict[str, Any]:
    """Wrap the whole model at ``world_size`` (deferred init) and count what rank 0 holds."""
    model = meta_gpt(cfg)
    numels = unit_numels(model)
    exp = expected(numels, world_size)
    gc.collect()
    t0 = time.perf_counter()
    with Tracker() as tracker:
        root = wrap_gpt(model, param_init(init))
    wrap_s = time.perf_counter() - t0
    check_groups(root, world_size)
    params = list(root.parameters())
    param_bytes = tensor_bytes(params)
    storage_bytes = sum(p.untyped_storage().nbytes() for p in params)  # no full buffer hides behind a view
    row = {
        "world_size": world_size,
        **exp,
        "measured_param_bytes": param_bytes,
        "param_storage_bytes": storage_bytes,
        "total_bytes": param_bytes + exp["grad_bytes"] + exp["optim_bytes"],
        "wrap_peak_tracked_bytes": tracker.peak,
        "wrap_seconds": wrap_s,
        "rss_after_wrap_bytes": rss_bytes(),
    }
    assert param_bytes == exp["param_bytes"], (param_bytes, exp["param_bytes"])
    del root, params, model
    gc.collect()
    return row


# ------------------------------------------------------------------------------------------ 2. step
def step_at(cfg: GPTConfig, world_size: int, n_layer: int, tokens: int) -> dict[str, Any]:
    """One real AdamW training step of the first ``n_layer`` blocks (0: all) at ``world_size``."""
    model = meta_gpt(cfg, n_layer or None)
    numels = unit_numels(model)
    exp = expected(numels, world_size)
    root = wrap_gpt(model, param_init("normal"))
    check_groups(root, world_size)
    optim = torch.optim.AdamW(root.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab, (1, tokens), generator=gen)
    gc.collect()
    before = tensor_bytes(root.parameters())
    hwm_ok = reset_peak_rss()
    with Tracker(root, optim) as tracker:
        t0 = time.perf_counter()
        _, loss = root(x, x)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optim.step()
        t3 = time.perf_counter()
    times = {"forward_s": t1 - t0, "backward_s": t2 - t1, "optim_s": t3 - t2}
    params = list(root.parameters())
    grads = [p.grad for p in params]
    assert all(g is not None and g.shape == p.shape for g, p in zip(grads, params)), (
        "gradients are not shards"
    )
    moments = [s[k] for s in optim.state.values() for k in ("exp_avg", "exp_avg_sq")]
    steps = [s["step"] for s in optim.state.values() if torch.is_tensor(s.get("step"))]
    measured = {
        "param_bytes": tensor_bytes(params),
        "grad_bytes": tensor_bytes(grads),
        "optim_bytes": tensor_bytes(moments),
        "optim_step_scalar_bytes": tensor_bytes(steps),
    }
    comm = root.comm_stats()
    row = {
        "world_size": world_size,
        "n_layer": n_layer or cfg.n_layer,
        "tokens": tokens,
        **exp,
        **{f"measured_{k}": v for k, v in measured.items()},
        "total_bytes": measured["param_bytes"] + measured["grad_bytes"] + measured["optim_bytes"],
        "params_before_step_bytes": before,
        "peak_tracked_bytes": tracker.peak,
        "peak_tracked_breakdown": tracker.breakdown,
        # the model: model states plus the largest unit, twice that with one unit prefetched
        "expected_peak_bytes": exp["formula_bytes"] + 2 * exp["largest_unit_bytes"],
        "peak_rss_bytes": rss_bytes("VmHWM") if hwm_ok else None,
        "calls": {k: v["calls"] for k, v in comm.items()},
        **times,
    }
    del root, optim, params, grads, moments, loss
    gc.collect()
    return row


# ------------------------------------------------------------------------------------------ 3. bookkeeping
def bookkeeping(
    units: list[int], world_size: int, width: int, tokens: int, rounds: int, warmup: int
) -> list[dict[str, Any]]:
    """Host time of forward + backward per wrapped unit: FSDP minus the same model unwrapped."""
    vocab, heads = 64, 2
    variants: dict[int, tuple[nn.Module, FSDP]] = {}
    with fake_world(world_size):
        for n in units:
            torch.manual_seed(0)
            plain = GPT(vocab, tokens, n, width, heads, 0.0)
            wrapped = wrap_gpt(copy.deepcopy(plain), None)
            check_groups(wrapped, world_size)
            variants[n] = (plain, wrapped)
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, vocab, (1, tokens), generator=gen)
        times: dict[tuple[int, str], list[float]] = {(n, v): [] for n in units for v in ("plain", "fsdp")}
        calls: dict[int, dict[str, int]] = {}
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a collection inside one timed step would dwarf a millisecond per unit
        try:
            for r in range(warmup + rounds):
                for n, (plain, wrapped) in variants.items():
                    order = [("plain", plain), ("fsdp", wrapped)]
                    for name, model in order if r % 2 else order[::-1]:  # A B, B A, ...
                        if name == "fsdp":
                            wrapped.reset_comm_stats()
                        t0 = time.perf_counter()
                        logits, loss = model(x, x)
                        loss.backward()
                        # freeing the graph is part of the step (a training loop drops it each
                        # step); left to the next assignment it would land in another variant's time
                        del logits, loss
                        dt = time.perf_counter() - t0
                        model.zero_grad(set_to_none=True)
                        if r >= warmup:
                            times[(n, name)].append(dt)
                    calls[n] = {k: v["calls"] for k, v in wrapped.comm_stats().items()}
        finally:
            if gc_was_enabled:
                gc.enable()
        rows = []
        for n in units:
            plain_t, fsdp_t = times[(n, "plain")], times[(n, "fsdp")]
            diff = statistics.median(f - p for f, p in zip(fsdp_t, plain_t))
            n_units = len(get_fsdp_instances(variants[n][1]))
            rows.append(
                {
                    "blocks": n,
                    "units": n_units,
                    "params": sum(p.numel() for p in variants[n][0].parameters()),
                    "plain_s": statistics.median(plain_t),
                    "fsdp_s": statistics.median(fsdp_t),
                    "overhead_s": diff,
                    "overhead_per_unit_ms": diff / n_units * 1e3,
                    "calls": calls[n],
                }
            )
        del variants
    return rows


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: (a, b). With one point, the line through the origin."""
    if len(xs) < 2:
        return 0.0, ys[0] / xs[0]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


# ------------------------------------------------------------------------------------------ report
def _mib(b: int | float | None) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    if b is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:.3g} {unit}" if abs(b) < 100 * size else f"{b / size:.0f} {unit}"
    return f"{b:.0f} B"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def tables(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"## Per-rank memory, {_count(cfg['num_params'])}-parameter GPT "
        f"(n_layer={cfg['n_layer']}, n_embd={cfg['n_embd']}, vocab={cfg['vocab']}), "
        f"{cfg['units']} units, fp32 + AdamW",
        "",
        "| N | params/rank | grads/rank | AdamW/rank | total/rank | P x 16 / N | excess (bound) "
        "| largest unit | wrap peak (tracked) | wrap s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["memory"]:
        lines.append(
            f"| {r['world_size']} | {_mib(r['measured_param_bytes'])} | {_mib(r['grad_bytes'])} "
            f"| {_mib(r['optim_bytes'])} | {_mib(r['total_bytes'])} | {_mib(r['formula_bytes'])} "
            f"| {r['total_bytes'] - r['formula_bytes']} B ({r['padding_bound_bytes']} B) "
            f"| {_mib(r['largest_unit_bytes'])} | {_mib(r['wrap_peak_tracked_bytes'])} | {r['wrap_seconds']:.1f} |"
        )
    lines += [
        "",
        "## One real training step (measured after forward, backward, AdamW)",
        "",
        "| N | blocks | P | params | grads | AdamW | total | P x 16 / N | 16P/N + 2 units | peak tracked "
        "| peak RSS | fwd s | bwd s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["steps"]:
        lines.append(
            f"| {s['world_size']} | {s['n_layer']} | {_count(s['num_params'])} "
            f"| {_mib(s['measured_param_bytes'])} | {_mib(s['measured_grad_bytes'])} "
            f"| {_mib(s['measured_optim_bytes'])} | {_mib(s['total_bytes'])} | {_mib(s['formula_bytes'])} "
            f"| {_mib(s['expected_peak_bytes'])} | {_mib(s['peak_tracked_bytes'])} | {_mib(s['peak_rss_bytes'])} "
            f"| {s['forward_s']:.1f} | {s['backward_s']:.1f} |"
        )
    bk = result.get("bookkeeping")
    if bk is None:
        return "\n".join(lines)
    lines += [
        "",
        f"## Host time per step vs wrapped units (world size {bk['world_size']}, n_embd={bk['width']}, "
        f"{bk['tokens']} tokens, median of {bk['rounds']} interleaved rounds)",
        "",
        "| blocks | units | unwrapped ms | FSDP ms | FSDP - unwrapped ms | per unit ms | all-gathers | reduce-scatters |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in bk["rows"]:
        lines.append(
            f"| {r['blocks']} | {r['units']} | {r['plain_s'] * 1e3:.1f} | {r['fsdp_s'] * 1e3:.1f} "
            f"| {r['overhead_s'] * 1e3:.1f} | {r['overhead_per_unit_ms']:.3f} "
            f"| {r['calls'].get('all_gather', 0)} | {r['calls'].get('reduce_scatter', 0)} |"
        )
    fit = bk["fit"]
    lines += [
        "",
        f"Least-squares fit over the rows: FSDP adds {fit['per_unit_ms']:.3f} ms per unit and step "
        f"plus {fit['fixed_ms']:.1f} ms per step.",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", choices=[k for k in MODELS if k != "quick"], default="3b")
    p.add_argument("--world-sizes", type=str, default="8,16,64,256,1024")
    p.add_argument("--step-world-sizes", type=str, default="8,1024", help="world sizes that run a real step")
    p.add_argument(
        "--step-layers", type=int, default=2, help="blocks of the model that the real step runs (0: all)"
    )
    p.add_argument("--step-tokens", type=int, default=8, help="tokens of the one-sequence step batch")
    p.add_argument("--init", choices=["empty", "zero", "normal"], default="empty", help="param_init_fn")
    p.add_argument("--units", type=str, default="8,32,128,512", help="blocks of the bookkeeping model")
    p.add_argument("--bookkeeping-world-size", type=int, default=8)
    p.add_argument("--bookkeeping-width", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help="a tiny model at world sizes 2 and 8 (the unit test)")
    p.add_argument("--out", type=str, default="out/simulate_scale.json")
    args = p.parse_args(argv)
    if args.quick:
        args.model = "quick"
        args.world_sizes = args.step_world_sizes = "2,8"
        args.step_layers = 0
        args.units = "2,4"
        args.rounds, args.warmup = 2, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = MODELS[args.model]
    sizes = [int(s) for s in args.world_sizes.split(",") if s]
    step_sizes = [int(s) for s in args.step_world_sizes.split(",") if s]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    numels = unit_numels(meta_gpt(cfg))
    result: dict[str, Any] = {
        "config": {
            **asdict(cfg),
            "model": args.model,
            "num_params": sum(numels),
            "units": len(numels),
            "init": args.init,
            "threads": args.threads,
        },
        "memory": [],
        "steps": [],
    }
    try:
        for n in sizes:
            with fake_world(n):
                row = memory_at(cfg, n, args.init)
            result["memory"].append(row)
            print(
                f"N={n}: {_mib(row['measured_param_bytes'])} of parameters per rank, "
                f"wrapped in {row['wrap_seconds']:.1f} s",
                flush=True,
            )
        for n in step_sizes:
            with fake_world(n):
                s = step_at(cfg, n, args.step_layers, args.step_tokens)
            result["steps"].append(s)
            print(f"N={n}: step of {s['n_layer']} blocks, peak {_mib(s['peak_tracked_bytes'])}", flush=True)
        units = [int(u) for u in args.units.split(",") if u]
        if units:  # --units "" skips the host-time section
            rows = bookkeeping(
                units,
                args.bookkeeping_world_size,
                args.bookkeeping_width,
                8,
                args.rounds,
                args.warmup,
            )
            fixed, per_unit = linear_fit([r["units"] for r in rows], [r["overhead_s"] for r in rows])
            result["bookkeeping"] = {
                "world_size": args.bookkeeping_world_size,
                "width": args.bookkeeping_width,
                "tokens": 8,
                "rounds": args.rounds,
                "rows": rows,
                "fit": {"per_unit_ms": per_unit * 1e3, "fixed_ms": fixed * 1e3},
            }
    finally:
        torch.set_num_threads(threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(tables(result))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
