"""The models of benchmarks/fidelity.py, as users write them: factories, a batch and a loss.

- `mlp`: residual MLP layers of uneven widths between an input projection and a head (a
  chain: pyplan cuts it between its children);
- `gpt2`, `llama`: Hugging Face causal LMs from a config (tests/models/hf.py's), 8 layers of
  width 256, a vocabulary of 8192, sequences of 128 tokens: cut in their own forward.
"""

import sys
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))

import hf  # noqa: E402 - the one place of the Hugging Face configs

WIDTH, BATCH, SEQUENCE, VOCAB = 256, 16, 128, 8192


class Residual(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, hidden), nn.Linear(hidden, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def mlp() -> nn.Module:
    widths = [2 * WIDTH, 4 * WIDTH, 8 * WIDTH, 8 * WIDTH, 2 * WIDTH, 4 * WIDTH]
    return nn.Sequential(OrderedDict(
        input=nn.Linear(WIDTH, WIDTH),
        layers=nn.Sequential(*(Residual(w) for w in widths)),
        head=nn.Linear(WIDTH, WIDTH)))


def _lm(family: str):
    return hf.build(family, num_hidden_layers=8, hidden_size=WIDTH, num_attention_heads=4,
                    num_key_value_heads=4, intermediate_size=4 * WIDTH, head_dim=WIDTH // 4,
                    n_layer=8, n_embd=WIDTH, n_head=4, vocab_size=VOCAB,
                    max_position_embeddings=SEQUENCE, n_positions=SEQUENCE)


def gpt2():
    return _lm("gpt2")


def llama():
    return _lm("llama")


def batch(step: int):
    """Tokens for the language models; vectors for the MLP (both take what they need)."""
    tokens, labels = hf.tokens(VOCAB, SEQUENCE, BATCH)
    return tokens, labels


def mlp_batch(step: int):
    x = torch.randn(BATCH * 8, WIDTH)
    return x, torch.randn(BATCH * 8, WIDTH)


def loss(logits, labels):
    if logits.dtype == torch.long or labels.is_floating_point():
        return F.mse_loss(logits, labels)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
