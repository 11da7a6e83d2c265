"""The models of benchmarks/fidelity.py, as users write them: factories, a batch and a loss.

- `mlp`: residual MLP layers of uneven widths between an input projection and a head (a
  chain: pyplan cuts it between its children);
- `gpt2`, `llama`: Hugging Face causal LMs from a config (tests/models/hf.py's), 8 layers of
  width 256, a vocabulary of 8192, sequences of 128 tokens: cut in their own forward;
- `drawn_model_I` / `drawn_batch_I`: models pyplan was not tuned on, drawn from a seed
  ($FIDELITY_SEED; $FIDELITY_UNSEEN of them): plain MLPs of 4-16 layers whose widths
  (64-2,048) differ several-fold, with GELU, ReLU, SiLU or Tanh; a residual MLP; a Llama.
"""

import math
import os
import random
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


# -- Models pyplan was not tuned on, drawn from a seed (FIDELITY_SEED, default 2026): the
# benchmark's unseen set. Named drawn_model_I / drawn_batch_I (I = 0, 1, ...), so a plan can
# name them; the same seed draws the same models in every process.

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}
MACS = 4e8  # multiply-adds per micro-batch at most (fewer rows, down to 64, for wide models)


def _rng(index: int) -> random.Random:
    return random.Random(f"{os.environ.get('FIDELITY_SEED', '2026')}-{index}")


def _width(rng: random.Random) -> int:
    """64 .. 2048, log-uniform: neighbouring layers differ several-fold."""
    return int(round(2 ** rng.uniform(6, 11) / 8)) * 8


def _rows(rng: random.Random, macs_per_row: int) -> int:
    """Rows of a micro-batch: a power of two in 64 .. 1024, fewer where MACS would be
    exceeded."""
    rows = 2 ** rng.randint(6, 10)
    while rows > 64 and rows * macs_per_row > MACS:
        rows //= 2
    return rows


def drawn(index: int, count: int) -> dict:
    """The description of drawn model `index` of `count`: the last is a Llama, the one
    before a residual MLP, the others plain MLPs; each with a recompute mode."""
    rng = _rng(index)
    recompute = rng.choice(["never", "always", "auto"])
    act = rng.choice(sorted(ACTIVATIONS))
    if index == count - 1:
        hidden = rng.choice([128, 192, 256])
        return dict(kind="llama", layers=rng.randint(2, 6), hidden=hidden,
                    intermediate=rng.randint(2, 5) * hidden, vocab=rng.choice([4096, 8192]),
                    sequence=rng.choice([64, 128]), recompute=recompute)
    if index == count - 2:
        width = rng.choice([128, 256, 512])
        hidden = [_width(rng) for _ in range(rng.randint(4, 10))]
        return dict(kind="residual", width=width, hidden=hidden, act=act,
                    rows=_rows(rng, 2 * width * sum(hidden)), recompute=recompute)
    widths = [_width(rng) for _ in range(rng.randint(4, 16) + 1)]
    return dict(kind="mlp", widths=widths, act=act,
                rows=_rows(rng, sum(a * b for a, b in zip(widths, widths[1:]))), recompute=recompute)


def describe(spec: dict) -> str:
    if spec["kind"] == "llama":
        return (f"llama {spec['layers']} layers, hidden {spec['hidden']}, mlp "
                f"{spec['intermediate']}, vocab {spec['vocab']}, seq {spec['sequence']}")
    if spec["kind"] == "residual":
        return (f"residual {len(spec['hidden'])} blocks, width {spec['width']}, hidden "
                f"{min(spec['hidden'])}-{max(spec['hidden'])}, {spec['act']}, rows "
                f"{spec['rows']}")
    w = spec["widths"]
    return (f"mlp {len(w) - 1} layers, widths {min(w)}-{max(w)}, {spec['act']}, rows "
            f"{spec['rows']}")


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.act, self.down = nn.Linear(width, hidden), ACTIVATIONS[act](), \
            nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def _drawn_model(spec: dict) -> nn.Module:
    if spec["kind"] == "llama":
        return hf.build("llama", num_hidden_layers=spec["layers"], hidden_size=spec["hidden"],
                        num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=spec["intermediate"], head_dim=spec["hidden"] // 4,
                        vocab_size=spec["vocab"], max_position_embeddings=spec["sequence"])
    if spec["kind"] == "residual":
        width = spec["width"]
        return nn.Sequential(nn.Linear(width, width),
                             *(Block(width, h, spec["act"]) for h in spec["hidden"]),
                             nn.Linear(width, width))
    layers = []
    for a, b in zip(spec["widths"], spec["widths"][1:]):
        layers += [nn.Linear(a, b), ACTIVATIONS[spec["act"]]()]
    return nn.Sequential(*layers[:-1])  # no activation after the last layer


def _drawn_batch(spec: dict, step: int):
    g = torch.Generator().manual_seed(step)
    if spec["kind"] == "llama":
        tokens = torch.randint(0, spec["vocab"], (16, spec["sequence"] + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    rows = 8 * spec["rows"]
    first, last = (spec["width"],) * 2 if spec["kind"] == "residual" else \
        (spec["widths"][0], spec["widths"][-1])
    return torch.randn(rows, first, generator=g), torch.randn(rows, last, generator=g)


def __getattr__(name: str):
    """drawn_model_I and drawn_batch_I, from the seed."""
    for prefix, make in (("drawn_model_", lambda s: lambda: _drawn_model(s)),
                         ("drawn_batch_", lambda s: lambda step: _drawn_batch(s, step))):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            index = int(name[len(prefix):])
            return make(drawn(index, int(os.environ.get("FIDELITY_UNSEEN", "8"))))
    raise AttributeError(name)
