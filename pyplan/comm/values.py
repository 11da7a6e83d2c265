"""Values handed from one block to the next: a tensor, or a tuple, list or dict of them
(nested), such as hidden states with a skip connection or a mask. torch's pytree utilities
flatten a value into its tensors (the leaves) and a structure that rebuilds it.

Gradients travel for the floating-point leaves only (an integer mask or ids have none), in
leaf order; both sides of a boundary know which leaves those are from the value itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pyplan.errors import UserCodeError

__all__ = ["Saved", "Value", "cast_of", "concatenated", "differentiable", "flatten", "nbytes",
           "plain", "rebuild", "saved_bytes", "spec_text", "structure", "value_text"]

Value = Any  # a tensor or a (nested) tuple, list or dict of tensors


def flatten(value: Value, what: str) -> tuple[list[torch.Tensor], pytree.TreeSpec]:
    """The tensors of a value and its structure; UserCodeError naming `what` (the block that
    made it) when a leaf is not a tensor."""
    leaves, spec = pytree.tree_flatten(value)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise UserCodeError(f"{what} returned a {type(leaf).__name__} inside its output; "
                                "a block returns a tensor or a tuple, list or dict of tensors")
    if not leaves:
        raise UserCodeError(f"{what} returned no tensor")
    return leaves, spec


def rebuild(leaves: list[torch.Tensor], spec: pytree.TreeSpec) -> Value:
    return pytree.tree_unflatten(leaves, spec)


class _Shown:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def value_text(spec: pytree.TreeSpec, shapes: list[tuple[torch.dtype, tuple]]) -> str:
    """A value's structure with each tensor as its dtype and shape, for messages:
    "a tensor float32 (2, 4)", "{'b': float32 (2, 4)}"."""
    shown = [_Shown(f"{str(dtype).removeprefix('torch.')} {tuple(shape)}")
             for dtype, shape in shapes]
    if spec.is_leaf():
        return f"a tensor {shown[0]}"
    return repr(rebuild(shown, spec))


def concatenated(values: list[Value], what: str) -> Value:
    """The micro-batches' values (of `what`, e.g. "block 'b'") joined along dim 0, as the
    whole batch's; UserCodeError naming the first micro-batch whose structure, dtypes or
    shapes beyond dim 0 differ from micro-batch 0's."""
    flat = [flatten(v, what) for v in values]
    first, spec = flat[0]

    def text(leaves, spec) -> str:
        return value_text(spec, [(t.dtype, t.shape) for t in leaves])

    for m, (leaves, other) in enumerate(flat[1:], 1):
        if other != spec or [(t.dtype, t.shape[1:]) for t in leaves] != \
                [(t.dtype, t.shape[1:]) for t in first] or any(t.dim() == 0 for t in leaves):
            raise UserCodeError(f"{what} returned {text(leaves, other)} for micro-batch {m} "
                                f"but {text(first, spec)} for micro-batch 0: the whole "
                                "batch's output joins the micro-batches' along dim 0, so they "
                                "need the same structure and shapes beyond it",
                                hint="give every micro-batch of a batch the same shapes (e.g. "
                                     "pad to one sequence length per batch)")
    if any(t.dim() == 0 for t in first):
        raise UserCodeError(f"{what} returned {text(first, spec)} for micro-batch 0: a 0-dim "
                            "tensor cannot be joined over the micro-batches",
                            hint="return tensors with the batch along dim 0")
    return rebuild([torch.cat(column) for column in zip(*(leaves for leaves, _ in flat))], spec)


def structure(text: str) -> pytree.TreeSpec:
    return pytree.treespec_loads(text)


def spec_text(spec: pytree.TreeSpec) -> str:
    return pytree.treespec_dumps(spec)


def differentiable(leaves: list[torch.Tensor]) -> list[int]:
    """Positions of the leaves that carry a gradient across a boundary."""
    return [i for i, t in enumerate(leaves) if t.is_floating_point()]


def nbytes(value: Value) -> int:
    """Bytes of the tensors in a value (anything else counts nothing)."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor))


def plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding t's data: t itself, or the local tensors of a wrapper such as a
    DTensor (which has no storage of its own), for counting the bytes autograd saves."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, name) for name in names)
    return [x for y in inner if isinstance(y, torch.Tensor) for x in plain(y)]


@dataclass
class Saved:
    """What autograd saved while a body ran (filled when it ends)."""

    bytes: int = 0
    """Each saved tensor once, parameters (and views of them) excluded; tensor sizes, not
    storages, as a micro-batch is a view of the whole batch."""
    storages: frozenset[int] = frozenset()
    """The data pointers of the storages those tensors live in."""


def cast_of(t: torch.Tensor, params: set[int]) -> bool:
    """Whether t is (a view of) autocast's cast copy of a parameter (ids in `params`): a copy
    the iteration holds once, in autocast's cache, not one per micro-batch."""
    base = t._base if t._is_view() and t._base is not None else t
    node = base.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0":
        return False
    source = node.next_functions[0][0]
    return id(getattr(source, "variable", None)) in params


@contextlib.contextmanager
def saved_bytes(params):
    """What autograd saves while the body runs (yields a Saved, filled when it ends): what a
    forward holds until its backward. `params`: the parameters, or a function giving them as
    they are while the body runs (FSDP2 unshards them inside the forward). Neither they nor
    autocast's cast copies of them count (held once for every micro-batch: the bf16 weights
    of a Linear are not a micro-batch's activations)."""
    skip: set[int] = set()
    mine: set[int] = set()
    seen: dict[tuple, int] = {}
    storages: set[int] = set()
    found = Saved()

    def pack(t: torch.Tensor):
        if not skip:  # the parameters as the forward uses them, once it has begun
            now = list(params() if callable(params) else params)
            skip.update(x.untyped_storage().data_ptr() for p in now for x in plain(p))
            mine.update(id(p) for p in now)
            skip.add(-1)  # (known, even with no parameters)
        if cast_of(t, mine):
            return t.detach()
        for x in plain(t):  # a DTensor's local tensor: the wrapper has no storage
            storage = x.untyped_storage().data_ptr()
            if storage not in skip:
                seen[(x.data_ptr(), tuple(x.shape), x.dtype)] = x.numel() * x.element_size()
                storages.add(storage)
        # Not t itself: a saved output would hold its own grad_fn, a cycle through C++ that
        # Python's collector never sees (the graph, and every weight it reads, leaked).
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield found
    found.bytes, found.storages = sum(seen.values()), frozenset(storages)
