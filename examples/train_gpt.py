"""Train a small character-level GPT with nested FSDP, resumably.

A nanoGPT-like decoder-only transformer (examples/gpt.py) learns to write Python, one character at a
time, from the source of Python's own standard library (on every machine with Python: no download).
Each transformer block is its own FSDP unit and the root unit owns the rest (embeddings, final norm,
language-model head), so a rank holds the full parameters of at most two blocks at a time (the one
computing and the next, prefetched) plus the root, and otherwise its 1/world_size shard of
everything. Run it from the repository root (CPU ranks with gloo; NCCL and cuda:LOCAL_RANK when
CUDA is available):

    torchrun --standalone --nproc_per_node=2 -m examples.train_gpt
    python3 -m examples.train_gpt            # one rank, no torchrun needed

Rank 0 prints the train/val loss at every evaluation and a short sample at the end, and writes to
--out-dir: loss_curve.png, loss_curve.json and model.pt (the full state dict with the plain model's
keys, loadable into ``GPT`` without FSDP). Every --save-interval steps, and at the end, every rank
writes its shards and its own loop state (data position, RNG streams, LR schedule, loss scaler)
into a checkpoint under --out-dir/checkpoints; --resume continues from the newest complete one,
exactly where it stood. A run never deletes an earlier run's results unless given --overwrite.

This file reads the options and then imports the training run (examples/training.py): torch and
fsdp load only after the options parse, so --help and a mistyped option answer at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# The public names of fsdp.ShardingStrategy (written out: importing fsdp takes seconds; a test checks them).
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def not_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m examples.train_gpt",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # The defaults train in about a minute with 2 ranks on a 2-core CPU machine.
    train = p.add_argument_group("training")
    train.add_argument("--max-iters", type=positive, default=250, help="optimizer steps in the whole run")
    train.add_argument("--batch-size", type=positive, default=16, help="sequences per rank and step")
    train.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    train.add_argument(
        "--warmup-iters", type=positive, default=20, help="steps of linear warmup, then cosine decay to lr/10"
    )
    train.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's decoupled weight decay")
    train.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="compute dtype; bf16/fp16 keep fp32 master weights (mixed precision), fp16 adds loss scaling",
    )
    train.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="FULL_SHARD",
        help="how parameters, gradients and optimizer state are spread over ranks (docs/strategies.md)",
    )
    train.add_argument(
        "--seed", type=int, default=1337, help="seed of the weights, the data order and dropout"
    )
    model = p.add_argument_group("model")
    model.add_argument("--block-size", type=positive, default=64, help="context length in characters")
    model.add_argument("--n-layer", type=positive, default=4, help="transformer blocks (one FSDP unit each)")
    model.add_argument("--n-embd", type=positive, default=128, help="width of the residual stream")
    model.add_argument("--n-head", type=positive, default=4, help="attention heads (must divide --n-embd)")
    model.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    data = p.add_argument_group("data and evaluation")
    data.add_argument(
        "--corpus-chars", type=positive, default=2_000_000, help="characters of stdlib source to train on"
    )
    data.add_argument("--eval-interval", type=positive, default=50, help="evaluate every N steps")
    data.add_argument(
        "--eval-iters", type=positive, default=10, help="batches per split and rank per evaluation"
    )
    data.add_argument(
        "--sample-chars", type=not_negative, default=100, help="characters to generate at the end"
    )
    data.add_argument(
        "--top-k", type=positive, default=5, help="sample among the k likeliest characters (1: greedy)"
    )
    out = p.add_argument_group("output and checkpoints")
    out.add_argument("--out-dir", default="out", help="where the checkpoints, model.pt and the loss curve go")
    out.add_argument(
        "--save-interval",
        type=not_negative,
        default=100,
        help="checkpoint into OUT_DIR/checkpoints every N steps and at the end (0: never)",
    )
    again = out.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in OUT_DIR/checkpoints, exactly (any world size)",
    )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="delete OUT_DIR/checkpoints and overwrite the outputs of an earlier run in OUT_DIR",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.n_embd % args.n_head:
        p.error(f"--n-head {args.n_head} must divide --n-embd {args.n_embd}")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    # A fresh run never deletes an earlier one's checkpoints unasked. Every rank looks for itself
    # (the directory is on a file system they all see), so they all stop, before anything is built.
    out = Path(args.out_dir)
    earlier = [
        str(path) for path in (out / "checkpoints", out / "model.pt") if path.is_file() or _non_empty(path)
    ]
    if earlier and not (args.resume or args.overwrite):
        p.error(
            f"{out} holds the results of an earlier run ({', '.join(earlier)}): pass --resume to continue "
            "it, --overwrite to delete its checkpoints and start afresh, or another --out-dir"
        )
    return args


def _non_empty(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from examples.training import run  # torch, fsdp: seconds to import, so only now

    run(args)


if __name__ == "__main__":
    main()
