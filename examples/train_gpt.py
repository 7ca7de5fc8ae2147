"""Train a small GPT-style, character-level language model with nested FSDP.

A nanoGPT-like decoder-only transformer learns to write Python, one character at a time, from the
source files of Python's own standard library (present on every machine with Python, so the example
needs no download). Each transformer block is its own FSDP unit and the root unit owns the rest
(embeddings, final norm, language-model head), so at any time a rank holds the full parameters of
at most two blocks (the one computing and the next, prefetched) plus the root, and otherwise just its 1/world_size shard of everything.

Launch (CPU with gloo by default; NCCL and cuda:LOCAL_RANK when CUDA is available):

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py
    python3 examples/train_gpt.py            # a single rank, no torchrun needed

Rank 0 shows a progress bar, prints the train/val loss at every evaluation and a short sample, and
writes to --out-dir: loss_curve.png, loss_curve.json and model.pt (the full, unsharded state dict
with the plain model's keys, loadable into ``GPT`` without FSDP).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

# Make the library importable from a plain checkout (no `pip install -e .` needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fsdp import FullyShardedDataParallel as FSDP
from fsdp import (
    ShardedGradScaler,
    ShardingStrategy,
    auto_wrap,
    enable_wrap,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    transformer_auto_wrap_policy,
)


# --------------------------------------------------------------------------------------------------
# Config. The defaults train in about a minute with 2 ranks on a 2-core CPU machine.
# --------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    # training
    p.add_argument("--max-iters", type=int, default=250, help="optimizer steps")
    p.add_argument("--eval-interval", type=int, default=50, help="evaluate every N steps")
    p.add_argument("--eval-iters", type=int, default=10, help="batches per split and rank per evaluation")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup-iters", type=int, default=20, help="linear warmup, then cosine decay to lr/10")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    # model
    p.add_argument("--block-size", type=int, default=64, help="context length in characters")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0)
    # data, sampling, output
    p.add_argument("--corpus-chars", type=int, default=2_000_000, help="characters of stdlib source to read")
    p.add_argument("--sample-chars", type=int, default=100, help="characters to generate at the end")
    p.add_argument(
        "--top-k", type=int, default=5, help="sample among the k likeliest characters (1 = greedy)"
    )
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="compute dtype; bf16/fp16 keep fp32 master weights (mixed precision), fp16 adds loss scaling",
    )
    p.add_argument(
        "--strategy",
        choices=[s.name for s in ShardingStrategy],
        default="FULL_SHARD",
        help="how parameters, gradients and optimizer state are spread over ranks (docs/strategies.md)",
    )
    p.add_argument("--out-dir", type=str, default="out/")
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
    return p.parse_args()


# --------------------------------------------------------------------------------------------------
# Model: a pre-norm decoder-only transformer (GPT-2 layout, minus dropout in attention).
# Shapes: B = batch, T = time (<= block_size), C = n_embd, nh = n_head, hs = C // nh, V = vocab size.
# --------------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)  # q, k, v for all heads in one matmul
        self.proj = nn.Linear(n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # split the channels into heads: (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs), no peeking ahead
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads: (B, T, C)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)  # (B, T, C) -> (B, T, 4C)
        self.proj = nn.Linear(4 * n_embd, n_embd)  # (B, T, 4C) -> (B, T, C)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One transformer block; the unit that each gets its own FSDP wrapper."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        # pre-norm residual: the residual stream itself is never normalized, which keeps deep
        # stacks trainable without warmup tricks
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int, dropout: float
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)  # token embedding
        self.wpe = nn.Embedding(block_size, n_embd)  # learned position embedding
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        # Weight tying: reading a character and predicting it use one matrix (fewer parameters,
        # better small-data perplexity). Both modules stay in the root FSDP unit, so the shared
        # tensor lives in exactly one flat parameter.
        self.lm_head.weight = self.wte.weight

        self.apply(self._init_weights)
        # GPT-2: scale the init of the projections that write into the residual stream, so its
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape  # idx: (B, T) character ids
        assert T <= self.block_size, f"sequence of {T} is longer than block_size {self.block_size}"
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:  # targets: (B, T), the input shifted left by one character
            # the loss in fp32 even when the logits are bf16/fp16: log-softmax needs the range
            loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.view(B * T))
        return logits, loss


# --------------------------------------------------------------------------------------------------
# Data: Python's standard library source as one long string of characters.
# --------------------------------------------------------------------------------------------------
def load_corpus(max_chars: int) -> str:
    # Sorted file order makes the corpus (and so the vocabulary) identical on every rank without any
    # communication. Top-level modules only: plenty of text, and no test data with odd bytes.
    stdlib = Path(os.__file__).parent
    parts, n = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        n += len(text)
        if n >= max_chars:
            break
    return "".join(parts)[:max_chars]


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)  # (B,) start offsets
    x = torch.stack([data[i : i + block_size] for i in ix.tolist()])  # (B, T)
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix.tolist()])  # (B, T), next characters
    return x.to(device), y.to(device)


# --------------------------------------------------------------------------------------------------
# Distributed setup
# --------------------------------------------------------------------------------------------------
def setup_distributed() -> tuple[int, int, torch.device]:
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda and int(os.environ.get("LOCAL_RANK", 0)) >= torch.cuda.device_count():
        raise SystemExit(
            f"rank {os.environ['LOCAL_RANK']} on this machine has no GPU: it has {torch.cuda.device_count()}. "
            "Start one rank per GPU (torchrun --nproc_per_node=<GPUs>), or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to train on CPU ranks"
        )
    if "RANK" in os.environ:  # launched by torchrun: it exported RANK, WORLD_SIZE, MASTER_ADDR, ...
        dist.init_process_group(backend)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    else:
        # Plain `python3 train_gpt.py`: FSDP still needs a process group, so make a one-rank group
        # with an in-process store (no ports, no environment variables).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        local_rank, local_world = 0, 1
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # one machine of one rank (HYBRID_SHARD reads it)
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        # Ranks on one machine share its cores; more threads than cores makes every rank slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def main() -> None:
    args = parse_args()
    rank, world_size, device = setup_distributed()
    is_main = rank == 0
    out_dir = Path(args.out_dir)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)

    # ---- data ----------------------------------------------------------------------------------
    text = load_corpus(args.corpus_chars)
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)
    n_train = int(0.9 * len(data))
    train_data, val_data = data[:n_train], data[n_train:]  # 90/10 split; val is the tail of the corpus

    # ---- model ---------------------------------------------------------------------------------
    # Same seed on every rank -> identical initial weights before wrapping; each rank then keeps
    # only its own shard of them.
    torch.manual_seed(args.seed)
    model = GPT(len(chars), args.block_size, args.n_layer, args.n_embd, args.n_head, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())  # parameters() de-duplicates the tied weight
    model = model.to(device)

    # Nested FSDP through a wrapping policy: every transformer Block becomes its own unit, so its
    # full parameters are all-gathered just before its forward (and, with FULL_SHARD, again for its
    # backward) and freed right after. The root wrapper owns what is left: wte/lm_head (tied), wpe
    # and ln_f. See docs/strategies.md for what each --strategy costs in memory and communication.
    # Mixed precision: each unit casts its fp32 shard to bf16/fp16 *before* the all-gather (half the
    # bytes on the wire), computes in that dtype, and reduces gradients back onto the fp32 shard.
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    precision = {"mixed_precision": True, "compute_dtype": low} if low is not None else {}
    fsdp_kwargs = {"sharding_strategy": ShardingStrategy[args.strategy], **precision}
    with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=transformer_auto_wrap_policy({Block}), **fsdp_kwargs):
        model = auto_wrap(model)
    model = FSDP(model, **fsdp_kwargs)
    # fp16 gradients can underflow: scale the loss. The sharded scaler agrees across ranks on
    # which steps overflowed, so every rank skips the same steps.
    scaler = ShardedGradScaler(enabled=args.dtype == "fp16")

    # parameters() now yields this rank's flat shards only, so the optimizer state is sharded too.
    # Flat shards mix weights, biases and norm gains, so there is one parameter group (no separate
    # no-decay group as in nanoGPT).
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    # Every rank draws different training batches (seed + rank): that is what makes it data parallel.
    train_gen = torch.Generator().manual_seed(args.seed + rank)

    # ---- resume ----------------------------------------------------------------------------------
    # A checkpoint is sharded (each rank writes 1/world_size of the weights and of the AdamW state)
    # and loads at any world size. Only complete ones count: a save becomes visible when its commit
    # marker is written, last, so a run killed mid-save resumes from the checkpoint before.
    ckpt_dir = out_dir / "checkpoints"
    start_iter, resumed = 0, None
    # rank 0 picks the checkpoint, so that every rank loads the same one
    latest = [latest_checkpoint(ckpt_dir) if rank == 0 and args.resume else None]
    dist.broadcast_object_list(latest, src=0)
    if latest[0] is not None:
        resumed = load_checkpoint(latest[0], model, optimizer)  # collective: every rank loads its shards
        start_iter = resumed["iter"]
        if resumed["scaler"]:
            scaler.load_state_dict(resumed["scaler"])
        # a fresh stream of batches (the interrupted run's generators are not saved)
        train_gen.manual_seed(args.seed + rank + 7919 * start_iter)
        if is_main:
            print(f"resumed from {latest} at step {start_iter} (saved at another world size is fine)")
    elif is_main and ckpt_dir.exists():
        # a fresh run owns --out-dir, like model.pt and the plots it overwrites
        print(f"{'--resume: no complete checkpoint; ' if args.resume else ''}removing old {ckpt_dir}")
        shutil.rmtree(ckpt_dir)

    def lr_at(it: int) -> float:
        if it < args.warmup_iters:  # linear warmup: Adam's early steps are noisy
            return args.lr * (it + 1) / args.warmup_iters
        progress = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
        return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))

    def estimate_loss() -> dict[str, float]:
        """Mean loss over eval_iters batches per split, averaged over all ranks."""
        model.eval()  # disables dropout; the FSDP forward still all-gathers, so every rank runs it
        out = {}
        with torch.no_grad():
            for split, split_data in (("train", train_data), ("val", val_data)):
                # a fresh generator with a fixed seed: the same batches at every evaluation, so the
                # points of the curve differ only by the model, not by the sample
                gen = torch.Generator().manual_seed(args.seed + 10_000 + rank)
                losses = torch.zeros(args.eval_iters, device=device)
                for k in range(args.eval_iters):
                    x, y = get_batch(split_data, args.batch_size, args.block_size, gen, device)
                    _, loss = model(x, y)
                    losses[k] = loss
                mean = losses.mean()
                dist.all_reduce(mean, op=dist.ReduceOp.SUM)
                out[split] = mean.item() / world_size
        model.train()
        return out

    if is_main:
        print(
            f"corpus: {len(text):,} chars of stdlib source, vocab {len(chars)}, "
            f"train {len(train_data):,} / val {len(val_data):,}"
        )
        print(
            f"model: {n_params / 1e6:.2f}M parameters, {args.n_layer} layers x {args.n_embd} wide, "
            f"world size {world_size} on {device.type} ({dist.get_backend()}), "
            f"{args.batch_size * args.block_size * world_size:,} tokens per step"
        )

    # ---- training loop ---------------------------------------------------------------------------
    curve: dict[str, list[float]] = {"iter": [], "train": [], "val": []}

    def record(it: int) -> None:
        losses = estimate_loss()
        curve["iter"].append(it)
        curve["train"].append(losses["train"])
        curve["val"].append(losses["val"])
        if is_main:
            tqdm.write(f"iter {it:5d}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")

    step_losses: list[float] = []  # rank 0's own per-step loss, for the light line in the plot
    if resumed is not None:
        curve.update(resumed["curve"])
        step_losses.extend(resumed["step_losses"])
    gathered_bytes = 0  # bytes all-gathered by training steps (evaluation excluded)
    peak_gathered = 0  # the most parameter bytes gathered at once in a training step (memory_stats)
    t0 = time.perf_counter()
    pbar = tqdm(
        range(start_iter, args.max_iters),
        initial=start_iter,
        total=args.max_iters,
        disable=not is_main,
        desc="train",
        dynamic_ncols=True,
    )
    for it in pbar:
        if it % args.eval_interval == 0:
            record(it)
        lr = lr_at(it)
        for group in optimizer.param_groups:
            group["lr"] = lr

        x, y = get_batch(train_data, args.batch_size, args.block_size, train_gen, device)  # (B, T) each
        model.reset_comm_stats()
        model.reset_memory_stats()
        _, loss = model(x, y)
        scaler.scale(loss).backward()  # FSDP reduce-scatters: each rank gets the mean gradient of its shard
        scaler.step(optimizer)  # updates this rank's shards only (skipped on every rank after an overflow)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        gathered_bytes += model.comm_stats()["all_gather"]["bytes"]
        peak_gathered = max(peak_gathered, model.memory_stats()["unsharded_peak"])

        if is_main:
            step_losses.append(loss.item())
            pbar.set_postfix(loss=f"{step_losses[-1]:.4f}", lr=f"{lr:.1e}")
        done = it + 1
        if args.save_interval > 0 and (done % args.save_interval == 0 or done == args.max_iters):
            # collective: every rank writes its own shards into a fresh directory (rank 0's extra)
            extra = {"iter": done, "curve": curve, "step_losses": step_losses, "scaler": scaler.state_dict()}
            save_checkpoint(ckpt_dir / f"step_{done:06d}", model, optimizer, extra=extra)
    pbar.close()
    record(args.max_iters)
    train_s = time.perf_counter() - t0
    memory = model.memory_stats()  # this rank's bytes: shards, their gradients, full parameters

    # ---- checkpoint: every rank must call state_dict() (it all-gathers); rank 0 writes it ----------
    state_dict = model.state_dict()
    if is_main:  # host tensors: the file loads on a machine without a GPU
        torch.save({k: v.cpu() for k, v in state_dict.items()}, out_dir / "model.pt")
    del state_dict

    # ---- sample ----------------------------------------------------------------------------------
    # Every rank runs the same decode loop, because each FSDP forward is a collective; the same
    # generator seed keeps them in lockstep. Only rank 0 prints.
    model.eval()
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.tensor([[stoi[ch] for ch in "def "]], device=device)  # (1, T0) prompt
    with torch.no_grad():
        for _ in range(args.sample_chars):
            logits, _ = model(idx[:, -args.block_size :])  # (1, T, V); crop to the context length
            logits = logits[:, -1, :].float().cpu()  # (1, V): only the last position predicts the next char
            top, _ = torch.topk(logits, min(args.top_k, logits.size(-1)))
            logits[logits < top[:, [-1]]] = -float("inf")  # keep the k likeliest characters
            next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen)  # (1, 1)
            idx = torch.cat([idx, next_id.to(device)], dim=1)
    model.train()

    # ---- report ----------------------------------------------------------------------------------
    if is_main:
        print("sample:\n" + "".join(chars[i] for i in idx[0].tolist()) + "\n")
        summary = {
            "config": vars(args),
            "world_size": world_size,
            "device": device.type,
            "train_seconds": round(train_s, 2),
            "all_gather_bytes_per_step": gathered_bytes // max(1, args.max_iters - start_iter),
            "memory_bytes": {**memory, "peak_gathered_in_a_step": peak_gathered},
            **curve,
            "step_loss_rank0": [round(v, 4) for v in step_losses],
        }
        (out_dir / "loss_curve.json").write_text(json.dumps(summary, indent=1))
        plot_curve(curve, step_losses, out_dir / "loss_curve.png")
        print(f"wrote {out_dir / 'model.pt'}, {out_dir / 'loss_curve.png'}, {out_dir / 'loss_curve.json'}")
        print(
            f"train time {train_s:.1f}s ({1000 * train_s / max(1, args.max_iters - start_iter):.0f} ms/iter incl. evals), "
            f"{args.dtype}: {gathered_bytes / max(1, args.max_iters - start_iter) / 2**20:.2f} MiB all-gathered per step per rank"
        )
        print(
            f"parameters per rank: {memory['sharded_params'] / 2**20:.2f} MiB of shards; "
            f"{memory['full_params'] / 2**20:.2f} MiB in full, of which at most "
            f"{peak_gathered / 2**20:.2f} MiB were gathered at once in a step"
        )
        print(
            f"loss: start {curve['train'][0]:.4f} -> end {curve['train'][-1]:.4f} (val {curve['val'][-1]:.4f})"
        )

    dist.barrier()  # all ranks are done with their collectives
    time.sleep(0.1)  # let gloo release them before teardown (see getting-started.md, "Finishing")
    dist.destroy_process_group()


def plot_curve(curve: dict[str, list[float]], step_losses: list[float], path: Path) -> None:
    import matplotlib  # imported here: only rank 0 plots, and only at the end

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(len(step_losses)), step_losses, color="0.8", lw=0.8, label="step loss (rank 0)")
    ax.plot(curve["iter"], curve["train"], "o-", label="train (eval)")
    ax.plot(curve["iter"], curve["val"], "s-", label="val (eval)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy loss (nats/char)")
    ax.set_title("char-level GPT on Python stdlib source, nested FSDP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
