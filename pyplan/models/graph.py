"""The traced cut as a graph: torch.distributed.pipelining's tracer cuts the model after every
unit (SplitPoint.END, so what the forward does between two units, such as slicing an input or
concatenating branches, goes with the later unit), and the values that cross between its
pieces say which units read which. That is the model's graph of units (`unit_graph`, for
`pyplan partition --shape graph`) and the stages of a graph pipeline (`graph_stages`): a stage
runs its units' pieces and takes the outputs of the stages it reads, one argument each, in
plan order (after the micro-batch's inputs when one of its units reads them); it hands on, as
one value (a tuple when several), everything it computes that another stage reads.
"""

from __future__ import annotations

import torch
from torch import nn

from pyplan.errors import PlanError
from pyplan.models.traced import _INPUT, _order, _trace, _wiring

__all__ = ["GraphStage", "graph_stages", "unit_graph"]


def _pieces(model: nn.Module, names: list[str], inputs):
    """(per unit of `names`: its piece, where each of its arguments comes from as (unit,
    output index or None) or the model's input; where the model's output comes from)."""
    from torch.distributed.pipelining import SplitPoint

    for module in model.modules():  # a module the tracer split at before: its own forward
        if "_orig_forward" in module.__dict__:
            module.__dict__.pop("forward", None)
            del module.__dict__["_orig_forward"]
    order = _call_order(model, names, inputs)
    # After every unit but the last called: what follows it goes with that last one.
    pipe = _trace(model, inputs, {names[u]: SplitPoint.END for u in order[:-1]})
    sources, result = _wiring(pipe)
    if len(sources) != len(names):
        raise PlanError(f"torch's pipeline tracer cut the model into {len(sources)} pieces, "
                        f"not one per unit ({len(names)})",
                        hint="the units must be submodules the forward calls once each")
    unit_of = order

    def where(src):
        return src if src == _INPUT else (unit_of[src[0]], src[1])
    pieces = [None] * len(names)
    for k, unit in enumerate(unit_of):
        pieces[unit] = (pipe.get_stage_module(k), [where(s) for s in sources[k]])
    return pieces, where(result)


def _call_order(model: nn.Module, names: list[str], inputs) -> list[int]:
    """The units (indices into `names`) in the order the model's forward calls them; PlanError
    unless it calls each once."""
    order: list[int] = []
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda *_, k=k: order.append(k)) for k, name in enumerate(names)]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    if sorted(order) != list(range(len(names))):
        raise PlanError("the model's forward does not call each of its units once",
                        hint="a graph pipeline cuts between submodules the forward calls once "
                             "each")
    return order


def unit_graph(model: nn.Module, names: list[str], inputs
               ) -> tuple[list[tuple[int, ...]], list[bool], list[int]]:
    """Per unit of `names` (in model order): the units whose outputs it reads, whether it
    reads the model's inputs, and its output's bytes (the pieces run on `inputs`, on the meta
    device when the model is there)."""
    pieces, _ = _pieces(model, names, inputs)
    preds = [tuple(sorted({s[0] for s in sources if s != _INPUT})) for _, sources in pieces]
    reads = [any(s == _INPUT for s in sources) for _, sources in pieces]
    if any(p >= k for k, ps in enumerate(preds) for p in ps):
        raise PlanError("the model's units are not called in the order of its children",
                        hint="list the children in the order the forward calls them")
    env: dict = {_INPUT: inputs}
    sizes = [0] * len(names)
    with torch.no_grad():
        for k in range(len(names)):
            module, sources = pieces[k]
            out = module(*[_value(env, s) for s in sources])
            env[(k, None)] = out
            sizes[k] = sum(t.numel() * t.element_size()
                           for t in torch.utils._pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor))
    return preds, reads, sizes


def _value(env: dict, src):
    if src == _INPUT or src[1] is None:
        return env[src if src == _INPUT else (src[0], None)]
    return env[(src[0], None)][src[1]]


class GraphStage(nn.Module):
    """One stage of a graph pipeline: its units' pieces run in model order."""

    def __init__(self, parts: list[tuple[int, nn.Module, list]], reads_input: bool,
                 received: list[list[tuple]], provides: list[tuple]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(module for _, module, _ in parts)
        self.order = [(unit, sources) for unit, _, sources in parts]
        self.reads_input = reads_input
        """Whether it takes the micro-batch's inputs (first, before its predecessors')."""
        self.received, self.provides = received, provides

    def forward(self, *args):
        args = list(args)
        env: dict = {}
        if self.reads_input:
            env[_INPUT] = args.pop(0)
        for keys, value in zip(self.received, args):
            env.update(zip(keys, [value] if len(keys) == 1 else list(value)))
        for module, (unit, sources) in zip(self.parts, self.order):
            env[(unit, None)] = module(*[self._get(env, s) for s in sources])
        found = [self._get(env, v) for v in self.provides]
        return found[0] if len(found) == 1 else tuple(found)

    @staticmethod
    def _get(env: dict, src):
        if src in env:
            return env[src]
        return env[(src[0], None)][src[1]]


def graph_stages(model: nn.Module, stages: list[tuple[str, tuple[str, ...]]], inputs,
                 reads: list[list[int]]) -> list[GraphStage]:
    """The stages of a graph pipeline (stages: (block name, its units), in plan order), whose
    arguments are the outputs of the stages `reads` lists for each (the plan's after:):
    PlanError unless those are exactly, in stage order, the stages whose values its units
    read."""
    names = [u for _, units in stages for u in units]
    if len(set(names)) != len(names):
        raise PlanError("a graph pipeline's stages must not share units")
    order = _model_order(model, names)
    pieces, result = _pieces(model, order, inputs)
    stage_of = {}
    for s, (_, units) in enumerate(stages):
        for u in units:
            stage_of[order.index(u)] = s
    # A value is (unit, output index or None); the values each stage reads from others.
    needs: list[set] = [set() for _ in stages]
    for unit, (_, sources) in enumerate(pieces):
        for src in sources:
            if src != _INPUT and stage_of[src[0]] != stage_of[unit]:
                needs[stage_of[unit]].add(src)
    last = stage_of[result[0]]
    provides = [sorted({v for t in range(len(stages)) for v in needs[t] if stage_of[v[0]] == s}
                       | ({result} if s == last else set()), key=_order)
                for s in range(len(stages))]
    preds = [sorted({stage_of[v[0]] for v in needs[s]}) for s in range(len(stages))]
    found = []
    for s in range(len(stages)):
        mine = sorted(u for u, t in stage_of.items() if t == s)
        takes_input = any(src == _INPUT for u in mine for src in pieces[u][1])
        stage = GraphStage([(u, pieces[u][0], pieces[u][1]) for u in mine], takes_input,
                           [provides[p] for p in preds[s]], provides[s])
        found.append(stage)
        if preds[s] != reads[s]:
            want = ", ".join(stages[p][0] for p in preds[s])
            raise PlanError(f"block '{stages[s][0]}' of a graph pipeline must come after "
                            f"exactly the stages its units read, in plan order: after: "
                            f"[{want}]", hint="the plan is stale: re-run pyplan partition "
                            "--shape graph")
    return found


def _model_order(model: nn.Module, names: list[str]) -> list[str]:
    """The units in the order of the model's modules (its children, depth first)."""
    rank = {name: i for i, (name, _) in enumerate(model.named_modules())}
    missing = [n for n in names if n not in rank]
    if missing:
        raise PlanError(f"the model has no submodule {missing[0]}")
    return sorted(names, key=lambda n: rank[n])
