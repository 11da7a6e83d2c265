"""The batches of a run, from the plan's `model.data`, which names one of:

- a function `batch(step)` (or `batch(step, split="train")`) returning the global batch
  `(inputs, targets)` of that step, called with torch's RNG seeded from the run's seed and the
  step, so that every rank and --check's single-process run draw the same batch;
- a `torch.utils.data.Dataset` (map-style) whose items are whole global batches: step k takes
  item k modulo its length;
- any other iterable of global batches, a `torch.utils.data.DataLoader` for one: step k takes
  the k-th batch it yields, passes after passes. Each pass starts with torch's RNG seeded from
  the run's seed and the pass, so a shuffling loader yields the same order on every rank (its
  sampler and workers draw their seeds from torch's RNG when a pass starts). A resumed run
  starts at its pass directly (an iterable with a length) and, in a DataLoader of a map-style
  dataset without workers, skips the pass's earlier batches by their sampler indices: the
  same batches as an uninterrupted run, unless reading an item draws from torch's global RNG
  (a random transform), which the skipped items then did not.

Only the ranks that need a batch call for it: those running a block that takes the
micro-batch's inputs and those computing the loss (Pipeline.takes_inputs / takes_targets).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from pyplan.errors import PlanError

__all__ = ["DATA_HINT", "Source", "batch_problem", "batches_from", "check_batch", "describe", "split_batch",
           "to_device"]

DATA_HINT = "batch(step) returns (inputs, targets) for the global batch"


class Source:
    """Global batches by step from whatever `model.data` names (see the module docstring)."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.function = callable(data) and not isinstance(data, torch.utils.data.Dataset)
        self.dataset = not self.function and hasattr(data, "__getitem__") and \
            hasattr(data, "__len__")
        self.splits = self.function and _takes_split(data)
        self._pass, self._next, self._iterator = -1, 0, None
        self._last: tuple = (None, None)

    def get(self, step: int, seed_of, split: str | None = None):
        """Batch `step` (of `split`: "eval", for a function that takes one). `seed_of(*parts)`
        seeds torch's RNG."""
        if self.function:
            seed_of("data" if split is None else split, step)
            return self.data(step) if split is None else self.data(step, split=split)
        if split is not None:
            raise PlanError("model.data names a dataset or loader, which has no eval split",
                            hint="name a function batch(step, split) to evaluate")
        if self.dataset:
            seed_of("data", step)
            size = len(self.data)
            if size == 0:
                raise PlanError("model.data names an empty dataset", hint=DATA_HINT)
            return self.data[step % size]
        if self._last[0] == step:
            return self._last[1]
        if step < self._next:  # the same steps again (--check's run): from the first pass
            self._pass, self._next, self._iterator = -1, 0, None
        if step > self._next:  # a resumed run: its first step, without reading what came before
            self._skip_to(step, seed_of)
        batch = None
        while self._next <= step:
            if self._iterator is None:
                self._pass += 1
                seed_of("data pass", self._pass)
                self._iterator, self._yielded = iter(self.data), 0
            batch = next(self._iterator, _END)
            if batch is _END:
                if self._yielded == 0:
                    raise PlanError("model.data names an iterable that yields no batch",
                                    hint=DATA_HINT)
                self._iterator = None
                continue
            self._yielded += 1
            self._next += 1
        self._last = (step, batch)
        return batch


    def _skip_to(self, step: int, seed_of) -> None:
        """Move on to just before batch `step` without reading the batches before it, where
        the data says how: with a length, to the start of its pass (each pass starts from its
        own seed); in a torch DataLoader of a map-style dataset without workers, through the
        pass by its sampler's indices alone (no item read, no batch collated). What is left
        (another iterable, a loader with workers) is read up to the step."""
        try:
            size = len(self.data)
        except TypeError:
            return
        if size <= 0:
            return
        target_pass, within = divmod(step, size)
        if target_pass != self._pass or self._iterator is None:
            self._pass = target_pass
            seed_of("data pass", self._pass)
            self._iterator, self._yielded = iter(self.data), 0
            self._next = target_pass * size
        sampler = getattr(self._iterator, "_sampler_iter", None)
        if isinstance(self.data, torch.utils.data.DataLoader) and sampler is not None and \
                self.data.num_workers == 0:
            while self._next < step:
                next(sampler)
                self._iterator._num_yielded += 1
                self._yielded += 1
                self._next += 1


_END = object()


def _takes_split(function) -> bool:
    try:
        return "split" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def batches_from(data: Any) -> Source | None:
    """A Source over `data`, or None when it is neither a function, a dataset nor an
    iterable."""
    if callable(data) or isinstance(data, Iterable) or hasattr(data, "__getitem__"):
        return Source(data)
    return None


def check_batch(batch) -> str | None:
    """What is wrong with a batch the data gave (None: nothing): "returned ..."."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        return f"returned {describe(batch)}, not (inputs, targets)"
    why = batch_problem({"inputs": batch[0], "targets": batch[1]})
    return None if why is None else f"returned {why}"


def batch_problem(parts: dict[str, Any]) -> str | None:
    """What is wrong with these parts of a batch ("inputs", "targets"), naming the field
    ("inputs that hold None at inputs[1]"), or None: every leaf a tensor of at least one
    dimension, with values (not on the meta device), and as many samples along dim 0 as every
    other (each tensor is split into micro-batches on its own: inputs and targets of different
    sizes would pair the wrong rows)."""
    sizes = []
    for what, part in parts.items():
        leaves = tree_flatten_with_path(part)[0]
        if not leaves:
            return f"{what} that hold no tensor"
        for path, x in leaves:
            field = what + keystr(path)
            at = f" at {field}" if path else ""
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                return f"{what} that hold {'None' if x is None else describe(x)}{at}"
            if x.shape[0] == 0:
                return f"{what} of no sample ({describe(x)}){at}: an empty batch"
            if x.is_meta:
                return f"{what} with a tensor on the meta device{at}, which holds no values"
            sizes.append((field, x.shape[0]))
    other = next(((f, n) for f, n in sizes if n != sizes[0][1]), None)
    if other is not None:
        return (f"{sizes[0][0]} of {sizes[0][1]} samples and {other[0]} of {other[1]} (along "
                "dim 0): split into micro-batches each on its own, they would pair the wrong "
                "rows")
    return None


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}" if value.dim() else "a 0-dim tensor"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def to_device(tree, device, non_blocking: bool = False):
    """Every tensor of a batch (a tensor, or tuples, lists and dicts of them) on `device`."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device, non_blocking=non_blocking)
    if isinstance(tree, dict):
        return {k: to_device(v, device, non_blocking) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(to_device(v, device, non_blocking) for v in tree)
    return tree


def split_batch(tree, n: int) -> list:
    """Split every tensor of `tree` along dim 0 into n equal micro-batches."""
    if isinstance(tree, torch.Tensor):
        if tree.dim() > 0 and tree.shape[0] == 0:
            raise PlanError(f"a batch tensor of shape {tuple(tree.shape)} holds no sample: an "
                            "empty batch", hint="give at least one sample per micro-batch")
        if tree.dim() == 0 or tree.shape[0] % n:
            raise PlanError(f"a batch tensor of shape {tuple(tree.shape)} does not split into "
                            f"{n} equal micro-batches along dim 0",
                            hint="make the global batch size a multiple of micro_batches")
        return list(tree.chunk(n))
    if isinstance(tree, dict):
        parts = {k: split_batch(v, n) for k, v in tree.items()}
        return [{k: parts[k][i] for k in tree} for i in range(n)]
    if isinstance(tree, (tuple, list)):
        parts = [split_batch(v, n) for v in tree]
        return [type(tree)(p[i] for p in parts) for i in range(n)]
    return [tree] * n
