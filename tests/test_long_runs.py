"""Training runs that last: a line per step on a pipe and in `--log FILE` as each step ends;
learning-rate schedules, gradient accumulation, evaluation on the data's eval split and
clipping over a rank that holds no parameter, checked against the single-process run; a resume
with changed settings applies them, says so, and --check replays that history; docs/training-loop.md's
own loop saves and resumes through pyplan.runtime.save/load exactly; eval_step on a batch of
another size. (The torchtitan export is tested with torchtitan's own code in test_clients.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_checkpoints import THREE, UNITS, alone, launch, one_rank, report, solved  # noqa: F401

from pyplan.runtime import torch
from warm_torchrun import torchrun

ROOT = Path(__file__).resolve().parent.parent
PYPLAN = str(Path(sys.executable).with_name("pyplan"))


@pytest.mark.torchrun
def test_lines_as_they_happen_schedules_accumulation_evaluation_and_resume(tmp_path):
    solved(tmp_path, "three", THREE)
    command = [PYPLAN, "run", "three.resolved.yaml", "--nproc-per-node", "3", "--device", "cpu",
               "--optimizer", "adamw", "--iterations", "4", "--accumulate", "2",
               "--lr-schedule", "cosine", "--lr-warmup", "1", "--lr-min", "0.001",
               "--clip-grad-norm", "0.5", "--eval-every", "2", "--eval-batches", "2",
               "--check", "--save", "ck", "--log", "log.jsonl"]
    # Batches 4 and later take a second each: steps 2 and 3 are slow.
    with subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "LONGRUN_SLOW_FROM": "4"}) as process:
        arrivals, logged = [], None
        for line in process.stdout:
            arrivals.append((time.monotonic(), line.rstrip("\n")))
            if line.startswith("  step 2:"):
                logged = (tmp_path / "log.jsonl").read_text().splitlines()
        err = process.stderr.read()
        assert process.wait(timeout=300) == 0, err
    lines = [text for _, text in arrivals]
    first = next(t for t, text in arrivals if text.startswith("  step 1:"))
    last = next(t for t, text in arrivals if text.startswith("  step 4:"))
    assert last - first > 2.0, arrivals  # printed as it happened, not at the end
    assert [json.loads(x)["step"] for x in logged] == [1, 2]  # the log too
    assert lines[0].startswith("three: 4 steps on 3 ranks (cpu, gloo, fp32)") and \
        lines[0].endswith("adamw lr 0.01, clip 0.5, warmup 1, cosine decay to 0.001, 2 batches "
                          "per step")
    assert any(re.fullmatch(r"  eval after step 2: loss [0-9.]+ \(2 batches\)", x) for x in lines)
    check = next(x for x in lines if x.startswith("  check:"))
    assert re.search(r"3 steps: the loss, the gradients and the updated values of \d+ "
                     r"parameters .* the losses of all 4 steps differ by at most [-+0-9.e]+ .*; "
                     r"2 evaluations match", check), check
    records = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    # the warm-up, then the cosine decay (torch's schedulers), and the norm before clipping
    assert steps[0]["lr"] == pytest.approx(0.005) and steps[1]["lr"] == pytest.approx(0.01)
    assert steps[1]["lr"] > steps[2]["lr"] > steps[3]["lr"] > 0.001
    assert all(r["grad_norm"] > 0 and r["samples_per_second"] > 0 for r in steps)

    # Resumed with another lr and schedule: applied, said, and --check replays the history
    # (the single-process run switches at step 4 exactly as the resumed run does).
    code, out, err = launch(tmp_path, "three.resolved.yaml", 3, "--iterations", 2,
                            "--accumulate", 2, "--lr", 0.003, "--lr-schedule", "linear",
                            "--clip-grad-norm", 0.5, "--resume", "ck", "--check", "--json")
    assert code == 0, err
    result = report(out)
    assert result["check"]["ok"], result["check"]
    assert result["first_iteration"] == 4
    assert result["resumed"]["changed"] == [
        "lr 0.003 (was 0.01 in the checkpoint)", "lr warmup 0 (was 1 in the checkpoint)",
        "lr schedule linear (was cosine in the checkpoint)",
        "lr min 0 (was 0.001 in the checkpoint)",
        "schedule length (steps) 6 (was 4 in the checkpoint)"]


def _readme_resume_loop() -> str:
    text = (ROOT / "docs" / "training-loop.md").read_text()
    found = re.search(r"```python\n(# resume\.py.*?)```", text, re.S)
    assert found, "the loop with save and load in docs/training-loop.md"
    return found.group(1)


@pytest.mark.torchrun
def test_the_readmes_loop_saves_and_resumes_exactly(tmp_path):
    (tmp_path / "resume.py").write_text(_readme_resume_loop())
    for name in ("transformer-vshape.yaml", "transformer-vshape.resolved.yaml"):
        (tmp_path / name).write_text((ROOT / "plans" / name).read_text())

    def losses(*args) -> dict[int, str]:
        result = torchrun("resume.py", "transformer-vshape.resolved.yaml", "ck", *args,
                          nproc=4, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        return {int(s): v for s, v in re.findall(r"step (\d+) loss ([0-9.]+)", result.stdout)}

    whole = losses("6")
    assert sorted(whole) == list(range(6))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000004",
                                                                   "step-00000006"]
    assert losses("6", "ck/step-00000004") == {4: whole[4], 5: whole[5]}


def test_evaluation_of_another_batch_size_and_what_is_refused(one_rank, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    one = solved(tmp_path, "one", [UNITS])
    bare = solved(tmp_path, "bare", [UNITS], data="longrun:train_only")
    code, out, err = one_rank("run", bare, "--eval-every", 1)
    assert code == 2 and err.count("\n") == 1
    assert "error: --eval-every: longrun:train_only takes no split argument (hint: define it as "\
        "batch(step, split='train')" in err
    code, out, err = one_rank("run", one, "--log", one)
    assert code == 2 and "refusing to write over" in err
    try:
        from torch.utils import tensorboard  # noqa: F401
    except ImportError:
        code, out, err = one_rank("run", one, "--tensorboard", "tb")
        assert (code, err) == (2, "error: --tensorboard needs the tensorboard package, which "
                               "is not installed (hint: pip install tensorboard, or log JSON "
                               "lines with --log FILE)\n")
    else:
        code, out, err = one_rank("run", one, "--tensorboard", "tb", "--iterations", 2)
        assert code == 0, err
        assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())

    # eval_step on batches of 6 and 1 samples (the plan splits 16 into 4 micro-batches): 3 and
    # 1 micro-batches; the loss and the outputs are the whole model's.
    import longrun
    from pyplan.runtime import CheckpointError, Pipeline, load, save
    from pyplan.run.binding import build_whole

    alone(monkeypatch)
    pipe = Pipeline(str(one), device="cpu")
    try:
        whole = build_whole(pipe.model, 0).eval()
        pipe.eval()
        for size in (6, 1):
            inputs = torch.randn(size, 8)
            targets = torch.randn(size, 4)
            with torch.no_grad():
                expected = whole(inputs)
            assert torch.allclose(pipe.eval_step(inputs), expected, atol=1e-6)
            assert float(pipe.eval_step(inputs, targets)) == pytest.approx(
                float(longrun.loss(expected, targets)), abs=1e-6)
        assert sorted(pipe._evaluators) == [1, 3]
        # The API's save/load: the record, the optimizer's class checked before any tensor.
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        pipe.train()
        inputs, targets = longrun.batch(0)
        pipe.step(inputs, targets)
        optimizer.step()
        folder = save(tmp_path / "api", pipe, optimizer, step=1, meta={"note": "mine"})
        assert folder == tmp_path / "api" / "step-00000001"
        with pytest.raises(CheckpointError, match=r"holds AdamW's state, and this run's "
                                                  r"optimizer is SGD"):
            load(tmp_path / "api", pipe, torch.optim.SGD(pipe.parameters(), lr=0.1))
        saved = {k: v.clone() for k, v in pipe.state_dict()["model"].items()}
        with torch.no_grad():
            for p in pipe.parameters():
                p.zero_()
        record = load(tmp_path / "api", pipe, torch.optim.AdamW(pipe.parameters()))
        assert (record["step"], record["note"], record["iterations"]) == (1, "mine", 1)
        assert all(torch.equal(v, saved[k]) for k, v in pipe.state_dict()["model"].items())
    finally:
        pipe.close()
