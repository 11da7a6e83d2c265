"""The Pipeline API misused raises pyplan's own errors (RunError/PlanError, one line), never
torch's internals: clipping norms that are NaN, negative, zero or not numbers; a step after
close(); batches that are not tensors, empty, or that the user's block cannot take (named
with the block and the micro-batch); losses that cannot train; an optimizer that is none;
outputs whose shapes change between the micro-batches of an evaluation."""

from __future__ import annotations

import math
import re

import pytest

torch = pytest.importorskip("torch")

from pyplan.cli import main  # noqa: E402
from pyplan.errors import PyplanError, RunError, UserCodeError  # noqa: E402
from test_checkpoints import alone  # noqa: E402

MODEL = """\
import torch
from torch import nn


class Widening(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        return y if self.calls % 2 else torch.cat([y, y[:, :1]], 1)


def block(name, group):
    return nn.Linear(4, 4)


def widening(name, group):
    return nn.Linear(4, 4) if name == "a" else Widening()


def batch(step):
    return torch.randn(8, 4), torch.randn(8, 4)


def loss(output, target):
    return ((output[:, :4] - target) ** 2).mean()


def detached(output, target):
    return loss(output, target).detach()


def integer(output, target):
    return loss(output, target).long()
"""

PLAN = """\
pyplan: 1
name: {name}
devices: 1
micro_batches: 4
training: {{backward: {{time_ratio: 1}}}}
blocks:
  - {{name: a, devices: [0], time: 1, memory: 1}}
  - {{name: b, devices: [0], time: 1, memory: 1}}
model: {{blocks: "misuse:{blocks}", data: "misuse:batch", loss: "misuse:{loss}"}}
"""


@pytest.fixture
def pipeline(tmp_path, monkeypatch, capsys):
    """A one-process Pipeline of a plan written with `blocks` and `loss`; closed after."""
    (tmp_path / "misuse.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "misuse", raising=False)
    made = []

    def make(blocks: str = "block", loss: str = "loss"):
        from pyplan.runtime import Pipeline

        name = f"{blocks}-{loss}"
        (tmp_path / f"{name}.yaml").write_text(PLAN.format(name=name, blocks=blocks, loss=loss))
        assert main(["solve", str(tmp_path / f"{name}.yaml"), "--quiet"]) == 0
        alone(monkeypatch)
        pipe = Pipeline(str(tmp_path / f"{name}.resolved.yaml"), device="cpu")
        made.append(pipe)
        return pipe

    yield make
    for pipe in made:
        pipe.close()


def _refused(kind, match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(kind, match=match) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, PyplanError) and "\n" not in str(info.value)


def test_clipping_takes_positive_finite_norms(pipeline):
    pipe = pipeline()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)
    before = [p.grad.clone() for p in pipe.parameters()]
    for max_norm, norm_type, shown in [(math.nan, 2.0, "max_norm nan"), (-1.0, 2.0, "max_norm -1.0"),
                                       (0.0, 2.0, "max_norm 0.0"), ("x", 2.0, "max_norm 'x'"),
                                       (True, 2.0, "max_norm True"), (1.0, 0, "norm_type 0"),
                                       (1.0, -2.0, "norm_type -2.0"),
                                       (1.0, math.nan, "norm_type nan")]:
        _refused(RunError, f"Pipeline.clip_grad_norm_: {shown} is not a positive number",
                 pipe.clip_grad_norm_, max_norm, norm_type)
    _refused(RunError, "max_norm inf clips nothing", pipe.clip_grad_norm_, math.inf)
    # Nothing was touched by the refused calls; a good one still clips.
    assert all(torch.equal(a, p.grad) for a, p in zip(before, pipe.parameters()))
    norm = pipe.clip_grad_norm_(1e-3, norm_type="inf")
    assert float(norm) > 1e-3 and all(torch.isfinite(p.grad).all() for p in pipe.parameters())


def test_batches_that_are_not_tensors_or_are_empty(pipeline):
    pipe = pipeline()
    y = torch.randn(8, 4)
    _refused(RunError, r"Pipeline.step got inputs that hold an int at inputs\[0\] \(hint: "
             "pass tensors", pipe.step, [1, 2, 3], y)
    _refused(RunError, "Pipeline.step got inputs that hold a str", pipe.step, "abc", y)
    _refused(RunError, "Pipeline.step got targets that hold a 0-dim tensor", pipe.step,
             torch.randn(8, 4), torch.tensor(1.0))
    _refused(RunError, r"Pipeline.step got inputs of no sample \(a tensor of shape \(0, 4\)\): "
             "an empty batch", pipe.step, torch.randn(0, 4), torch.randn(0, 4))
    # What would pair the wrong rows, or hold nothing to compute with: named by its field.
    _refused(RunError, "Pipeline.step got inputs of 8 samples and targets of 16", pipe.step,
             torch.randn(8, 4), torch.randn(16, 4))
    _refused(RunError, r"Pipeline.step got targets that hold None at targets\['w'\]",
             pipe.step, torch.randn(8, 4), {"y": y, "w": None})
    _refused(RunError, "Pipeline.step got inputs with a tensor on the meta device", pipe.step,
             torch.randn(8, 4, device="meta"), y)
    _refused(RunError, r"Pipeline.eval_step got inputs of no sample \(a tensor of shape "
             r"\(0, 4\)\): an empty batch", pipe.eval_step, torch.randn(0, 4))
    # The user's block cannot take these inputs: named with the block and the micro-batch.
    _refused(UserCodeError, r"block 'a' \(micro-batch 0\) raised RuntimeError: mat1 and mat2 "
             r"shapes cannot be multiplied \(2x5 and 4x4\)", pipe.step, torch.randn(8, 5), y)


def test_misuse_of_the_optimizer_state_and_close(pipeline):
    pipe = pipeline()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)
    _refused(RunError, "Pipeline.step_optimizer: got object, not an optimizer",
             pipe.step_optimizer, object())
    _refused(RunError, r"Pipeline.load_state_dict: got a dict, not what state_dict\(\) returns",
             pipe.load_state_dict, {"x": 1})
    _refused(RunError, "Pipeline.step: rank 0 runs a block that reads the targets, but got None",
             pipe.step, x, None)
    pipe.close()
    pipe.close()  # twice: nothing more to do
    for name, args in [("step", (x, y)), ("eval_step", (x, y)), ("clip_grad_norm_", (1.0,)),
                       ("state_dict", ())]:
        _refused(RunError, rf"Pipeline.{name}: the pipeline is closed \(close\(\) was called\)",
                 getattr(pipe, name), *args)


@pytest.mark.parametrize("loss, message", [
    ("detached", "model.loss (misuse:detached) returned a loss that does not require grad: it "
                 "is cut off from the output"),
    ("integer", "model.loss (misuse:integer) returned a scalar of dtype int64, not a real "
                "floating-point one"),
])
def test_a_loss_that_cannot_train_is_refused(pipeline, loss, message):
    pipe = pipeline(loss=loss)
    _refused(PyplanError, re.escape(message), pipe.step, torch.randn(8, 4), torch.randn(8, 4))


def test_outputs_whose_width_changes_between_micro_batches(pipeline):
    pipe = pipeline(blocks="widening")
    # Training takes them (the loss sees one micro-batch at a time); the whole batch's output
    # cannot be joined, and eval_step says which micro-batch differs.
    assert math.isfinite(float(pipe.step(torch.randn(8, 4), torch.randn(8, 4))))
    _refused(UserCodeError, r"block 'b' returned a tensor float32 \(2, 5\) for micro-batch 1 "
             r"but a tensor float32 \(2, 4\) for micro-batch 0", pipe.eval_step,
             torch.randn(8, 4))
