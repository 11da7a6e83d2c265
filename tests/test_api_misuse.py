"""The Pipeline API misused raises pyplan's own errors (RunError/PlanError, one line), never
torch's internals: clipping norms that are NaN, negative, zero or not numbers; a step after
close(); batches that are not tensors, empty, or that the user's block cannot take (named
with the block and the micro-batch); losses that cannot train; an optimizer that is none;
outputs whose shapes change between the micro-batches of an evaluation; and, as `pyplan run`
checks its options, every public method's arguments (a table per method), the same error on
every rank when one rank's are bad."""

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

    def make(blocks: str = "block", loss: str = "loss", **arguments):
        from pyplan.runtime import Pipeline

        name = f"{blocks}-{loss}"
        (tmp_path / f"{name}.yaml").write_text(PLAN.format(name=name, blocks=blocks, loss=loss))
        assert main(["solve", str(tmp_path / f"{name}.yaml"), "--quiet"]) == 0
        alone(monkeypatch)
        pipe = Pipeline(str(tmp_path / f"{name}.resolved.yaml"), device="cpu", **arguments)
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


@pytest.mark.parametrize("arguments, message", [
    *[({"seed": seed}, f"Pipeline: seed {shown} is not an integer from 0 to 2**63 - 1")
      for seed, shown in [("0", "'0'"), (1.5, "1.5"), (None, "None"), (True, "True"),
                          (-1, "-1"), (2**63, str(2**63)), (math.nan, "nan")]],
    *[({"timeout": t}, f"Pipeline: timeout {shown} is not a number of seconds from 0 to 1e6")
      for t, shown in [(0, "0"), (-1.0, "-1.0"), (math.nan, "nan"), (math.inf, "inf"),
                       ("10", "'10'")]],
    ({"blocking": "no"}, "Pipeline: blocking 'no' is not True or False"),
    ({"sync_at_end": 1}, "Pipeline: sync_at_end 1 is not True or False"),
    ({"agree_arguments": None}, "Pipeline: agree_arguments None is not True or False"),
])
def test_the_constructor_checks_its_arguments(pipeline, arguments, message):
    _refused(RunError, re.escape(message), pipeline, **arguments)
    pipeline().close()  # the refused one left no process group behind


def _optimizers(pipe):
    return {"sgd": torch.optim.SGD(pipe.parameters(), lr=0.1),
            "adamw": torch.optim.AdamW(pipe.parameters())}


# method, its arguments from (pipe, optimizers, a state of each), the error
METHODS = [
    ("step", lambda p, o, s: ((torch.randn(8, 4), torch.randn(8, 4)), {"trace": "yes"}),
     "Pipeline.step: trace 'yes' is not True or False"),
    ("step", lambda p, o, s: ((torch.randn(8, 4), torch.randn(8, 4)), {"share_loss": None}),
     "Pipeline.step: share_loss None is not True or False"),
    ("step", lambda p, o, s: ((torch.randn(8, 4), torch.randn(8, 4)), {"grad_norm": 1}),
     "Pipeline.step: grad_norm 1 is not True or False"),
    ("clip_grads_with_norm_", lambda p, o, s: ((0.0, torch.tensor(1.0)), {}),
     "Pipeline.clip_grads_with_norm_: max_norm 0.0 is not a positive number"),
    ("clip_grads_with_norm_", lambda p, o, s: ((1.0, 2.5), {}),
     "Pipeline.clip_grads_with_norm_: got a float for total_norm, not a one-element tensor"),
    ("eval_step", lambda p, o, s: ((torch.randn(8, 4),), {"loss": "x"}),
     "Pipeline.eval_step: loss 'x' is not True or False"),
    ("step_optimizer", lambda p, o, s: ((None,), {}),
     "Pipeline.step_optimizer: got None for the optimizer, but this rank holds 4 trainable "
     "parameters, which would not be updated"),
    ("step_optimizer", lambda p, o, s: (("adamw",), {}),
     "Pipeline.step_optimizer: got str, not an optimizer"),
    ("grad_norm", lambda p, o, s: (("x",), {}),
     "Pipeline.grad_norm: norm_type 'x' is not a positive number"),
    ("grad_norm", lambda p, o, s: ((-2.0,), {}),
     "Pipeline.grad_norm: norm_type -2.0 is not a positive number"),
    ("state_dict", lambda p, o, s: ((p.parameters(),), {}),
     "Pipeline.state_dict: got list, not an optimizer"),
    ("load_state_dict", lambda p, o, s: ((s["sgd"], o["adamw"]), {}),
     "Pipeline.load_state_dict: the optimizer state is another optimizer type's than AdamW: "
     "it has no amsgrad, betas, capturable (but dampening, momentum, nesterov)"),
    ("load_state_dict", lambda p, o, s: ((s["adamw"], o["sgd"]), {}),
     "Pipeline.load_state_dict: the optimizer state is another optimizer type's than SGD: it "
     "has no dampening, momentum, nesterov (but amsgrad, betas, capturable)"),
    ("load_state_dict", lambda p, o, s: (({"model": s["sgd"]["model"]}, o["sgd"]), {}),
     "Pipeline.load_state_dict: got no optimizer state to load into the SGD"),
    ("load_state_dict", lambda p, o, s: (({**s["sgd"], "optimizer": 3}, o["sgd"]), {}),
     "Pipeline.load_state_dict: got an int for the optimizer state, not the dict"),
    ("load_state_dict", lambda p, o, s: ((s["sgd"], "sgd"), {}),
     "Pipeline.load_state_dict: got str, not an optimizer"),
    ("train", lambda p, o, s: (("no",), {}), "Pipeline.train: mode 'no' is not True or False"),
    # pyplan.runtime's checkpoints, every rank calling them with the pipeline
    ("runtime.save", lambda p, o, s: (("ck", p, o["sgd"]), {"step": 1.5}),
     "pyplan.runtime.save: step 1.5 is not an integer from 0 to 2**63 - 1"),
    ("runtime.save", lambda p, o, s: (("ck", p, o["sgd"]), {"step": -1}),
     "pyplan.runtime.save: step -1 is not an integer from 0 to 2**63 - 1"),
    ("runtime.save", lambda p, o, s: (("ck", p, o["sgd"]), {"step": 1, "keep_last": 0}),
     "pyplan.runtime.save: keep_last 0 is not an integer from 1 to 2**63 - 1"),
    ("runtime.save", lambda p, o, s: (("ck", p, o["sgd"]), {"step": 1, "meta": "x"}),
     "pyplan.runtime.save: meta is a str, not a dict"),
    ("runtime.save", lambda p, o, s: ((3, p, o["sgd"]), {"step": 1}),
     "pyplan.runtime.save: directory is an int, not a folder's path"),
    ("runtime.save", lambda p, o, s: (("ck", p, "sgd"), {"step": 1}),
     "pyplan.runtime.save: got str, not an optimizer"),
    ("runtime.load", lambda p, o, s: (("ck", "pipe"), {}),
     "pyplan.runtime.load: pipe is a str, not an open pyplan.runtime.Pipeline"),
    ("runtime.load", lambda p, o, s: (("ck", p, o["sgd"]), {"scheduler": 1}),
     "pyplan.runtime.load: scheduler is an int, not a learning-rate scheduler"),
]


@pytest.mark.parametrize("method, given, message", METHODS,
                         ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(METHODS)])
def test_every_method_checks_its_arguments(pipeline, tmp_path, monkeypatch, method, given,
                                          message):
    import pyplan.runtime

    monkeypatch.chdir(tmp_path)
    pipe = pipeline()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)
    optimizers = _optimizers(pipe)
    for optimizer in optimizers.values():
        pipe.step_optimizer(optimizer)  # each has its state (AdamW's moments)
    states = {name: pipe.state_dict(o) for name, o in optimizers.items()}
    before = [p.detach().clone() for p in pipe.parameters()]
    args, kwargs = given(pipe, optimizers, states)
    call = getattr(pyplan.runtime, method[8:]) if method.startswith("runtime.") else \
        getattr(pipe, method)
    _refused(PyplanError, re.escape(message), call, *args, **kwargs)
    assert not (tmp_path / "ck").exists()  # nothing written
    assert all(torch.equal(a, p) for a, p in zip(before, pipe.parameters()))  # untouched
    assert math.isfinite(float(pipe.step(x, y)))  # and it still runs


SAME_ERROR = """\
import os
import sys

import torch
import torch.distributed as dist

from pyplan.errors import PyplanError
from pyplan.runtime import Pipeline

dist.init_process_group("gloo")  # the script's: a refused Pipeline leaves it as it was
rank, lines = int(os.environ["RANK"]), []


def attempt(name, call):
    try:
        call()
        lines.append(f"{name}: no error")
    except PyplanError as exc:
        lines.append(f"{name}: {type(exc).__name__}: {exc}")


attempt("seed", lambda: Pipeline(sys.argv[1], device="cpu", seed=1.5 if rank else 0))
attempt("seeds", lambda: Pipeline(sys.argv[1], device="cpu", seed=rank))
pipe = Pipeline(sys.argv[1], device="cpu")
sgd, adamw = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.AdamW(pipe.parameters())
x, y = torch.randn(8, 4), torch.randn(8, 4)
pipe.step(x, y)
attempt("step_optimizer", lambda: pipe.step_optimizer(None if rank else sgd))
state = pipe.state_dict(sgd)
attempt("load_state_dict", lambda: pipe.load_state_dict(state, adamw if rank else sgd))
attempt("clip_grad_norm_", lambda: pipe.clip_grad_norm_(math.nan if rank == 0 else 1.0))
attempt("step", lambda: pipe.step(x, y, trace="yes" if rank else False))
lines.append(f"steps after: {float(pipe.step(x, y)) > 0}")
pipe.close()
# Without the agreement a bad argument is its own rank's error alone (no collective waits).
alone = Pipeline(sys.argv[1], device="cpu", agree_arguments=False)
alone.step(x, y)
attempt("alone", lambda: alone.step_optimizer(
    None if rank else torch.optim.SGD(alone.parameters(), lr=0.1)))
lines.append(f"alone after: {float(alone.step(x, y)) > 0}")
alone.close()
dist.destroy_process_group()
sys.stdout.write("".join(f"{rank} {line}\\n" for line in lines))  # one write
""".replace("import os\n", "import math\nimport os\n", 1)


def _two_ranks(folder) -> None:
    """p.resolved.yaml in `folder`: blocks a and b on two devices, misuse.py beside it."""
    (folder / "misuse.py").write_text(MODEL)
    (folder / "p.yaml").write_text(PLAN.format(name="two", blocks="block", loss="loss")
                                     .replace("devices: 1", "devices: 2")
                                     .replace("name: b, devices: [0]", "name: b, devices: [1]"))
    assert main(["solve", str(folder / "p.yaml"), "--quiet"]) == 0


@pytest.mark.torchrun
def test_one_ranks_bad_argument_is_every_ranks_error(tmp_path):
    """Rank 1 alone passes a bad argument (rank 0 for clipping): both ranks raise the same
    pyplan error, naming the rank (the other rank used to wait in a collective until gloo's
    "connection closed"), and both step on after it."""
    from warm_torchrun import torchrun

    _two_ranks(tmp_path)
    (tmp_path / "same_error.py").write_text(SAME_ERROR)
    result = torchrun("same_error.py", "p.resolved.yaml", nproc=2, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {rank: [line[2:] for line in result.stdout.splitlines() if line[:2] == f"{rank} "]
             for rank in (0, 1)}
    assert lines[0][:-2] == lines[1][:-2], result.stdout
    assert [lines[0][-2:], lines[1][-2:]] == [
        ["alone: no error", "alone after: True"],
        ["alone: RunError: error: Pipeline.step_optimizer: got None for the optimizer, but "
         "this rank holds 2 trainable parameters, which would not be updated (hint: pass the "
         "optimizer built over pipe.parameters() on every rank where they are not empty)",
         "alone after: True"]], result.stdout
    assert lines[0][:-2] == [
        "seed: RunError: error: rank 1: Pipeline: seed 1.5 is not an integer from 0 to 2**63 - 1 "
        "(hint: the same integer seed on every rank, e.g. seed=0)",
        "seeds: RunError: error: Pipeline: rank 1 has seed 1, rank 0 seed 0: each block's "
        "weights and dropout follow the seed (hint: pass the same seed on every rank)",
        "step_optimizer: RunError: error: rank 1: Pipeline.step_optimizer: got None for the "
        "optimizer, but this rank holds 2 trainable parameters, which would not be updated "
        "(hint: pass the optimizer built over pipe.parameters() on every rank where they are "
        "not empty)",
        "load_state_dict: RunError: error: rank 1: Pipeline.load_state_dict: the optimizer "
        "state is another optimizer type's than AdamW: it has no amsgrad, betas, capturable "
        "(but dampening, momentum, nesterov) (hint: load a state_dict(optimizer) of the same "
        "optimizer type)",
        "clip_grad_norm_: RunError: error: rank 0: Pipeline.clip_grad_norm_: max_norm nan is "
        "not a positive number (hint: max_norm: the largest norm allowed, e.g. 1.0; norm_type: "
        "2.0 (default), 1.0 or inf)",
        "step: RunError: error: rank 1: Pipeline.step: trace 'yes' is not True or False",
        "steps after: True"], result.stdout


AGAIN = """\
import sys

import torch

from misuse import batch
from pyplan.runtime import Pipeline

for attempt in range(2):  # the second joins a new world of its own (torchrun's, again)
    pipe = Pipeline(sys.argv[1], device="cpu")
    inputs, targets = batch(0)
    loss = pipe.step(inputs, targets)
    pipe.step_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    sys.stdout.write(f"{pipe.rank} {attempt} {float(loss):.6f}\\n")  # one write: no interleave
    sys.stdout.flush()
    pipe.close()
"""


@pytest.mark.slow
@pytest.mark.torchrun
def test_a_pipeline_after_a_closed_one_joins_a_new_world(tmp_path):
    """A Pipeline that made the process group leaves it on close(); the next one makes a new
    one (it read the first group's addresses from torchrun's store, failing to connect) and
    computes the same loss from the same seed."""
    from warm_torchrun import torchrun

    _two_ranks(tmp_path)
    (tmp_path / "again.py").write_text(AGAIN)
    result = torchrun("again.py", "p.resolved.yaml", nproc=2, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = sorted(line.split() for line in result.stdout.splitlines()
                    if line[:2] in ("0 ", "1 "))
    assert [(rank, attempt) for rank, attempt, _ in losses] == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], result.stdout
    assert len({loss for _, _, loss in losses}) == 1, result.stdout
