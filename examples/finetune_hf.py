"""Fine-tune a small Hugging Face causal language model with FSDP, in bf16 mixed precision.

The model is built from a config (GPT-2 or Llama layout, random weights: nothing is downloaded) or
loaded from a local directory written by ``save_pretrained`` (``--model-dir``; this script writes
one at the end, so a second run can fine-tune the first one's model). It learns to write Python
from the source files of Python's own standard library, read as UTF-8 bytes (a vocabulary of 256,
no tokenizer needed; a ``--model-dir`` with a tokenizer uses that instead).

Each block the model declares in ``_no_split_modules`` becomes its own FSDP unit
(``no_split_modules_auto_wrap_policy``: no import of the model's classes), the root unit holds the
embeddings and the head. Training computes in bf16 with fp32 master weights and fp32 gradient
reductions. Every ``--save-interval`` steps a resumable checkpoint (model, optimizer, scheduler,
loss curve) is written with ``fsdp.save_checkpoint``; ``--resume`` continues from the newest
complete one, at any number of ranks. At the end: a loss plot, the model in ``save_pretrained``
form, and sample generations through the wrapper (HF's ``generate``; each unit is gathered for its
call and freed after, never the whole model).

Launch from the repository root (CPU ranks with gloo; NCCL and one GPU per rank when CUDA is
available):

    torchrun --standalone --nproc_per_node=2 -m examples.finetune_hf
    torchrun --standalone --nproc_per_node=2 -m examples.finetune_hf --resume --max-iters 300
    torchrun --standalone --nproc_per_node=2 -m examples.finetune_hf --model-dir out/hf/model \\
        --out-dir out/hf2
    python3 -m examples.finetune_hf          # one rank, no torchrun needed

Needs ``pip install -e ".[examples,hf]"`` (tqdm, matplotlib, transformers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

# (torch and transformers are imported in main(), after the arguments: --help stays fast)


# --------------------------------------------------------------------------------------------------
# Config. The defaults train in a few minutes with 2 ranks on a 2-core CPU machine.
# --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m examples.finetune_hf",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # model
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="a local directory written by save_pretrained (config and weights) to fine-tune; "
        "default: a new model built from --arch and the size options",
    )
    p.add_argument(
        "--arch", choices=["gpt2", "llama"], default="gpt2", help="layout of a model built from a config"
    )
    p.add_argument("--n-layer", type=int, default=4, help="blocks of a model built from a config")
    p.add_argument("--n-embd", type=int, default=128, help="width of a model built from a config")
    p.add_argument("--n-head", type=int, default=4, help="attention heads of a model built from a config")
    # training
    p.add_argument(
        "--max-iters", type=int, default=200, help="optimizer steps in all (a resumed run counts on)"
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-iters", type=int, default=20, help="linear warmup, then cosine decay to lr/10")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="compute dtype; bf16 keeps fp32 master weights and reduces gradients in fp32",
    )
    p.add_argument(
        "--checkpointing",
        action="store_true",
        help="HF's activation checkpointing: recompute each block in backward instead of keeping its activations",
    )
    p.add_argument("--eval-interval", type=int, default=50, help="evaluate every N steps")
    p.add_argument("--eval-iters", type=int, default=4, help="batches per split and rank per evaluation")
    # data, sampling, output
    p.add_argument("--corpus-chars", type=int, default=1_000_000, help="characters of stdlib source to read")
    p.add_argument("--prompt", type=str, default="def ", help="prompt of the sample generations")
    p.add_argument("--samples", type=int, default=2, help="sample generations at the end (0: none)")
    p.add_argument("--sample-tokens", type=int, default=60, help="tokens per sample generation")
    p.add_argument("--top-k", type=int, default=5, help="sample among the k likeliest tokens (1: greedy)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the weights, the batches and the samples")
    p.add_argument("--out-dir", type=Path, default=Path("out/hf"), help="where everything is written")
    p.add_argument(
        "--save-interval",
        type=int,
        default=100,
        help="write a resumable checkpoint to OUT_DIR/checkpoints every N steps and at the end (0: never)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in OUT_DIR/checkpoints (any world size)",
    )
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# Tokens: UTF-8 bytes of Python's standard library, or the model directory's own tokenizer.
# --------------------------------------------------------------------------------------------------
class ByteTokenizer:
    """Text <-> UTF-8 byte values: a vocabulary of 256 that every model built here has."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def get_batch(data: Any, batch_size: int, block_size: int, seed: int) -> Any:
    """(B, T) token ids drawn by a generator seeded per step and rank: a resumed run draws the same."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=gen)  # (B,) start offsets
    return torch.stack([data[i : i + block_size] for i in ix.tolist()])  # (B, T); HF shifts the labels


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------
def build_model(args: argparse.Namespace, vocab_size: int) -> Any:
    import transformers

    if args.model_dir is not None:
        # every rank reads the same files, so every rank starts from the same weights
        return transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype="float32")
    if args.arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab_size, n_positions=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd,
            n_head=args.n_head, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, max_position_embeddings=args.block_size, num_hidden_layers=args.n_layer,
            hidden_size=args.n_embd, intermediate_size=4 * args.n_embd, num_attention_heads=args.n_head,
            num_key_value_heads=args.n_head, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
        )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


def setup_distributed() -> tuple[int, int, Any]:
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    if use_cuda and int(os.environ.get("LOCAL_RANK", 0)) >= torch.cuda.device_count():
        raise SystemExit(
            f"rank {os.environ['LOCAL_RANK']} on this machine has no GPU: it has {torch.cuda.device_count()}. "
            "Start one rank per GPU (torchrun --nproc_per_node=<GPUs>), or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to train on CPU ranks"
        )
    backend = "nccl" if use_cuda else "gloo"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group(backend)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    else:  # plain `python3 finetune_hf.py`: a one-rank group with an in-process store
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        local_rank, local_world = 0, 1
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # ranks share the cores
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    import transformers
    from tqdm import tqdm

    # the checkout's fsdp and examples packages, also when started as a file path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from examples.data import load_corpus  # (the GPT example's: the standard library's source)
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp import (
        MixedPrecision,
        latest_checkpoint,
        load_checkpoint,
        no_split_modules_auto_wrap_policy,
        save_checkpoint,
    )

    transformers.logging.set_verbosity_error()  # (config notes, once per rank)
    rank, world_size, device = setup_distributed()
    is_main = rank == 0
    ckpt_dir = args.out_dir / "checkpoints"
    if is_main:
        args.out_dir.mkdir(parents=True, exist_ok=True)

    # ---- data ----------------------------------------------------------------------------------
    tokenizer: Any = ByteTokenizer()
    if args.model_dir is not None and any(args.model_dir.glob("tokenizer*")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    text = load_corpus(args.corpus_chars)
    data = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    n_train = int(0.9 * len(data))
    train_data, val_data = data[:n_train], data[n_train:]  # the tail of the corpus is held out

    # ---- model ---------------------------------------------------------------------------------
    torch.manual_seed(args.seed)  # the same weights on every rank before wrapping
    model = build_model(args, tokenizer.vocab_size)
    if model.get_input_embeddings().num_embeddings < tokenizer.vocab_size:
        raise SystemExit(f"the model's vocabulary is smaller than the tokenizer's ({tokenizer.vocab_size})")
    n_params = sum(p.numel() for p in model.parameters())  # (the tied head counted once)
    model_name = type(model).__name__
    model = model.to(device)
    # One unit per block the model declares; bf16 compute with fp32 master weights. The fp32 gradient
    # reduction keeps the small gradients that bf16 would round away.
    precision = (
        {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if args.dtype == "bf16"
        else {}
    )
    model = FSDP(model, auto_wrap_policy=no_split_modules_auto_wrap_policy(model), **precision)
    if args.checkpointing:
        model.gradient_checkpointing_enable()  # HF's method, reached through the wrapper
    units = sum(isinstance(m, FSDP) for m in model.modules())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def lr_factor(it: int) -> float:  # linear warmup, then cosine decay to a tenth
        if it < args.warmup_iters:
            return (it + 1) / args.warmup_iters
        progress = min(1.0, (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    # ---- resume ----------------------------------------------------------------------------------
    # A checkpoint is sharded (each rank writes its part of the weights and of the AdamW state) and
    # loads at any world size; one becomes visible only once complete (its commit marker is last).
    start_iter, curve = 0, {"iter": [], "train": [], "val": [], "step_loss": []}
    latest = [latest_checkpoint(ckpt_dir) if is_main and args.resume else None]  # rank 0 picks it
    dist.broadcast_object_list(latest, src=0)
    if latest[0] is not None:
        extra = load_checkpoint(latest[0], model, optimizer)  # collective
        start_iter, curve = extra["iter"], extra["curve"]
        scheduler.load_state_dict(extra["scheduler"])
        if is_main:
            print(f"resumed from {latest[0]} at step {start_iter}")
    elif ckpt_dir.exists() and any(ckpt_dir.iterdir()):  # nothing is ever deleted
        raise SystemExit(
            f"{ckpt_dir} holds checkpoints of an earlier run: pass --resume to continue it, or another --out-dir"
        )

    def estimate_loss() -> dict[str, float]:
        """Mean loss over eval_iters batches per split, averaged over the ranks (every rank runs it)."""
        model.eval()
        out = {}
        with torch.no_grad():
            for i, (split, split_data) in enumerate((("train", train_data), ("val", val_data))):
                losses = []
                for k in range(args.eval_iters):  # the same batches at every evaluation
                    seed = args.seed + 7 * (100 * i + k) + rank
                    x = get_batch(split_data, args.batch_size, args.block_size, seed).to(device)
                    losses.append(model(input_ids=x, labels=x).loss.float())
                mean = torch.stack(losses).mean()
                dist.all_reduce(mean)
                out[split] = mean.item() / world_size
        model.train()
        return out

    def record(it: int) -> None:
        losses = estimate_loss()
        curve["iter"].append(it)
        curve["train"].append(losses["train"])
        curve["val"].append(losses["val"])
        if is_main:
            tqdm.write(f"step {it:5d}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")

    if is_main:
        print(
            f"model: {model_name}, {n_params / 1e6:.2f}M parameters, {units - 1} blocks as units, "
            f"{args.dtype}, world size {world_size} on {device.type} ({dist.get_backend()}); corpus "
            f"{len(data):,} tokens"
        )

    # ---- training loop ---------------------------------------------------------------------------
    model.train()
    t0 = time.perf_counter()
    for it in tqdm(range(start_iter, args.max_iters), initial=start_iter, total=args.max_iters,
                   disable=not is_main, desc="fine-tune", dynamic_ncols=True):  # fmt: skip
        if it % args.eval_interval == 0 and (not curve["iter"] or curve["iter"][-1] != it):
            record(it)
        # each rank its own batch and dropout masks, the same whether or not the run was resumed
        step_seed = args.seed * 1_000_003 + 7919 * it + rank
        torch.manual_seed(step_seed)  # (dropout draws from the global generator)
        x = get_batch(train_data, args.batch_size, args.block_size, step_seed).to(device)
        loss = model(input_ids=x, labels=x).loss  # (HF computes it in fp32 from the bf16 logits)
        loss.backward()  # each rank ends with the mean gradient of its shards
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        curve["step_loss"].append(round(loss.item(), 4))  # this rank's, for the light line of the plot
        done = it + 1
        if args.save_interval > 0 and (done % args.save_interval == 0 or done == args.max_iters):
            extra = {"iter": done, "curve": curve, "scheduler": scheduler.state_dict()}  # (rank 0's is saved)
            save_checkpoint(ckpt_dir / f"step_{done:06d}", model, optimizer, extra=extra)  # collective
    train_s = time.perf_counter() - t0
    if not curve["iter"] or curve["iter"][-1] != args.max_iters:
        record(args.max_iters)

    # ---- the model in Hugging Face's form: every rank gathers (collective), rank 0 writes -----------
    state = model.state_dict()
    if is_main:
        model.save_pretrained(args.out_dir / "model", state_dict={k: v.cpu() for k, v in state.items()})
        if not isinstance(tokenizer, ByteTokenizer):
            tokenizer.save_pretrained(args.out_dir / "model")
    del state

    # ---- sample generations through the wrapper ------------------------------------------------------
    # HF's generate calls the inner model once per token; each call gathers the units it runs and frees
    # them after. Every rank runs the same steps (each forward is collective): same seed, same length.
    model.eval()
    samples = []
    prompt = torch.tensor([tokenizer.encode(args.prompt)], device=device)  # (1, T0)
    for i in range(args.samples):
        torch.manual_seed(args.seed + i)
        out = model.generate(
            prompt, max_new_tokens=args.sample_tokens, min_new_tokens=args.sample_tokens,
            do_sample=args.top_k > 1, top_k=args.top_k, pad_token_id=0,
        )  # fmt: skip
        samples.append(tokenizer.decode(out[0].tolist()))

    if is_main:
        for i, sample in enumerate(samples):
            print(f"--- sample {i} ---\n{sample}")
        memory = model.memory_stats()
        summary = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": model_name,
            "params": n_params,
            "units": units,
            "world_size": world_size,
            "device": device.type,
            "train_seconds": round(train_s, 2),
            "memory_bytes": memory,
            "samples": samples,
            **curve,
        }
        (args.out_dir / "loss_curve.json").write_text(json.dumps(summary, indent=1))
        plot_curve(curve, args.out_dir / "loss_curve.png")
        print(
            f"loss: {curve['train'][0]:.4f} -> {curve['train'][-1]:.4f} (val {curve['val'][-1]:.4f}); "
            f"wrote {args.out_dir / 'loss_curve.png'}, {args.out_dir / 'loss_curve.json'}, {args.out_dir / 'model'}"
        )
    dist.barrier()  # all ranks are done with their collectives
    time.sleep(0.1)  # let gloo release them before teardown (see getting-started.md, "Finishing")
    dist.destroy_process_group()


def plot_curve(curve: dict[str, Any], path: Path) -> None:
    import matplotlib  # only rank 0 plots, at the end

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        range(len(curve["step_loss"])), curve["step_loss"], color="0.8", lw=0.8, label="step loss (rank 0)"
    )
    ax.plot(curve["iter"], curve["train"], "o-", label="train (eval)")
    ax.plot(curve["iter"], curve["val"], "s-", label="val (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title("Hugging Face causal LM on Python stdlib source, FSDP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
