"""Binding a plan's `model:` section to nn.Modules, batches and a loss (the contract is in the
`model:` descriptions of schemas/plan.schema.json).

Every rank and the single-process reference build a block (or the whole model) after seeding
torch's RNG from the run's seed and the block's name, so a block starts with the same weights
wherever it is built, whatever else that process built before it; and every forward of a block
runs with the RNG seeded from the seed, the iteration, the block and the micro-batch, so dropout
draws the same masks in any schedule, on every rank of a multi-device block and in the
single-process reference.

User code (the factory, blocks, data and loss) fails in one line that names the function, what
it did and the plan line that names it (`UserCodeError`), never with a traceback from inside
pyplan.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from pyplan.errors import PlanError, RunError, UserCodeError
from pyplan.errors import describe_exception as _describe_exception
from pyplan.models import CHAIN, FORWARD, TRACED, Cut, Tie, member, stage_modules, ties, traced
from pyplan.models.deferred import Deferred, defer
from pyplan.models.weights import open_checkpoint
from pyplan.run.data import (DATA_HINT, Source, batches_from, check_batch, describe, split_batch,
                             to_device)
from pyplan.run.user_calls import running
from pyplan.problem import Problem
from pyplan.planfile import load_yaml

__all__ = ["Built", "Model", "block_inputs", "block_seeds", "build", "build_whole",
           "call_user", "check_model", "defer_whole", "forward_blocks", "forward_seed",
           "import_function", "load_model", "loss_function", "make_batch", "seed_everything",
           "seed_generators"]

# ---------------------------------------------------------------- the model's functions

@dataclass(frozen=True)
class Model:
    build: Callable[[str, Any], torch.nn.Module] | None
    """(block name, group) -> the block's module; None when `whole` builds the model."""
    data: Callable[[int], tuple[Any, Any]]
    loss: Callable[..., torch.Tensor]
    whole: Callable[[], torch.nn.Module] | None = None
    """() -> the whole model, whose submodules `stages` names for each block."""
    stages: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cut: Cut = Cut()
    ties: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    """The ties the plan records (parameter, stages), None when it records none."""
    names: dict[str, str] = field(default_factory=dict)
    """Which plan key names each function ('model.data'), for messages."""
    source: str | None = None
    vocab: tuple[str, str] | None = None
    """(token embedding, head) the multi-device blocks holding them shard over the
    vocabulary (model.vocab_parallel); `loss` is then pyplan.models.vocab.parallel_loss of the
    user's."""
    weights: Path | None = None
    """The checkpoint the parameters start from (model.weights, resolved against the plan's
    folder)."""
    batches: Source | None = field(default=None, compare=False, repr=False)
    """Global batches by step from `data` (made from it)."""

    def __post_init__(self) -> None:
        if self.batches is None:
            object.__setattr__(self, "batches", batches_from(self.data))


_HINTS = {"blocks": "build(block_name, group) must return an nn.Module for every declared "
                     "block",
          "data": DATA_HINT,
          "loss": "loss(output, targets) returns a scalar tensor, the mean over the micro-batch",
          "module": "the factory returns the whole model, an nn.Module"}


def call_user(model: Model | None, what: str, fn: Callable, *args, context: str = ""):
    """Call the user's function `what` ('data', 'loss', 'module', 'blocks'); any exception,
    SystemExit included, becomes one UserCodeError naming it (and `context`, e.g. which
    block it was building). The data and the loss are watched while they run (a factory
    builds, maybe downloads, for as long as it needs)."""
    watched = running((id(model), what), lambda: _named(model, what)) \
        if what in ("data", "loss") else nullcontext()
    try:
        with watched:
            return fn(*args)
    except (PlanError, RunError):
        raise
    except BaseException as exc:  # SystemExit too: the user's code must not end the run
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise _user_error(model, what, f"raised {_describe_exception(exc)}"
                          + (f" {context}" if context else ""), _HINTS.get(what)) from None


def loss_function(model: Model, context: str = "") -> Callable:
    """The model's loss, called as the user's code (failures named at its plan line, with
    `context` after the exception) and checked to return a scalar tensor."""
    def loss(output, targets, *group):
        value = call_user(model, "loss", model.loss, output, targets, *group, context=context)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise _user_error(model, "loss", f"returned {describe(value)}, not a scalar tensor",
                              _HINTS["loss"])
        if value.is_meta:
            raise _user_error(model, "loss", "returned a loss on the meta device, which holds no "
                              "value", _HINTS["loss"])
        if not value.is_floating_point():
            raise _user_error(model, "loss", f"returned a scalar of dtype {str(value.dtype)[6:]}, "
                              "not a real floating-point one", _HINTS["loss"])
        if torch.is_grad_enabled() and not value.requires_grad and any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in torch.utils._pytree.tree_leaves(output)):
            raise _user_error(model, "loss", "returned a loss that does not require grad: it is "
                              "cut off from the output (.detach(), .item(), torch.no_grad() or "
                              "a new tensor), so nothing would train", _HINTS["loss"])
        return value
    return loss


def located(source: str | None, keys: tuple, message: str, hint: str | None = None,
            error=PlanError) -> PlanError:
    """An error at the position of `keys` (e.g. ("model", "data")) in the plan file `source`,
    or without a position when the file cannot say."""
    if source is not None and Path(source).is_file():
        try:
            return load_yaml(source).error(keys, message, hint)
        except PlanError:  # the plan is unreadable now: the message without a position
            pass
    return error(message, hint=hint, file=source)


def _who(model: Model | None, what: str) -> tuple[str, str | None]:
    """(the plan key naming the user's function `what`, its "module:name" if known)."""
    path = (model.names if model is not None else {}).get(what, f"model.{what}")
    function = getattr(model, {"module": "whole", "blocks": "build"}.get(what, what), None) \
        if model is not None else None
    label = getattr(function, "__qualname__", None)
    module = getattr(function, "__module__", None)
    return path, f"{module}:{label}" if label and module else None


def _named(model: Model | None, what: str) -> str:
    """"the data function pkg.mod:fn (plan.yaml model.data)"."""
    path, function = _who(model, what)
    where = f"{model.source} {path}" if model is not None and model.source else path
    word = {"module": "model factory", "blocks": "block factory"}.get(what, what)
    return f"the {word} function {function} ({where})" if function else f"the {word} ({where})"


def _user_error(model: Model | None, what: str, message: str, hint: str | None = None):
    path, function = _who(model, what)
    who = f"{path} ({function})" if function else path
    if model is None or model.source is None:
        return UserCodeError(f"{who} {message}", hint=hint)
    return located(model.source, tuple(path.split(".")), f"{who} {message}", hint,
                   UserCodeError)


def import_function(text: str, what: str, *, file: str | None = None,
                    hint: str = "install the model's package or set model.path",
                    check=callable) -> Callable:
    """The function (or, with another `check`, the object) an import path "pkg.mod:fn" names;
    PlanError (about `what`) otherwise. Importing runs the user's module: whatever it raises
    (or a SyntaxError) is one line."""
    module_name, _, attr = text.partition(":")
    if not module_name or not attr:
        raise PlanError(f"{what} {text!r} is not an import path pkg.mod:fn", file=file)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PlanError(f"{what}: cannot import {module_name}: {exc}", hint=hint,
                        file=file) from None
    except BaseException as exc:  # noqa: BLE001 - the user's module failed while importing
        if isinstance(exc, KeyboardInterrupt):
            raise
        where = ""
        if isinstance(exc, SyntaxError) and exc.filename:
            where = f" ({exc.filename}:{exc.lineno})"
        raise PlanError(f"{what}: importing {module_name} raised "
                        f"{_describe_exception(exc)}{where}", file=file) from None
    function = getattr(module, attr, None)
    if function is None or not check(function):
        kind = "function" if check is callable else "function, dataset or iterable"
        raise PlanError(f"{what}: {module_name} has no {kind} {attr!r}", file=file)
    return function


def load_model(problem: Problem, plan_dir: Path, source: str | None = None) -> Model:
    """Import the plan's model functions, with the plan's folder and model.path (relative to
    it) on sys.path, however the process was started (python -m, a console script, torchrun
    --no-python). Messages point into `source` (the plan file), else the problem's file."""
    spec = problem.model
    file = source or problem.source_path
    for folder in ([spec.path] if spec.path else []) + ["."]:
        path = str((plan_dir / folder).resolve())
        if path not in sys.path:
            sys.path.insert(0, path)

    def function(text: str, what: str, check=callable) -> Callable:
        try:
            return import_function(text, f"model.{what}", check=check)
        except PlanError as exc:  # at the line that names the function
            raise located(file, ("model", what), exc.message, exc.hint) from None

    data = function(spec.data, "data", check=lambda found: batches_from(found) is not None)
    loss = function(spec.loss, "loss")
    names = {k: f"model.{k}" for k in ("data", "loss", "module", "blocks")}
    if spec.module is not None:
        vocab = getattr(spec, "vocab_parallel", None)
        if vocab is not None:  # the loss of vocabulary-sharded logits: under loss_parallel
            from pyplan.models.vocab import parallel_loss

            loss = parallel_loss(loss)
        weights = None if spec.weights is None else plan_dir / spec.weights
        return Model(None, data, loss, whole=function(spec.module, "module"),
                     stages=dict(spec.stages), cut=Cut.of(spec.cut, spec.layer_returns),
                     ties=spec.ties, names=names, source=file, vocab=vocab, weights=weights)
    return Model(function(spec.blocks, "blocks"), data, loss, names=names, source=file)


# ---------------------------------------------------------------- random numbers

def seed_everything(seed: int, *parts: object) -> None:
    text = ":".join(str(p) for p in (seed,) + parts)
    torch.manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big"))


@functools.lru_cache(maxsize=None)
def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:forward:{name}".encode()).digest()[:7], "big")


def block_seeds(seed: int, names: list[str]) -> list[int]:
    """Per block, the base of its forwards' random numbers (hashed once, not per forward)."""
    return [_name_seed(seed, name) for name in names]


def forward_seed(base: int, iteration: int, micro_batch: int) -> int:
    """The seed of one forward: its block's base mixed with the iteration and the global
    micro-batch (splitmix64's finaliser: cheap, and far apart for neighbouring inputs)."""
    z = (base + 0x9E3779B97F4A7C15 * (iteration * 1_000_003 + micro_batch + 1)) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1


def seed_generators(seed: int, device: torch.device) -> None:
    """Seed the CPU generator and, on CUDA, this device's (not every device's)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)


@contextmanager
def kept_rng(device: torch.device):
    """Leave the caller's random number state as it was after the body (which reseeds)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


# ---------------------------------------------------------------- building the modules

def forward_blocks(problem: Problem) -> list[int]:
    """The declared (forward or other) blocks, which own the modules, in plan order."""
    return [b.index for b in problem.blocks if b.is_forward]


def block_inputs(problem: Problem, blocks) -> dict[int, list[int]]:
    """For each forward block, the blocks whose outputs it takes, in `after:` order (an empty
    list: it takes the micro-batch's inputs)."""
    preds: dict[int, list[int]] = {b: [] for b in blocks}
    for a, c in problem.edges:
        if c in preds and problem.blocks[c].is_forward and problem.blocks[a].is_forward:
            preds[c].append(a)
    return preds


@dataclass
class Built:
    """A rank's modules: one per forward block it runs, and the model they come from."""

    modules: dict[int, torch.nn.Module]
    names: dict[int, str]
    """id(parameter) -> its name in the model (the first of its names)."""
    whole: torch.nn.Module | None
    """The (pruned) whole model the modules belong to, when the plan builds one."""
    ties: list[Tie]
    wants_inputs: frozenset[int]
    """Blocks that also take the micro-batch's inputs (forward-cut stages)."""
    read: tuple[str, ...] = ()
    """The tensors this process read from the checkpoint the model starts from."""


def _stages_in_order(problem: Problem, model: Model) -> list[tuple[str, tuple[str, ...]]]:
    return [(problem.blocks[b].name, model.stages[problem.blocks[b].name])
            for b in forward_blocks(problem)]


def _check_stage_names(whole: torch.nn.Module, model: Model, problem: Problem) -> None:
    """Every block has an entry in model.stages naming submodules the model has; PlanError
    at the entry's position otherwise."""
    def fail(where: tuple, message: str, hint: str) -> PlanError:
        return located(model.source or problem.source_path, ("model", "stages") + where,
                       message, hint)

    for b in forward_blocks(problem):
        name = problem.blocks[b].name
        if name not in model.stages:
            raise fail((), f"model.stages has no entry for block '{name}'",
                       "list the submodules of every declared block")
        for i, unit in enumerate(model.stages[name]):
            try:
                module = member(whole, unit)
            except AttributeError:
                raise fail((name, i), f"model.stages: the model has no submodule '{unit}' "
                           f"(block '{name}')", "names are dotted paths as in "
                           "named_modules(), e.g. layers.0") from None
            # A chain calls each unit; a container (ModuleList, ModuleDict) has no forward.
            if model.cut.kind == CHAIN and type(module).forward is torch.nn.Module.forward:
                raise fail((name, i), f"model.stages: '{unit}' (block '{name}') is a "
                           f"{type(module).__name__}, which has no forward to call",
                           "name its items instead, e.g. "
                           f"{unit}.{next(iter(dict(module.named_children())), '0')}")


def defer_whole(model: Model, seed: int, *, say: bool = True) -> Deferred:
    """The user's whole model with its parameters on the meta device, each with the recipe of
    its value under the run's seed (pyplan.models.deferred): every process that builds it gets
    the same bits for the parameters it materialises. `say`: warn on stderr when the factory
    could not be followed and the model was built whole."""
    seed_everything(seed, "module")
    if os.environ.get("PYPLAN_BUILD") == "whole":  # every process builds it whole (to compare)
        deferred = call_user(model, "module", eager_whole, model.whole, seed)
    else:
        deferred = call_user(model, "module", defer, model.whole, seed)
    if not isinstance(deferred.model, torch.nn.Module):
        raise _user_error(model, "module", f"returned {type(deferred.model).__name__}, not a "
                          "torch.nn.Module", _HINTS["module"])
    if deferred.eager and say:
        print(f"warning: {model.names.get('module', 'model.module')} is built whole on every "
              f"rank: {deferred.why_eager}", file=sys.stderr, flush=True)
    if model.weights is not None:
        try:
            deferred.start_from(open_checkpoint(model.weights))
        except PlanError as exc:  # at the line that names the checkpoint
            raise located(model.source, ("model", "weights"), exc.message, exc.hint) from None
    return deferred


def check_weights(problem: Problem, plan_dir: Path, source: str | None = None) -> None:
    """The checkpoint model.weights names opens and its index agrees with its shards, from
    the files' headers alone (no tensor read, no model built): cheap enough to say before any
    process starts what would otherwise fail on every rank."""
    if problem.model is None or getattr(problem.model, "weights", None) is None:
        return
    try:
        open_checkpoint(plan_dir / problem.model.weights).header()
    except PlanError as exc:  # at the line that names the checkpoint
        raise located(source, ("model", "weights"), exc.message, exc.hint) from None


def eager_whole(factory, seed: int) -> Deferred:
    """The model built by its factory as it is, whole ($PYPLAN_BUILD=whole)."""
    return Deferred(factory(), seed, None, why_eager="$PYPLAN_BUILD is whole")


def build_whole(model: Model, seed: int, device="cpu") -> torch.nn.Module:
    """The user's whole model, every parameter materialised on `device` (the single-process
    reference, consolidate): the same values every rank gives its own."""
    deferred = defer_whole(model, seed)
    deferred.materialize(deferred.model, device)
    return deferred.model.to(device)


def build(model: Model, problem: Problem, *, seed: int, device, rank: int | None = None,
          groups: dict[int, Any] | None = None, only: list[int] | None = None) -> Built:
    """The modules of the forward blocks on `rank` (every block when rank is None: the
    single-process reference, where every block is built whole; `only` these blocks). A
    `module:` plan's model is built on the meta device and only the parameters of the blocks
    built are materialised."""
    blocks = forward_blocks(problem)
    mine = [b for b in blocks if (rank is None or rank in problem.blocks[b].devices) and
            (only is None or b in only)]
    if model.whole is None:
        modules = {}
        for b in mine:
            block = problem.blocks[b]
            seed_everything(seed, "block", block.name)
            module = call_user(model, "blocks", model.build, block.name,
                               (groups or {}).get(b), context=f"building block '{block.name}'")
            if not isinstance(module, torch.nn.Module):
                raise _user_error(model, "blocks", f"returned {type(module).__name__} for "
                                  f"block '{block.name}', not a torch.nn.Module",
                                  _HINTS["blocks"])
            modules[b] = module.to(device)
        names = {id(p): f"{problem.blocks[b].name}.{n}" for b, m in modules.items()
                 for n, p in reversed(list(m.named_parameters()))}
        return Built(modules, names, None, [], frozenset())
    deferred = defer_whole(model, seed, say=rank in (None, 0))
    whole = deferred.model
    _check_stage_names(whole, model, problem)
    _check_cut(whole, model, problem)
    stages = _stages_in_order(problem, model)
    found = ties(whole, stages)
    _check_ties(model, found, problem)
    index = {problem.blocks[b].name: s for s, b in enumerate(blocks)}
    before = {id(p): n for n, p in reversed(list(whole.named_parameters(remove_duplicate=False)))}
    inputs = None
    materialize = lambda pruned: deferred.materialize(pruned, device)  # noqa: E731
    if model.cut.kind == TRACED:  # every rank traces the same micro-batch
        batch = make_batch(model, 0, seed, torch.device("cpu"))[0]
        inputs = split_batch(batch, problem.num_micro_batches)[0]
        if deferred.eager:
            materialize = None
        else:  # on the meta device, then each of this rank's pieces gets its own values
            inputs = to_device(inputs, torch.device("meta"))
            made: dict = {}  # a tied parameter's copies in this process: one parameter
            materialize = lambda piece: traced.materialize(piece, deferred, device, made)  # noqa
    elif model.cut.kind == CHAIN:  # only the units of this rank's stages
        owned = tuple(f"{u}." for b in mine for u in model.stages[problem.blocks[b].name])
        deferred.materialize(whole, device, names=lambda name: name.startswith(owned))
    # Traced stages that are not a chain form a graph pipeline: each reads its after: stages.
    reads = [[blocks.index(p) for p in ps] for ps in block_inputs(problem, blocks).values()]
    graph = reads if model.cut.kind == TRACED and reads != [
        [s - 1] if s else [] for s in range(len(blocks))] else None
    by_stage = stage_modules(whole, model.cut, stages,
                             [index[problem.blocks[b].name] for b in mine], device, inputs,
                             materialize=materialize, graph=graph)
    if model.vocab is not None:
        _shard_vocab(whole, model, problem, stages, by_stage, mine, rank, groups or {}, device)
    # A parameter's name in the model: a tied one's first name, though pruning may have
    # removed that module (a materialised parameter remembers it).
    names = {id(p): getattr(p, "pyplan_name", None) or before.get(id(p), n)
             for n, p in reversed(list(whole.named_parameters(remove_duplicate=False)))}
    modules = {b: by_stage[index[problem.blocks[b].name]] for b in mine}
    # Pieces traced on the meta device got parameters of their own, which know their names.
    names.update((id(p), p.pyplan_name) for m in modules.values() for p in m.parameters()
                 if id(p) not in names and hasattr(p, "pyplan_name"))
    wants = frozenset(b for b in mine if model.cut.kind == FORWARD and index[
        problem.blocks[b].name] > 0 or graph and graph[index[problem.blocks[b].name]] and
        modules[b].reads_input)
    read = tuple(deferred.checkpoint.read) if deferred.checkpoint is not None else ()
    return Built(modules, names, whole if model.cut.kind != TRACED else None, found, wants,
                 read)


def _vocab_blocks(model: Model, problem: Problem,
                  stages: list[tuple[str, tuple[str, ...]]]) -> list[int]:
    """The stages (indices into `stages`) holding model.vocab_parallel's embedding and head;
    PlanError unless both are found in blocks that run on several devices."""
    found = []
    for module in model.vocab:
        holders = [s for s, (_, units) in enumerate(stages)
                   if any(module == u or module.startswith(f"{u}.") for u in units)]
        block = problem.blocks[problem.by_name[stages[holders[0]][0]]] if holders else None
        if block is None or len(block.devices) < 2:
            where = f"block '{block.name}', on one device" if block else "no block"
            raise located(model.source or problem.source_path, ("model", "vocab_parallel"),
                          f"model.vocab_parallel: {module} is held by {where}; a module "
                          "sharded over the vocabulary runs in a block on several devices",
                          "re-run pyplan partition --shape mshape")
        found.append(holders[0])
    return found


def _shard_vocab(whole, model: Model, problem: Problem, stages, by_stage: dict, mine: list[int],
                 rank: int | None, groups: dict, device) -> None:
    """Shard the embedding and the head over the devices of the blocks holding them, on ranks
    that run those blocks (the single-process reference keeps them whole)."""
    from pyplan.models.vocab import Vocab, shard

    held = _vocab_blocks(model, problem, stages)
    blocks = [problem.by_name[stages[s][0]] for s in held]
    if rank is None or blocks[0] not in mine:
        return
    if problem.blocks[blocks[0]].devices != problem.blocks[blocks[1]].devices:
        raise located(model.source or problem.source_path, ("model", "vocab_parallel"),
                      "model.vocab_parallel: the blocks holding the embedding and the head "
                      "must run on the same devices")
    embed = by_stage.get(held[0])
    active = (lambda: embed.running) if model.cut.kind == FORWARD else None
    size = whole.get_submodule(model.vocab[0]).weight.shape[0]
    shard(whole, Vocab(model.vocab[0], model.vocab[1], size), groups[blocks[0]],
          torch.device(device), active=active)


def _check_ties(model: Model, found: list[Tie], problem: Problem) -> None:
    """The ties the plan records (if any) are those the model has."""
    if model.ties is None:
        return
    recorded = {p: tuple(s) for p, s in model.ties}
    actual = {t.parameter: t.stages for t in found}
    if recorded != actual:
        differ = sorted(set(recorded.items()) ^ set(actual.items()))[0]
        where = "records" if differ[0] in recorded and recorded[differ[0]] == differ[1] \
            else "lacks"
        keys = ("model", "ties", [p for p, _ in model.ties].index(differ[0])) \
            if where == "records" else ("model", "ties")
        raise located(model.source or problem.source_path, keys,
                      f"model.ties {where} the tie of {differ[0]} over stages "
                      f"{', '.join(differ[1])}, which the model "
                      f"{'does not have' if where == 'records' else 'has'}",
                      "the plan is stale: re-run pyplan partition")


def _check_cut(whole: torch.nn.Module, model: Model, problem: Problem) -> None:
    """The plan's model.cut can cut this model (an edited cut would fail mid-run): the forward
    cut needs a list of layers; the chain and traced cuts run only the stages' modules, so
    every parameter must belong to one of them."""
    from pyplan.models.forward import _owner, decoder_layers

    source = model.source or problem.source_path
    where = ("model", "cut")  # (the model: section, when the plan leaves the default chain)
    if model.cut.kind == FORWARD:
        if decoder_layers(whole) is None:
            raise located(source, where, "model.cut is forward, but the model has no list of "
                          "layers (an nn.ModuleList) for its forward to be cut at",
                          "the cut is what pyplan partition found: re-run it")
        return
    owners = {name: 0 for _, units in _stages_in_order(problem, model) for name in units}
    for name, _ in whole.named_parameters():
        if _owner(name, owners) is None:
            raise located(source, where, f"model.cut is {model.cut.kind}, which runs only the "
                          f"stages' modules, but the model's parameter {name} is in none of "
                          "them", "the cut is what pyplan partition found: re-run it, or "
                          "list the module holding it in a stage")


def check_model(problem: Problem, plan_dir: Path, source: str | None = None) -> int:
    """Import the model functions and build every declared block whole on the meta device (no
    memory, no compute), so a wrong name in `model:` or a failing build shows before any
    process starts. Returns how many blocks were built."""
    model = load_model(problem, plan_dir, source)
    blocks = forward_blocks(problem)
    if model.whole is not None:
        whole = defer_whole(model, 0).model
        _check_stage_names(whole, model, problem)
        _check_cut(whole, model, problem)
        _check_ties(model, ties(whole, _stages_in_order(problem, model)), problem)
        if model.vocab is not None:
            from pyplan.models.vocab import check_modules

            _vocab_blocks(model, problem, _stages_in_order(problem, model))
            check_modules(whole, *model.vocab, file=problem.source_path)
        return len(blocks)
    with torch.device("meta"):
        built = build(model, problem, seed=0, device="meta")
    shared_across_devices(problem, built.modules)
    return len(blocks)


def shared_across_devices(problem: Problem, modules: dict[int, torch.nn.Module]) -> None:
    """RunError naming a parameter that blocks on different devices share: hand-written blocks
    are built once per rank, so such a parameter would silently become two."""
    seen: dict[int, int] = {}
    for b, module in modules.items():
        for name, param in module.named_parameters():
            other = seen.setdefault(id(param), b)
            if problem.blocks[other].devices != problem.blocks[b].devices:
                raise RunError(f"blocks '{problem.blocks[other].name}' and "
                               f"'{problem.blocks[b].name}' share the parameter {name}, but "
                               "run on different devices: each would train its own copy",
                               hint="build the whole model with model: {module: ...} (pyplan "
                                    "partition), whose ties pyplan keeps in step")


# ---------------------------------------------------------------- batches

def make_batch(model: Model, step: int, seed: int, device,
               split: str | None = None) -> tuple[Any, Any]:
    """The global batch of iteration `step`, the same on every rank and in the reference;
    with `split` ("eval"), batch `step` of that split (pyplan.run.data), None past its end
    (the data returned None)."""
    if model.batches is None:
        raise _user_error(model, "data", f"is {describe(model.data)}, neither a function nor a "
                          "dataset or iterable of batches", DATA_HINT)
    batch = call_user(model, "data", model.batches.get, step,
                      lambda *parts: seed_everything(seed, *parts), split)
    if batch is None and split is not None:  # past the end of that split
        return None
    why = check_batch(batch)
    if why is not None:
        raise _user_error(model, "data", why, DATA_HINT if why.endswith("(inputs, targets)")
                          else "inputs and targets are tensors (or tuples, lists or dicts of "
                          "them) with the batch along dim 0")
    return to_device(batch[0], device), to_device(batch[1], device)
