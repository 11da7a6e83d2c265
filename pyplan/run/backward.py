"""A block's backward, whole or split into B (input gradients) and W (weight gradients), the
zero-bubble split (Qi et al.), without doing any work twice.

B runs autograd from the block's outputs (or its loss) to its inputs only. Before it does, the
autograd graph is cut in two: the nodes that lead to an input (the input side, which B runs)
and the rest (which lead only to parameters). The gradient arriving at each input-side node
that also feeds the parameter side is captured while B runs; W starts from exactly those
captured gradients (torch.autograd.graph.GradientEdge) and runs the parameter side alone. So
B + W costs what one full backward costs: on an MLP, B and W each do half its matmuls
(tests/test_backward.py counts them with torch.utils.flop_counter). Roots that do not depend
on any input (a first stage, whose inputs are token ids) have no input side: W runs them
whole.

W runs one autograd call per connected piece of the parameter side, so no call walks through
another piece's input-side nodes (which would redo input gradients); pieces that meet (a
parameter used in two places) are one call, with the captured gradients pinned where the
call reaches another captured node. Each node of the graph therefore runs at most once, and a
collective inside a backward (tensor-parallel blocks) is issued once.

A node whose backward computes every gradient at once, whatever autograd asks for (a custom
torch.autograd.Function, a torch.compile'd region: aot_autograd's CompiledFunction), cannot
be split so: run again in W, it would redo its input gradients and run its backward twice. B
keeps what it computed for the parameter side (a hook on the node) and W starts from there, at
its parameter-side children; where W would reach such a node again (a parameter shared with
another start), the node's outputs are dropped, so each gradient still counts once.

A weight gradient W finds may be a gradient B already handed on (`x + p`: both gradients are
the output's, the same tensor, which may still be on its way to the previous stage): W stores
a copy of such a gradient in `.grad`, which later micro-batches add to in place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["WeightWork", "backward_input", "backward_weight", "full_backward", "root"]


def root(t: torch.Tensor):
    """What a backward starts from for an output `t`: its gradient edge (the node that makes
    it and which of its outputs), which does not hold t's data, so the output itself can be
    freed once sent (Megatron's deallocated outputs); a tensor without a node stays itself,
    and so does one a Python function's node makes where torch cannot start from its edge."""
    if t.grad_fn is not None and (not fused(t.grad_fn) or _python_edges()):
        return GradientEdge(t.grad_fn, t.output_nr)
    return t


@functools.cache
def _python_edges() -> bool:
    """Whether autograd starts a backward at a gradient edge of a Python function's node (an
    autograd.Function's, torch.compile's): torch 2.13 does; torch 2.11 reads the node's
    `_input_metadata`, which such a node lacks there ("legacy access pattern")."""
    class Same(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    with torch.enable_grad():
        node = Same.apply(torch.zeros(1, requires_grad=True)).grad_fn
    try:
        node._input_metadata  # noqa: B018 - what torch.autograd reads of a root edge's node
    except (RuntimeError, AttributeError):
        return False
    return True


def _live(r) -> bool:
    """Whether a root takes part in the backward."""
    return isinstance(r, GradientEdge) or r.requires_grad


def _node(t):
    """The autograd node that receives t's gradient (a leaf's gradient accumulator)."""
    if isinstance(t, GradientEdge):
        return t.node
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


def _children(node) -> list:
    return [c for c, _ in node.next_functions if c is not None]


def _post_order(roots: list) -> list:
    """Every node reachable from the roots, each after all of its children."""
    order, seen = [], set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(_children(root)))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                order.append(node)
            elif child not in seen:
                seen.add(child)
                stack.append((child, iter(_children(child))))
    return order


CAPTURED, ROOT, FUSED = "captured", "root", "fused"
"""Where W starts: an input-side node with the gradients B captured arriving there; a root
without an input side, with its own gradient; a fused node's parameter-side child, with what
the node computed for it in B."""


def fused(node) -> bool:
    """Whether a node's backward computes all its gradients whatever autograd needs (a Python
    autograd.Function's, torch.compile's among them); a built-in node computes only those."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)


@dataclass
class WeightWork:
    """What W needs after B: per piece of the parameter side, where it starts and the
    parameters it reaches, and the fused nodes whose work B has done."""

    pieces: list[tuple[list[tuple[object, tuple, str]], list[torch.Tensor], list]]
    """(seeds, parameters, fused nodes done); a seed is (node, gradients at its inputs by
    index, CAPTURED/ROOT/FUSED)."""

    @property
    def captured_bytes(self) -> int:
        """What B keeps for W besides the graph: the gradients it captured."""
        return sum(g.numel() * g.element_size() for seeds, _, _ in self.pieces
                   for _, at, kind in seeds if kind != ROOT for g in at if g is not None)


def full_backward(roots: list, grads: list[torch.Tensor]) -> None:
    """Input and weight gradients at once (inputs are leaves: their .grad is set); `roots`:
    tensors or gradient edges (`root`)."""
    pairs = [(r, g) for r, g in zip(roots, grads) if _live(r)]
    if pairs:
        torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])


def backward_input(roots: list[torch.Tensor], grads: list[torch.Tensor],
                   inputs: list[torch.Tensor], params: list[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: the gradients of `inputs` (None where there is none), and the work W still has;
    `roots`: tensors or gradient edges (`root`)."""
    pairs = [(r, g) for r, g in zip(roots, grads) if _live(r)]
    nodes = [_node(r) for r, _ in pairs]
    input_nodes = {_node(x) for x in inputs}
    param_index = {_node(p): i for i, p in enumerate(params)}
    order = _post_order(nodes)
    to_input: dict = {}
    for node in order:
        to_input[node] = node in input_nodes or any(to_input[c] for c in _children(node))

    # Union the parameter side into connected pieces; each starts at input-side nodes
    # (captured in B) or at roots without an input side.
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    starts = [n for n in order if to_input[n] and any(not to_input[c] for c in _children(n))]
    starts += [n for n in dict.fromkeys(nodes) if not to_input[n]]
    for node in order:
        if not to_input[node] or node in starts:
            for child in _children(node):
                if not to_input[child]:
                    parent[find(child)] = find(node)
    by_piece: dict = {}
    for node in order:
        if node in param_index and not to_input[node]:
            by_piece.setdefault(find(node), [[], []])[1].append(param_index[node])
    for node in starts:
        piece = by_piece.get(find(node))
        if piece is not None:
            piece[0].append(node)

    captured: dict = {}
    computed: dict = {}  # a fused start -> what its backward returned for each of its edges
    handles = [n.register_prehook(lambda g, n=n: captured.__setitem__(n, g))
               for piece in by_piece.values() for n in piece[0] if to_input[n]]
    handles += [n.register_hook(lambda given, _, n=n: computed.__setitem__(n, given))
                for piece in by_piece.values() for n in piece[0] if to_input[n] and fused(n)]
    try:
        wanted = [x for x in inputs if _node(x) in to_input]
        got = iter(torch.autograd.grad([r for r, _ in pairs], wanted, [g for _, g in pairs],
                                       retain_graph=True, allow_unused=True)
                   if wanted else ())
        input_grads = [next(got) if _node(x) in to_input else None for x in inputs]
    finally:
        for handle in handles:
            handle.remove()
    root_grads = dict(zip(nodes, (g for _, g in pairs)))
    root_outputs = dict(zip(nodes, (r.output_nr for r, _ in pairs)))
    pieces = []
    for piece_starts, piece_params in by_piece.values():
        seeds, done = [], []
        at_children: dict = {}  # a fused start's parameter-side child -> {input: gradient}
        for node in piece_starts:
            param_side = [(i, c, nr) for i, (c, nr) in enumerate(node.next_functions)
                          if c is not None and not to_input[c]]
            given = computed.get(node)
            if given is not None and all(given[i] is not None for i, _, _ in param_side):
                done.append(node)  # its backward has run: W starts below it
                for i, child, nr in param_side:
                    into = at_children.setdefault(child, {})
                    into[nr] = given[i] if nr not in into else into[nr] + given[i]
            elif to_input[node]:
                seeds.append((node, captured.get(node, ()), CAPTURED))
            else:  # a root without an input side: seeded with its own gradient
                grads_at = [None] * (root_outputs[node] + 1)
                grads_at[root_outputs[node]] = root_grads[node]
                seeds.append((node, tuple(grads_at), ROOT))
        for child, into in at_children.items():
            seeds.append((child, tuple(into.get(k) for k in range(max(into) + 1)), FUSED))
        pieces.append((seeds, [params[i] for i in sorted(piece_params)], done))
    return input_grads, WeightWork(pieces)


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the weight gradients into the parameters' .grad."""
    for seeds, params, done in work.pieces:
        edges, grads = [], []
        for node, at, _ in seeds:
            for i, g in enumerate(at):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        # Where this call reaches another start of the piece through the input side, that
        # node gets exactly what B gave it (what arrives there again is already counted), and
        # a fused node whose work B did hands on nothing (its children are seeded).
        hooks = [node.register_prehook(lambda _, at=at: at) for node, at, kind in seeds
                 if kind == CAPTURED and at and len(seeds) > 1]
        hooks += [node.register_hook(lambda given, _: (None,) * len(given)) for node in done]
        try:  # each parameter's gradient added to its .grad as it is made, as a backward does
            # (a gradient B still holds is referenced here too: autograd copies, never steals it)
            torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
        finally:
            for hook in hooks:
                hook.remove()
