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

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from pyplan.errors import PlanError, TimeLimitError
from pyplan.models.calls import arguments, call_model, for_loss, model_keywords

__all__ = ["materialize", "pieces", "place", "traced_units"]

_INPUT = ("input",)
"""The model's input, in pyplan.models.graph's wiring (one input, one output)."""


def traced_units(model: nn.Module, inputs, candidates: list[str]) -> list[tuple[str, ...]]:
    """The modules of each unit of a traced cut, in the order one forward (eval mode, no
    gradients) first calls them: each starts at a candidate module the forward calls exactly
    once (a split point for the tracer). A candidate called more than once (T5's shared
    embedding, in the encoder and the decoder) or under several names joins the unit running
    at its first call (the first unit, before any); a parameter the model holds itself (CLIP's
    logit_scale) joins each unit running when a torch function takes it, as the tracer puts it
    in each piece that uses it."""
    from torch.overrides import TorchFunctionMode

    first = {}  # module object -> its first name among the candidates
    for name in candidates:
        first.setdefault(id(model.get_submodule(name)), name)
    owned = tuple(f"{n}." for n in candidates)
    own = {id(p): n for n, p in model.named_parameters() if not n.startswith(owned)}
    events: list[tuple[bool, str]] = []  # (a call, else a use of a parameter; its name)

    class Uses(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            for x in tree_flatten((args, kwargs or {}))[0]:
                if id(x) in own:
                    events.append((False, own[id(x)]))
            return func(*args, **(kwargs or {}))

    handles = [model.get_submodule(name).register_forward_pre_hook(
        lambda *_, name=name: events.append((True, name))) for name in first.values()]
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), Uses():
            call_model(model, inputs)
    finally:
        model.train(was)
        for handle in handles:
            handle.remove()
    calls: dict[str, int] = {}
    for is_call, name in events:
        if is_call:
            calls[name] = calls.get(name, 0) + 1
    starts = [name for name in dict.fromkeys(n for c, n in events if c) if calls[name] == 1]
    if not starts:
        return []
    units: dict[str, list[str]] = {n: [n] for n in starts}
    unit_of = {n: n for n in starts}
    running = None
    for is_call, name in events:  # the others join the unit running at their first use
        if is_call and calls[name] == 1:
            running = name
        elif name not in unit_of:
            unit_of[name] = running or starts[0]
            units[unit_of[name]].append(name)
        elif not is_call and unit_of[name] != (running or starts[0]):
            raise PlanError(f"torch's tracer would copy its parameter {name} into the units "
                            f"of {unit_of[name]} and of {running or starts[0]}, which use it",
                            hint="move the parameter into a submodule of the model, called "
                                 "where it is used")
    for name in candidates:  # aliases join their module's unit; modules never called the first
        if name not in unit_of:
            unit_of[name] = unit_of.get(first[id(model.get_submodule(name))], starts[0])
            units[unit_of[name]].append(name)
    return [tuple(dict.fromkeys(units[n])) for n in starts]


def pieces(model: nn.Module, starts: list[str], inputs) -> list[nn.Module]:
    """The model cut by torch's tracer before each name in `starts` (after the first): one
    module per stage."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    args, kwargs = arguments(inputs)
    kwargs.update(model_keywords(model, inputs))
    quiet = logging.root.manager.disable
    try:
        # torch.export's deprecation notices and the graphs it logs or prints on a failure are
        # not the user's to read
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore", FutureWarning)
            logging.disable(logging.WARNING)
            with _output_structure() as output, _buffers_like(model, inputs):
                pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs,
                                split_spec={name: SplitPoint.BEGINNING for name in starts[1:]})
    except TimeLimitError:
        raise
    except Exception as exc:  # the tracer's limits: the cause in one line, torch's words after
        raise PlanError(f"torch's pipeline tracer stops at {_cause(exc)}",
                        hint="torch's tracer needs the forward as one graph (no graph breaks, "
                             "no control flow on tensor values)") from None
    finally:
        logging.disable(quiet)
    if pipe.num_stages != len(starts):
        raise PlanError(f"torch's pipeline tracer cut the model into {pipe.num_stages} stages, "
                        f"not {len(starts)}", hint="split points must be submodules the "
                        "forward runs once, in order")
    first = pipe.get_stage_module(0)
    if type(first.graph._codegen) is not torch.fx.graph.CodeGen:
        # torch gives the first piece the model's own signature where their arguments are
        # as many; pyplan calls each piece on the tensors of the split graph, in its order
        first.graph._codegen = torch.fx.graph.CodeGen()
        first.recompile()
    sources, result, count_inputs = _flat_wiring(pipe.split_gm.graph)
    in_spec, output_spec = output[0].in_spec, output[0].out_spec
    if output_spec.num_leaves != len(result):
        raise PlanError(f"torch's pipeline tracer returns {len(result)} of the "
                        f"{output_spec.num_leaves} tensors the model's output holds",
                        hint="return tensors only (no Python numbers or strings) in the output")
    inputs_flat = [(-1, k) for k in range(count_inputs)]
    count = len(sources)
    # live[k]: the values still needed after stage k, in a fixed order.
    live = []
    for k in range(count):
        needed = {src for later in sources[k + 1:] for src in later} | \
            (set(result) if k < count - 1 else set())
        live.append(sorted((v for v in needed if v[0] <= k), key=_order))
    found = [_Piece(pipe.get_stage_module(k), k, sources[k], inputs_flat if k == 0 else
                    live[k - 1], live[k] if k < count - 1 else result,
                    output_spec if k == count - 1 else None) for k in range(count)]
    found[0].in_spec, found[0].keywords = in_spec, model_keywords(model, inputs)
    return found


@contextlib.contextmanager
def _buffers_like(model: nn.Module, inputs):
    """While a model whose parameters are on the meta device is traced on a micro-batch
    there: its buffers on the meta device too (a deferred model computes them on the CPU, and
    torch's tracer refuses an operation on both, such as Marian's and mBART's logits plus
    their final_logits_bias). The pieces hold meta buffers then, which `materialize` gives
    the model's values."""
    if not any(isinstance(t, torch.Tensor) and t.is_meta for t in
               tree_flatten(inputs)[0]):
        yield
        return
    swapped = []
    for module in model.modules():
        for attr, tensor in module._buffers.items():
            if tensor is not None and not tensor.is_meta:
                swapped.append((module, attr, tensor))
    meta = {}
    for module, attr, tensor in swapped:  # a buffer held twice stays one
        module._buffers[attr] = meta.setdefault(id(tensor), tensor.to("meta"))
    try:
        yield
    finally:
        for module, attr, tensor in swapped:
            module._buffers[attr] = tensor


@contextlib.contextmanager
def _output_structure():
    """A list that gets the structure (pytree spec) of the model's output as torch.export
    traced it: the tracer's pieces return its tensors flat, and the last stage rebuilds the
    output (a ModelOutput) from them."""
    from torch.distributed.pipelining._IR import Pipe

    found, original = [], Pipe.__dict__["_trace_with_export"]

    def recording(mod, example_args, example_kwargs=None):
        exported = original.__func__(mod, example_args, example_kwargs)
        found.append(exported.call_spec)
        return exported

    Pipe._trace_with_export = staticmethod(recording)
    try:
        yield found
    finally:
        Pipe._trace_with_export = original


def place(piece: nn.Module, device) -> nn.Module:
    """A piece on `device`, with the tensors its graph makes or moves there too: torch.ones(...,
    device=x.device) and x.to(y.device) were recorded with the device they were traced on
    (meta), as a keyword or a positional argument (CLIP's pooled text, which moves the input
    ids to the hidden states' device: on meta, the CPU's indices would index nothing)."""
    piece = piece.to(device)
    device = torch.device(device)
    for module in piece.modules():  # GraphModules, and the InterpreterModules of unflattening
        code = module if isinstance(module, torch.fx.GraphModule) else \
            module.__dict__.get("graph_module")
        graphs = {id(g): g for g in (getattr(module, "graph", None), getattr(code, "graph", None))
                  if isinstance(g, torch.fx.Graph)}
        if any([_devices_to(g, device) for g in graphs.values()]) and code is not None:
            code.recompile()
    return piece


def _devices_to(graph: torch.fx.Graph, device: torch.device) -> bool:
    """Every device among the graph's calls' arguments made `device`; whether any changed."""
    changed = False

    def swap(value):
        nonlocal changed
        if isinstance(value, torch.device) and value != device:
            changed = True
            return device
        if isinstance(value, (tuple, list)):
            return type(value)(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value
    for node in graph.nodes:
        if node.op == "call_function":
            node.args, node.kwargs = swap(node.args), swap(node.kwargs)
    return changed


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
            with _buffers_like(model, inputs):
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
    if value == _INPUT:  # (pyplan.models.graph's)
        return -1, 0
    return value[0], -1 if value[1] is None else value[1]


def _flat_wiring(graph) -> tuple[list[list[tuple]], list[tuple], int]:
    """Per piece, where each of its arguments comes from ((piece, output index or None for the
    whole output), or (-1, k): the k-th tensor of the model's inputs, flattened); where each
    tensor of the model's output comes from; how many input tensors there are."""
    names, sources, result, count = {}, {}, [], 0
    for node in graph.nodes:
        if node.op == "placeholder":
            names[node.name] = (-1, count)
            count += 1
        elif node.op == "call_module":  # submod_pp_K: the split graph calls them in any order
            index = int(node.target.rpartition("_")[2])
            sources[index] = [names[a.name] for a in node.args]
            names[node.name] = (index, None)
        elif node.op == "call_function" and node.target is operator.getitem:
            piece, _ = names[node.args[0].name]
            names[node.name] = (piece, node.args[1])
        elif node.op == "output":
            out = node.args[0]
            result = [names[o.name] for o in (out if isinstance(out, (tuple, list)) else [out])]
    return [sources[k] for k in sorted(sources)], result, count


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
    """One traced piece as a chain stage: takes the values live before it (the first piece:
    the micro-batch's inputs), returns those live after it (one value alone, several as a
    tuple; the last piece: the model's output, rebuilt in its structure)."""

    def __init__(self, graph: nn.Module, index: int, sources: list[tuple], before: list[tuple],
                 after: list[tuple], output_spec=None) -> None:
        super().__init__()
        self.graph, self.index = graph, index
        self.sources, self.before, self.after = sources, before, after
        self.output_spec = output_spec

    def forward(self, value):
        if self.index == 0:  # flat, as the tracer took them (keywords in its order)
            from torch.fx._pytree import tree_flatten_spec

            args, kwargs = arguments(value)
            values = tree_flatten_spec((args, {**kwargs, **self.keywords}), self.in_spec)
        else:
            values = [value] if len(self.before) == 1 else list(value)
        env = dict(zip(self.before, values))
        out = self.graph(*[env[src] for src in self.sources])
        env[(self.index, None)] = out
        if isinstance(out, (tuple, list)):
            env.update(((self.index, i), x) for i, x in enumerate(out))
        found = [env[v] for v in self.after]
        if self.output_spec is not None:
            return for_loss(tree_unflatten(found, self.output_spec))
        return found[0] if len(found) == 1 else tuple(found)


def materialize(piece: nn.Module, deferred, device, made: dict | None = None):
    """Give the meta parameters and buffers of a piece traced on the meta device their values
    on `device`, found by identity in the deferred model (pyplan.models.deferred.Deferred,
    whose model the piece was traced from; a tied parameter stays one). Returns a function
    that puts the meta tensors back (partition measures one piece at a time)."""
    places: dict[int, list[tuple[dict, str, object]]] = {}
    paths: dict[int, str] = {}  # where the piece holds it: the model's name (graph. ...)
    for path, module in piece.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                if tensor is not None and tensor.is_meta:
                    if id(tensor) not in places:
                        paths[id(tensor)] = f"{path}.{attr}".partition(".")[2]
                    places.setdefault(id(tensor), []).append((table, attr, tensor))
    # A tensor the tracer copied into several pieces (a tied parameter: the copy knows its
    # name; a buffer: where the piece holds it names it)
    names = {key: deferred.first.get(key) or getattr(where[0][2], "pyplan_name", None) or
             paths[key] for key, where in places.items()}
    unknown = [n for n in names.values() if n not in deferred.names]
    if unknown:
        raise PlanError(f"torch's pipeline tracer made a tensor {unknown[0]} that is not the "
                        "model's, on the meta device the model is traced on",
                        hint="make the tensors the forward needs buffers of the model "
                             "(register_buffer), not constants made while it runs")
    # one tensor per model name, shared by a process's pieces: copies of a tie stay one
    made = {} if made is None else made
    values = deferred.values([n for n in dict.fromkeys(names.values()) if n not in made])
    for key, where in places.items():
        value, meta = made.get(names[key]), where[0][2]
        if value is None:
            value = values[names[key]].to(device)
            if isinstance(meta, nn.Parameter):
                fresh = nn.Parameter(value, requires_grad=meta.requires_grad)
                fresh.__dict__.update(meta.__dict__)  # its name in the model too
                value = fresh
            made[names[key]] = value
        for table, attr, _ in where:
            table[attr] = value

    def undo() -> None:
        for where in places.values():
            for table, attr, meta in where:
                table[attr] = meta
    return undo
