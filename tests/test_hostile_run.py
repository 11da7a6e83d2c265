"""Hostile input to `pyplan run` under torchrun: a block whose output changes its structure
between the micro-batches of an iteration, a check that cannot join the last block's outputs,
data the blocks cannot take. Each is the user's error: every rank exits 2 with one line that
names the block and the micro-batch, and the launcher adds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

PYPLAN = str(Path(sys.executable).with_name("pyplan"))

MODEL = """\
import torch
from torch import nn


class Alternating(nn.Module):
    \"\"\"Its output changes every call: dict keys, or the width of the last dimension.\"\"\"

    def __init__(self, keys):
        super().__init__()
        self.lin, self.keys, self.calls = nn.Linear(4, 4), keys, 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x[:, :4])
        if self.keys:
            return {"a": y} if self.calls % 2 else {"b": y}
        return y if self.calls % 2 else torch.cat([y, y[:, :1]], 1)


class Take(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, v):
        v = next(iter(v.values())) if isinstance(v, dict) else v
        return self.lin(v[:, :4])


def keys(name, group):
    return Alternating(True) if name == "a" else Take()


def last_wider(name, group):
    return nn.Linear(4, 4) if name == "a" else Alternating(False)


def plain(name, group):
    return nn.Linear(4, 4)


def batch(step):
    return torch.randn(8, 4), torch.randn(8, 4)


def wide_batch(step):
    return torch.randn(8, 5), torch.randn(8, 4)


def loss(output, target):
    return ((output[:, :4] - target) ** 2).mean()


class Exits(nn.Linear):
    def forward(self, x):
        import sys
        sys.exit(5)


def exits(name, group):
    return Exits(4, 4)


def pair(name, group):
    return nn.Linear(4, 4), nn.Linear(4, 4)
"""

PLAN = """\
pyplan: 1
name: {name}
devices: 2
micro_batches: 4
training: {{backward: {{time_ratio: 1}}}}
blocks:
  - {{name: a, devices: [0], time: 1, memory: 1}}
  - {{name: b, devices: [1], time: 1, memory: 1}}
model: {{blocks: "hostile_run:{blocks}", data: "hostile_run:{data}", loss: "hostile_run:loss"}}
"""


def _pyplan(tmp_path, *args):
    return subprocess.run([PYPLAN, *map(str, args)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)


@pytest.mark.torchrun
@pytest.mark.parametrize("blocks, data, extra, message", [
    ("keys", "batch", [], "rank 0 failed at instruction 4 of iteration 0 (send a@1 output to "
     "rank 1): block 'a' (micro-batch 1) returned {'b': float32 (2, 4)}, but block 'a' "
     "(micro-batch 0) returned {'a': float32 (2, 4)} in this iteration"),
    ("last_wider", "batch", ["--check"], "rank 0 failed at the final report: block 'b' "
     "returned a tensor float32 (2, 5) for micro-batch 1 but a tensor float32 (2, 4) for "
     "micro-batch 0"),
    ("plain", "wide_batch", [], "rank 0 failed at instruction 0 of iteration 0 (compute a@0): "
     "block 'a' (micro-batch 0) raised RuntimeError: mat1 and mat2 shapes cannot be multiplied "
     "(2x5 and 4x4)"),
])
def test_the_users_blocks_failing_exit_2_on_every_rank(tmp_path, blocks, data, extra, message):
    (tmp_path / "hostile_run.py").write_text(MODEL)
    (tmp_path / "p.yaml").write_text(PLAN.format(name=blocks, blocks=blocks, data=data))
    assert _pyplan(tmp_path, "solve", "p.yaml", "--quiet").returncode == 0
    result = _pyplan(tmp_path, "run", "p.resolved.yaml", "--nproc-per-node", 2, "--device",
                     "cpu", *extra)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert any(line.startswith(f"error: {message}") for line in errors), errors
    assert any(line.startswith("error: rank ") and " stops: " in line for line in errors), errors


NO_TARGETS = """\
import sys

import torch

from pyplan.errors import RunError
from pyplan.runtime import Pipeline

pipe = Pipeline(sys.argv[1], device="cpu")
x, y = torch.randn(8, 4), torch.randn(8, 4)
try:
    pipe.step(x, None)  # the last rank computes the loss and needs them
except RunError as exc:
    sys.stdout.write(f"{exc}\\n")
sys.stdout.write(f"rank {pipe.rank} steps after: {float(pipe.step(x, y)) > 0}\\n")
pipe.close()
"""


@pytest.mark.torchrun
@pytest.mark.parametrize("case, message", [
    ("exit-in-forward", "block 'a' (micro-batch 0) raised SystemExit(5) (it called sys.exit)"),
    ("block-is-a-tuple", "model.blocks (hostile_run:pair) returned tuple for block 'a', not a "
     "torch.nn.Module"),
    ("step-without-targets", "Pipeline.step: rank 1 runs a block that reads the targets, but "
     "got None for them"),
])
def test_round_4_leftovers_are_one_line_on_every_rank(tmp_path, case, message):
    """Left from round 4: sys.exit in a block's forward, a block factory returning a tuple,
    and Pipeline.step without targets on the rank that reads them (the other rank waited in a
    transfer: gloo's traceback). The others: a stage given as a ModuleList in
    tests/test_user_code.py, a resealed plan with edited memory in
    tests/test_resolved_seal.py ("capacity")."""
    (tmp_path / "hostile_run.py").write_text(MODEL)
    blocks = {"exit-in-forward": "exits", "block-is-a-tuple": "pair"}.get(case, "plain")
    (tmp_path / "p.yaml").write_text(PLAN.format(name=case, blocks=blocks, data="batch"))
    assert _pyplan(tmp_path, "solve", "p.yaml", "--quiet").returncode == 0
    if case == "step-without-targets":
        from warm_torchrun import torchrun

        (tmp_path / "no_targets.py").write_text(NO_TARGETS)
        result = torchrun("no_targets.py", "p.resolved.yaml", nproc=2, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        errors = sorted(line for line in result.stdout.splitlines() if "error:" in line)
        assert errors == [f"error: {message} (hint: pass the global batch on the ranks whose "
                          "takes_inputs / takes_targets is True (any rank may get it))"] * 2, \
            result.stdout  # the same error on every rank
        assert result.stdout.count("steps after: True") == 2, result.stdout
        return
    dry = case == "block-is-a-tuple"  # refused before any rank starts
    result = _pyplan(tmp_path, "run", "p.resolved.yaml", "--device", "cpu",
                     *(["--dry-run"] if dry else ["--nproc-per-node", 2]))
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == (1 if dry else 2) and "Traceback" not in result.stderr, \
        result.stderr[-3000:]
    assert any(message in line for line in errors), errors
