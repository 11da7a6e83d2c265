"""Building blocks of the example models: a pre-norm transformer layer and tensor-parallel
layers for blocks that run on several devices.

Tensor-parallel layers draw the whole weight (so the RNG advances exactly as in the unsharded
layer the single-process reference builds) and keep their group rank's chunk, marked with
pyplan.runtime.shard. With group None they are the plain, whole layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pyplan.runtime import shard
from pyplan.models.vocab import cross_entropy
from pyplan.models.collectives import all_sum

__all__ = ["ColumnParallelLinear", "Embed", "Head", "Layer", "RowParallelLinear",
           "VocabParallelEmbedding", "VocabParallelHead", "all_sum",
           "vocab_parallel_cross_entropy"]


class Embed(nn.Module):
    """Token embedding plus learned positions, (B, T) ids -> (B, T, D)."""

    def __init__(self, vocab: int, dim: int, sequence: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(sequence, dim) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Head(nn.Module):
    """Final norm and vocabulary projection, (B, T, D) -> (B, T, vocab)."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class Layer(nn.Module):
    """Pre-norm transformer layer: self-attention and a 4x MLP, each with residual dropout
    (GPT-2's 0.1), (B, T, D) -> (B, T, D)."""

    def __init__(self, dim: int, heads: int, causal: bool = True, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.drop = nn.Dropout(dropout)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def _chunk(whole: torch.Tensor, group, dim: int) -> nn.Parameter:
    if group is None:
        return nn.Parameter(whole.detach().clone())
    size = dist.get_world_size(group)
    if whole.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {whole.shape[dim]} does not split over "
                         f"{size} ranks")
    part = whole.detach().chunk(size, dim)[dist.get_rank(group)].clone()
    return shard(nn.Parameter(part), dim)


def _span(total: int, group) -> tuple[int, int]:
    if group is None:
        return 0, total
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return rank * total // size, (rank + 1) * total // size


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a slice of the vocabulary; tokens outside it contribute zeros."""

    def __init__(self, vocab: int, dim: int, group) -> None:
        super().__init__()
        self.group = group
        self.weight = _chunk(torch.randn(vocab, dim) * 0.02, group, 0)
        self.lo, self.hi = _span(vocab, group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        local = F.embedding((ids - self.lo).clamp(0, self.hi - self.lo - 1), self.weight)
        return all_sum(local * mine.unsqueeze(-1), self.group)


class VocabParallelHead(nn.Module):
    """Logits of the group rank's slice of the vocabulary (all of it with group None); as the
    last block, its output goes straight to vocab_parallel_cross_entropy on the same ranks."""

    def __init__(self, dim: int, vocab: int, group) -> None:
        super().__init__()
        self.weight = _chunk(torch.randn(vocab, dim) * dim ** -0.5, group, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 group) -> torch.Tensor:
    """Mean cross-entropy of logits split over the vocabulary (Megatron-LM): only per-token
    sums cross the ranks, never the logits."""
    if group is None:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return cross_entropy(logits, targets, group)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the output features split over the ranks (output stays split)."""

    def __init__(self, features_in: int, features_out: int, group) -> None:
        super().__init__()
        whole = nn.Linear(features_in, features_out)
        self.weight = _chunk(whole.weight, group, 0)
        self.bias = _chunk(whole.bias, group, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input features split over the ranks; the partial products are
    summed, the bias (replicated) is added once after the sum."""

    def __init__(self, features_in: int, features_out: int, group) -> None:
        super().__init__()
        self.group = group
        whole = nn.Linear(features_in, features_out)
        self.weight = _chunk(whole.weight, group, 1)
        self.bias = nn.Parameter(whole.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_sum(F.linear(x, self.weight), self.group) + self.bias
