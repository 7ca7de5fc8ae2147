"""Peak tensor memory of generating through the wrapper against ``summon_full_params`` + generate.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.generate_memory [--size 35M] \
        [--new-tokens 20] [--out out/generate_memory]

The example's GPT (one FSDP unit per block plus the root, ``FULL_SHARD``, fp32) gets a ``generate``
method, greedy decoding that calls ``self(...)`` once per new token, as Hugging Face's ``generate``
does. Two ways to run it, each under torch's ``MemTracker`` (a dispatch mode that follows every
tensor storage; the model's shards registered beforehand), one after the other in the same ranks:

- ``through_wrapper``: ``model.generate(prompt)``, reached through the wrapper's attribute
  forwarding. Each call of the inner module gathers the units it runs and frees them after (see
  [Note: calls past the wrapper] in fsdp/wrapper/direct_call.py).
- ``summon``: ``with model.summon_full_params(): model.generate(prompt)``, the fairscale and torch
  FSDP1 way: the whole model is gathered on every rank for the whole generation.

Both must give the same tokens. Reports the peak live tensor bytes of each (and the wrapper's own
count of the most unshard-buffer bytes held at once, ``memory_stats()["unsharded_peak"]``), and
writes ``OUT/generate_memory.json``; rank 0 prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from benchmarks._example import wrap_blocks
from benchmarks.peers import SIZES
from examples.gpt import GPT


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="35M", help="the example GPT's size")
    p.add_argument(
        "--vocab", type=int, default=96, help="vocabulary size (the example's corpus has 96 chars)"
    )
    p.add_argument("--block-size", type=int, default=64, help="context length")
    p.add_argument("--prompt", type=int, default=4, help="prompt length in tokens")
    p.add_argument("--new-tokens", type=int, default=20, help="tokens to generate")
    p.add_argument("--out", type=Path, default=Path("out/generate_memory"), help="output directory")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def with_generate(gpt_cls: type) -> type:
    class GenerativeGPT(gpt_cls):  # type: ignore[misc, valid-type]
        @torch.no_grad()
        def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
            """Greedy decoding: one call of ``self`` per new token, as HF's ``generate``."""
            for _ in range(new_tokens):
                logits, _ = self(idx[:, -self.block_size :])  # (B, T, V)
                idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            return idx

    return GenerativeGPT


class PeakTracker(MemTracker):
    """``MemTracker``'s accounting of live storages (and their resizes), without its statistics per
    module, which refuse a module called again in one tracked region (here once per new token)."""

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        pass

    def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
        pass


def tracked(model: Any, run: Any) -> tuple[torch.Tensor, dict[str, int]]:
    gc.collect()
    warnings.filterwarnings("ignore", message="Expected a tensor or a traceable", category=UserWarning)
    tracker = PeakTracker()
    tracker.track_external(model)
    before = tracker.get_tracker_snapshot("current")
    model.reset_memory_stats()
    dist.barrier()
    with tracker:
        tokens = run()
    peak = tracker.get_tracker_snapshot("peak")
    dev = next(d for d in peak if torch.device(d).type == "cpu")
    return tokens, {
        "tracked_peak_bytes": int(peak[dev]["Total"]),
        "tracked_before_bytes": int(before[dev]["Total"]) if dev in before else 0,
        "unsharded_peak_bytes": int(model.memory_stats()["unsharded_peak"]),
    }


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n_layer, n_embd, n_head = SIZES[args.size]
    torch.manual_seed(args.seed)
    base = with_generate(GPT)(args.vocab, args.block_size, n_layer, n_embd, n_head, 0.0).eval()
    n_params = sum(p.numel() for p in base.parameters())
    model = wrap_blocks(base)
    memory = model.memory_stats()
    prompt = torch.randint(
        0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed)
    )

    def summoned() -> torch.Tensor:
        with model.summon_full_params():
            return model.generate(prompt, args.new_tokens)  # type: ignore[no-any-return]

    runs = {
        "through_wrapper": lambda: model.generate(prompt, args.new_tokens),
        "summon": summoned,
    }
    results: dict[str, Any] = {}
    tokens: dict[str, torch.Tensor] = {}
    for name, run in runs.items():
        tokens[name], results[name] = tracked(model, run)
    same = torch.equal(tokens["through_wrapper"], tokens["summon"])
    report = {
        "size": args.size,
        "params": n_params,
        "world_size": world,
        "new_tokens": args.new_tokens,
        "prompt": args.prompt,
        "full_params_bytes": memory["full_params"],
        "sharded_params_bytes": memory["sharded_params"],
        "largest_unit_bytes": memory["largest_unit"],
        "same_tokens": same,
        "runs": results,
        "peak_ratio_through_wrapper_to_summon": results["through_wrapper"]["tracked_peak_bytes"]
        / results["summon"]["tracked_peak_bytes"],
    }
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "generate_memory.json").write_text(json.dumps(report, indent=2) + "\n")
        mib = 2**20
        print(
            f"{args.size} GPT ({n_params:,} parameters), world size {world}, {args.new_tokens} new tokens; "
            f"full parameters {memory['full_params'] / mib:.1f} MiB, this rank's shards "
            f"{memory['sharded_params'] / mib:.1f} MiB; same tokens: {same}"
        )
        print("| run | peak tensor MiB (MemTracker) | unsharded peak MiB (memory_stats) |")
        print("| --- | --- | --- |")
        for name, r in results.items():
            print(f"| {name} | {r['tracked_peak_bytes'] / mib:.1f} | {r['unsharded_peak_bytes'] / mib:.1f} |")
        print(f"ratio through_wrapper / summon: {report['peak_ratio_through_wrapper_to_summon']:.3f}")
    if not same:
        raise SystemExit("the two runs generated different tokens")
    dist.barrier()
    time.sleep(0.1)  # lets gloo's workers drop their last tensors before teardown (docs/design.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
