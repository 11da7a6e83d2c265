"""Vocabulary parallelism for a model as it comes: its token embedding and its output head
sharded over the ranks of a multi-device block (Tessel's M-shape: both on every device, the
layers between them in single-device stages), and its loss computed on the sharded logits
without gathering them (torch's `loss_parallel`).

Each rank keeps its chunk of the vocabulary, torch.chunk(whole, ranks, 0)[rank], as a plain
parameter marked with pyplan.runtime.shard (so pyplan's gradient handling, clipping, --check and
checkpoints treat it as the hand-written tensor-parallel layers are treated); DTensor carries
the communication:

- the embedding looks the ids up in the rank's rows (ids of other ranks' rows give zeros: the
  masked lookup of DTensor's Shard(0) embedding, done locally because torch's DTensor has no
  row-wise embedding backward and would make the whole vocabulary's gradient on every rank)
  and the partial rows become whole as a Partial DTensor redistributed to Replicate (an
  all-reduce); the module's own forward runs (a subclass scaling its output, Gemma's, too);
- the head is its nn.Linear on the rank's rows of the weight: the rank's slice of the logits,
  no communication;
- the loss gets the logits as a DTensor sharded on the vocabulary dimension and runs the user's
  own loss function (F.cross_entropy on them) under `loss_parallel`, forward and backward.

A multi-device block in pyplan is one SPMD program whose output gradient may arrive split among
its ranks (the pipeline hands it to one of them) and whose input and replicated-parameter
gradients are summed over its ranks. DTensor's autograd assumes replicated gradients instead, so
where a sharded computation meets the rest of the block, `_summed_gradient` (identity forward,
all-reduce of the gradient backward) turns the split gradient into the whole one: after the
embedding's all-reduce and on the loss (pyplan seeds it on the block's first rank only). The
head's input gradient stays each rank's share (its rows' contribution), which pyplan sums.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from pyplan.errors import PlanError

__all__ = ["Vocab", "check_divisible", "check_modules", "find", "mesh_of", "parallel_loss",
           "shard"]


@dataclass(frozen=True)
class Vocab:
    """The modules sharded over the vocabulary (dotted names in the model)."""

    embedding: str
    """The token embedding (an nn.Embedding over the vocabulary)."""
    head: str
    """The output projection (an nn.Linear whose outputs are the vocabulary's logits)."""
    size: int


def _token_ids(inputs) -> torch.Tensor | None:
    """The micro-batch's token ids: the inputs, or `input_ids`, or their first integer tensor."""
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, dict):
        if isinstance(inputs.get("input_ids"), torch.Tensor):
            return inputs["input_ids"]
        inputs = list(inputs.values())
    for value in inputs if isinstance(inputs, (tuple, list)) else ():
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            return value
    return None


def find(model: nn.Module, inputs, first: tuple[str, ...], last: tuple[str, ...],
         logits: torch.Tensor) -> Vocab | None:
    """The token embedding among the modules of the first unit (`first`, an nn.Embedding over
    the logits' vocabulary called with the token ids) and the head among those of the last
    (`last`, the last nn.Linear called there with the vocabulary as its outputs); None when the
    model has not both. `logits`: the whole model's output on `inputs`."""
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        return None
    size = logits.shape[-1]
    ids = _token_ids(inputs)

    def inside(name: str, units: tuple[str, ...]) -> bool:
        return any(name == u or name.startswith(f"{u}.") for u in units)

    called: list[tuple[str, object]] = []
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.num_embeddings == size and \
                inside(name, first):
            handles.append(module.register_forward_pre_hook(
                lambda _m, args, name=name: called.append((name, args[0] if args else None))))
        elif isinstance(module, nn.Linear) and module.out_features == size and \
                inside(name, last):
            handles.append(module.register_forward_pre_hook(
                lambda _m, _a, name=name: called.append((name, None))))
    if not handles or ids is None:
        for handle in handles:
            handle.remove()
        return None
    from pyplan.models.forward import observe

    observe(model, inputs, handles)
    embedding = next((n for n, arg in called if isinstance(arg, torch.Tensor) and
                      isinstance(model.get_submodule(n), nn.Embedding) and
                      arg.shape == ids.shape and torch.equal(arg, ids)), None)
    heads = [n for n, _ in called if isinstance(model.get_submodule(n), nn.Linear)]
    if embedding is None or not heads:
        return None
    return Vocab(embedding, heads[-1], size)


def check_divisible(vocab: Vocab, ranks: int) -> None:
    """PlanError unless every rank gets the same number of rows of the vocabulary."""
    if vocab.size % ranks:
        raise PlanError(f"the vocabulary of {vocab.size} tokens ({vocab.embedding}, "
                        f"{vocab.head}) does not split evenly over {ranks} devices",
                        hint=f"pad it to a multiple of {ranks} (a Hugging Face model: "
                             f"model.resize_token_embeddings(n, pad_to_multiple_of={ranks}))")


def check_modules(model: nn.Module, embedding: str, head: str,
                  file: str | None = None) -> tuple[nn.Embedding, nn.Linear]:
    """The embedding and head modules model.vocab_parallel names; PlanError unless they are an
    nn.Embedding and an nn.Linear over one vocabulary."""
    found = []
    for name, kind in ((embedding, nn.Embedding), (head, nn.Linear)):
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        if not isinstance(module, kind):
            raise PlanError(f"model.vocab_parallel: {name} is not an nn.{kind.__name__} in "
                            "the model", hint="the plan is stale: re-run pyplan partition",
                            file=file)
        found.append(module)
    if found[0].num_embeddings != found[1].out_features:
        raise PlanError(f"model.vocab_parallel: {embedding} has {found[0].num_embeddings} "
                        f"tokens, {head} {found[1].out_features} outputs",
                        hint="the plan is stale: re-run pyplan partition", file=file)
    return found[0], found[1]


@functools.lru_cache(maxsize=None)
def _mesh(group, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type)


def mesh_of(group, device: torch.device):
    """A one-dimensional DeviceMesh over the ranks of `group` (made once per group)."""
    return _mesh(group, device.type)


def _summed_gradient(x: torch.Tensor, mesh) -> torch.Tensor:
    """x itself; backward, the gradient summed over the mesh (a partial gradient made whole)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(x, mesh, [Replicate()], run_check=False) \
        .to_local(grad_placements=[Partial()])


def _holders(model: nn.Module, param: torch.Tensor) -> list[tuple[nn.Module, str]]:
    """Every (module, attribute) holding `param` (a tied parameter has several)."""
    return [(m, key) for m in model.modules() for key, p in m._parameters.items()
            if p is param]


def _local(param: torch.Tensor, ranks: int, rank: int) -> nn.Parameter:
    from pyplan.runtime.binding import shard as mark

    chunk = param.detach().chunk(ranks, 0)[rank].clone()
    return mark(nn.Parameter(chunk, requires_grad=param.requires_grad), 0)


def shard(model: nn.Module, vocab: Vocab, group, device: torch.device, *,
          active: Callable[[], bool] | None = None) -> None:
    """In place: the embedding and the head of `model` keep this rank's rows of the vocabulary
    (a tied weight stays one parameter). `active()` says whether a call of the embedding is its
    own block's (the forward cut also calls it while a later stage runs the model's forward up
    to its entry: then it returns zeros, at no cost and without a collective)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    check_divisible(vocab, ranks)
    mesh = mesh_of(group, device)
    embedding, head = check_modules(model, vocab.embedding, vocab.head)
    if embedding.max_norm is not None or embedding.sparse or embedding.scale_grad_by_freq:
        raise PlanError(f"{vocab.embedding}: an embedding with max_norm, sparse gradients or "
                        "gradients scaled by frequency "
                        "cannot be sharded over the vocabulary", hint="use another --shape")
    whole = embedding.weight
    shape = tuple(whole.shape)
    local = _local(whole, ranks, rank)
    for module, key in _holders(model, whole):
        module._parameters[key] = local
    for key in ("weight", "bias"):
        param = head._parameters.get(key)
        if param is not None and shard_dim_of(param) is None:
            chunk = _local(param, ranks, rank)
            for module, name in _holders(model, param):
                module._parameters[name] = chunk

    rows = shape[0] // ranks
    first, padding = rank * rows, embedding.padding_idx
    mine = padding - first if padding is not None and first <= padding < first + rows else None
    call = {}

    def enter(module, args, kwargs):
        if active is not None and not active():
            call["zeros"] = True
            module._parameters["weight"] = torch.zeros((), dtype=local.dtype,
                                                       device=local.device).expand(shape)
            return None
        # The rank's rows looked up locally (the masked lookup of DTensor's Shard(0)
        # embedding, whose backward in torch has no row-wise form: it would make the whole
        # vocabulary's gradient on every rank); ids of other ranks' rows give zeros.
        ids = args[0] if args else kwargs["input"]
        call["mask"] = ((ids >= first) & (ids < first + rows)).unsqueeze(-1)
        module.padding_idx = mine
        local_ids = (ids - first).clamp(0, rows - 1)
        if args:
            return (local_ids, *args[1:]), kwargs
        return args, {**kwargs, "input": local_ids}

    def leave(module, args, kwargs, out):
        module._parameters["weight"], module.padding_idx = local, padding
        if call.pop("zeros", False):
            return out
        partial = out * call.pop("mask").to(out.dtype)
        # The partial rows summed over the ranks (DTensor: Partial -> Replicate); the
        # gradient that arrives split among the ranks is summed back (_summed_gradient).
        whole = DTensor.from_local(partial, mesh, [Partial()], run_check=False) \
            .redistribute(mesh, [Replicate()]).to_local()
        return _summed_gradient(whole, mesh)

    embedding.register_forward_pre_hook(enter, with_kwargs=True)
    embedding.register_forward_hook(leave, with_kwargs=True, always_call=True)


def shard_dim_of(param: torch.Tensor) -> int | None:
    from pyplan.runtime.binding import shard_dim

    return shard_dim(param)


class _ParallelLoss(torch.autograd.Function):
    """The user's loss on vocabulary-sharded logits, forward and backward under torch's
    loss_parallel (which must see both); the loss's own graph is kept for the backward."""

    @staticmethod
    def forward(ctx, local, compute):
        leaf = local.detach().requires_grad_()
        with torch.enable_grad():
            loss = compute(leaf)
        ctx.leaf, ctx.loss = leaf, loss
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor.parallel import loss_parallel

        leaf, loss = ctx.leaf, ctx.loss
        ctx.leaf = ctx.loss = None
        with loss_parallel():
            (found,) = torch.autograd.grad(loss, leaf, grad)
        return found, None


def parallel_loss(loss: Callable) -> Callable:
    """`loss(logits, targets)` as pyplan calls the loss of a multi-device last block:
    (this rank's slice of the logits, targets, group). With group None (the single-process
    reference) it is the user's loss on whole logits."""

    @functools.wraps(loss)
    def wrapped(output, targets, group=None):
        if group is None:
            return loss(output, targets)
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.parallel import loss_parallel

        mesh = mesh_of(group, output.device)
        shape = (*output.shape[:-1], output.shape[-1] * dist.get_world_size(group))
        stride = torch.empty(shape, device="meta").stride()

        def compute(local: torch.Tensor) -> torch.Tensor:
            logits = DTensor.from_local(local, mesh, [Shard(output.dim() - 1)],
                                        run_check=False, shape=shape, stride=stride)
            with loss_parallel():
                value = loss(logits, targets)
            if isinstance(value, DTensor):
                value = value.full_tensor() if any(p.is_partial() for p in value.placements) \
                    else value.to_local()
            # pyplan seeds the loss's gradient on the block's first rank only.
            return _summed_gradient(value, mesh)

        if not torch.is_grad_enabled() or not output.requires_grad:
            with torch.no_grad():
                return compute(output)
        return _ParallelLoss.apply(output, compute)

    return wrapped
