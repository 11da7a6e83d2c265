"""`pyplan run` executing plans: every example's loss and gradients equal single-process
training after one iteration and its losses after five (Pfeife's protocol), with 4 gloo
processes started by `pyplan run --nproc-per-node` (also as two 2-process "nodes") and under
torchrun; the zero-bubble split in-process; faults end every rank with a message naming the
failing rank and instruction."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import PLANS
from pyplan.cli import main
from pyplan.export.chrome import schedule_events
from pyplan.resolved import load_resolved

from pyplan.errors import PlanError
from pyplan.runtime import torch  # imports torch without its numpy warning
from pyplan.run.data import split_batch
from pyplan.train.check import compare


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Processes start outside the source tree, which would shadow an installed (compiled) pyplan
# (but for the tests that start them from the root on purpose).
NEUTRAL = tempfile.gettempdir()
ROOT = PLANS.parent
PYPLAN = str(Path(sys.executable).with_name("pyplan"))  # the installed console script


# A rank that fails must not leave the others waiting in a collective for its timeout (600 s):
# every rank ends well within FAULT_BOUND seconds, loaded machine or not.
FAULT_BOUND = 300
FAULT_TIMEOUT = 400


def _launch(*args, nproc=4, cwd=NEUTRAL, timeout=300):
    """`pyplan run ARGS --nproc-per-node NPROC`: (the finished process, its wall seconds)."""
    started = time.monotonic()
    result = subprocess.run([PYPLAN, "run", *map(str, args), "--nproc-per-node", str(nproc)],
                            capture_output=True, text=True, timeout=timeout, cwd=cwd)
    return result, time.monotonic() - started


def _check_line(out: str, iterations: int) -> None:
    checked = min(iterations, 3)
    assert re.search(rf"check: {checked} steps: the loss, the gradients and the updated values "
                     r"of \d+ parameters \(worst: .*, relative error [-+0-9.e]+\) match the "
                     r"single-process run's", out), out
    assert len(re.findall(r"step \d+: +[0-9.]+ ms  loss \d", out)) == iterations


# ---------------------------------------------------------------- in this process

def test_compare_names_the_worst_parameter_of_the_first_step_that_differs():
    t = torch.tensor
    ref = {"a.w": t([1.0, 2.0]), "b.w": t([3.0])}
    good = {("a.w", "s0"): t([1.0, 2.0]), ("b.w", "s1"): t([3.0])}

    def steps(*grads):
        return [{"gradients": g, "values": good} for g in grads]

    ref_steps = [{"gradients": ref, "values": ref}] * 2
    assert compare([1.0, 0.5], steps(good, good), [1.0, 0.5], ref_steps, 1e-5).ok
    # Relative errors: 0.1 / 3 in b.w beats 0.01 / 2.24 in a.w; named at its step (1-based).
    worse = {("a.w", "s0"): t([1.0, 2.01]), ("b.w", "s1"): t([3.1])}
    verdict = compare([1.0, 0.5], steps(good, worse), [1.0, 0.5], ref_steps, 1e-5,
                      first_step=4)
    assert not verdict.ok
    assert verdict.message.startswith("at step 6 the gradient of b.w differs from the "
                                      "single-process run's: relative error 0.0333 (tolerance "
                                      "1e-05; the worst of 2 parameters)"), verdict.message
    # A tied parameter: each copy is compared, and a wrong one is named with its block.
    tied = {**good, ("b.w", "s3"): t([2.0])}
    verdict = compare([1.0, 0.5], steps(tied, good), [1.0, 0.5], ref_steps, 1e-5)
    assert verdict.message.startswith("at step 1 the gradient of b.w (the copy in block s3) "
                                      "differs")
    verdict = compare([1.0, 0.6], steps(good, good), [1.0, 0.5], ref_steps, 1e-5)
    assert verdict.message.startswith("the loss of step 2 is 0.6, the single-process "
                                      "run's 0.5")
    # Later steps' losses are reported, not judged; a missing parameter is named.
    verdict = compare([1.0, 0.6], steps(good), [1.0, 0.5], ref_steps[:1], 1e-5)
    assert verdict.ok and "the losses of all 2 steps differ by at most 2.0e-01" in \
        verdict.message
    assert "missing" in compare([1.0], steps({}), [1.0], ref_steps[:1], 1e-5).message
    # Buffers (batch norms' running statistics) after the step: a count is shown as counts.
    stats = {"bn.num_batches_tracked": t([4.0]), "bn.running_mean": t([0.5, 1.0])}
    theirs = [{"gradients": ref, "values": ref, "buffers": stats}]
    mine = [{"gradients": good, "values": good,
             "buffers": {(n, ""): v for n, v in stats.items()}}]
    assert "and so do 2 buffers" in compare([1.0], mine, [1.0], theirs, 1e-5).message
    mine[0]["buffers"][("bn.num_batches_tracked", "")] = t([8.0])
    assert compare([1.0], mine, [1.0], theirs, 1e-5).message.startswith(
        "at step 1 buffer bn.num_batches_tracked is 8, the single-process run's 4")
    mine[0]["buffers"][("bn.num_batches_tracked", "")] = t([4.0])
    mine[0]["buffers"][("bn.running_mean", "")] = t([0.5, 1.1])
    assert "buffer bn.running_mean differs from the single-process run's: relative error " \
        "0.0894" in compare([1.0], mine, [1.0], theirs, 1e-5).message


def test_batches_must_split_evenly():
    parts = split_batch({"x": torch.arange(8), "y": (torch.ones(8, 2),)}, 4)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(PlanError, match=r"shape \(6,\) does not split into 4 equal"):
        split_batch(torch.arange(6), 4)


ONE_DEVICE = """\
pyplan: 1
name: zb-one-device
devices: 1
micro_batches: 4
training:
  backward: {time_ratio: 1, weight_time_ratio: 1}
blocks:
  - {name: stage0, devices: [0], time: 1, memory: 1}
  - {name: stage1, devices: [0], time: 1, memory: 1}
  - {name: stage2, devices: [0], time: 1, memory: 1}
  - {name: stage3, devices: [0], time: 1, memory: 1}
model:
  blocks: pyplan.examples.transformer:build
  data: pyplan.examples.transformer:batch
  loss: LOSS
  path: .
"""

SUM_LOSS = """\
import torch.nn.functional as F


def loss(logits, targets):  # a sum, not a mean: micro-batching changes the loss
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum")
"""


@pytest.fixture
def one_process(monkeypatch):
    """torchrun's environment for a world of one process (use capfd, not capsys: torchrun's
    error recording needs real file descriptors)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))


def _one_device_plan(tmp_path, loss: str):
    (tmp_path / "sum_loss.py").write_text(SUM_LOSS)
    plan = tmp_path / "zb.yaml"
    plan.write_text(ONE_DEVICE.replace("LOSS", loss))
    assert main(["solve", str(plan), "--quiet"]) == 0
    return tmp_path / "zb.resolved.yaml"


def test_zero_bubble_split_matches_single_process_training(tmp_path, one_process, capfd):
    resolved = _one_device_plan(tmp_path, "pyplan.examples.transformer:loss")
    kinds = {b.kind for b in load_resolved(resolved).problem.blocks}
    assert kinds == {"forward", "backward", "weight"}
    assert main(["run", str(resolved), "--check", "--iterations", "3"]) == 0
    out, err = capfd.readouterr()
    assert err == ""
    _check_line(out, 3)


def test_check_fails_naming_the_loss_when_it_is_not_a_mean(tmp_path, one_process, capfd):
    resolved = _one_device_plan(tmp_path, "sum_loss:loss")
    assert main(["run", str(resolved), "--check"]) == 1
    out, err = capfd.readouterr()
    assert "check FAILED: the loss of step 1 is" in out
    assert err.startswith("error: check failed: the loss of step 1 is ")
    assert err.count("\n") == 1


# ---------------------------------------------------------------- several processes

@pytest.mark.torchrun
def test_gpt_mshape_under_torchrun_from_the_root_matches_single_process_training(tmp_path):
    # In the checkout, `pyplan/` is the source tree; the installed package must run anyway.
    resolved = "plans/gpt-mshape.resolved.yaml"
    trace = tmp_path / "run.json"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "4", "--no-python", PYPLAN, "run", resolved,
                             "--check", "--iterations", "5", "--trace", str(trace)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "non-blocking communication" in result.stdout
    assert "Traceback" not in result.stderr
    _check_line(result.stdout, 5)
    events = json.loads(trace.read_text())["traceEvents"]
    ran = {(e["tid"], e["name"]) for e in events
           if e.get("ph") == "X" and e["cat"] in ("forward", "backward")}
    schedule = load_resolved(ROOT / resolved).schedule
    planned = {(e.device, e.name) for e in schedule_events(schedule)}
    assert ran == planned
    assert {e["cat"] for e in events if e.get("ph") == "X"} >= {"send", "recv", "wait",
                                                               "reduce"}


@pytest.mark.torchrun
def test_pyplan_launches_its_workers_from_the_root_flava_with_blocking_communication():
    # In the checkout, `pyplan/` is the source tree: the workers (and the process they are
    # forked from) must import the installed package anyway.
    result, _ = _launch("plans/flava-kshape.resolved.yaml", "--check", "--iterations", "5",
                        "--blocking", cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on 4 ranks" in result.stdout and "blocking communication" in result.stdout
    assert "non-blocking" not in result.stdout
    _check_line(result.stdout, 5)
    assert "Traceback" not in result.stderr


@pytest.mark.torchrun
def test_transformer_vshape_on_two_nodes_matches_single_process_training():
    # pyplan run passes torchrun's multi-node options to torch's launcher.
    endpoint = f"localhost:{_free_port()}"
    command = [PYPLAN, "run", str(PLANS / "transformer-vshape.resolved.yaml"), "--check",
               "--iterations", "5", "--nproc-per-node", "2", "--nnodes", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    nodes = [subprocess.Popen(command + ["--node-rank", str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=NEUTRAL)
             for n in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:]
    _check_line(outputs[0][0], 5)  # global rank 0 runs on node 0
    assert outputs[1][0] == ""


@pytest.mark.torchrun
def test_a_raising_rank_stops_every_rank_with_its_instruction():
    # The failure is reported at once; the timeout only has to outlast a slow start-up on a
    # loaded machine (a rank not heard from within it is declared dead, another message).
    result, seconds = _launch(PLANS / "transformer-vshape.resolved.yaml", "--fail-at", "2:3",
                              "--fault-timeout", "15", timeout=FAULT_TIMEOUT)
    assert result.returncode != 0
    what = ("rank 2 failed at instruction 3 of iteration 0 (compute stage2@0): RuntimeError: "
            "injected fault (--fail-at)")
    assert f"\nerror: {what}\n" in result.stderr
    for rank in (0, 1, 3):
        assert f"\nerror: rank {rank} stops: {what}\n" in result.stderr
    assert seconds < FAULT_BOUND


@pytest.mark.torchrun
def test_a_dead_rank_stops_every_rank_within_the_timeout():
    result, seconds = _launch(PLANS / "transformer-vshape.resolved.yaml", "--fail-at",
                              "1:9:kill", "--iterations", "3", "--fault-timeout", "3",
                              timeout=FAULT_TIMEOUT)
    assert result.returncode != 0
    for rank in (0, 2, 3):
        assert re.search(rf"\nerror: rank {rank} stops: rank 1 died \(its process ended "
                         r"without a word: killed, or crashed\); last seen at (set-up|"
                         r"instruction \d+ of iteration 0 \(.*\))\n", result.stderr), \
            result.stderr[-3000:]
    assert seconds < FAULT_BOUND


@pytest.mark.torchrun
def test_sharded_data_parallel_replicas_match_single_process_training(tmp_path):
    # The dp2 plan with sharded gradients and parameters (reduce-scatter, gather); the plan as
    # it is (all-reduce) runs with --check in docs/meshes.md (tests/test_docs.py).
    text = (PLANS / "transformer-vshape-dp2.yaml").read_text()
    plan = tmp_path / "dp2-shard.yaml"
    plan.write_text(text.replace("mesh: {data: 2, sync: 3}",
                                 "mesh: {data: 2, sync: 3, shard: true}"))
    assert main(["solve", str(plan), "--quiet"]) == 0
    resolved = tmp_path / "dp2-shard.resolved.yaml"
    assert "mesh: {data: 2, shard: true, sync: 3}" in resolved.read_text()
    result, _ = _launch(resolved, "--check", "--iterations", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on 4 ranks" in result.stdout
    _check_line(result.stdout, 3)


@pytest.mark.torchrun
def test_a_dead_rank_in_one_replica_stops_every_rank():
    result, seconds = _launch(PLANS / "transformer-vshape-dp2.resolved.yaml", "--fail-at",
                              "3:6:kill", "--iterations", "3", "--fault-timeout", "3",
                              timeout=FAULT_TIMEOUT)
    assert result.returncode != 0
    for rank in (0, 1, 2):
        assert re.search(rf"\nerror: rank {rank} stops: rank 3 died \(its process ended",
                         result.stderr), result.stderr[-3000:]
    assert seconds < FAULT_BOUND


@pytest.mark.torchrun
def test_world_size_must_match_the_plan():
    result, _ = _launch(PLANS / "transformer-vshape.resolved.yaml", nproc=2)
    assert result.returncode != 0
    assert ("error: the plan needs 4 processes (devices: 4), --nproc-per-node 2 starts 2 (hint: "
            f"launch it with: pyplan run {PLANS / 'transformer-vshape.resolved.yaml'} "
            "--nproc-per-node 4)\n") in result.stderr
