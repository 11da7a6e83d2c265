"""`pyplan run` before anything runs: stale and model-less plans, launching outside torchrun,
--dry-run, and the commands that must work without torch."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import PLANS

VSHAPE = PLANS / "transformer-vshape.resolved.yaml"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def outside_torchrun(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)


def test_stale_plan_is_refused(cli, tmp_path, outside_torchrun):
    for name in ("transformer-vshape.yaml", "transformer-vshape.resolved.yaml"):
        shutil.copy(PLANS / name, tmp_path / name)
    plan = tmp_path / "transformer-vshape.yaml"
    plan.write_text(plan.read_text().replace("micro_batches: 8", "micro_batches: 16"))
    code, out, err = cli("run", tmp_path / "transformer-vshape.resolved.yaml")
    assert (code, out) == (2, "")
    assert err == (f"{tmp_path}/transformer-vshape.resolved.yaml:1:1: error: stale: {plan} "
                   "changed since this plan was resolved (hint: re-run pyplan solve "
                   f"{plan})\n")


def test_outside_torchrun_says_how_to_launch(cli, outside_torchrun):
    code, out, err = cli("run", VSHAPE)
    assert (code, out) == (1, "")
    assert err == ("error: pyplan run runs one process per device under torchrun (hint: "
                   f"launch it with: pyplan run {VSHAPE} --nproc-per-node 4)\n")


@pytest.fixture
def no_workers(monkeypatch):
    """pyplan run's launcher, made to fail the test if it starts any worker."""
    from pyplan.cli import run

    def launch(*_):
        raise AssertionError("workers started")
    monkeypatch.setattr(run, "launch", launch)


@pytest.mark.parametrize("options, message", [
    (["--nproc-per-node", "3"], "the plan needs 4 processes (devices: 4), --nproc-per-node 3 "
                                "starts 3"),
    (["--nproc-per-node", "1", "--nnodes", "2"], "the plan needs 4 processes (devices: 4), "
                                                 "--nproc-per-node 1 on 2 machines starts 2"),
    (["--nproc-per-node", "2", "--nnodes", "two"], "--nnodes 'two' is not a number of machines"),
    (["--nproc-per-node", "0"], "--nproc-per-node '0' is not a whole number from 1 to "
                                "4,096")])
def test_a_launch_that_cannot_run_the_plan_is_refused_before_workers_start(
        options, message, cli, outside_torchrun, no_workers):
    code, out, err = cli("run", VSHAPE, *options)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_eval_every_on_data_without_an_eval_split_is_refused_before_workers_start(
        cli, outside_torchrun, no_workers):
    pytest.importorskip("torch")
    code, out, err = cli("run", VSHAPE, "--nproc-per-node", "4", "--eval-every", "1")
    assert (code, out) == (2, "")
    assert "error: --eval-every: pyplan.examples.transformer:batch takes no split argument" \
        in err and err.count("\n") == 1


def test_python_dash_m_outside_torchrun_does_not_crash(outside_torchrun, tmp_path):
    # (run outside the source tree, which would shadow an installed, compiled pyplan)
    result = subprocess.run([sys.executable, "-m", "pyplan", "run", str(VSHAPE)],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert f"pyplan run {VSHAPE} --nproc-per-node 4" in result.stderr


def test_plan_without_model_is_refused(cli, outside_torchrun):
    code, _, err = cli("run", PLANS / "tessel-vshape.resolved.yaml")
    assert code == 2
    assert err == (f"{PLANS}/tessel-vshape.yaml:1:1: error: the plan has no model: section, so "
                   "there is nothing to run (hint: add model: {blocks: ..., data: ..., loss: "
                   "...} and re-run pyplan solve)\n")


def test_dry_run_prints_verified_programs(cli, outside_torchrun):
    code, out, err = cli("run", PLANS / "gpt-mshape-blocks.resolved.yaml", "--dry-run")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == ("gpt-mshape-blocks: 96 block instances on 4 ranks; verified: no "
                        "send/recv pair can cross or block forever, and every collective is reached by all "
                        "its ranks in the same order (non-blocking communication)")
    assert "rank 0: 98 instructions (48 compute, 16 send, 16 recv, 16 wait)" in lines
    assert "     0 compute embed@0 on ranks 0-3" in lines
    assert "     9 wait for stage3@0 output from rank 3 before head@0" in lines


def test_dry_run_verifies_every_replica_and_its_gradient_syncs(cli, outside_torchrun):
    code, out, err = cli("run", PLANS / "transformer-vshape-dp2.resolved.yaml", "--dry-run")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    # Ranks run pipeline-major: device 1's replicas are ranks 2 and 3.
    assert lines[0].startswith("transformer-vshape-dp2: 16 block instances on 2 devices x 2 "
                               "replicas (4 ranks); verified:")
    assert "rank 3: 21 instructions (8 compute, 4 send, 4 recv, 4 wait, 1 sync)" in lines
    assert lines[lines.index("rank 3: 21 instructions (8 compute, 4 send, 4 recv, 4 wait, "
                             "1 sync)") + 20:][:2] == [
        "    19 send gradient stage1.b->stage0.b@3 of rank 3 to rank 1",
        "    20 sync stage1 gradients across replicas on ranks 2,3"]
    assert "     5 send gradient stage1.b->stage0.b@0 of rank 3 to rank 1" in lines


def test_dry_run_builds_the_model_and_names_a_broken_block(cli, outside_torchrun, tmp_path):
    pytest.importorskip("torch")
    code, out, _ = cli("run", PLANS / "gpt-mshape-blocks.resolved.yaml", "--dry-run")
    assert code == 0 and out.splitlines()[-1].startswith(
        "model: pyplan.examples.gpt:build built all 6 declared blocks")
    # The same placement written by pyplan partition: the whole model, its vocabulary
    # modules checked against the blocks that shard them.
    code, out, _ = cli("run", PLANS / "gpt-mshape.resolved.yaml", "--dry-run")
    assert code == 0 and out.splitlines()[-1].startswith(
        "model: pyplan.examples.gpt:model built all 6 declared blocks")
    # A model module beside the plan (found through the plan's folder) whose build cannot
    # make one of the blocks: the dry run says which, before any process starts.
    (tmp_path / "tiny.py").write_text(
        "import torch\n"
        "def build(name, group):\n"
        "    return {'a': torch.nn.Linear(4, 4)}[name]\n"
        "def batch(step):\n    return torch.ones(4, 4), torch.ones(4, 4)\n"
        "def loss(out, target):\n    return ((out - target) ** 2).mean()\n")
    plan = tmp_path / "tiny.yaml"
    plan.write_text("pyplan: 1\nname: tiny\ndevices: 2\nmicro_batches: 2\n"
                    "training: {backward: {time_ratio: 2}}\n"
                    "blocks:\n  - {name: a, devices: [0], time: 1, memory: 1}\n"
                    "  - {name: b, devices: [1], time: 1, memory: 1}\n"
                    "model: {blocks: 'tiny:build', data: 'tiny:batch', loss: 'tiny:loss'}\n")
    assert cli("solve", plan, "--quiet")[0] == 0
    code, out, err = cli("run", tmp_path / "tiny.resolved.yaml", "--dry-run")
    assert code == 2
    # The user's code failed: one line at the plan's line that names the function.
    assert err == (f"{plan}:9:17: error: model.blocks (tiny:build) raised KeyError: 'b' "
                   "building block 'b' (hint: build(block_name, group) must return an "
                   "nn.Module for every declared block)\n")


@pytest.mark.parametrize("value", ["2", "a:1", "1:2:explode"])
def test_bad_fail_at_is_refused(cli, value):
    code, _, err = cli("run", VSHAPE, "--fail-at", value)
    assert code == 2 and f"--fail-at '{value}' is not RANK:INDEX or RANK:INDEX:kill" in err


@pytest.mark.slow
def test_commands_work_without_torch(tmp_path):
    # torch set to None in sys.modules makes every `import torch` fail, as if uninstalled.
    plan, out = PLANS / "transformer-vshape.yaml", tmp_path / "v.resolved.yaml"
    script = f"""
import os, sys
sys.modules["torch"] = None
from pyplan.cli import main
assert main(["validate", {str(plan)!r}]) == 0
assert main(["solve", {str(plan)!r}, "-o", {str(out)!r}, "--quiet"]) == 0
assert main(["run", {str(out)!r}, "--dry-run"]) == 0
assert main(["profile", {str(plan)!r}]) == 1
assert main(["run", {str(out)!r}, "--nproc-per-node", "4"]) == 1
os.environ.update(RANK="0", WORLD_SIZE="4")
assert main(["run", {str(out)!r}]) == 1
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    hint = "(hint: install a pinned torch: pip install \"torch==2.13.0\" \".[run]\")"
    assert result.stderr.splitlines() == [
        f"error: pyplan {command} needs torch (import of torch halted; None in sys.modules) "
        f"{hint}" for command in ("profile", "run", "run")]


def test_the_clis_choices_are_the_runtimes():
    pytest.importorskip("torch")
    from pyplan.cli import run
    from pyplan.comm.devices import DEVICES
    from pyplan.run.pipeline import DTYPES, PARAMS
    from pyplan.train.training import OPTIMIZERS, SCHEDULES

    assert (run.DEVICES, run.DTYPES, run.OPTIMIZERS, run.SCHEDULES, run.PARAMS) == \
        (DEVICES, tuple(DTYPES), OPTIMIZERS, SCHEDULES, PARAMS)
    from pyplan.train.faults import TIMEOUT
    from pyplan.train.report import Options
    assert run.FAULT_TIMEOUT == TIMEOUT == Options.fault_timeout


def test_the_clis_torch_free_copies_are_the_runtimes():
    """What the CLI spells again so that it parses without torch: the time limit of a
    measurement (profile, partition) and the name of a checkpoint's record (the output checks)."""
    pytest.importorskip("torch")
    from pyplan.cli import profile
    from pyplan.options import outputs as _outputs
    from pyplan.measure.limits import DEFAULT_SECONDS
    from pyplan.train.checkpoint import META

    assert (profile.TIME_LIMIT, _outputs.META) == (DEFAULT_SECONDS, META)
