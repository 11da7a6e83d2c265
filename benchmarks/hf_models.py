"""Two Hugging Face causal LMs as users build them (from a config, nothing downloaded), sized
for benchmarks/partition.py on 4 CPU ranks: GPT-2 (tied embeddings, learned positions) and
Llama (rotary embeddings, untied head), 8 layers of width 128 and a vocabulary of 8192, so the
embedding and head weigh more than a layer, as in real models. Llama keeps its config's default
head_dim (128: the value is not re-derived when hidden_size changes), so its 4 attention heads
project to 512 wide; the figures in the README were measured so."""

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB, SEQUENCE, BATCH = 8192, 64, 16


def _build(family: str):
    cfg = AutoConfig.for_model(family)
    for key, value in dict(num_hidden_layers=8, hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=4, intermediate_size=512, vocab_size=VOCAB,
                           n_layer=8, n_embd=128, n_head=4, max_position_embeddings=SEQUENCE,
                           n_positions=SEQUENCE, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2).items():
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    return AutoModelForCausalLM.from_config(cfg)


def gpt2():
    return _build("gpt2")


def llama():
    return _build("llama")


def batch(step: int):
    tokens = torch.randint(3, VOCAB, (BATCH, SEQUENCE + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
