"""From a user's nn.Module to pipeline stages: its units (what partition may cut between), the
cut itself (the module each stage runs), and the parameters several stages share (ties). One
place, so partition, profile, `pyplan run` and its --check reference all cut a model the same
way. Needs torch.

Three cuts, tried in this order by partition and recorded in the plan (`model.cut`):
- chain: the model's forward is its children run one after another (nn.Sequential and
  nn.ModuleList flattened); a stage is its units in a row (pyplan.models.chain).
- forward: the model's forward calls a list of layers between embeddings and a head (every
  Hugging Face causal LM); a stage runs the model's own forward from its first module to the
  next stage's (pyplan.models.forward). Units: the modules with parameters called before the
  first layer (one unit, "the embeddings"), each layer, those called after the last (the final
  norm and the head).
- traced: anything torch.distributed.pipelining's tracer can split (pyplan.models.traced).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pyplan.errors import PlanError, PyplanError, UserCodeError, describe_exception
from pyplan.models import chain, forward, traced
from pyplan.models.calls import call_model
from pyplan.models.deferred import move
from pyplan.models.traced import traced_units

__all__ = ["CHAIN", "CUTS", "FORWARD", "TRACED", "Cut", "Tie", "Unit", "everywhere",
           "find_units", "member", "stage_modules", "ties"]

CHAIN, FORWARD, TRACED = "chain", "forward", "traced"
CUTS = (CHAIN, FORWARD, TRACED)


@dataclass(frozen=True)
class Unit:
    """The smallest piece partition places: one or more modules that go together."""

    name: str
    modules: tuple[str, ...]


@dataclass(frozen=True)
class Tie:
    """A parameter several stages hold (tied embeddings, any shared module): each holds a copy
    and their gradients are summed after every backward, so the copies stay one parameter."""

    parameter: str
    """Its name in the model (the first of its names in named_parameters order)."""
    stages: tuple[str, ...]
    bytes: int


@dataclass(frozen=True)
class Cut:
    """How a model is cut, as the plan records it (model.cut, model.layer_returns)."""

    kind: str = CHAIN
    returns: int = 0
    """Forward cut: what the model's layers return: 0 the hidden states, n a tuple of n values
    (hidden states first)."""
    why: str = ""
    """Traced cut, as partition found it: why the model's own forward could not be followed."""

    @property
    def layer_returns(self) -> str:
        """`returns` as the plan writes it (one of pyplan.planfile.types.LAYER_RETURNS)."""
        return "tensor" if not self.returns else "tuple" if self.returns == 1 else \
            f"tuple of {self.returns}"

    @staticmethod
    def of(kind: str, layer_returns: str = "tensor") -> Cut:
        """The cut a plan records (model.cut, model.layer_returns)."""
        returns = 0 if layer_returns == "tensor" else 1 if layer_returns == "tuple" else \
            int(layer_returns.rpartition(" ")[2])
        return Cut(kind, returns)


_REWRITE = "make the forward call its list of layers (an nn.ModuleList) once each, in " \
    "order, between the embeddings and the head, or build each block yourself (model: " \
    "{blocks: ...})"


def find_units(model: nn.Module, inputs) -> tuple[Cut, list[Unit]]:
    """How the model can be cut, and its units in order. UserCodeError when the model's own
    forward fails on the micro-batch `inputs`: its failure, not a cut's; PlanError when no cut
    applies (a cut that `pyplan run` would refuse is never returned)."""
    _runs(model, inputs)
    names = chain.units(model)
    if names and chain.is_chain(model, names, inputs):
        _held_by_units(model, names, "its forward runs its children in a row, but")
        return Cut(CHAIN), [Unit(n, (n,)) for n in names]
    why = "it has no nn.ModuleList of layers"
    if forward.decoder_layers(model) is not None:
        found = forward.units(model, inputs)
        if not isinstance(found, str):
            units, returns = found
            return Cut(FORWARD, returns), [Unit(n, m) for n, m in units]
        why = found
    if not names:
        raise PlanError(f"the model cannot be cut: not at its layers ({why}), and it has no "
                        "children for torch's tracer to make stages of", hint=_REWRITE)
    try:
        units = [Unit(u[0], u) for u in traced_units(model, inputs, _expanded(model, names))]
    except PlanError as exc:
        raise PlanError(f"the model cannot be cut: not at its layers ({why}), and "
                        f"{exc.message}", hint=exc.hint) from None
    _held_by_units(model, [m for u in units for m in u.modules],
                   f"not at its layers ({why}), and torch's tracer makes stages of its "
                   "children, but")
    return Cut(TRACED, why=why), units


def _expanded(model: nn.Module, names: list[str]) -> list[str]:
    """`names` with each module that holds a list of layers (an nn.ModuleList) and no
    parameter of its own replaced by its children, recursively, but not the layers
    themselves: a T5's encoder and decoder, CLIP's two towers, a U-Net's blocks become their
    layers and the modules around them, for the tracer to cut between."""
    found = []
    for name in names:
        module = model.get_submodule(name)
        parent = model.get_submodule(name.rpartition(".")[0])
        if not module._parameters and not isinstance(parent, (nn.ModuleList, nn.Sequential)) \
                and any(isinstance(m, nn.ModuleList) for m in module.modules()):
            found += _expanded(model, chain.units(module, f"{name}."))
        else:
            found.append(name)
    return found


def member(model: nn.Module, name: str) -> nn.Module:
    """A unit's module `name`; for a parameter the model holds itself, which a unit of the
    traced cut may list (CLIP's logit_scale), a module holding just that parameter."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        holder = nn.Module()
        holder.register_parameter(name.rpartition(".")[2], model.get_parameter(name))
        return holder


def _held_by_units(model: nn.Module, names: list[str], why: str) -> None:
    """PlanError unless every parameter of the model belongs to one of the units `names` (the
    chain and traced cuts run nothing but their units)."""
    owners = dict.fromkeys(names, 0)
    for name, _ in model.named_parameters():
        if forward._owner(name, owners) is None:
            raise PlanError(f"the model cannot be cut: {why} its parameter {name} belongs to "
                            "none of them", hint="move the parameter into one of the model's "
                            f"submodules, or {_REWRITE}")


def _runs(model: nn.Module, inputs) -> None:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            call_model(model, inputs)
    except (PyplanError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # SystemExit too: the user's forward must not end pyplan
        raise UserCodeError(f"the model's forward raised {describe_exception(exc)} on one "
                            "micro-batch of the data's inputs",
                            hint="the model takes the inputs the data returns (a micro-batch "
                                 "of them); call it on them yourself to see where") from None
    finally:
        model.train(was)


def stage_modules(model: nn.Module, cut: Cut, stages: list[tuple[str, tuple[str, ...]]],
                  mine: list[int], device, inputs=None,
                  materialize=None, graph: list[list[int]] | None = None
                  ) -> dict[int, nn.Module]:
    """The modules of stages `mine` (indices into `stages`: (block name, its modules), in
    model order), on `device`. `inputs` (a micro-batch) is needed by the traced cut. A model
    whose parameters are still on the meta device: the forward cut calls `materialize(model)`
    once it has dropped what other stages hold, the traced cut `materialize(piece)` for each
    piece of `mine` (traced on the meta device, with `inputs` there too); the chain cut needs
    the caller to have materialised its stages' parameters first. `graph` (traced cut): the
    stages form a DAG, each taking the outputs of the stages graph[s] (the plan's after:,
    checked against the model's dataflow) and, where its module's `reads_input`, the
    micro-batch's inputs first (pyplan.models.graph)."""
    if cut.kind == TRACED and graph is not None:
        from pyplan.models.graph import graph_stages

        found = graph_stages(model, stages, inputs, graph)
        if materialize is not None:
            for s in mine:
                materialize(found[s])
        return {s: traced.place(found[s], device) for s in mine}
    if cut.kind == FORWARD:
        return forward.prune(model, [m for _, m in stages], mine, device,
                             returns=cut.returns, materialize=materialize)
    if cut.kind == TRACED:
        try:
            pieces = traced.pieces(model, [m[0] for _, m in stages], inputs)
        except PlanError as exc:
            if not cut.why:
                raise
            raise PlanError(f"the model cannot be cut: not at its layers ({cut.why}), and "
                            f"{exc.message}", hint=f"{_REWRITE}; {exc.hint}") from None
        if materialize is not None:  # traced on the meta device: only these stages' values
            for s in mine:
                materialize(pieces[s])
        return {s: traced.place(pieces[s], device) for s in mine}
    stages_of = {s: chain.stage(model, stages[s][1], first=s == 0) for s in mine}
    for module in stages_of.values():
        move(module, device)
    return stages_of


def everywhere(model: nn.Module, units: list[Unit]) -> tuple[str, ...]:
    """Names of the parameters of modules no unit holds (forward cut: every stage keeps them,
    as a tie)."""
    owners = {name: 0 for unit in units for name in unit.modules}
    found = []
    for name, _ in model.named_parameters():
        if forward._owner(name, owners) is None:
            found.append(name)
    return tuple(found)


def ties(model: nn.Module, stages: list[tuple[str, tuple[str, ...]]]) -> list[Tie]:
    """The parameters held by more than one stage, by identity: a module listed in two stages,
    modules sharing a parameter object, or (forward cut) parameters of modules no stage lists,
    which every stage keeps."""
    owners: dict[str, int] = {}
    for s, (_, names) in enumerate(stages):
        for name in names:
            owners[name] = s
    holders: dict[int, set[int]] = {}
    first: dict[int, tuple[str, torch.Tensor]] = {}
    everywhere = set(range(len(stages)))
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = forward._owner(name, owners)
        holders.setdefault(id(param), set()).update(everywhere if owner is None else {owner})
        first.setdefault(id(param), (name, param))
    out = []
    for key, stage_set in holders.items():
        if len(stage_set) > 1:
            name, param = first[key]
            out.append(Tie(name, tuple(stages[s][0] for s in sorted(stage_set)),
                           param.numel() * param.element_size()))
    return sorted(out, key=lambda t: t.parameter)
