"""Runs that are stopped and started again: SIGTERM to `pyplan run` (what SLURM and Kubernetes
send before they preempt) saves and exits 75; a second signal to the ranks exits at once and
leaves the checkpoints intact; the same command line (`--steps N --resume auto`) then continues
to exactly the losses of an uninterrupted run, its log holding each step once. A NaN batch is
skipped and logged; three in a row stop the run naming the step and the stage. Every new
flag's bad value is one line, exit 2."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_checkpoints import UNITS, launch, one_rank, solved  # noqa: F401

PYPLAN = str(Path(sys.executable).with_name("pyplan"))
TWO = [["0"], ["1", "2", "3", "4", "5"]]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _logged(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _wait_for_step(path: Path, step: int, process, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(r.get("step", 0) >= step and "loss" in r for r in _logged(path)):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.torchrun
@pytest.mark.parametrize("saving", [(), ("--async-save",)], ids=["sync", "async"])
def test_sigterm_saves_and_the_same_command_continues_exactly(tmp_path, saving):
    """(--async-save: the stop's save is waited for before the exit, so it is there.)"""
    solved(tmp_path, "two", TWO)
    command = [PYPLAN, "run", "two.resolved.yaml", "--nproc-per-node", "2", "--device", "cpu",
               "--optimizer", "adamw", "--steps", "6"]
    full = subprocess.run(command + ["--log", "full.jsonl"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert full.returncode == 0, full.stderr
    restartable = command + ["--save", "ck", "--save-every", "1", "--resume", "auto",
                             "--log", "log.jsonl", *saving]
    slow = {**os.environ, "LONGRUN_SLOW_FROM": "1"}  # a second per batch from batch 1 on

    # SIGTERM to the launcher in step 3: it passes it on; the ranks finish the step, save
    # and exit 75.
    with subprocess.Popen(restartable, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=slow) as process:
        _wait_for_step(tmp_path / "log.jsonl", 2, process)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    assert process.returncode == 75, err
    stopped = [x for x in out.splitlines() if "stopped after step" in x]
    assert len(stopped) == 1 and "got SIGTERM; saved ck/step-0000000" in stopped[0], out
    at = int(stopped[0].split("stopped after step ")[1].split()[0])
    assert at >= 3 and (tmp_path / "ck" / f"step-{at:08d}").is_dir()

    # Two signals to every rank (SLURM signals each process): they exit at once, without a
    # save; the checkpoints before stay intact.
    with subprocess.Popen(restartable, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=slow) as process:
        _wait_for_step(tmp_path / "log.jsonl", at + 1, process)
        ranks = [w for server in _children(process.pid) for w in _children(server)]
        assert len(ranks) == 2, ranks
        for sent in range(2):
            for rank in ranks:
                os.kill(rank, signal.SIGTERM)
            time.sleep(0.05)
        started = time.monotonic()
        out, err = process.communicate(timeout=120)
    assert process.returncode != 0 and time.monotonic() - started < 30
    assert "stopped at once by a second SIGTERM (the checkpoints saved before are intact)" \
        in err, err

    # The same command again, to the end: exactly the uninterrupted run's losses, each step
    # logged once.
    done = subprocess.run(restartable, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "resumed from ck/step-0000000" in done.stdout
    steps = [r for r in _logged(tmp_path / "log.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in steps] == [r["loss"] for r in _logged(tmp_path / "full.jsonl")]
    # Started again at the end: nothing left to do.
    again = subprocess.run(restartable, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and "nothing left to train" in again.stdout, again.stderr


@pytest.mark.torchrun
def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path):
    solved(tmp_path, "two", TWO)
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--iterations", 4, "--log",
                            "nan.jsonl", env={"LONGRUN_NAN_AT": "1"})
    assert code == 0, err
    steps = _logged(tmp_path / "nan.jsonl")
    assert [r.get("skipped") for r in steps] == [
        None, "a non-finite gradient on rank 0 (stage0)", None, None]
    assert all(r["loss"] == r["loss"] for r in (steps[0], *steps[2:]))  # finite after it
    # The skipped step's norm is not finite (the log has no NaN: null); the others' are.
    assert steps[1]["grad_norm"] is None and all(r["grad_norm"] > 0 for r in steps[2:])
    assert "SKIPPED: a non-finite gradient on rank 0 (stage0)" in out
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--iterations", 6,
                            "--save", "ck", "--save-every", "1", env={"LONGRUN_NAN_AT": "1,2,3"})
    assert code == 1
    assert any(e.endswith("step 4: a non-finite gradient on rank 0 (stage0), 3 steps in a row "
                          "(--max-bad-steps); the run stops (hint: lower --lr, clip with "
                          "--clip-grad-norm, or look at the data of those steps)")
               for e in err), err
    assert sorted(p.name for p in (tmp_path / "ck").iterdir())[-1] == "step-00000003"


def test_every_new_flag_refuses_bad_values_in_one_line(one_rank, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    one = solved(tmp_path, "one", [UNITS])
    for args, message in [
            (("--max-time", "soon"), "--max-time 'soon' is not a duration of at most"),
            (("--max-time", "0"), "--max-time '0' is not a duration of at most"),
            (("--steps", "0"), "--steps '0' is not a whole number from 1 to"),
            (("--check-steps", "0"), "--check-steps '0' is not a whole number from 1 to"),
            (("--max-bad-steps", "0"), "--max-bad-steps '0' is not a whole number from 1"),
            (("--steps", "3", "--iterations", "2"), "--iterations and --steps both say"),
            (("--resume", "auto"), "--resume auto resumes from --save's folder"),
            (("--perturb", "x"), "--perturb 'x' is not RANK:PARAMETER")]:
        code, out, err = one_rank("run", one, *args)
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: " + message), \
            (args, err)
    # --config: run's options in YAML, the command line's winning; errors at FILE:LINE:COL.
    Path("c.yaml").write_text("optimizer: adamw\nlr: 0.002\nclip-grad-norm: 1.0\n")
    code, out, err = one_rank("run", one, "--config", "c.yaml", "--lr", 0.003, "--save", "cc")
    assert code == 0, err
    assert "adamw lr 0.003, clip 1" in out.splitlines()[0]
    record = json.loads(Path("cc/step-00000001/pyplan.json").read_text())
    assert record["config"] == {"file": "c.yaml", "options": {
        "optimizer": "adamw", "lr": 0.002, "clip-grad-norm": 1.0}}
    for text, message in [
            ("lr: x\n", "c.yaml:1:5: error: --config: lr: 'x' is not a number"),
            ("lr: 1\nclip-gard-norm: 2\n", "c.yaml:2:1: error: --config: 'clip-gard-norm' is "
             "not an option of pyplan run (hint: did you mean 'clip-grad-norm'?)"),
            ("check: 3\n", "c.yaml:1:8: error: --config: check is a flag: true or false"),
            ("dtype: fp64\n", "c.yaml:1:8: error: --config: dtype: 'fp64' is not one of"),
            ("- lr\n", "c.yaml:1:1: error: a --config file is a mapping of run's options")]:
        Path("c.yaml").write_text(text)
        code, out, err = one_rank("run", one, "--config", "c.yaml")
        assert code == 2 and err.count("\n") == 1 and err.startswith(message), (text, err)
    # An evaluation over the whole eval split (3 batches, the last smaller), weighted by its
    # samples, as the single-process run computes it.
    code, out, err = one_rank("run", one, "--eval-every", 1, "--eval-batches", "all",
                              "--check", "--check-steps", 1)
    assert code == 0, err
    assert re.search(r"  eval after step 1: loss [0-9.]+ \(3 batches\)", out), out
    assert "; 1 evaluations match" in out
    code, out, err = one_rank("run", one, "--eval-batches", "some")
    assert code == 2 and err.startswith("error: --eval-batches 'some' is not a whole number")
    # --resume auto with an empty --save starts afresh; the checkpoint it saves is resumed.
    code, out, err = one_rank("run", one, "--steps", 2, "--save", "ck", "--resume", "auto",
                              "--json")
    assert code == 0, err
    code, out, err = one_rank("run", one, "--steps", 3, "--save", "ck", "--resume", "auto",
                              "--json")
    assert code == 0 and json.loads(out.splitlines()[-1])["first_iteration"] == 2, err


def test_mfu_has_a_peak_only_for_known_gpus_in_bf16_and_fp16(monkeypatch):
    from pyplan.runtime import torch
    from pyplan.train.flops import peak_flops

    cuda = torch.device("cuda", 0)
    for name, dtype, peak in [("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
                              ("NVIDIA H100 PCIe", "fp16", 756e12),
                              ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
                              ("NVIDIA A100-SXM4-80GB", "fp32", None),
                              ("NVIDIA GeForce RTX 4090", "bf16", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, n=name: n)
        assert peak_flops(cuda, dtype) == peak, (name, dtype)
    assert peak_flops(torch.device("cpu"), "bf16") is None
