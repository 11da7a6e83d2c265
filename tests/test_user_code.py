"""The user's own code failing (their factory, blocks, data or loss raises, calls sys.exit, has
a syntax error, returns the wrong thing): one line that names the function, what it did and,
for a plan, the line that names it; exit 2; nothing blames pyplan, torch's tracer or memory."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

GOOD = """\
import torch
from torch import nn


def model():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def batch(step):
    return torch.randn(8, 4), torch.randn(8, 4)


def loss(output, target):
    return ((output - target) ** 2).mean()
"""

BAD = GOOD + """

def raises():
    raise RuntimeError("out of coffee")


def exits():
    import sys
    sys.exit(3)


def not_a_module():
    return {"a": 1}


def batch_one():
    return torch.randn(8, 4)


def batch_single(step):
    return torch.randn(8, 4)


def loss_vector(output, target):
    return (output - target) ** 2


def loss_raises(output, target):
    raise ValueError("labels missing")


class Exits(nn.Module):
    def forward(self, x):
        import sys
        sys.exit(0)


class Pair(nn.Module):
    def forward(self, x):
        return x, None


class First(nn.Module):
    def forward(self, pair):
        return pair[0]


def exits_in_forward():
    return nn.Sequential(nn.Linear(4, 4), Exits(), nn.Linear(4, 4))


def pair_with_none():
    return nn.Sequential(nn.Linear(4, 4), Pair(), First(), nn.Linear(4, 4))


def half():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).half()


def batch_wide(step):
    return torch.randn(8, 5), torch.randn(8, 4)


def batch_empty(step):
    return torch.randn(0, 4), torch.randn(0, 4)


def loss_complex(output, target):
    return ((output - target) ** 2).mean() * (1 + 1j)


def loss_int(output, target):
    return ((output - target) ** 2).mean().long()


def loss_detached(output, target):
    return ((output - target) ** 2).mean().detach()
"""


@pytest.fixture
def user(tmp_path, monkeypatch):
    (tmp_path / "usermodel.py").write_text(BAD)
    (tmp_path / "broken_syntax.py").write_text("def model(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("usermodel", "broken_syntax"):  # each test imports its own copy
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("factory, data, loss, message", [
    ("usermodel:raises", "usermodel:batch", "usermodel:loss",
     "error: factory (usermodel:raises) raised RuntimeError: out of coffee (hint: the factory "
     "returns the whole model, an nn.Module)"),
    ("usermodel:exits", "usermodel:batch", "usermodel:loss",
     "error: factory (usermodel:exits) raised SystemExit(3) (it called sys.exit)"),
    ("usermodel:not_a_module", "usermodel:batch", "usermodel:loss",
     "error: factory (usermodel:not_a_module) returned dict, not a torch.nn.Module"),
    ("broken_syntax:model", "usermodel:batch", "usermodel:loss",
     "error: factory: importing broken_syntax raised SyntaxError: invalid syntax"),
    ("usermodel:model", "usermodel:batch_one", "usermodel:loss",
     "error: data (usermodel:batch_one) raised TypeError: batch_one() takes 0 positional "
     "arguments but 1 was given"),
    ("usermodel:model", "usermodel:batch_single", "usermodel:loss",
     "error: data (usermodel:batch_single) returned a tensor of shape (8, 4), not (inputs, "
     "targets)"),
    ("usermodel:model", "usermodel:batch", "usermodel:loss_raises",
     "error: loss (usermodel:loss_raises) raised ValueError: labels missing"),
    # round 4: the model's own forward, its outputs and the loss's value
    ("usermodel:exits_in_forward", "usermodel:batch", "usermodel:loss",
     "error: the model's forward raised SystemExit(0) (it called sys.exit) on one micro-batch "
     "of the data's inputs"),
    ("usermodel:model", "usermodel:batch_wide", "usermodel:loss",
     "error: the model's forward raised RuntimeError: mat1 and mat2 shapes cannot be multiplied "
     "(2x5 and 4x4) on one micro-batch"),
    ("usermodel:half", "usermodel:batch", "usermodel:loss",
     "error: the model's forward raised RuntimeError: mat1 and mat2 must have the same dtype"),
    ("usermodel:pair_with_none", "usermodel:batch", "usermodel:loss",
     "error: unit 1 returned a NoneType inside its output; a block returns a tensor or a "
     "tuple, list or dict of tensors"),
    ("usermodel:model", "usermodel:batch_empty", "usermodel:loss",
     "error: data (usermodel:batch_empty) returned inputs of no sample (a tensor of shape "
     "(0, 4)): an empty batch"),
    ("usermodel:model", "usermodel:batch", "usermodel:loss_complex",
     "error: loss (usermodel:loss_complex) returned a scalar of dtype complex64, not a real "
     "floating-point one"),
    ("usermodel:model", "usermodel:batch", "usermodel:loss_int",
     "error: loss (usermodel:loss_int) returned a scalar of dtype int64, not a real "
     "floating-point one"),
    ("usermodel:model", "usermodel:batch", "usermodel:loss_detached",
     "error: loss (usermodel:loss_detached) returned a loss that does not require grad: it "
     "is cut off from the output"),
])
def test_partition_names_the_users_function(cli, user, factory, data, loss, message):
    code, out, err = cli("partition", factory, "--data", data, "--loss", loss, "--devices", "2",
                         "--repeats", "1", "-o", user / "p.yaml")
    assert code == 2, err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not (user / "p.yaml").exists()


RUNNABLE = """\
pyplan: 1
name: user
devices: 1
micro_batches: 2
training: {{backward: {{time_ratio: 1}}}}
blocks:
  - {{name: a, devices: [0], time: 1, memory: 1}}
model:
  blocks: usermodel:{blocks}
  data: usermodel:{data}
  loss: usermodel:{loss}
"""

BLOCKS = """

def block(name, group):
    return nn.Linear(4, 4)


def batch_pairs_wrong(step):
    return torch.randn(8, 4), torch.randn(16, 4)


def batch_meta(step):
    return torch.randn(8, 4, device="meta"), torch.randn(8, 4)


def loss_meta(output, target):
    return torch.zeros((), device="meta")


def block_raises(name, group):
    raise KeyError(name)
"""


@pytest.mark.parametrize("blocks, data, loss, where, message", [
    ("block_raises", "batch", "loss", "9:11",
     "model.blocks (usermodel:block_raises) raised KeyError: 'a' building block 'a'"),
    ("block", "exits", "loss", "10:9",
     "model.data (usermodel:exits) raised TypeError"),
    ("block", "batch", "loss_vector", "11:9",
     "model.loss (usermodel:loss_vector) returned a tensor of shape (4, 4), not a scalar "
     "tensor"),
    ("block", "batch_pairs_wrong", "loss", "10:9",
     "model.data (usermodel:batch_pairs_wrong) returned inputs of 8 samples and targets of 16 "
     "(along dim 0)"),
    ("block", "batch_meta", "loss", "10:9",
     "model.data (usermodel:batch_meta) returned inputs with a tensor on the meta device"),
    ("block", "batch", "loss_meta", "11:9",
     "model.loss (usermodel:loss_meta) returned a loss on the meta device"),
])
def test_run_names_the_users_function_at_its_plan_line(user, monkeypatch, capfd, blocks, data,
                                                        loss, where, message):
    from pyplan.cli import main
    from test_runtime import _free_port

    (user / "usermodel.py").write_text(BAD + BLOCKS)
    plan = user / "user.yaml"
    plan.write_text(RUNNABLE.format(blocks=blocks, data=data, loss=loss))
    assert main(["solve", str(plan), "--quiet"]) == 0
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    capfd.readouterr()
    code = main(["run", str(user / "user.resolved.yaml"), "--device", "cpu"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert message in err and err.count("\n") == 1, err
    assert err.startswith(f"{plan}:{where}: error:"), err


SLEEPS = """
import time


class Sleeps(nn.Module):
    def forward(self, x):
        time.sleep(3600)
        return x


class Spins(nn.Module):
    def forward(self, x):
        while True:
            x = x + 0


def sleeps():
    return nn.Sequential(nn.Linear(4, 4), Sleeps(), nn.Linear(4, 4))


def spins():
    return nn.Sequential(nn.Linear(4, 4), Spins(), nn.Linear(4, 4))
"""


@pytest.mark.parametrize("factory, limit, message", [
    ("sleeps", "300", "the model's forward computed nothing for 10 s while measured (it sleeps "
     "or waits for something) (hint: if it is slow, not stuck, raise --unit-time-limit (now "
     "300 s of CPU time; the idle bound is 1/30 of it, at least 10 s))"),
    ("spins", "2", "the model's forward took more than 2 s of CPU time to measure"),
])
def test_a_forward_that_never_ends_is_stopped(cli, user, factory, limit, message):
    import time

    (user / "usermodel.py").write_text(BAD + SLEEPS)
    started = time.process_time()
    code, out, err = cli("partition", f"usermodel:{factory}", "--data", "usermodel:batch",
                         "--loss", "usermodel:loss", "--devices", "2", "--repeats", "1",
                         "--unit-time-limit", limit, "-o", user / "p.yaml")
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert time.process_time() - started < 60  # the sleep: no CPU; the spin: 2 s and a bit
    assert not (user / "p.yaml").exists()


def test_the_time_limit_lets_a_slow_unit_finish():
    """A unit computing without a break for longer than the idle bound, within the CPU
    limit, is measured (the idle bound watches for no CPU time, not for a long run); one that
    sleeps past the idle bound is stopped, one computing past the CPU limit too."""
    import time

    from pyplan.measure.limits import TimeLimitError, time_limit

    with time_limit("unit slow", 60, idle=0.6):
        end = time.process_time() + 2.5
        while time.process_time() < end:
            pass
    with pytest.raises(TimeLimitError, match="unit idle computed nothing for 0.6 s"):
        with time_limit("unit idle", 60, idle=0.6):
            time.sleep(30)
    with pytest.raises(Exception, match="unit slow took more than 0.5 s of CPU time"):
        with time_limit("unit slow", 0.5):
            while True:
                pass


def _hostile_batches():
    import torch

    x = torch.ones(8, 4)
    return [
        (None, "returned a NoneType, not (inputs, targets)"),
        ((x,), "returned a tuple of 1, not (inputs, targets)"),
        ((x, x, x), "returned a tuple of 3, not (inputs, targets)"),
        ((None, x), "returned inputs that hold None"),
        (((x, None), x), "returned inputs that hold None at inputs[1]"),
        ((x, {"labels": None}), "returned targets that hold None at targets['labels']"),
        (({"ids": x, "mask": "all"}, x), "returned inputs that hold a str at inputs['mask']"),
        ((x, torch.tensor(1.0)), "returned targets that hold a 0-dim tensor"),
        (([], x), "returned inputs that hold no tensor"),
        ((x, torch.ones(0, 4)), "returned targets of no sample (a tensor of shape (0, 4)): an "
                                "empty batch"),
        ((torch.ones(8, 4, device="meta"), x), "returned inputs with a tensor on the meta "
                                               "device, which holds no values"),
        ((x, torch.ones(16)), "returned inputs of 8 samples and targets of 16 (along dim 0)"),
        (((x, torch.ones(4, 4)), x), "returned inputs[0] of 8 samples and inputs[1] of 4"),
        ((x, {"y": x, "w": torch.ones(9)}), "returned inputs of 8 samples and targets['w'] of 9"),
    ]


def test_every_hostile_batch_is_named_by_its_field():
    """A table of what a data function might return: each refused, naming the field."""
    import torch

    from pyplan.run.data import check_batch

    for batch, message in _hostile_batches():
        why = check_batch(batch)
        assert why is not None and why.startswith(message), (batch, why)
    x = torch.ones(8, 4)
    for good in [(x, x), ((x, x), {"y": x}), ({"ids": x.long()}, [x, torch.ones(8)])]:
        assert check_batch(good) is None


STAGED = """\
pyplan: 1
name: staged
devices: 2
micro_batches: 2
training: {{backward: {{time_ratio: 1}}}}
blocks:
  - {{name: a, devices: [0], time: 1, memory: 1}}
  - {{name: b, devices: [1], time: 1, memory: 1}}
model: {{module: "staged:net", stages: {{a: [{first}], b: [head]}}, data: "staged:batch",
         loss: "staged:loss", path: {path}}}
"""

NET = GOOD + """

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def net():
    return Net()
"""


@pytest.mark.parametrize("folder, first, message", [
    # round 4's leftovers (the others: tests/test_hostile_run.py): a stage given as a
    # ModuleList, at the line of the plan the user wrote (not of its resolved copy); a model
    # folder whose name holds quotes and a backslash (YAML-quoted, imported as it is)
    ("models", "layers", "9:44: error: model.stages: 'layers' (block 'a') is a ModuleList, "
     "which has no forward to call (hint: name its items instead, e.g. layers.0)"),
    ("q'u\"o\\te", "layers.0, layers.1", None),
])
def test_a_cut_models_stages_and_folder_are_checked_before_running(cli, tmp_path, folder,
                                                                   first, message):
    import json

    (tmp_path / folder).mkdir()
    (tmp_path / folder / "staged.py").write_text(NET)
    plan = tmp_path / "staged.yaml"
    plan.write_text(STAGED.format(first=first, path=json.dumps(str(tmp_path / folder))))
    assert cli("solve", plan, "--quiet")[0] == 0
    code, out, err = cli("run", plan.with_suffix(".resolved.yaml"), "--dry-run")
    if message is None:
        assert code == 0 and err == "", err
        assert "staged:net built all 2 declared blocks" in out, out
    else:
        assert code == 2 and err.count("\n") == 1, err
        assert err == f"{plan}:{message}\n", err  # at the line of the plan the user wrote


HANGS = """
import os
import time

from longrun import batch as _batch, loss, model  # noqa: F401


def batch(step, split="train"):
    if step >= 1 and os.environ["RANK"] == "1":  # its first call has the start-up grace
        time.sleep(3600)
    return _batch(step, split)
"""


@pytest.mark.torchrun
@pytest.mark.parametrize("sent, code, message", [
    (None, 1, "rank 1: the data function hang:batch (two.yaml model.data) has not returned for "
     "2 s (it hangs, or needs longer than --fault-timeout)"),
    ("SIGTERM", 75, "rank 1: the data function hang:batch (two.yaml model.data) has not "
     "returned for 2 s, so the step asked to stop by SIGTERM cannot end; stopped without a save "
     "(the checkpoints saved before are intact)"),
    ("SIGINT", 130, None),
])
def test_a_data_function_that_never_returns_is_a_named_fault(tmp_path, sent, code, message):
    """A data function hanging on one rank (the other waits for it in a collective, both
    heartbeats beating) ends the run within --fault-timeout naming it, on every rank; SIGTERM
    to the launcher (a preemption) cannot save after a step that never ends, and says so;
    Ctrl-C (SIGINT to the whole process group) interrupts at once, without a traceback."""
    import os
    import signal
    import subprocess
    import time

    from test_checkpoints import PYPLAN, solved

    solved(tmp_path, "two", [["0"], ["1", "2", "3", "4", "5"]], data="hang:batch")
    (tmp_path / "hang.py").write_text(HANGS)
    with subprocess.Popen([PYPLAN, "run", "two.resolved.yaml", "--nproc-per-node", "2",
                           "--device", "cpu", "--iterations", "3", "--fault-timeout", "2"],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as process:
        first = process.stdout.readline() + process.stdout.readline()
        assert "step 1:" in first, (first, process.stderr.read())  # batch 1 is being read
        if sent == "SIGTERM":
            process.send_signal(signal.SIGTERM)
        elif sent == "SIGINT":
            os.killpg(process.pid, signal.SIGINT)
        started = time.monotonic()
        out, err = process.communicate(timeout=60)
    assert process.returncode == code, err
    assert time.monotonic() - started < 30 and "Traceback" not in err, err
    if message is None:
        assert "interrupted" in err and "error:" not in err, err
    else:
        for rank in (0, 1):
            assert f"\nerror: rank {rank} stops: {message}\n" in err, err


def test_the_data_and_loss_are_named_for_the_watchdog_while_they_run():
    """What the fault watchdog names when a user function does not return
    (pyplan.run.user_calls): the data and the loss, each call's start, the first call marked
    (it gets the start-up grace); not the factories, which build as long as they need."""
    from pyplan.run import user_calls
    from pyplan.run.binding import Model, call_user

    seen = []

    def loss(output, target):
        running = user_calls.now()
        seen.append(None if running is None else (running.name(), running.first))
        return output

    model = Model(build=None, data=lambda step: None, loss=loss, source="p.yaml",
                  names={"loss": "model.loss", "module": "model.module"})
    named = f"the loss function {__name__}:{loss.__qualname__} (p.yaml model.loss)"
    for _ in range(2):
        call_user(model, "loss", model.loss, 1, 2)
    call_user(model, "module", model.loss, 1, 2)
    assert seen == [(named, True), (named, False), None]
    assert user_calls.now() is None  # nothing runs between calls


LATER = """
import os
import sys
import time


class Later(nn.Module):
    calls = 0

    def forward(self, x):  # the first call (the model run on a micro-batch) returns
        Later.calls += 1
        if Later.calls == int(os.environ["LATER_CALL"]):
            what = os.environ["LATER"]
            if what == "exit":
                sys.exit(5)
            if what == "os_exit":
                os._exit(5)
            if what == "interrupt":
                raise KeyboardInterrupt
            time.sleep(3600)
        return x


def later():
    return nn.Sequential(nn.Linear(4, 4), Later(), nn.Linear(4, 4))
"""

ENDED = ("while pyplan partition measured the model; the model's code must return or raise, "
         "not end the process (hint: raise an exception instead (it is reported with the unit))")


@pytest.mark.parametrize("what, call, message", [
    ("exit", 2, f"Later.forward (usermodel.py:106) called sys.exit(5) {ENDED}"),
    ("os_exit", 3, f"Later.forward (usermodel.py:108) called os._exit(5) {ENDED}"),
    ("interrupt", 2, f"Later.forward (usermodel.py:110) raised KeyboardInterrupt {ENDED}"),
    ("sleep", 2, "the model's forward computed nothing for 10 s while measured (it sleeps or "
     "waits for something) (hint: if it is slow, not stuck, raise --unit-time-limit (now 10 s "
     "of CPU time; the idle bound is 1/30 of it, at least 10 s))"),
])
def test_a_later_call_into_the_model_is_guarded_as_the_first(user, what, call, message):
    """Round 5's leftovers: whatever the model's forward does on a later call that pyplan
    partition makes into it (finding its units, tracing, measuring them) is one line naming
    it, exit 2, and --unit-time-limit holds for it; a KeyboardInterrupt the model raises is not
    a Ctrl-C (the command itself: pyplan's own SIGINT handler)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (user / "usermodel.py").write_text(BAD + LATER)
    result = subprocess.run([str(Path(sys.executable).with_name("pyplan")), "partition",
                             "usermodel:later", "--data", "usermodel:batch", "--loss",
                             "usermodel:loss", "--devices", "2", "--repeats", "1",
                             "--unit-time-limit", "10", "-o", "p.yaml"],
                            cwd=user, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "LATER": what, "LATER_CALL": str(call)})
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr == f"error: {message}\n"
    assert not (user / "p.yaml").exists()
