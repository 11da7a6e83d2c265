"""Two Hugging Face causal LMs as users build them (from a config, nothing downloaded), sized
for benchmarks/partition.py on 4 CPU ranks: GPT-2 (tied embeddings, learned positions) and
Llama (rotary embeddings, untied head), 8 layers of width 128 and a vocabulary of 8192, so the
embedding and head weigh more than a layer, as in real models. Llama keeps its config's default
head_dim (128: the value is not re-derived when hidden_size changes), so its 4 attention heads
project to 512 wide; the figures in docs/benchmarks.md were measured so. The configs come from
tests/models/hf.py's `config`, the tests' tiny models resized."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))

import hf  # noqa: E402  (tests/models/hf.py)

VOCAB, SEQUENCE, BATCH = 8192, 64, 16
SIZE = dict(num_hidden_layers=8, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=512, head_dim=128, vocab_size=VOCAB, n_layer=8, n_embd=128,
            n_head=4, max_position_embeddings=SEQUENCE, n_positions=SEQUENCE)


def gpt2():
    return hf.build("gpt2", **SIZE)


def llama():
    return hf.build("llama", **SIZE)


def batch(step: int):
    return hf.tokens(VOCAB, SEQUENCE, BATCH)


loss = hf.loss
