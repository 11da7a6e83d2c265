"""The forward cut: a stage of a model runs the model's own `forward`, entering at its first
module and leaving at the next stage's, so everything the model computes around its layers
(rotary embeddings, attention masks, position ids, embedding scales) comes out right on every
stage without a line of per-model code. This is how Hugging Face causal LMs are cut as they
come; it fits any model whose forward calls a list of layers (`layers`, `h`, ...) between
modules before them (embeddings) and after them (final norm, head).

On a stage, in one call of the model's forward:
- modules before the stage's first one run as they are where this rank owns them, and with
  zeros for parameters where it does not (an embedding it does not hold returns zeros of the
  right shape, almost free); the layers before it pass their hidden states through;
- at the stage's first module a forward pre-hook replaces the hidden states with those received
  from the previous stage (a leaf, so the backward stops there), and restores the random
  number state the stage started with, so dropout inside the stage draws what it draws in the
  single-process model when reseeded at the same point;
- at the next stage's first module another pre-hook ends the call, carrying out the hidden
  states it was about to get. The last stage returns the model's logits (`.logits` of its
  output when it has one).
Modules of later stages are never called; this rank drops their parameters (except those it
shares with its own modules: tied weights). A layer held by another rank is a stand-in that
returns what the real layer returns, in the same structure (the hidden states, or a tuple of
the same length with them first and None after: `hidden, attn = layer(...)` unpacks it), and
answers the attributes the model's forward reads of the layer and its submodules (Nemotron-H's
`layer.block_type`), with no parameter of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from pyplan.errors import TimeLimitError
from pyplan.models.calls import call_model, for_loss
from pyplan.models.deferred import move

__all__ = ["ForwardStage", "call_order", "decoder_layers", "hidden_position", "logits",
           "observe", "prune", "stand_in", "units", "whole_forward"]


def decoder_layers(model: nn.Module) -> str | None:
    """The dotted name of the model's list of layers: the longest nn.ModuleList not inside
    another one (lists of experts or adapters live inside a layer), whatever the classes of
    its layers (hybrid models alternate Mamba and attention layers); None if it has none."""
    best, size = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > size and \
                not (best is not None and name.startswith(f"{best}.")) and \
                not any(name.startswith(f"{outer}.") for outer in _lists_above(model, name)):
            best, size = name, len(module)
    return best


def _lists_above(model: nn.Module, name: str) -> list[str]:
    """The names of the nn.ModuleLists that hold module `name`."""
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))
            if isinstance(model.get_submodule(".".join(parts[:k])), nn.ModuleList)]


def call_order(model: nn.Module, inputs) -> tuple[list[str], int]:
    """The model's modules with parameters of their own, and its layers, in the order one
    forward (eval mode, no gradients) first calls them; and what its layers return: 0 for the
    hidden states, n for a tuple of n (hidden states first; the longest any layer returns)."""
    layers_name = decoder_layers(model)
    layers = {f"{layers_name}.{i}" for i in range(len(model.get_submodule(layers_name)))} \
        if layers_name else set()
    order: dict[str, None] = {}
    # Modules holding the layers are called first and own no unit (their parameters are
    # shared by every stage); modules inside a layer are the layer's.
    handles = [module.register_forward_pre_hook(lambda *_, name=name: order.setdefault(name))
               for name, module in model.named_modules()
               if name in layers or (module._parameters and
                                     not f"{layers_name}.".startswith(f"{name}.") and name and
                                     not name.startswith(f"{layers_name}."))]
    returns = [0]
    handles += [model.get_submodule(name).register_forward_hook(
        lambda _m, _a, out: returns.append(len(out) if isinstance(out, tuple) else 0))
        for name in sorted(layers)]
    observe(model, inputs, handles)
    return list(order), max(returns)


def observe(model: nn.Module, inputs, handles: list) -> None:
    """One forward of the whole model (eval mode, no gradients) for the hooks behind `handles`
    to watch; then the hooks are removed and the model's mode restored."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole_forward(model, inputs)
    finally:
        model.train(was)
        for handle in handles:
            handle.remove()


def units(model: nn.Module, inputs) -> tuple[list[tuple[str, tuple[str, ...]]], int] | str:
    """(name, modules) of the units of a forward cut: the modules with parameters called before
    the first layer, each layer, the ones called after the last; and what the layers return (0
    the hidden states, n a tuple of n). Else why the cut does not apply: the model's forward
    does not call its layers in order between other modules, or the cut pieces, chained, do not
    compute what the whole model computes."""
    layers_name = decoder_layers(model)
    count = len(model.get_submodule(layers_name))
    layers = [f"{layers_name}.{i}" for i in range(count)]
    try:
        order, returns = call_order(model, inputs)
    except TimeLimitError:  # (measured under pyplan.measure.limits: not this code's to keep)
        raise
    except Exception as exc:  # a forward that cannot run on these inputs is not this cut's
        return f"its forward raised {_describe(exc)} on a micro-batch"
    called = [name for name in order if name in set(layers)]
    if called != layers:
        shown = ", ".join(n.rpartition(".")[2] for n in called[:8])
        return (f"its forward does not call the {count} layers of {layers_name} once each, "
                f"in order (called: {shown or 'none'})")
    first, last = order.index(layers[0]), order.index(layers[-1])
    before, after = _outermost(order[:first]), _outermost(order[last + 1:])
    if any(name in before + after for name in layers):
        return f"its forward calls the layers of {layers_name} more than once"
    other = _other_layers(model, layers_name, before + after)
    if other is not None:  # an encoder-decoder: both lists are to be cut, not one
        return f"its forward calls a second list of layers, {other}, around {layers_name}"
    tail = [("+".join(after), tuple(after))] if after else []
    found = ([("+".join(before), tuple(before))] if before else []) + \
        [(name, (name,)) for name in layers] + tail
    why = _differs_from_whole(model, [m for _, m in found], inputs, returns)
    if why is None:
        return found, returns
    # Layers that read the embeddings' output itself (Zamba2's shared attention takes it
    # beside the hidden states) need it on every stage: the embeddings become no unit's, so
    # every stage runs them (their parameters tied over the stages).
    found = [(name, (name,)) for name in layers] + tail
    if before and _differs_from_whole(model, [m for _, m in found], inputs, returns) is None:
        return found, returns
    return f"cut at its layers, each stage on a rank of its own, {why}"


def _other_layers(model: nn.Module, layers_name: str, names: list[str]) -> str | None:
    """The name of another list of layers (an nn.ModuleList of 2 or more, not inside a
    list) holding one of the modules `names`, if any."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and name != layers_name and \
                not _lists_above(model, name) and \
                any(n.startswith(f"{name}.") for n in names):
            return name
    return None


def _outermost(names: list[str]) -> list[str]:
    """`names` without those inside another of them (ViT's embeddings own the class token and
    positions, and hold the patch embedding's convolution, called first): a unit's modules
    never overlap."""
    return [n for n in names if not any(n.startswith(f"{m}.") for m in names if m != n)]


def _differs_from_whole(model: nn.Module, stage_modules: list[tuple[str, ...]], inputs,
                        returns: int) -> str | None:
    """Each unit as a stage of its own rank (a copy of the model pruned as that rank prunes
    it), chained: None when that computes the whole model's logits, else how it fails."""
    import copy

    try:
        with torch.no_grad():
            whole_model = copy.deepcopy(model).eval()
            want = logits(whole_forward(whole_model, inputs))
            del whole_model
            hidden = None
            for s in range(len(stage_modules)):
                stage = prune(copy.deepcopy(model).eval(), stage_modules, [s],
                              torch.device("cpu"), returns=returns)[s]
                hidden = stage(inputs) if s == 0 else stage(inputs, hidden)
                del stage
    except TimeLimitError:  # (measured under pyplan.measure.limits: not this code's to keep)
        raise
    except Exception as exc:  # any failure of the cut pieces means: not this cut
        return f"stage {s} raised {_describe(exc)}"
    if not (isinstance(want, torch.Tensor) and isinstance(hidden, torch.Tensor) and
            want.shape == hidden.shape):
        return "the last stage's output is not the model's logits"
    if not torch.allclose(want, hidden, atol=1e-5):
        return (f"the stages compute other logits than the whole model (largest difference "
                f"{float((want - hidden).abs().max()):.3g})")
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def hidden_position(args: tuple, kwargs: dict):
    """Where a module call's hidden states are: its first positional tensor, else the
    `hidden_states` keyword, else its first tensor keyword."""
    if args and isinstance(args[0], torch.Tensor):
        return 0
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states"
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            return key
    return None


class _Leave(Exception):
    """Ends a stage's call of the model's forward, carrying the hidden states out."""

    def __init__(self, value) -> None:
        super().__init__("stage exit")
        self.value = value


logits = for_loss  # what the loss gets of the model's output (pyplan.models.calls)
whole_forward = call_model  # the model's own forward on a micro-batch's inputs


class _Calls:
    """Shared by the stages of one pruned model on a rank: which stage is running, and the
    layers it passes through."""

    def __init__(self) -> None:
        self.stage: ForwardStage | None = None
        self.through: frozenset[int] = frozenset()


class ForwardStage(nn.Module):
    """One stage: call with (micro-batch inputs) on the first stage, (inputs, hidden) after."""

    pyplan_wants_inputs = True

    def __init__(self, model: nn.Module, calls: _Calls, entry: str | None, exit: str | None,
                 through: frozenset[int], last: bool, index: int = 0,
                 owners: dict[str, int] | None = None) -> None:
        super().__init__()
        self.model = model
        self.calls, self.through, self.last = calls, through, last
        self.index, self.owners = index, owners
        self.entry_name, self.exit_name = entry, exit
        self.received = None
        self.rng: tuple | None = None
        if entry is not None:
            model.get_submodule(entry).register_forward_pre_hook(self._enter, with_kwargs=True)
        if exit is not None:
            model.get_submodule(exit).register_forward_pre_hook(self._leave, with_kwargs=True)

    @property
    def running(self) -> bool:
        """Whether this stage's call of the model's forward is the one under way."""
        return self.calls.stage is self

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """The parameters this stage trains: those of its own modules and of modules no stage
        lists, not every parameter of the (pruned) model it calls (which holds this rank's
        other stages too): what the runtime reduces, splits and counts per block."""
        seen = set()
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate=False):
            if self.owners is not None:
                module = name[len(prefix) + 1 if prefix else 0:].rpartition(".")[0]
                module = module[len("model."):] if module.startswith("model.") else ""
                if _owner(module, self.owners) not in (None, self.index):
                    continue
            if remove_duplicate and id(param) in seen:
                continue
            seen.add(id(param))
            yield name, param

    def _enter(self, module, args, kwargs):
        if self.calls.stage is not self:
            return None
        where = hidden_position(args, kwargs)
        if where is None:
            raise RuntimeError(f"the stage's first module {self.entry_name} was called without "
                               "a tensor to replace with the received hidden states")
        _restore_rng(self.rng)
        if isinstance(where, int):
            return (self.received, *args[1:]), kwargs
        return args, {**kwargs, where: self.received}

    def _leave(self, module, args, kwargs):
        if self.calls.stage is not self:
            return None
        where = hidden_position(args, kwargs)
        if where is None:
            raise RuntimeError(f"the next stage's first module {self.exit_name} was called "
                               "without hidden states to hand on")
        raise _Leave(args[where] if isinstance(where, int) else kwargs[where])

    def forward(self, inputs, hidden=None):
        self.received = hidden
        self.rng = _rng_state() if hidden is not None else None
        outer = (self.calls.stage, self.calls.through)
        self.calls.stage, self.calls.through = self, self.through
        try:
            out = whole_forward(self.model, inputs)
        except _Leave as leave:
            return leave.value
        finally:
            self.calls.stage, self.calls.through = outer
            self.received = self.rng = None
        if not self.last:
            raise RuntimeError(f"the model's forward ended before the next stage's first module "
                               f"{self.exit_name} was called")
        return logits(out)


def _rng_state():
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if cuda else None)


def _restore_rng(state) -> None:
    if state is None:
        return
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _through(args: tuple, kwargs: dict, returns: int):
    """A layer call's hidden states, handed on as the layer would return them: alone
    (`returns` 0), or first in a tuple of `returns` (None for the rest)."""
    where = hidden_position(args, kwargs)
    hidden = args[where] if isinstance(where, int) else kwargs[where]
    return (hidden,) + (None,) * (returns - 1) if returns else hidden


class _PassThrough(nn.Module):
    """A layer this rank does not hold: hands its hidden states on unchanged, in the structure
    the layer returns."""

    def __init__(self, returns: int) -> None:
        super().__init__()
        self.returns = returns

    def forward(self, *args, **kwargs):
        return _through(args, kwargs, self.returns)


def stand_in(layer: nn.Module, returns: int) -> _PassThrough:
    """The stand-in of `layer` on a rank that does not hold it: a pass-through that carries
    the layer's plain attributes, and shells of its submodules carrying theirs (what a model's
    forward may read of its layers: `layer.block_type`, `layer.self_attn.is_sliding`), and no
    parameters or buffers."""
    found = _PassThrough(returns)
    _copy_attributes(layer, found)
    return found


def _copy_attributes(source: nn.Module, target: nn.Module) -> None:
    for key, value in vars(source).items():
        if not key.startswith("_") and key not in vars(target) and key not in ("training",
                                                                              "forward"):
            target.__dict__[key] = value
    for name, child in source.named_children():
        shell = nn.Module()
        _copy_attributes(child, shell)
        target.add_module(name, shell)


class _Elsewhere(nn.Module):
    """A module of a later stage, held by another rank: never called on this one."""

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__()
        self.name = name
        _copy_attributes(module, self)  # read before the call (MobileNet's padding: .stride)

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} belongs to a later stage but was called before this "
                           "stage ended (its modules are not called in the order of its units)")


def _owner(name: str, owners: dict[str, int]) -> int | None:
    """The stage that owns module `name`: the one listing it or an enclosing module."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        found = owners.get(".".join(parts[:k]))
        if found is not None:
            return found
    return None


def prune(model: nn.Module, stage_modules: list[tuple[str, ...]], mine: list[int],
          device, *, returns: int = 0, materialize=None) -> dict[int, ForwardStage]:
    """Keep what stages `mine` (indices into `stage_modules`, the stages in model order) need
    of the whole model, move it to `device`, and return each stage's module. Modules no stage
    lists are kept everywhere (their parameters are shared by all stages). `returns`: what the
    layers return (0 the hidden states, n a tuple of n). A model built on the meta device gets
    `materialize(model)` once only what these stages need is left."""
    layers_name = decoder_layers(model)
    layers = model.get_submodule(layers_name) if layers_name else nn.ModuleList()
    owners = {name: s for s, names in enumerate(stage_modules) for name in names}
    last = max(mine)
    for i in range(len(layers)):
        if _owner(f"{layers_name}.{i}", owners) not in mine:
            layers[i] = stand_in(layers[i], returns)
    zeroed = []
    for name, module in list(model.named_modules()):
        owner = _owner(name, owners)
        if owner is None or owner in mine or (layers_name and name.startswith(layers_name)):
            continue
        if owner > last and name in owners:  # a later stage's: never called here
            parent, _, child = name.rpartition(".")
            model.get_submodule(parent).register_module(child, _Elsewhere(name, module))
        elif owner < last:  # runs before this rank's stages start: zeros, almost free
            for pname, param in list(module._parameters.items()):
                if param is not None:
                    zeroed.append((module, pname, param.dtype, tuple(param.shape)))
                    del module._parameters[pname]
    if materialize is not None:
        materialize(model)
    move(model, device)  # parameters still deferred are materialised when used (streaming)
    for module, pname, dtype, shape in zeroed:  # after the move: views of one zero each
        module.register_buffer(pname, torch.zeros((), dtype=dtype, device=device).expand(shape),
                               persistent=False)
    calls = _Calls()
    for i, layer in enumerate(layers):
        if not isinstance(layer, _PassThrough):
            layer.forward = _switched(layer.forward, calls, i, returns)
    stages = {}
    for s in mine:
        names = stage_modules[s]
        start = _layer_index(names, layers_name)
        through = frozenset(range(len(layers) if start is None else start))
        stages[s] = ForwardStage(model, calls, names[0] if s > 0 else None,
                                 stage_modules[s + 1][0] if s + 1 < len(stage_modules) else None,
                                 through, last=s + 1 == len(stage_modules), index=s,
                                 owners=owners)
    return stages


def _layer_index(names: tuple[str, ...], layers_name: str | None) -> int | None:
    """The index of the first layer among a stage's modules (None if it has none)."""
    for name in names:
        if layers_name and name.startswith(f"{layers_name}."):
            return int(name[len(layers_name) + 1:].split(".")[0])
    return None


def _switched(forward, calls: _Calls, index: int, returns: int):
    """A layer's (bound) forward that passes its hidden states through in the calls of the
    stages that start after it."""
    def switched(*args, **kwargs):
        if index in calls.through:
            return _through(args, kwargs, returns)
        return forward(*args, **kwargs)
    return switched
