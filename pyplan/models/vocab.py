"""Vocabulary parallelism for a model as it comes: its token embedding and its output head
sharded over the ranks of a multi-device block (Tessel's M-shape: both on every device, the
layers between them in single-device stages), and its loss computed on the sharded logits
without gathering them (torch's `loss_parallel`).

Each rank keeps its chunk of the vocabulary, torch.chunk(whole, ranks, 0)[rank], as a plain
parameter marked with pyplan.runtime.shard (so pyplan's gradient handling, clipping, --check and
checkpoints treat it as the hand-written tensor-parallel layers are treated):

- the embedding looks the ids up in the rank's rows (ids of other ranks' rows give zeros: the
  masked lookup of DTensor's Shard(0) embedding, done locally because torch's DTensor has no
  row-wise embedding backward and would make the whole vocabulary's gradient on every rank)
  and the partial rows are summed over the ranks; the module's own forward runs (a subclass
  scaling its output, Gemma's, too);
- the head is its nn.Linear on the rank's rows of the weight: the rank's slice of the logits,
  no communication;
- the loss: a user's loss that is exactly a mean cross-entropy of the logits (recognised from
  the operations it runs on meta tensors: shape-only views, log_softmax over the vocabulary,
  nll_loss with mean reduction and no class weights) is computed fused, as Megatron-LM does:
  one all-reduce of the row maxima, one of the stacked sums of exponentials and target logits,
  and a local backward (softmax minus one-hot); any other loss gets the logits as a DTensor
  sharded on the vocabulary dimension and runs under torch's `loss_parallel`, forward and
  backward. `--check` compares either with the user's loss on whole logits.

A multi-device block in pyplan is one SPMD program whose output gradient may arrive split among
its ranks (the pipeline hands it to one of them) and whose input and replicated-parameter
gradients are summed over its ranks. DTensor's autograd assumes replicated gradients instead, so
where a sharded computation meets the rest of the block the split gradient is summed
(pyplan.models.collectives): after the embedding's sum and on the loss (pyplan seeds it on the
block's first rank only). The head's input gradient stays each rank's share (its rows'
contribution), which pyplan sums. Every all-reduce here, DTensor's included, goes through
pyplan.models.collectives, which keeps small ones off gloo's slow ring.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pyplan.errors import PlanError, TimeLimitError
from pyplan.models.collectives import all_reduce_, all_sum, summed_gradient

__all__ = ["Vocab", "check_divisible", "check_modules", "cross_entropy", "find", "mesh_of",
           "parallel_loss", "shard"]


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


def _holders(model: nn.Module, param: torch.Tensor) -> list[tuple[nn.Module, str]]:
    """Every (module, attribute) holding `param` (a tied parameter has several)."""
    return [(m, key) for m in model.modules() for key, p in m._parameters.items()
            if p is param]


def _local(param: torch.Tensor, ranks: int, rank: int) -> nn.Parameter:
    from pyplan.models.chunks import shard as mark

    chunk = param.detach().chunk(ranks, 0)[rank].clone()
    return mark(nn.Parameter(chunk, requires_grad=param.requires_grad), 0)


def shard(model: nn.Module, vocab: Vocab, group, device: torch.device, *,
          active: Callable[[], bool] | None = None) -> None:
    """In place: the embedding and the head of `model` keep this rank's rows of the vocabulary
    (a tied weight stays one parameter). `active()` says whether a call of the embedding is its
    own block's (the forward cut also calls it while a later stage runs the model's forward up
    to its entry: then it returns zeros, at no cost and without a collective)."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    check_divisible(vocab, ranks)
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
        # The partial rows summed over the ranks; the gradient that arrives split among the
        # ranks is summed back.
        return all_sum(out * call.pop("mask").to(out.dtype), group)

    embedding.register_forward_pre_hook(enter, with_kwargs=True)
    embedding.register_forward_hook(leave, with_kwargs=True, always_call=True)


def shard_dim_of(param: torch.Tensor) -> int | None:
    from pyplan.models.chunks import shard_dim

    return shard_dim(param)


class _CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of rows of logits split over the vocabulary: forward two all-reduces,
    backward none (the gradient of a rank's slice is its softmax slice minus the one-hot)."""

    @staticmethod
    def forward(ctx, local, targets, group, ignore_index, dtype):
        rows = local.shape[-1]
        lo = dist.get_rank(group) * rows
        x = local.detach().reshape(-1, rows).to(dtype)
        t = targets.reshape(-1)
        peak = all_reduce_(x.max(dim=-1).values, group, "max")  # any shift works: no overflow
        shifted = x - peak.unsqueeze(-1)
        exp = shifted.exp()
        mine = (t >= lo) & (t < lo + rows)
        index = (t - lo).clamp(0, rows - 1)
        picked = shifted.gather(1, index.unsqueeze(-1)).squeeze(-1) * mine
        sums = all_reduce_(torch.stack([exp.sum(dim=-1), picked]), group)
        valid = (t != ignore_index).to(dtype)
        count = valid.sum()
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), index, mine, valid, count)
        ctx.shape, ctx.dtype = local.shape, local.dtype
        return ((sums[0].log() - sums[1]) * valid).sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine, valid, count = ctx.saved_tensors
        # Out of place: the saved softmax stays intact should autograd run this backward again.
        found = softmax.scatter_add(1, index.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        found.mul_((valid * (grad / count)).unsqueeze(-1))
        return found.reshape(ctx.shape).to(ctx.dtype), None, None, None, None


def cross_entropy(local: torch.Tensor, targets: torch.Tensor, group, *,
                  ignore_index: int = -100, dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=...) of logits whose
    last dimension is split over `group` (`local`: this rank's chunk, torch.chunk order),
    computed in `dtype` (default the logits'). The same value on every rank; its gradient may
    be seeded on any of them (pyplan's contract for a multi-device block)."""
    value = _CrossEntropy.apply(local, targets, group, ignore_index, dtype or local.dtype)
    return summed_gradient(value, group)


_VIEWS = {"view", "_unsafe_view", "reshape", "clone", "contiguous", "alias", "detach",
          "_to_copy", "flatten"}


class _Ops(TorchDispatchMode):
    """Follows the logits and the targets through the operations of a loss (on meta tensors):
    whether it is exactly a mean cross-entropy, and with which ignore_index and dtype."""

    def __init__(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        super().__init__()
        self.kinds = {id(logits): "logits", id(targets): "targets"}
        self.keep = [logits, targets]  # ids stay unique while the loss runs
        self.size, self.form, self.loss, self.dtype = logits.shape[-1], None, None, None
        self.other = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        kinds = [self.kinds.get(id(a)) for a in tensors]  # lists and out= included
        if not any(kinds):
            return out  # not on the logits or the targets (e.g. a constant)
        kind = kinds[0]
        if name in _VIEWS and isinstance(out, torch.Tensor) and len(kinds) == 1 and \
                (kind != "logits" or (out.shape[-1] == self.size and out.is_floating_point())):
            self._tag(out, kind)
            if kind == "logits":
                self.dtype = out.dtype
        elif name == "_log_softmax" and kind == "logits" and \
                args[1] in (-1, args[0].dim() - 1):
            self._tag(out, "log_probs")
            if args[2]:  # half_to_float
                self.dtype = torch.float32
        elif name == "nll_loss_forward" and kinds == ["log_probs", "targets"] and \
                args[0].dim() == 2 and args[2] is None and args[3] == 1:
            self.form, self.loss = int(args[4]), out[0]
        else:
            self.other = True
        return out

    def _tag(self, tensor: torch.Tensor, kind: str) -> None:
        self.kinds[id(tensor)] = kind
        self.keep.append(tensor)


@functools.lru_cache(maxsize=64)
def _cross_entropy_form(loss: Callable, shape: tuple, dtype: torch.dtype, target_shape: tuple,
                        target_dtype: torch.dtype):
    """(ignore_index, dtype) when `loss` on logits of `shape` is exactly a mean cross-entropy,
    else None."""
    logits = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
    targets = torch.empty(target_shape, dtype=target_dtype, device="meta")
    ops = _Ops(logits, targets)
    try:
        with ops:
            value = loss(logits, targets)
    except TimeLimitError:
        raise
    except Exception:  # noqa: BLE001 - a loss meta tensors cannot run: not recognised
        return None
    if ops.other or ops.form is None or value is not ops.loss:
        return None
    return ops.form, ops.dtype or dtype


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

        from pyplan.models.collectives import Star

        leaf, loss = ctx.leaf, ctx.loss
        ctx.leaf = ctx.loss = None
        with loss_parallel(), Star():
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
        whole = (*output.shape[:-1], output.shape[-1] * dist.get_world_size(group))
        form = _cross_entropy_form(loss, whole, output.dtype, tuple(targets.shape),
                                   targets.dtype) if isinstance(targets, torch.Tensor) else None
        if form is not None:
            dtype = form[1]  # as probed on meta tensors, where autocast does not act
            if torch.is_autocast_enabled(output.device.type):
                # Autocast runs cross_entropy (log_softmax, nll_loss) in fp32: so does this.
                dtype = torch.promote_types(dtype, torch.float32)
            return cross_entropy(output, targets, group, ignore_index=form[0], dtype=dtype)
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.parallel import loss_parallel

        from pyplan.models.collectives import Star

        mesh = mesh_of(group, output.device)
        shape, stride = whole, torch.empty(whole, device="meta").stride()

        def compute(local: torch.Tensor) -> torch.Tensor:
            logits = DTensor.from_local(local, mesh, [Shard(output.dim() - 1)],
                                        run_check=False, shape=shape, stride=stride)
            with loss_parallel(), Star():
                value = loss(logits, targets)
                if isinstance(value, DTensor):
                    value = value.full_tensor() \
                        if any(p.is_partial() for p in value.placements) else value.to_local()
            # pyplan seeds the loss's gradient on the block's first rank only.
            return summed_gradient(value, group)

        if not torch.is_grad_enabled() or not output.requires_grad:
            with torch.no_grad():
                return compute(output)
        return _ParallelLoss.apply(output, compute)

    return wrapped
