"""Binding a plan's `model:` section to nn.Modules, batches and a loss (the contract is in the
`model:` descriptions of schemas/plan.schema.json).

Every rank and the single-process reference build a block after seeding torch's RNG from the
run's seed and the block's name, so a block starts with the same weights wherever it is built,
whatever else that process built before it; and every forward of a block runs with the RNG seeded
from the seed, the iteration, the block and the micro-batch, so dropout draws the same masks in
any schedule, on every rank of a multi-device block and in the single-process reference.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from pyplan.errors import PlanError, RunError
from pyplan.problem import Problem
from pyplan.spec import load_yaml

__all__ = ["SHARD_DIM", "Model", "block_inputs", "build_modules", "check_model",
           "forward_blocks", "forward_rng", "import_function", "load_model", "make_batch", "named_parameters",
           "seed_everything", "shard", "shard_dim", "split_batch", "submodules",
           "traced_stages"]

SHARD_DIM = "pyplan_shard_dim"


def shard(param: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Mark `param` of a multi-device block as this rank's chunk of the whole parameter:
    torch.chunk(whole, group size, dim)[rank in group]. Unmarked parameters of such a block are
    replicated: pyplan sums their gradients over the block's ranks."""
    setattr(param, SHARD_DIM, dim)
    return param


def shard_dim(param: torch.Tensor) -> int | None:
    return getattr(param, SHARD_DIM, None)


@dataclass(frozen=True)
class Model:
    build: Callable[[str, Any], torch.nn.Module] | None
    """(block name, group) -> the block's module; None when `whole` builds the model."""
    data: Callable[[int], tuple[Any, Any]]
    loss: Callable[[torch.Tensor, Any], torch.Tensor]
    whole: Callable[[], torch.nn.Module] | None = None
    """() -> the whole model, whose submodules `stages` names for each block."""
    stages: dict[str, tuple[str, ...]] = field(default_factory=dict)
    traced: bool = False
    """The whole model's forward is not its submodules one after another: each block is the
    stage torch's tracer (torch.distributed.pipelining.pipeline) cuts at its first submodule."""


def traced_stages(model: torch.nn.Module, starts: list[str], inputs) -> list[torch.nn.Module]:
    """The model cut by torch.distributed.pipelining's tracer before each name in `starts`
    (after the first): one module per stage, each taking and returning one tensor."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        with warnings.catch_warnings():  # torch.export's own deprecation notices, not ours
            warnings.simplefilter("ignore", FutureWarning)
            pipe = pipeline(model, mb_args=(inputs,),
                            split_spec={name: SplitPoint.BEGINNING for name in starts[1:]})
    except Exception as exc:  # the tracer's limits: name them in one line
        raise PlanError(f"torch's pipeline tracer cannot cut the model: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                        hint="make the model's forward its children in order") from None
    if pipe.num_stages != len(starts):
        raise PlanError(f"torch's pipeline tracer cut the model into {pipe.num_stages} stages, "
                        f"not {len(starts)}", hint="split points must be submodules the "
                        "forward runs once, in order")
    stages = [pipe.get_stage_module(s) for s in range(pipe.num_stages)]
    x = inputs
    with torch.no_grad():  # a pipeline block takes one tensor and returns one
        for s, stage in enumerate(stages):
            try:
                x = stage(x)
            except TypeError:
                x = None
            if not isinstance(x, torch.Tensor):
                raise PlanError(f"cut before '{starts[s]}', the model passes more than one "
                                "tensor from one piece to the next",
                                hint="pyplan runs pipelines whose stages hand on one tensor; "
                                     "write the plan's blocks by hand (model.blocks)")
    return stages


def submodules(whole: torch.nn.Module, stages: dict[str, tuple[str, ...]],
               blocks: list[str], *, source: str | None = None) -> dict[str, torch.nn.Module]:
    """Each block's module: its named submodules of `whole`, run one after another. A name the
    model lacks is a plan error, at its place in `source` (the plan file) when given."""
    def fail(where: tuple, message: str, hint: str) -> PlanError:
        if source is not None and Path(source).is_file():
            try:
                return load_yaml(source).error(("model", "stages") + where, message, hint)
            except PlanError:  # unreadable now: the message without a position
                pass
        return PlanError(message, hint=hint, file=source)

    out = {}
    for name in blocks:
        if name not in stages:
            raise fail((), f"model.stages has no entry for block '{name}'",
                       "list the submodules of every declared block")
        parts = []
        for i, unit in enumerate(stages[name]):
            try:
                parts.append(whole.get_submodule(unit))
            except AttributeError:
                raise fail((name, i), f"model.stages: the model has no submodule '{unit}' "
                           f"(block '{name}')", "names are dotted paths as in "
                           "named_modules(), e.g. layers.0") from None
        out[name] = parts[0] if len(parts) == 1 else torch.nn.Sequential(*parts)
    return out


def import_function(text: str, what: str, *, file: str | None = None,
                    hint: str = "install the model's package or set model.path") -> Callable:
    """The function an import path "pkg.mod:fn" names; PlanError (about `what`) otherwise."""
    module_name, _, attr = text.partition(":")
    if not module_name or not attr:
        raise PlanError(f"{what} {text!r} is not an import path pkg.mod:fn", file=file)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PlanError(f"{what}: cannot import {module_name}: {exc}", hint=hint,
                        file=file) from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise PlanError(f"{what}: {module_name} has no function {attr!r}", file=file)
    return function


def _function(text: str, what: str, file: str) -> Callable:
    return import_function(text, f"model.{what}", file=file)


def load_model(problem: Problem, plan_dir: Path) -> Model:
    """Import the plan's model functions, with the plan's folder and model.path (relative to
    it) on sys.path, however the process was started (python -m, a console script, torchrun
    --no-python)."""
    spec = problem.model
    file = problem.source_path
    for folder in ([spec.path] if spec.path else []) + ["."]:
        path = str((plan_dir / folder).resolve())
        if path not in sys.path:
            sys.path.insert(0, path)
    data, loss = _function(spec.data, "data", file), _function(spec.loss, "loss", file)
    if spec.module is not None:
        return Model(None, data, loss, whole=_function(spec.module, "module", file),
                     stages=dict(spec.stages), traced=spec.traced)
    return Model(_function(spec.blocks, "blocks", file), data, loss)


def check_model(problem: Problem, plan_dir: Path) -> int:
    """Import the model functions and build every declared block whole on the meta device (no
    memory, no compute), so a wrong name in `model:` or a failing build shows before any
    process starts. Returns how many blocks were built."""
    model = load_model(problem, plan_dir)
    blocks = forward_blocks(problem)
    with torch.device("meta"):
        if model.whole is not None:
            try:
                whole = model.whole()
            except Exception as exc:  # the user's code: any failure is theirs to see
                raise RunError(f"model.module failed to build the model: "
                               f"{type(exc).__name__}: {exc}") from None
            submodules(whole, model.stages, [problem.blocks[b].name for b in blocks],
                       source=problem.source_path)
            return len(blocks)
        for b in blocks:
            name = problem.blocks[b].name
            try:
                module = model.build(name, None)
            except Exception as exc:  # the user's code: any failure is theirs to see
                raise RunError(f"model.blocks failed to build block '{name}': "
                               f"{type(exc).__name__}: {exc}",
                               hint="build(block_name, group) must return an nn.Module for "
                                    "every declared block") from None
            if not isinstance(module, torch.nn.Module):
                raise RunError(f"model.blocks returned {type(module).__name__} for block "
                               f"'{name}', not a torch.nn.Module")
    return len(blocks)


def seed_everything(seed: int, *parts: object) -> None:
    text = ":".join(str(p) for p in (seed,) + parts)
    torch.manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big"))


@contextmanager
def forward_rng(seed: int, step: int, block: str, micro_batch: int, device):
    """Run a block's forward of one micro-batch with its own RNG stream, leaving the caller's
    RNG state as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        seed_everything(seed, "forward", step, block, micro_batch)
        yield


def forward_blocks(problem: Problem) -> list[int]:
    """The declared (forward or other) blocks, which own the modules, in plan order."""
    return [b.index for b in problem.blocks if b.is_forward]


def build_modules(model: Model, problem: Problem, *, seed: int, device, rank: int | None = None,
                  groups: dict[int, Any] | None = None) -> dict[int, torch.nn.Module]:
    """{block index: module} for the forward blocks on `rank` (every block when rank is None:
    the single-process reference, where every block is built whole)."""
    modules = {}
    mine = [b for b in forward_blocks(problem)
            if rank is None or rank in problem.blocks[b].devices]
    if model.whole is not None:  # one model, the same weights on every rank (one seed)
        seed_everything(seed, "module")
        whole = model.whole()
        if model.traced:  # every rank cuts the whole model the same way
            names = [problem.blocks[b].name for b in forward_blocks(problem)]
            inputs = split_batch(make_batch(model, 0, seed, torch.device("cpu"))[0],
                                 problem.num_micro_batches)[0]
            stages = traced_stages(whole, [model.stages[n][0] for n in names], inputs)
            parts = dict(zip(names, stages))
        else:
            parts = submodules(whole, model.stages, [problem.blocks[b].name for b in mine],
                               source=problem.source_path)
        return {b: parts[problem.blocks[b].name].to(device) for b in mine}
    for b in mine:
        block = problem.blocks[b]
        seed_everything(seed, "block", block.name)
        module = model.build(block.name, (groups or {}).get(b))
        if not isinstance(module, torch.nn.Module):
            raise RunError(f"model.blocks returned {type(module).__name__} for block "
                           f"'{block.name}', not a torch.nn.Module")
        modules[b] = module.to(device)
    return modules


def block_inputs(problem: Problem, modules: dict) -> dict[int, list[int]]:
    """For each built forward block, the blocks whose outputs it takes, in `after:` order
    (an empty list: it takes the micro-batch's inputs)."""
    preds: dict[int, list[int]] = {b: [] for b in modules}
    for a, c in problem.edges:
        if c in modules and problem.blocks[c].is_forward and \
                problem.blocks[a].is_forward:
            preds[c].append(a)
    return preds


def named_parameters(problem: Problem, modules: dict[int, torch.nn.Module]):
    """("block.parameter", parameter) of every module, in plan order."""
    for b, module in modules.items():
        for name, param in module.named_parameters():
            yield f"{problem.blocks[b].name}.{name}", param


def make_batch(model: Model, step: int, seed: int, device) -> tuple[Any, Any]:
    """The global batch of iteration `step`, the same on every rank and in the reference."""
    seed_everything(seed, "data", step)
    batch = model.data(step)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise RunError("model.data must return (inputs, targets)")
    return _to(batch[0], device), _to(batch[1], device)


def _to(tree, device):
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_to(v, device) for v in tree)
    return tree


def split_batch(tree, n: int) -> list:
    """Split every tensor of `tree` along dim 0 into n equal micro-batches."""
    if isinstance(tree, torch.Tensor):
        if tree.dim() == 0 or tree.shape[0] % n:
            raise RunError(f"a batch tensor of shape {tuple(tree.shape)} does not split into "
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
