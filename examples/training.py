"""The training run of ``examples/train_gpt.py`` (which parses the options, then calls :func:`run`).

Ranks and devices, data split across ranks, the model wrapped in FSDP, the optimizer with its LR
schedule, the loop, resumable checkpoints and the outputs, one short function each, in that order.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

from examples.data import CharWindows, ResumableSampler, endless_batches, load_corpus
from examples.gpt import GPT, Block
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


# ---------------------------------------------------------------------------------------- ranks
def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the process group: NCCL and cuda:LOCAL_RANK when CUDA is available, else gloo on the CPU."""
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
        # plain `python -m examples.train_gpt`: FSDP still needs a process group, so make a
        # one-rank group with an in-process store (no ports, no environment variables)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        local_rank, local_world = 0, 1
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # one machine of one rank (HYBRID_SHARD reads it)
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)
    # ranks on one machine share its cores; more threads than cores makes every rank slower
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def finish() -> None:
    """Leave the process group (see docs/getting-started.md, "Finishing")."""
    dist.barrier()  # every rank is done with its collectives
    time.sleep(0.1)  # let gloo release them before the teardown
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- data
@dataclass
class Data:
    chars: list[str]  # the vocabulary: character id -> character
    sampler: ResumableSampler  # which training windows this rank takes, and how far it got
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]  # this rank's (x, y) batches, (B, T) each
    eval_loaders: dict[str, DataLoader[Any]]  # "train" / "val": the same fixed windows at every evaluation


def build_data(args: argparse.Namespace, rank: int, world_size: int) -> Data:
    text = load_corpus(args.corpus_chars)
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)
    n_train = int(0.9 * len(ids))  # 90/10 split; val is the tail of the corpus
    splits = {
        "train": CharWindows(ids[:n_train], args.block_size),
        "val": CharWindows(ids[n_train:], args.block_size),
    }
    # DistributedSampler gives every rank a different share of each epoch's permutation: that is
    # what makes it data parallel. Its own seed and the loader's own generator leave the global
    # RNG (dropout's) untouched, so resuming does not shift it.
    sampler = ResumableSampler(
        splits["train"], num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(
        splits["train"], args.batch_size, sampler=sampler, drop_last=True, generator=torch.Generator()
    )
    # evaluation: a fixed random sample of eval_iters global batches per split, split across the
    # ranks the same way, so the points of the curve differ only by the model
    eval_loaders = {}
    for name, windows in splits.items():
        g = torch.Generator().manual_seed(args.seed)
        n = min(len(windows), args.eval_iters * args.batch_size * world_size)
        subset = Subset(windows, torch.randperm(len(windows), generator=g)[:n].tolist())
        eval_sampler: DistributedSampler[int] = DistributedSampler(
            subset, num_replicas=world_size, rank=rank, shuffle=False
        )
        eval_loaders[name] = DataLoader(
            subset, args.batch_size, sampler=eval_sampler, generator=torch.Generator()
        )
    return Data(chars, sampler, endless_batches(loader, sampler), eval_loaders)


# ---------------------------------------------------------------------------------------- model
def build_model(args: argparse.Namespace, vocab_size: int, device: torch.device) -> tuple[FSDP, int]:
    """The GPT, with one FSDP unit per transformer block and a root unit for the rest; its size."""
    # the same seed on every rank: identical initial weights, of which each rank then keeps its shard
    torch.manual_seed(args.seed)
    model = GPT(vocab_size, args.block_size, args.n_layer, args.n_embd, args.n_head, args.dropout).to(device)
    n_params = sum(p.numel() for p in model.parameters())  # parameters() counts the tied weight once
    # Every Block becomes its own unit: its full parameters are all-gathered just before its
    # forward (with FULL_SHARD, again for its backward) and freed right after. The root owns the
    # rest: wte/lm_head (tied), wpe and ln_f. With bf16/fp16, each unit casts its fp32 shard to the
    # low dtype *before* the all-gather (half the bytes), computes in it, and reduces gradients
    # back onto the fp32 shard. docs/strategies.md says what each --strategy costs.
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    precision = {"mixed_precision": True, "compute_dtype": low} if low is not None else {}
    fsdp_kwargs: dict[str, Any] = {"sharding_strategy": ShardingStrategy[args.strategy], **precision}
    with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=transformer_auto_wrap_policy({Block}), **fsdp_kwargs):
        blocks_wrapped = auto_wrap(model)
    return FSDP(blocks_wrapped, **fsdp_kwargs), n_params


def build_optimizer(
    args: argparse.Namespace, model: FSDP
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, ShardedGradScaler]:
    # parameters() now yields this rank's flat shards only, so the optimizer state is sharded too.
    # Flat shards mix weights, biases and norm gains: one parameter group (no no-decay group).
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def lr_factor(step: int) -> float:  # of --lr, at optimizer step `step`
        if step < args.warmup_iters:  # linear warmup: Adam's first steps are noisy
            return (step + 1) / args.warmup_iters
        progress = (step - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))  # cosine to lr / 10

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    # fp16 gradients can underflow: scale the loss. The sharded scaler agrees across ranks on which
    # steps overflowed, so every rank skips the same steps.
    return optimizer, scheduler, ShardedGradScaler(enabled=args.dtype == "fp16")


# ---------------------------------------------------------------------------------------- state
class Progress:
    """Where the run stands; ``Stateful``, so it travels in the checkpoints."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config  # the options of this run
        self.saved_config: dict[str, Any] = {}  # those of the run that saved the loaded checkpoint
        self.step = 0  # optimizer steps done
        self.curve: dict[str, list[float]] = {"iter": [], "train": [], "val": []}  # evaluations
        self.step_losses: list[float] = []  # every step's loss, averaged over the ranks

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "curve": self.curve,
            "step_losses": self.step_losses,
            "config": self.config,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.curve, self.step_losses = state["step"], state["curve"], state["step_losses"]
        self.saved_config = state["config"]


class RNGState:
    """This rank's random number generators (dropout draws from them); ``Stateful``."""

    def __init__(self, seed: int, rank: int, world_size: int, device: torch.device) -> None:
        self.seed, self.rank, self.world_size, self.device = seed, rank, world_size, device
        self.reseeded = False  # True after loading the state of a run at another world size

    def state_dict(self) -> dict[str, Any]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return {"cpu": torch.get_rng_state(), "cuda": cuda, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.world_size:  # another rank's stream: each rank starts its own
            torch.manual_seed(self.seed + self.rank)
            self.reseeded = True
            return
        torch.set_rng_state(state["cpu"])
        if state["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


@dataclass
class Run:
    """What one training run holds."""

    args: argparse.Namespace
    device: torch.device
    data: Data
    model: FSDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: ShardedGradScaler
    progress: Progress
    rng: RNGState

    def app_state(self) -> dict[str, Any]:
        """What an exact resume needs besides the weights and the optimizer. Each value is
        ``Stateful`` (``state_dict`` / ``load_state_dict``), and every rank saves and loads its own."""
        return {
            "progress": self.progress,
            "sampler": self.data.sampler,  # the epoch and the windows consumed in it
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "rng": self.rng,
        }


# ---------------------------------------------------------------------------------------- checkpoints
def previous_run(args: argparse.Namespace, rank: int) -> Path | None:
    """The checkpoint to resume from (with --resume), the same on every rank; or, with --overwrite,
    none after the earlier run's checkpoints are deleted."""
    ckpt_dir = Path(args.out_dir) / "checkpoints"
    if args.resume:
        # collective: rank 0 picks the newest complete, undamaged one and every rank gets its name
        found = latest_checkpoint(ckpt_dir, group=dist.group.WORLD)
        if found is None and rank == 0:
            print(f"--resume: no complete checkpoint in {ckpt_dir}; starting at step 0")
        return found
    if rank == 0 and args.overwrite and ckpt_dir.exists():
        print(f"--overwrite: deleting {ckpt_dir}")
        shutil.rmtree(ckpt_dir)
    dist.barrier()  # no rank saves before rank 0 has deleted
    return None


def resume(r: Run, path: Path) -> None:
    """Load the checkpoint: weights, optimizer, and the loop's own state (every rank its own)."""
    load_checkpoint(path, r.model, r.optimizer, app_state=r.app_state())  # collective, any world size
    if dist.get_rank() != 0:
        return
    saved, now = r.progress.saved_config, r.progress.config
    print(f"resumed from {path} at step {r.progress.step}")
    changed = [
        f"{k} {v} -> {now.get(k)}"
        for k, v in saved.items()
        if now.get(k) != v and k not in ("resume", "overwrite")
    ]
    if changed:
        print("options that differ from the saved run's: " + ", ".join(changed))
    saved_batch = saved.get("batch_size", 0) * saved.get("world_size", 0)
    if saved_batch != now["batch_size"] * now["world_size"]:
        print(
            f"the global batch (--batch-size x ranks) was {saved_batch}: the data order and the curve will "
            "differ from those of an uninterrupted run"
        )
    if r.rng.reseeded:
        print("saved at another world size: every rank starts a fresh random stream (dropout)")


def save(r: Run, step: int) -> None:
    # collective: every rank writes its shards and its own loop state into a fresh directory
    path = Path(r.args.out_dir) / "checkpoints" / f"step_{step:06d}"
    save_checkpoint(path, r.model, r.optimizer, app_state=r.app_state())


# ---------------------------------------------------------------------------------------- steps
def train_step(
    model: FSDP,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    scaler: ShardedGradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
) -> float:
    """One optimizer step on this rank's batch; returns the loss averaged over the ranks."""
    _, loss = model(x, y)
    scaler.scale(loss).backward()  # FSDP reduce-scatters: each rank gets the mean gradient of its shard
    scaler.step(optimizer)  # updates this rank's shards only (skipped on every rank after an overflow)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()  # the learning rate of the next step
    mean = loss.detach().float()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model: FSDP, loaders: dict[str, DataLoader[Any]], device: torch.device) -> dict[str, float]:
    """Mean loss over each split's evaluation windows, averaged over all ranks."""
    model.eval()  # no dropout; every rank still runs it, since each FSDP forward is a collective
    out = {}
    for split, loader in loaders.items():
        losses = [model(x.to(device), y.to(device))[1] for x, y in loader]
        mean = torch.stack(losses).mean()
        dist.all_reduce(mean)
        out[split] = mean.item() / dist.get_world_size()
    model.train()
    return out


def record_eval(r: Run, step: int) -> None:
    curve = r.progress.curve
    if curve["iter"][-1:] == [step]:  # evaluated there before a resume
        return
    losses = evaluate(r.model, r.data.eval_loaders, r.device)
    for key, value in (("iter", step), ("train", losses["train"]), ("val", losses["val"])):
        curve[key].append(value)
    if dist.get_rank() == 0:
        tqdm.write(f"iter {step:5d}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")


@torch.no_grad()
def sample(model: FSDP, chars: list[str], args: argparse.Namespace, device: torch.device) -> str:
    """Characters generated after the prompt "def ". Every rank runs the same decode loop, since each
    FSDP forward is a collective; the same generator seed keeps them in lockstep."""
    model.eval()
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.tensor([[chars.index(ch) for ch in "def "]], device=device)  # (1, T0)
    for _ in range(args.sample_chars):
        logits, _ = model(idx[:, -args.block_size :])  # (1, T, V); crop to the context length
        logits = logits[:, -1, :].float().cpu()  # (1, V): only the last position predicts the next one
        top, _ = torch.topk(logits, min(args.top_k, logits.size(-1)))
        logits[logits < top[:, [-1]]] = -float("inf")  # keep the k likeliest characters
        next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen)  # (1, 1)
        idx = torch.cat([idx, next_id.to(device)], dim=1)
    model.train()
    return "".join(chars[i] for i in idx[0].tolist())


# ---------------------------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> None:
    rank, world_size, device = setup_distributed()
    checkpoint = previous_run(args, rank)
    data = build_data(args, rank, world_size)
    model, n_params = build_model(args, len(data.chars), device)
    optimizer, scheduler, scaler = build_optimizer(args, model)
    torch.manual_seed(args.seed + rank)  # each rank its own random stream (dropout)
    progress = Progress({**vars(args), "world_size": world_size})
    rng = RNGState(args.seed, rank, world_size, device)
    r = Run(args, device, data, model, optimizer, scheduler, scaler, progress, rng)
    if checkpoint is not None:
        resume(r, checkpoint)
        if progress.step >= args.max_iters:  # the final checkpoint is written after the outputs
            if rank == 0:
                print(
                    f"the run in {args.out_dir} is finished: its newest checkpoint is at step {progress.step} "
                    f"(--max-iters {args.max_iters}); nothing to do, and its outputs are left as they are. "
                    "Pass a larger --max-iters to train on, or --overwrite to start afresh"
                )
            finish()
            return
    if rank == 0:
        print(f"vocab {len(data.chars)}, {len(data.sampler.dataset):,} training windows")  # type: ignore[arg-type]
        print(
            f"model: {n_params / 1e6:.2f}M parameters, {args.n_layer} layers x {args.n_embd} wide, "
            f"world size {world_size} on {device.type} ({dist.get_backend()}), "
            f"{args.batch_size * args.block_size * world_size:,} tokens per step"
        )
    stats = train(r)
    record_eval(r, args.max_iters)
    write_outputs(r, stats)
    if args.save_interval > 0:  # last: a run whose final checkpoint exists has written its outputs
        save(r, args.max_iters)
    finish()


def train(r: Run) -> dict[str, Any]:
    """The loop, from the step the run stands at to --max-iters; returns what it measured."""
    args, progress = r.args, r.progress
    start = progress.step
    gathered_bytes = 0  # bytes all-gathered by training steps (evaluation excluded)
    peak_gathered = 0  # the most parameter bytes gathered at once in a training step
    t0 = time.perf_counter()
    bar = tqdm(
        range(start, args.max_iters), initial=start, total=args.max_iters, disable=dist.get_rank() != 0
    )
    for step in bar:
        if step % args.eval_interval == 0:
            record_eval(r, step)
        x, y = next(r.data.batches)  # (B, T) each: this rank's share of the global batch
        r.model.reset_comm_stats()
        r.model.reset_memory_stats()
        loss = train_step(r.model, r.optimizer, r.scheduler, r.scaler, x.to(r.device), y.to(r.device))
        gathered_bytes += r.model.comm_stats()["all_gather"]["bytes"]
        peak_gathered = max(peak_gathered, r.model.memory_stats()["unsharded_peak"])
        progress.step_losses.append(loss)
        progress.step = step + 1
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{r.scheduler.get_last_lr()[0]:.1e}")
        if args.save_interval and progress.step % args.save_interval == 0 and progress.step < args.max_iters:
            save(r, progress.step)
    bar.close()
    n = args.max_iters - start
    return {
        "steps": n,
        "seconds": time.perf_counter() - t0,
        "gathered": gathered_bytes // n,
        "peak": peak_gathered,
    }


# ---------------------------------------------------------------------------------------- outputs
def write_outputs(r: Run, stats: dict[str, Any]) -> None:
    """model.pt (every rank gathers, rank 0 writes), a sample, loss_curve.json and .png, a summary."""
    out_dir, curve = Path(r.args.out_dir), r.progress.curve
    memory = r.model.memory_stats()  # this rank's bytes: shards, their gradients, full parameters
    state_dict = r.model.state_dict()  # collective: every rank must call it (it all-gathers)
    text = sample(r.model, r.data.chars, r.args, r.device)
    if dist.get_rank() != 0:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.cpu() for k, v in state_dict.items()}, out_dir / "model.pt")  # loads without a GPU
    print("sample:\n" + text + "\n")
    summary = {
        "config": vars(r.args),
        "world_size": dist.get_world_size(),
        "device": r.device.type,
        "steps_this_run": stats["steps"],
        "train_seconds": round(stats["seconds"], 2),
        "all_gather_bytes_per_step": stats["gathered"],
        "memory_bytes": {**memory, "peak_gathered_in_a_step": stats["peak"]},
        **curve,
        "step_loss": r.progress.step_losses,
    }
    (out_dir / "loss_curve.json").write_text(json.dumps(summary, indent=1))
    plot_curve(curve, r.progress.step_losses, out_dir / "loss_curve.png")
    print(f"wrote {out_dir / 'model.pt'}, {out_dir / 'loss_curve.png'}, {out_dir / 'loss_curve.json'}")
    ms = 1000 * stats["seconds"] / stats["steps"]
    print(
        f"{stats['steps']} steps in {stats['seconds']:.1f}s ({ms:.0f} ms/step incl. evaluations), "
        f"{r.args.dtype}: {stats['gathered'] / 2**20:.2f} MiB all-gathered per step per rank"
    )
    print(
        f"parameters per rank: {memory['sharded_params'] / 2**20:.2f} MiB of shards; "
        f"{memory['full_params'] / 2**20:.2f} MiB in full, of which at most "
        f"{stats['peak'] / 2**20:.2f} MiB were gathered at once in a step"
    )
    print(f"loss: start {curve['train'][0]:.4f} -> end {curve['train'][-1]:.4f} (val {curve['val'][-1]:.4f})")


def plot_curve(curve: dict[str, list[float]], step_losses: list[float], path: Path) -> None:
    import matplotlib  # imported here: only rank 0 plots, and only at the end

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(len(step_losses)), step_losses, color="0.8", lw=0.8, label="step loss (mean over ranks)")
    ax.plot(curve["iter"], curve["train"], "o-", label="train (eval)")
    ax.plot(curve["iter"], curve["val"], "s-", label="val (eval)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy loss (nats/char)")
    ax.set_title("char-level GPT on Python stdlib source, nested FSDP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
