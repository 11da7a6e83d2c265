"""A model built without its weights: every parameter on the meta device, and the recipe that
gives it its value, so that a rank materialises only the parameters of its own stages and
partition one unit at a time.

While the user's factory runs, a parameter registration hook swaps each new parameter for a
meta one (the tensor it was created from is kept only until something overwrites it: most are
`torch.empty`, whose pages were never touched), and a torch function mode records every
operation the factory applies to those parameters: `reset_parameters()`'s `kaiming_uniform_`,
Hugging Face's `_init_weights` (`normal_`, `ones_`, a padding row's `zero_`), a GPT's scaled
`normal_(std=0.02 / sqrt(2L))`, a dtype conversion. Buffers are computed as usual (rotary
frequencies, masks): only parameters are deferred. A parameter's value is its recipe replayed
on the CPU: the tensor it was created from (if nothing overwrote it), then the recorded
operations since its last full overwrite, each random one drawing from a generator seeded by the
run's seed, the parameter's name and the operation's position. So a parameter's value depends on
nothing but its own recipe: every rank that holds it, a tied copy included, and the whole model
`--check` builds in one process get the same bits, in any order, on any machine.

A factory this cannot follow (it derives a parameter from another one in a way the recipe
cannot express, or fails on the meta device) is built eagerly instead, whole, with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["Deferred", "DeferredError", "DeferredParameter", "defer", "eager", "move"]

# Whole-tensor writes: after one, what earlier operations did to the tensor is lost.
_OVERWRITES = frozenset({
    "normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_",
    "log_normal_", "cauchy_", "geometric_", "trunc_normal_", "constant_", "ones_", "zeros_",
    "eye_", "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
    "kaiming_normal_", "orthogonal_", "sparse_"})
# In-place calls about autograd or sharing, not values: nothing to replay.
_METADATA = frozenset({"requires_grad_", "retain_grad", "share_memory_", "register_hook",
                       "_set_grad_enabled", "__get__grad", "__set__grad",
                       "__set__requires_grad"})


_CPU = torch.device("cpu")


class DeferredError(RuntimeError):
    """The factory cannot be built without its weights (the reason is the message)."""


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and owner is not None:  # a property: .data, .grad, .T
        return f"{name}{getattr(owner, '__name__', '')}"
    return name


def _in_place(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("__")) or name in (
        "__setitem__", "__set__data") or (name.startswith("__i") and name.endswith("__"))


class DeferredParameter(nn.Parameter):
    """A parameter on the meta device whose value a recipe gives; `pyplan_name` is its name in
    the model (copies keep it, so a copied or pruned model still knows whose value it holds)."""

    pyplan_name: str

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            with torch._C.DisableTorchFunction():  # a copy on meta, even while streaming
                copy = type(self)(self.data.clone(), self.requires_grad)
            copy.__dict__.update(self.__dict__)
            memo[id(self)] = copy
        return memo[id(self)]


@dataclass
class _Op:
    func: Callable
    args: tuple
    kwargs: dict
    result: list
    """The result's tensors (meta ones are what later operations read)."""
    roots: frozenset[int]
    target: int | None
    """In-place: the root whose storage it writes (the root itself, a view or `.data` of
    it); None when it writes a tensor of its own (a temporary made from a root)."""
    overwrites: bool
    """It writes the whole of its target's storage without reading what was there."""


@dataclass
class _Root:
    """A tensor whose value a recipe gives: a registered parameter, or a meta tensor the
    factory made without one (a constant it then copies into a parameter, a meta buffer)."""

    meta: torch.Tensor
    initial: torch.Tensor | None
    """A parameter's tensor as it was created, until an operation overwrites it all."""
    made: bool = False
    """Made by its first operation (not registered): nothing to start from."""
    ops: list[int] = field(default_factory=list)
    """The operations that read or write it, in order."""


class _Recorder(TorchFunctionMode):
    """Records what the factory does to its (meta) parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.roots: dict[int, _Root] = {}
        # id(tracked meta tensor) -> the roots it derives from; the tape holds every tracked
        # tensor, so ids stay valid while it exists.
        self.family: dict[int, frozenset[int]] = {}
        self.tape: list[_Op] = []
        self.quiet = False

    def register(self, module: nn.Module, name: str, param):
        """Parameter registration hook: a new parameter becomes a meta one."""
        if param is None or type(param) is not nn.Parameter or id(param) in self.roots:
            return None
        if param.is_meta:  # made from another parameter, or on the meta device by the factory
            raise DeferredError(f"{type(module).__name__}.{name} is made from another "
                                "parameter or on the meta device")
        self.quiet = True
        try:
            meta = DeferredParameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                     requires_grad=param.requires_grad)
        finally:
            self.quiet = False
        meta.__dict__.update(param.__dict__)
        initial = param.detach()
        self.roots[id(meta)] = _Root(meta, initial)
        self.family[id(meta)] = frozenset((id(meta),))
        return meta

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.quiet:
            return func(*args, **kwargs)
        flat = pytree.tree_leaves((args, kwargs))
        roots = frozenset().union(*(self.family[id(t)] for t in flat
                                    if isinstance(t, torch.Tensor) and id(t) in self.family))
        out = func(*args, **kwargs)
        name = _name(func)
        if name in _METADATA:
            return out
        produced = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and
                    t.is_meta and id(t) not in self.family]
        in_place = _in_place(name)
        if not roots and not produced or not produced and not in_place:
            return out  # real tensors only; or a size, a dtype, a comparison
        written = (args[0] if args else next(iter(kwargs.values()), None)) if in_place \
            else None
        target = self._root_of(written)
        # What the operation reads besides the tensor it writes: copy_(p / 2) reads p.
        sources = frozenset().union(*(self.family[id(t)] for t in pytree.tree_leaves(
            (args[1:] if args else (), kwargs)) if isinstance(t, torch.Tensor)
            and id(t) in self.family))
        overwrites = target is not None and target not in sources and (
            name in _OVERWRITES or name == "__set__data") and \
            written.numel() == self.roots[target].meta.numel()
        result = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        index = len(self.tape)
        self.tape.append(_Op(func, args, kwargs, result, roots, target, overwrites))
        for root in roots:
            self.roots[root].ops.append(index)
        for t in produced:
            if roots:
                self.family[id(t)] = roots
            else:  # made from constants on the meta device: a root of its own
                self.roots[id(t)] = _Root(t, None, made=True, ops=[index])
                self.family[id(t)] = frozenset((id(t),))
        if overwrites:
            self.roots[target].initial = None  # its pages can go
        return out

    def _root_of(self, written) -> int | None:
        """The root whose storage `written` is (itself, a view, its `.data`), else None."""
        if not isinstance(written, torch.Tensor) or id(written) not in self.family:
            return None
        storage = written.untyped_storage()._cdata
        return next((r for r in self.family[id(written)]
                     if self.roots[r].meta.untyped_storage()._cdata == storage), None)


def _dead_writes(recorder: _Recorder) -> frozenset[int]:
    """The operations whose writes nothing reads: each root's operations walked from its last
    (whose value the model keeps) back; a write to the root is dead when a later whole
    overwrite comes before any read of what it wrote (`reset_parameters()`'s init that
    `_init_weights` then replaces), live otherwise (`p.copy_(f(p))` reads it)."""
    dead = set()
    for root_id, root in recorder.roots.items():
        live = True  # the value the root ends with is wanted
        for index in reversed(root.ops):
            op = recorder.tape[index]
            if op.target != root_id:
                live = True  # reads the root (into a temporary, another root, a size)
            elif not live:
                dead.add(index)
            else:
                live = not op.overwrites  # a partial or reading write needs what was there
    return frozenset(dead)


def _seed(seed: int, name: str, k: int) -> int:
    text = f"{seed}:init:{name}:{k}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "big")


class Deferred:
    """A model whose parameters are on the meta device, each with the recipe of its value
    (`defer`), or a model built eagerly (`eager`, when the recipe could not be followed)."""

    def __init__(self, model: nn.Module, seed: int, recorder: _Recorder | None,
                 why_eager: str | None = None) -> None:
        self.model, self.seed, self.why_eager = model, seed, why_eager
        self.recorder = recorder
        self.names: dict[str, int] = {}
        """Every name of every parameter (a tied one under each) and buffer -> its tensor."""
        self.first: dict[int, str] = {}
        if not isinstance(model, nn.Module):  # the caller says what is wrong with it
            model = nn.Module()
        for name, tensor in [*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)]:
            self.names[name] = id(tensor)
            self.first.setdefault(id(tensor), name)
            if isinstance(tensor, DeferredParameter) and "pyplan_name" not in tensor.__dict__:
                tensor.pyplan_name = name
        self._real = {id(t): t for t in [*model.parameters(), *model.buffers()]
                      if not t.is_meta}
        self.checkpoint = None
        self._stored: dict[int, str] = {}
        """Tensor -> its name in the checkpoint the model starts from (`start_from`)."""
        self._dead = _dead_writes(recorder) if recorder is not None else frozenset()

    @property
    def eager(self) -> bool:
        return self.recorder is None

    def start_from(self, checkpoint) -> None:
        """Take parameters and persistent buffers from `checkpoint` (a
        pyplan.models.weights.Checkpoint), checked against the whole model first."""
        keys = self.model.state_dict(keep_vars=True)
        params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        checkpoint.check({n: (tuple(t.shape), t.dtype) for n, t in keys.items()},
                         {n: self.first[id(t)] for n, t in keys.items()},
                         {n for n in keys if n not in params}, model=self.model)
        stored = set(checkpoint.provides)
        for name, tensor in keys.items():
            if name in stored:
                self._stored.setdefault(id(tensor), name)
        self.checkpoint = checkpoint

    def value(self, name: str) -> torch.Tensor:
        """A parameter's (or buffer's) value on the CPU."""
        return self.values([name])[name]

    def values(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The values of these parameters and buffers (by any of their names), replayed
        together: new tensors, or the eager model's own."""
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise KeyError(f"the model has no parameter or buffer {unknown[0]}")
        wanted = {self.names[n] for n in names}
        found = {t: self.checkpoint.tensor(self._stored[t]) for t in wanted
                 if t in self._stored}
        found.update((t, self._real[t].detach()) for t in wanted - set(found)
                     if t in self._real)
        todo = wanted - set(found)
        if todo:
            found.update(self._replay(todo))
        return {n: found[self.names[n]] for n in names}

    def _replay(self, wanted: set[int]) -> dict[int, torch.Tensor]:
        recorder = self.recorder
        if recorder is None or any(t not in recorder.family for t in wanted):
            raise DeferredError("a tensor of the model has no recipe")
        needed = set().union(*(recorder.family[t] for t in wanted))
        stack = list(needed)
        while stack:  # an operation on two roots needs both
            for index in recorder.roots[stack.pop()].ops:
                for root in recorder.tape[index].roots - needed:
                    needed.add(root)
                    stack.append(root)
        env: dict[int, torch.Tensor] = {}
        for root in needed:
            r = recorder.roots[root]
            if not r.made:
                env[root] = r.initial.clone() if r.initial is not None else \
                    torch.empty(r.meta.shape, dtype=r.meta.dtype)

        def real(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                found = env.get(id(x))
                if found is None:
                    raise DeferredError("a recipe reads a tensor it did not make")
                return found
            if isinstance(x, torch.device) and x.type == "meta":  # made on the meta device
                return _CPU
            return x

        counts: dict[str, int] = {}
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for index in sorted({i for root in needed for i in recorder.roots[root].ops}):
                op = recorder.tape[index]
                # The same seed on every rank: by the first parameter's name and the count of
                # its operations, not by address; an operation on constants by its position.
                names = sorted(self.first[r] for r in op.roots if r in self.first)
                key = names[0] if names else f"#{index}"
                counts[key] = counts.get(key, 0) + 1
                if index in self._dead:
                    continue  # overwritten before anything reads it: its effect is lost
                torch.manual_seed(_seed(self.seed, key, counts[key]))
                args, kwargs = pytree.tree_map(real, (op.args, op.kwargs))
                if "generator" in kwargs:
                    kwargs["generator"] = None
                if kwargs.get("device") == "meta":
                    kwargs["device"] = _CPU
                if _name(op.func) == "__set__data":  # the value becomes the tensor's data
                    args = (args[0], args[1].clone())
                result = op.func(*args, **kwargs)
                values = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
                for meta, value in zip(op.result, values):
                    if meta.is_meta:
                        env[id(meta)] = value
        return {t: env[t].detach() for t in wanted}

    def streaming(self, budget: int | None = None):
        """A context in which the deferred parameters of this model (and of copies of it) take
        part in operations with their values, materialised on the CPU a few at a time (at
        most `budget` bytes, default: twice the largest parameter or an eighth of the model,
        whichever is more), so a whole forward runs without the whole model in memory."""
        if self.eager:
            return contextlib.nullcontext()
        if budget is None:
            sizes = [p.numel() * p.element_size() for p in self.model.parameters()]
            budget = max(2 * max(sizes, default=0), sum(sizes) // 8)
        return _Streaming(self, budget)

    def materialize(self, module: nn.Module, device, *, names: Callable[[str], bool]
                    = lambda name: True, prefix: str = "") -> int:
        """Give every meta parameter and buffer of `module` whose model name (`prefix` + its
        name in `module`) `names` accepts its value on `device` (a parameter shared inside
        `module` stays one object); with a checkpoint (`start_from`), every such tensor it holds
        takes its value from there. Returns the bytes of parameters materialised."""
        groups: dict[int, list[tuple[nn.Module, str, str, bool]]] = {}
        for kind, named in ((True, module.named_parameters(remove_duplicate=False)),
                            (False, module.named_buffers(remove_duplicate=False))):
            for full, tensor in named:
                if tensor.is_meta or id(tensor) in self._stored:
                    owner_name, _, attr = full.rpartition(".")
                    owner = module.get_submodule(owner_name) if owner_name else module
                    groups.setdefault(id(tensor), []).append((owner, attr, prefix + full, kind))
        chosen = [places for places in groups.values()
                  if any(names(model_name) for _, _, model_name, _ in places)]
        values = self.values([places[0][2] for places in chosen])
        total = 0
        for places in chosen:
            owner, attr, model_name, is_param = places[0]
            value = values[model_name].to(device)
            if is_param:
                meta = owner._parameters[attr]
                value = nn.Parameter(value, requires_grad=meta.requires_grad)
                value.__dict__.update(meta.__dict__)  # pyplan_name too: whose value it is
                total += value.numel() * value.element_size()
            for owner, attr, _, is_param in places:
                (owner._parameters if is_param else owner._buffers)[attr] = value
        return total


class _Streaming(TorchFunctionMode):
    """Operations see the values of the deferred parameters they are given, materialised on
    the CPU when first used and kept while they fit `budget` bytes (least recently used go
    first): a forward of the whole model holds about one layer's weights at a time."""

    def __init__(self, deferred: Deferred, budget: int) -> None:
        super().__init__()
        self.deferred, self.budget = deferred, budget
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0

    def _value(self, param: DeferredParameter) -> torch.Tensor:
        name = param.pyplan_name
        found = self.cache.get(name)
        if found is None:
            found = self.deferred.value(name).requires_grad_(param.requires_grad)
            size = found.numel() * found.element_size()
            while self.cache and self.bytes + size > self.budget:
                _, old = self.cache.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()
            self.cache[name] = found
            self.bytes += size
        self.cache.move_to_end(name)
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name == "__deepcopy__":  # its memo holds the parameters copied so far: not operands
            return func(*args, **kwargs)
        if any(isinstance(x, DeferredParameter) for x in pytree.tree_leaves((args, kwargs))):
            if name in _SAME_ON_META:  # asked of the parameter, not its value: not made for it
                return func(*args, **kwargs)
            if name == "__get__device":
                return _CPU
            if name == "__get__is_meta":
                return False
            args, kwargs = pytree.tree_map_only(DeferredParameter, self._value,
                                                (args, kwargs))
        return func(*args, **kwargs)


# What a meta parameter answers as its value would.
_SAME_ON_META = frozenset({"__get__shape", "__get__dtype", "__get__ndim", "__get__requires_grad",
                           "__get__is_leaf", "__get__layout", "size", "dim", "numel",
                           "element_size", "is_floating_point", "is_complex", "__len__",
                           "requires_grad_"})


def defer(factory: Callable[[], nn.Module], seed: int) -> Deferred:
    """Build the model with its parameters on the meta device (see the module docstring); if
    the factory cannot be followed, build it eagerly (`Deferred.why_eager` says why)."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    recorder = _Recorder()
    handle = register_module_parameter_registration_hook(recorder.register)
    reason = None
    try:
        with recorder:
            model = factory()
        reason = _unfollowable(model, recorder)
    except DeferredError as exc:
        reason = str(exc)
    finally:
        handle.remove()
    if reason is None:
        return Deferred(model, seed, recorder)
    return Deferred(factory(), seed, None, why_eager=reason)


def move(module: nn.Module, device) -> None:
    """`module.to(device)` for everything but deferred parameters, which stay as they are (a
    tensor shared by several modules stays one)."""
    device, moved = torch.device(device), {}
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for key, t in store.items():
                if t is None or isinstance(t, DeferredParameter) or t.device == device:
                    continue
                if id(t) not in moved:
                    value = t.to(device)
                    if isinstance(t, nn.Parameter):
                        value = nn.Parameter(value, requires_grad=t.requires_grad)
                        value.__dict__.update(t.__dict__)
                    moved[id(t)] = value
                store[key] = moved[id(t)]


def eager(model: nn.Module, seed: int = 0) -> Deferred:
    """A model that exists with its weights, behind the same interface."""
    return Deferred(model, seed, None, why_eager="built by the caller")


def _unfollowable(model, recorder: _Recorder) -> str | None:
    if not isinstance(model, nn.Module):
        return None  # the caller says what is wrong with it
    for name, param in model.named_parameters():
        if param.is_meta and id(param) not in recorder.roots:
            return f"parameter {name} was made on the meta device outside pyplan's record"
    for name, buffer in model.named_buffers():
        if buffer.is_meta and id(buffer) not in recorder.family:
            return f"buffer {name} was made on the meta device outside pyplan's record"
    return None

