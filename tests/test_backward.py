"""The zero-bubble split backward: B (input gradients) then W (weight gradients) give exactly
the gradients of one full backward, and together do the full backward's work, no more
(counted with torch.utils.flop_counter): on an MLP B and W each do half the matmuls; a custom
autograd.Function or a torch.compile'd block, whose backward computes every gradient at once,
runs it once."""

from __future__ import annotations

import pytest

from pyplan.runtime import torch
from pyplan.run.backward import backward_input, backward_weight
from torch.utils.flop_counter import FlopCounterMode

nn = torch.nn


class TwoOutputs(nn.Module):
    """Returns (hidden, a side tensor that depends on parameters only) and reuses one weight
    in two places."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.side = nn.Parameter(torch.randn(4, 16))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = self.b(h) + self.a(h)  # self.a used twice: one parameter, two input-side nodes
        return h, self.side * 2


class Embedder(nn.Module):
    """A first stage: integer ids in, so no input gradient at all."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.fc = nn.Embedding(50, 16), nn.Linear(16, 16)

    def forward(self, ids):
        return self.fc(self.embed(ids)).relu()


class _Linear(torch.autograd.Function):
    """x @ w.T with a hand-written backward that computes both gradients at once (as any
    custom Function does); counts its backward's runs."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        _Linear.calls += 1
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


class CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.w = nn.Linear(16, 16), nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return torch.tanh(self.a(torch.tanh(_Linear.apply(x, self.w))))


class SharedWithAFunction(nn.Module):
    """One weight used by the custom Function and again by a matmul after it: W reaches the
    Function again from the matmul's side."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return torch.tanh(torch.tanh(_Linear.apply(x, self.w)) @ self.w.t())


def _cases():
    torch.manual_seed(0)
    mlp = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return {
        "mlp": (mlp, [torch.randn(8, 32)]),
        "transformer-layer": (layer, [torch.randn(2, 8, 32)]),
        "two-outputs-shared-weight": (TwoOutputs(), [torch.randn(8, 16)]),
        "first-stage": (Embedder(), [torch.randint(0, 50, (4, 8))]),
        "custom-function": (CustomFunction(), [torch.randn(8, 16)]),
        "custom-function-shared-weight": (SharedWithAFunction(), [torch.randn(8, 16)]),
    }


def _roots(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("name", list(_cases()))
def test_split_backward_gives_the_full_backward_gradients(name):
    module, args = _cases()[name]
    params = [p for p in module.parameters()]
    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    roots = _roots(module(*leaves))
    grads = [torch.randn_like(r) for r in roots]
    torch.autograd.backward(roots, grads)
    want_inputs = [x.grad for x in leaves]
    want = [p.grad.clone() for p in params]
    module.zero_grad(set_to_none=True)

    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    inputs = [x for x in leaves if x.requires_grad]
    input_grads, work = backward_input(_roots(module(*leaves)), grads, inputs, params)
    assert all(p.grad is None for p in params)  # B touched no weight gradient
    backward_weight(work)
    for got, expected in zip(input_grads, [g for g in want_inputs if g is not None]):
        torch.testing.assert_close(got, expected)
    for p, expected in zip(params, want):
        torch.testing.assert_close(p.grad, expected)


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_b_and_w_each_do_half_of_an_mlps_backward():
    torch.manual_seed(0)
    mlp = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    x = torch.randn(16, 64)
    grad = torch.randn(16, 64)

    leaf = x.clone().requires_grad_()
    out = mlp(leaf)
    full = _flops(lambda: out.backward(grad))

    leaf = x.clone().requires_grad_()
    out = mlp(leaf)
    state = {}
    b = _flops(lambda: state.update(work=backward_input([out], [grad], [leaf],
                                                         list(mlp.parameters()))[1]))
    w = _flops(lambda: backward_weight(state["work"]))
    matmul = 2 * 16 * 64 * 64
    assert full == 8 * matmul  # 4 input-gradient and 4 weight-gradient matmuls
    assert b == 4 * matmul and w == 4 * matmul


class _Collective(torch.autograd.Function):
    """Stands for a tensor-parallel collective in the backward (Megatron's f: identity forward,
    all-reduce backward); counts how often its backward runs."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Collective.calls += 1
        return grad


def test_a_collective_in_the_backward_runs_once_with_the_split():
    torch.manual_seed(0)
    column, row = nn.Linear(16, 32), nn.Linear(32, 16)
    x = torch.randn(4, 16, requires_grad=True)
    out = row(torch.relu(column(_Collective.apply(x)))) + _Collective.apply(row.bias)
    params = [column.weight, column.bias, row.weight, row.bias]
    _Collective.calls = 0
    _, work = backward_input([out], [torch.ones_like(out)], [x], params)
    after_b = _Collective.calls
    backward_weight(work)
    # The one on the input path runs in B, the one on a parameter's path in W: each once.
    assert (after_b, _Collective.calls) == (1, 2)


def test_a_custom_functions_backward_runs_once_with_the_split():
    """It used to run in B (for the input gradient) and again in W (for the weight's): a
    Function's backward computes both whatever autograd asks for."""
    torch.manual_seed(0)
    module = CustomFunction()
    x = torch.randn(8, 16, requires_grad=True)
    out = module(x)
    _Linear.calls = 0
    _, work = backward_input([out], [torch.ones_like(out)], [x], list(module.parameters()))
    backward_weight(work)
    assert _Linear.calls == 1
    assert work.captured_bytes >= module.w.numel() * 4  # its weight gradient waits for W


def test_a_compiled_block_splits_without_running_its_backward_twice():
    """torch.compile's region is one autograd node (aot_autograd's CompiledFunction) computing
    every gradient: B runs it once, W only accumulates what it gave the weights."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    compiled = torch.compile(eager, backend="aot_eager")
    x, grad = torch.randn(8, 16), torch.randn(8, 16)
    leaf = x.clone().requires_grad_()
    eager(leaf).backward(grad)
    want = [leaf.grad, *(p.grad.clone() for p in eager.parameters())]
    eager.zero_grad(set_to_none=True)

    leaf = x.clone().requires_grad_()
    out = compiled(leaf)
    node = out.grad_fn
    runs = []
    node.register_prehook(lambda g: runs.append(1))
    (input_grad,), work = backward_input([out], [grad], [leaf], list(eager.parameters()))
    assert all(p.grad is None for p in eager.parameters())
    backward_weight(work)
    assert len(runs) == 1
    for got, expected in zip([input_grad, *(p.grad for p in eager.parameters())], want):
        torch.testing.assert_close(got, expected)
