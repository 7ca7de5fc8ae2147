"""The example's model: a small GPT (decoder-only transformer, GPT-2 layout), nothing distributed.

``examples/train_gpt.py`` trains it with nested FSDP, one unit per ``Block``; the benchmarks import
it from here (``from examples.gpt import GPT``, run from the repository root). It knows nothing of
FSDP: a state dict saved from the wrapped model loads into ``GPT(...)`` as it is.

Shapes: B = batch, T = time (<= block_size), C = n_embd, nh = n_head, hs = C // nh, V = vocab size.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention"]


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
