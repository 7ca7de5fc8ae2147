"""Hugging Face ``transformers`` models as users bring them: training, ``save_pretrained``, ``generate``.

Tiny configs with random weights (nothing is downloaded), wrapped with the policy built from the
model's own ``_no_split_modules``, on two ranks. Training equals torch's DDP to the last bit (in
bf16 mixed precision, DDP's own mixed precision needs CUDA, so the reference is what it does, by
hand: a bf16 copy computes, its gradients are averaged in fp32 over the ranks, fp32 Adam steps).
``transformers`` is an optional test dependency (``pip install -e ".[hf]"``): without it these
tests are skipped.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import MixedPrecision, no_split_modules_auto_wrap_policy
from fsdp.api import MemoryState
from tests.rank_pool import RankPool

transformers = pytest.importorskip(
    "transformers",
    reason="needs Hugging Face transformers, an optional test dependency: pip install -e '.[hf]'",
)

VOCAB = 64
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _config(name: str) -> Any:
    """A tiny config without dropout (DDP and FSDP must draw nothing random to agree bit for bit)."""
    t = transformers
    tokens = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if name == "gpt2":  # tied head
        return t.GPT2Config(
            n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0, embd_pdrop=0,
            attn_pdrop=0, **tokens,
        )  # fmt: skip
    if name == "llama":
        return t.LlamaConfig(
            num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=VOCAB, max_position_embeddings=32, **tokens,
        )  # fmt: skip
    if name == "bert":  # masked LM; its MLM head is tied to the word embeddings
        return t.BertConfig(
            num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=VOCAB,
            max_position_embeddings=32, pad_token_id=0, hidden_dropout_prob=0, attention_probs_dropout_prob=0,
        )  # fmt: skip
    if name == "t5":  # encoder-decoder: cross-attention, embeddings shared by encoder, decoder and head
        return t.T5Config(
            num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=VOCAB, dropout_rate=0,
            decoder_start_token_id=0, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
    assert name == "bart"
    return t.BartConfig(
        encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        dropout=0, attention_dropout=0, activation_dropout=0, decoder_start_token_id=2, forced_eos_token_id=None,
        **tokens,
    )  # fmt: skip


CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "bert": "BertForMaskedLM",
    "t5": "T5ForConditionalGeneration",
    "bart": "BartForConditionalGeneration",
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return getattr(transformers, CLASSES[name])(_config(name))


def _batch(name: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    if name in ("t5", "bart"):
        return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (2, 7), generator=g)}
    if name == "bert":
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = ids[:, ::3]  # every third token is predicted
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids}


def _wrap(model: nn.Module, bf16: bool) -> FSDP:
    """The way the docs say: the policy from the model's own block declaration, nothing imported."""
    kw: dict[str, Any] = {"mixed_precision": BF16} if bf16 else {}
    return FSDP(model, auto_wrap_policy=no_split_modules_auto_wrap_policy(model), **kw)


class _HandMadeMixedPrecisionDDP:
    """torch DDP's mixed precision (param_dtype=bf16, reduce_dtype=fp32) by hand: a bf16 copy of the
    fp32 master computes; its gradients, cast to fp32, are averaged over the ranks onto the master."""

    def __init__(self, master: nn.Module) -> None:
        self.master, self.low = master, copy.deepcopy(master)

    def __call__(self, **batch: torch.Tensor) -> Any:
        for low, p in zip(self.low.parameters(), self.master.parameters(), strict=True):
            low.data, low.grad = p.data.to(torch.bfloat16), None
        return self.low(**batch)

    def reduce(self) -> None:
        world = dist.get_world_size()
        for low, p in zip(self.low.parameters(), self.master.parameters(), strict=True):
            g = low.grad.float()
            dist.all_reduce(g)
            p.grad = g / world


def _train_beside_ddp(name: str, checkpointing: bool, bf16: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    ref = _build(name).train()
    model = _wrap(copy.deepcopy(ref), bf16)
    if checkpointing:  # HF's own activation checkpointing, per block; on the wrapper after wrapping
        ref.gradient_checkpointing_enable()
        model.gradient_checkpointing_enable()
    peer: Any = _HandMadeMixedPrecisionDDP(ref) if bf16 else nn.parallel.DistributedDataParallel(ref)
    block_calls = [0]
    unit = next(m for m in model.modules() if isinstance(m, FSDP) and m is not model)
    # (HF checkpoints the block's forward, so the block's own hooks run once: count a module inside)
    inside = next(m for m in list(unit.module.modules())[1:] if not isinstance(m, nn.ModuleList))
    inside.register_forward_pre_hook(lambda m, a: block_calls.__setitem__(0, block_calls[0] + 1))
    opts = [torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)]
    losses = []
    for step in range(3):
        batch = _batch(name, torch.Generator().manual_seed(10 * step + rank))
        pair = []
        for m, opt in zip((model, peer), opts):
            loss = m(**batch).loss
            loss.backward()
            if m is peer and bf16:
                peer.reduce()
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        losses.append(tuple(pair))
    ours, theirs = model.state_dict(), ref.state_dict()
    return {
        "losses": losses,
        "keys_equal": list(ours) == list(theirs),
        "differ": [k for k in theirs if not torch.equal(ours[k], theirs[k])],
        "block_calls": block_calls[0],
        "units": sum(isinstance(m, FSDP) for m in model.modules()),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf_checkpointing"])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_training_equals_ddp_bit_for_bit(pool: RankPool, name: str, checkpointing: bool, dtype: str) -> None:
    for r in pool.run(_train_beside_ddp, name, checkpointing, dtype == "bf16", timeout=120):
        assert all(a == b for a, b in r["losses"]), r["losses"]
        assert r["keys_equal"] and r["differ"] == [], r["differ"]
        assert r["block_calls"] == 3 * (2 if checkpointing else 1), r  # recomputed in backward when on
        assert r["units"] == 1 + (3 if name == "bert" else 4), r  # the root and one unit per block


def _save_pretrained_and_reload(name: str) -> Any:
    model = _wrap(_build(name), bf16=False)
    batch = _batch(name, torch.Generator().manual_seed(dist.get_rank()))
    model(**batch).loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.step()  # values no initialization would give
    state = model.state_dict()  # collective: the full state dict, plain names
    if dist.get_rank() != 0:
        return None
    saved = dict(state)  # (save_pretrained empties the dict it is given as it writes)
    path = tempfile.mkdtemp(prefix="fsdp-hf-")
    try:
        model.save_pretrained(path, state_dict=saved)  # HF's method, reached through the wrapper
        reloaded = getattr(transformers, CLASSES[name]).from_pretrained(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    again = reloaded.state_dict()
    return {
        "keys_equal": sorted(again) == sorted(state),
        "differ": [k for k in state if not torch.equal(again[k], state[k])],
        "tied": name == "bert"
        or reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_save_pretrained_of_the_full_state_dict_reloads_identically(pool: RankPool, name: str) -> None:
    r = pool.run(_save_pretrained_and_reload, name, timeout=120)[0]
    assert r["keys_equal"] and r["differ"] == [], r
    if name in ("gpt2", "t5", "bart"):
        assert r["tied"], r  # the tie survives


def _generate(name: str, bf16: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    plain = _build(name).eval()
    model = _wrap(copy.deepcopy(plain), bf16).eval()
    if bf16:  # the reference computes with bf16 parameters too (buffers keep their dtype, as in the wrapper)
        for p in plain.parameters():
            p.data = p.data.to(torch.bfloat16)
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(rank))
    model.reset_memory_stats()
    # through the wrapper's attribute: HF's generate calls the inner module itself, step by step
    got = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    expected = plain.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    memory = model.memory_stats()
    return {
        "equal": torch.equal(got, expected),
        "new_tokens": got.shape[1] - (0 if name in ("t5", "bart") else prompt.shape[1]),
        "peak_below_full": 0 < memory["unsharded_peak"] < memory["full_params"],
        "freed": memory["unsharded"] == 0
        and all(h.state is MemoryState.SHARDED for w in model._wrappers() for h in w.handles),
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["bart", "gpt2", "llama", "t5"])
def test_generate_through_the_wrapper_equals_the_plain_model(pool: RankPool, name: str, dtype: str) -> None:
    for r in pool.run(_generate, name, dtype == "bf16", timeout=120):
        assert r["equal"], r
        assert r["new_tokens"] >= 8, r
        assert r["peak_below_full"] and r["freed"], r  # unit by unit, never the whole model at once


def _generate_until_eos() -> dict[str, Any]:
    """Ranks whose sampled generations end at different lengths: HF's ``synced_gpus=True`` keeps a
    finished rank calling the model (each call is collective) until every rank is done."""
    rank = dist.get_rank()
    plain = _build("gpt2").eval()
    model = _wrap(copy.deepcopy(plain), bf16=False).eval()
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(rank))
    kw: dict[str, Any] = {
        "max_new_tokens": 25,
        "do_sample": True,
        "top_k": 3,
        "eos_token_id": [5, 6, 7, 8, 9, 10],
    }
    torch.manual_seed(rank)
    got = model.generate(prompt, synced_gpus=True, **kw)
    torch.manual_seed(rank)
    expected = plain.generate(prompt, **kw)
    lengths = [torch.tensor(got.shape[1]), torch.tensor(0)]
    dist.all_gather(lengths, lengths[0].clone())
    return {"equal": torch.equal(got, expected), "lengths": [int(n) for n in lengths]}


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_generate_with_ranks_stopping_at_different_lengths(pool: RankPool) -> None:
    for r in pool.run(_generate_until_eos, timeout=120):
        assert r["equal"], r
        assert r["lengths"][0] != r["lengths"][1], r  # (the seeds make them stop apart)
