"""The traced cut: torch.distributed.pipelining's tracer (torch.export) splits the model before
each stage's first unit, for models whose forward is not a chain of their children and has no
list of layers.

The tracer's pieces form a graph: a piece may take values from any earlier piece (a skip
connection) and hand on several. pyplan's stages form a chain, so each stage here takes
everything still needed after the previous stage (its values, a tuple when several) and
hands on everything still needed after itself: its own outputs and the values it passes
through. Those are the tensors that cross each boundary.

A model built on the meta device (pyplan.models.deferred) is traced there, on a micro-batch
moved to the meta device, and each piece then gets its own parameters' and buffers' values
(`materialize`): a rank builds only its stages, partition one unit at a time.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import warnings

from torch import nn

from pyplan.errors import PlanError, TimeLimitError

__all__ = ["materialize", "pieces"]

_INPUT = ("input",)


def pieces(model: nn.Module, starts: list[str], inputs) -> list[nn.Module]:
    """The model cut by torch's tracer before each name in `starts` (after the first): one
    module per stage."""
    from torch.distributed.pipelining import SplitPoint

    pipe = _trace(model, inputs, {name: SplitPoint.BEGINNING for name in starts[1:]})
    if pipe.num_stages != len(starts):
        raise PlanError(f"torch's pipeline tracer cut the model into {pipe.num_stages} stages, "
                        f"not {len(starts)}", hint="split points must be submodules the "
                        "forward runs once, in order")
    sources, result = _wiring(pipe)
    count = len(sources)
    # live[k]: the values still needed after stage k, in a fixed order.
    live = []
    for k in range(count):
        needed = {src for later in sources[k + 1:] for src in later} | ({result} if k < count - 1
                                                                      else set())
        live.append(sorted((v for v in needed if v == _INPUT or v[0] <= k), key=_order))
    return [_Piece(pipe.get_stage_module(k), k, sources[k], [_INPUT] if k == 0 else live[k - 1],
                   live[k] if k < count - 1 else [result]) for k in range(count)]


def _trace(model: nn.Module, inputs, split_spec: dict):
    """torch.distributed.pipelining's Pipe of the model split at `split_spec`, or PlanError
    with the tracer's cause in one line."""
    from torch.distributed.pipelining import pipeline

    quiet = logging.root.manager.disable
    try:
        # torch.export's deprecation notices and the graphs it logs or prints on a failure are
        # not the user's to read
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore", FutureWarning)
            logging.disable(logging.WARNING)
            return pipeline(model, mb_args=(inputs,), split_spec=split_spec)
    except TimeLimitError:
        raise
    except Exception as exc:  # the tracer's limits: the cause in one line, torch's words after
        raise PlanError(f"torch's pipeline tracer stops at {_cause(exc)}",
                        hint="torch's tracer needs the forward as one graph (no graph breaks, "
                             "no control flow on tensor values)") from None
    finally:
        logging.disable(quiet)


def _cause(exc: BaseException) -> str:
    """The innermost cause of a tracer failure (torch wraps it in its generic "cannot capture
    your model as a full graph"), as "Type: first line", at most 160 characters."""
    seen = set()
    while (exc.__cause__ or exc.__context__) is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip().splitlines()
    found = f"{type(exc).__name__}: {text[0].strip()}" if text else type(exc).__name__
    return found if len(found) <= 160 else found[:157] + "..."


def _order(value: tuple) -> tuple:
    return (-1, 0) if value == _INPUT else (value[0], -1 if value[1] is None else value[1])


def _wiring(pipe) -> tuple[list[list[tuple]], tuple]:
    """Per piece (by its stage number: the graph may call them in another order, e.g.
    independent branches), where each of its arguments comes from ((piece, output index or
    None for the whole output) or the model's input), and where the model's output comes
    from."""
    number = {id(pipe.get_stage_module(k)): k for k in range(pipe.num_stages)}
    names, sources, result = {}, [None] * pipe.num_stages, None
    for node in pipe.split_gm.graph.nodes:
        if node.op == "placeholder":
            names[node.name] = _INPUT
        elif node.op == "call_module":
            k = number[id(pipe.split_gm.get_submodule(node.target))]
            sources[k] = [names[a.name] for a in node.args]
            names[node.name] = (k, None)
        elif node.op == "call_function" and node.target is operator.getitem:
            piece, _ = names[node.args[0].name]
            names[node.name] = (piece, node.args[1])
        elif node.op == "output":
            out = node.args[0]
            out = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
            result = names[out.name]
    return sources, result


class _Piece(nn.Module):
    """One traced piece as a chain stage: takes the values live before it, returns those live
    after it (one value alone, several as a tuple)."""

    def __init__(self, graph: nn.Module, index: int, sources: list[tuple], before: list[tuple],
                 after: list[tuple]) -> None:
        super().__init__()
        self.graph, self.index = graph, index
        self.sources, self.before, self.after = sources, before, after

    def forward(self, value):
        values = [value] if len(self.before) == 1 else list(value)
        env = dict(zip(self.before, values))
        out = self.graph(*[env[src] for src in self.sources])
        env[(self.index, None)] = out
        if isinstance(out, (tuple, list)):
            env.update(((self.index, i), x) for i, x in enumerate(out))
        found = [env[v] for v in self.after]
        return found[0] if len(found) == 1 else tuple(found)


def materialize(piece: nn.Module, deferred, device, made: dict | None = None):
    """Give the meta parameters and buffers of a piece traced on the meta device their values
    on `device`, found by identity in the deferred model (pyplan.models.deferred.Deferred,
    whose model the piece was traced from; a tied parameter stays one). Returns a function
    that puts the meta tensors back (partition measures one piece at a time)."""
    places: dict[int, list[tuple[dict, str, object]]] = {}
    for module in piece.modules():
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                if tensor is not None and tensor.is_meta:
                    places.setdefault(id(tensor), []).append((table, attr, tensor))
    # The tracer gives a tied parameter a copy per piece that uses it, which knows its name:
    # one value per name, so the copies in one stage stay one parameter.
    names = {key: deferred.first.get(key) or getattr(where[0][2], "pyplan_name")
             for key, where in places.items()}
    made = {} if made is None else made  # name -> value, shared by a process's pieces
    values = deferred.values([n for n in dict.fromkeys(names.values()) if n not in made])
    for key, where in places.items():
        if names[key] not in made:
            value, meta = values[names[key]].to(device), where[0][2]
            if isinstance(meta, nn.Parameter):
                fresh = nn.Parameter(value, requires_grad=meta.requires_grad)
                fresh.__dict__.update(meta.__dict__)  # its name in the model too
                value = fresh
            made[names[key]] = value
        for table, attr, _ in where:
            table[attr] = made[names[key]]

    def undo() -> None:
        for where in places.values():
            for table, attr, meta in where:
                table[attr] = meta
    return undo
