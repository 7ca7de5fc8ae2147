"""What the cross-rank handshakes cost a training step of the example's GPT (see [Note: agreement
before communication] in fsdp/comm/consistency.py).

    torchrun --standalone --nproc_per_node=2 -m benchmarks.agreement [--size 35M] [--rounds 12] \
        [--out out/agreement]

Each forward and each backward of the root starts with one handshake, each wrapped unit's forward
with one more, and the root's forward ends with one (clip_grad_norm_() adds one more). Measured two
ways, in the same rank processes:

- **Paired steps.** One model (one FSDP unit per transformer block), trained with AdamW; every round
  runs one step with the handshakes and one without (every handshake of a step replaced by a no-op),
  in alternating order, each between barriers. A round's ratio is its two step times (the slower
  rank's, which the barriers make every rank's); the report gives the median and quartiles. On a
  shared machine the step times drift by more than the handshakes cost, so this ratio bounds the cost
  rather than measures it.
- **Inside the steps.** The time each step with handshakes spent inside them, waiting for the
  other rank included: removing them saves at most that (a rank that arrives first would wait at the
  next collective instead), so its median share of a step bounds the cost from above.
- **The handshake alone.** In every round, after the two steps, the same handshake repeated
  ``--handshakes`` times between barriers, and as many barriers (the latency floor of a collective
  on this machine): the median over rounds of the time per handshake, times the handshakes per
  step, over the median step time.

Writes ``OUT/agreement.json``; rank 0 prints the summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdp
import fsdp.wrapper.base
from benchmarks._example import wrap_blocks
from benchmarks.peers import SIZES
from examples.gpt import GPT
from fsdp.comm.consistency import FORWARD, agree_on_entry, agree_on_step, agree_on_unit


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="35M")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (one step of each variant)")
    p.add_argument("--handshakes", type=int, default=20, help="handshakes timed alone in each round")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=96)
    p.add_argument("--clip", action="store_true", help="clip the gradients in each step (one more handshake)")
    p.add_argument("--out", type=str, default="out/agreement")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    n_layer, n_embd, n_head = SIZES[args.size]
    torch.manual_seed(0)
    model = wrap_blocks(GPT(args.vocab, args.block_size, n_layer, n_embd, n_head, 0.0))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_params = sum(p.numel() for p in model.parameters()) * world  # (shards, padding included)
    gen = torch.Generator().manual_seed(1000 + rank)

    inside = [0.0]  # seconds spent in the step handshakes of the current step

    def timed(handshake: Any) -> Any:
        def call(*args: Any) -> None:
            t0 = time.perf_counter()
            handshake(*args)
            inside[0] += time.perf_counter() - t0

        return call

    handshakes_of_a_step = {
        "agree_on_step": agree_on_step,
        "agree_on_unit": agree_on_unit,
        "agree_on_entry": agree_on_entry,
    }
    on = {name: timed(fn) for name, fn in handshakes_of_a_step.items()}
    off = {name: (lambda *args: None) for name in handshakes_of_a_step}

    def step(handshakes: bool) -> float:
        for name, fn in (on if handshakes else off).items():  # the ones the wrapper's step calls
            setattr(fsdp.wrapper.base, name, fn)
        inside[0] = 0.0
        x = torch.randint(0, args.vocab, (args.batch_size, args.block_size), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        if args.clip:
            model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - t0

    def repeated(call: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.handshakes):
            call()
        dist.barrier()
        return (time.perf_counter() - t0) / args.handshakes

    step(True)  # warm-up (lazy init, schedule, first allocations)
    step(False)
    times: dict[str, list[float]] = {"on": [], "off": []}
    alone: dict[str, list[float]] = {"handshake": [], "barrier": []}
    spent: list[float] = []  # per step with handshakes: the share of its time spent in them
    for r in range(args.rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            times[name].append(step(name == "on"))
            if name == "on":
                spent.append(inside[0] / times[name][-1])
        alone["handshake"].append(repeated(lambda: agree_on_step(model, FORWARD)))
        alone["barrier"].append(repeated(dist.barrier))
    for name, fn in handshakes_of_a_step.items():
        setattr(fsdp.wrapper.base, name, fn)
    ratios = sorted(a / b for a, b in zip(times["on"], times["off"], strict=True))
    handshake = statistics.median(alone["handshake"])
    units = len(fsdp.get_fsdp_instances(model)) - 1  # the wrappers under the root, each one forward a step
    per_step = 3 + units + (1 if args.clip else 0)  # forward, its end, backward, one per unit, clip
    median_step = statistics.median(times["off"])
    result: dict[str, Any] = {
        "size": args.size,
        "parameters": n_params,
        "world_size": world,
        "batch": [args.batch_size, args.block_size],
        "rounds": args.rounds,
        "step_s": times,
        "ratio_on_off": {
            "median": statistics.median(ratios),
            "q1": ratios[len(ratios) // 4],
            "q3": ratios[(3 * len(ratios)) // 4],
        },
        "handshake_s": handshake,
        "per_round_s": alone,
        "barrier_s": statistics.median(alone["barrier"]),
        "handshakes_per_step": per_step,
        "units": units,
        "handshake_share_of_step": per_step * handshake / median_step,
        "share_inside_handshakes": {"median": statistics.median(spent), "max": max(spent)},
        "machine": "shared CPU machine (gloo); figures drift with the other load",
    }
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "agreement.json").write_text(json.dumps(result, indent=1))
        r = result["ratio_on_off"]
        print(
            f"{args.size} GPT ({n_params / 1e6:.1f}M parameters), world size {world}, {args.rounds} paired rounds:\n"
            f"  median step {median_step * 1e3:.1f} ms; step with / without handshakes: median {r['median']:.4f} "
            f"(quartiles {r['q1']:.4f} to {r['q3']:.4f})\n"
            f"  one handshake {handshake * 1e6:.0f} us (a barrier: {result['barrier_s'] * 1e6:.0f} us); {per_step} per step = "
            f"{100 * result['handshake_share_of_step']:.3f}% of the median step\n"
            f"  time inside the handshakes of a step (waiting for the other rank included): median "
            f"{100 * result['share_inside_handshakes']['median']:.3f}% of the step, at most "
            f"{100 * result['share_inside_handshakes']['max']:.3f}%"
        )
    dist.barrier()
    time.sleep(0.1)  # let gloo release the works before teardown (see getting-started.md, "Finishing")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
