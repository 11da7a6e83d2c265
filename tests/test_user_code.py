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
     "error: FACTORY (usermodel:raises) raised RuntimeError: out of coffee (hint: the factory "
     "returns the whole model, an nn.Module)"),
    ("usermodel:exits", "usermodel:batch", "usermodel:loss",
     "error: FACTORY (usermodel:exits) raised SystemExit(3) (it called sys.exit)"),
    ("usermodel:not_a_module", "usermodel:batch", "usermodel:loss",
     "error: FACTORY (usermodel:not_a_module) returned dict, not a torch.nn.Module"),
    ("broken_syntax:model", "usermodel:batch", "usermodel:loss",
     "error: FACTORY: importing broken_syntax raised SyntaxError: invalid syntax"),
    ("usermodel:model", "usermodel:batch_one", "usermodel:loss",
     "error: --data (usermodel:batch_one) raised TypeError: batch_one() takes 0 positional "
     "arguments but 1 was given"),
    ("usermodel:model", "usermodel:batch_single", "usermodel:loss",
     "error: --data (usermodel:batch_single) returned a tensor of shape (8, 4), not (inputs, "
     "targets)"),
    ("usermodel:model", "usermodel:batch", "usermodel:loss_raises",
     "error: --loss (usermodel:loss_raises) raised ValueError: labels missing"),
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
