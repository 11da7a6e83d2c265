"""`pyplan run`'s GPU flags, shown on 2 gloo CPU ranks: --compile BACKEND (torch.compile per
block; aot_eager here: dynamo's capture and AOTAutograd's joint forward/backward graph, as
inductor has, without inductor's C++ build, which took 17 s for one small graph here),
--params bf16 (bf16 parameters, fp32 masters), each checked against the single-process run
(--check), shown in the header and --json, recorded in the checkpoint; --profile DIR (a
torch.profiler Chrome trace per rank and chosen step); --async-save (checkpoints written
while training goes on, as complete and checked as the synchronous ones); and their bad
combinations refused before any worker starts."""

from __future__ import annotations

import json
import os
import statistics
import subprocess

import pytest

from test_checkpoints import PYPLAN, launch, listing, report, solved
from test_run_cli import VSHAPE, no_workers, outside_torchrun  # noqa: F401  (fixtures)

TWO = [["0", "1", "2"], ["3", "4", "5"]]


@pytest.mark.parametrize("options, message", [
    (["--params", "bf16"], "--params bf16 computes in bf16, and --dtype is fp32 (hint: add "
                           "--dtype bf16, or leave --params out)"),
    (["--params", "bf16", "--dtype", "fp16"], "--params bf16 computes in bf16, and --dtype is "
                                              "fp16"),
    (["--compile", "inductr"], "--compile 'inductr' is not a torch.compile backend (hint: did "
                               "you mean 'inductor'?)"),
    (["--profile-steps", "2"], "--profile-steps does nothing without --profile DIR (hint: "
                               "give --profile, or leave --profile-steps out)"),
    (["--profile", "p", "--profile-steps", "1,9", "--iterations", "3"],
     "--profile-steps: step 9 is never profiled: the run ends at step 3 (hint: give steps up "
     "to 3, or train longer)"),
    (["--profile", "p", "--profile-steps", "2,x"], "--profile-steps '2,x' is not whole numbers "
                                                   "from 1 to 1,000,000,000, separated by "
                                                   "commas"),
    (["--profile", str(VSHAPE)], f"--profile {VSHAPE}: exists and is not a folder"),
    (["--async-save"], "--async-save does nothing without --save DIR (hint: give --save, or "
                       "leave --async-save out)"),
])
def test_bad_combinations_are_refused_before_workers_start(options, message, cli,
                                                           outside_torchrun, no_workers):
    if "--compile" in options:
        pytest.importorskip("torch")
    code, out, err = cli("run", VSHAPE, "--nproc-per-node", "4", *options)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_params_takes_fp32_or_bf16(cli, outside_torchrun, no_workers):
    code, out, err = cli("run", VSHAPE, "--nproc-per-node", "4", "--params", "fp16")
    assert (code, out) == (2, "")
    assert err == ("error: argument --params: invalid choice: 'fp16' (choose from 'fp32', "
                   "'bf16') (hint: pyplan run --help)\n")


def _split(folder) -> None:
    """two.resolved.yaml with a split backward (zero bubble's B and W)."""
    plan = (folder / "two.yaml").read_text()
    (folder / "two.yaml").write_text(plan.replace("time_ratio: 2}", "time_ratio: 2, "
                                                  "weight_time_ratio: 1}"))
    assert "weight_time_ratio" in (folder / "two.yaml").read_text()
    result = subprocess.run([PYPLAN, "solve", "two.yaml", "--quiet"], cwd=folder,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.torchrun
@pytest.mark.parametrize("split", [False, True], ids=["1f1b", "split-backward"])
def test_compiled_blocks_pass_the_check(tmp_path, split):
    """Step 2, the census's, runs eagerly (the FLOP counter and the census are dispatch
    modes, under which torch.compile would give the blocks up for good); steps 1, 3 and 4 run
    the compiled graphs, which --check compares with the eager single-process run at fp32's
    tolerance, under a split backward too (each compiled region's backward runs once, in B)."""
    solved(tmp_path, "two", TWO)
    if split:
        _split(tmp_path)
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--compile", "aot_eager",
                            "--iterations", 4, "--check", "--check-steps", 4, "--json")
    assert code == 0, err
    result = report(out)
    assert result["check"]["ok"] and "tolerance 1e-05" in result["check"]["message"], result
    assert result["compile"] == "aot_eager" and result["params"] == "fp32"
    assert [r["compiled_graphs"] for r in result["rank_memory"]] == [1, 1]
    assert result["census_iteration"] == 1
    assert result["median_seconds"] == statistics.median(result["iteration_seconds"][2:])


@pytest.mark.torchrun
def test_bf16_parameters_pass_the_check_and_are_recorded(tmp_path):
    solved(tmp_path, "two", TWO)
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--params", "bf16", "--dtype",
                            "bf16", "--iterations", 3, "--check", "--save", "ck", "--json")
    assert code == 0, err
    result = report(out)
    assert result["check"]["ok"] and "tolerance 0.02" in result["check"]["message"], result
    assert (result["params"], result["dtype"], result["compile"]) == ("bf16", "bf16", None)
    record = json.loads((tmp_path / "ck" / "step-00000003" / "pyplan.json").read_text())
    assert {k: record["training"][k] for k in ("dtype", "params", "compile")} == \
        {"dtype": "bf16", "params": "bf16", "compile": None}
    # The checkpoint holds the fp32 masters: fp32 parameters continue from it, and say so.
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--dtype", "bf16", "--resume",
                            "ck", "--iterations", 1)
    assert code == 0, err
    assert "two: 1 step on 2 ranks (cpu, gloo, bf16), " in out
    assert "; changed: params fp32 (was bf16 in the checkpoint)" in out, out


@pytest.mark.torchrun
def test_profile_writes_a_chrome_trace_per_rank_and_step_with_the_blocks(tmp_path):
    solved(tmp_path, "two", TWO)
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--iterations", 3, "--profile",
                            "prof", "--profile-steps", "1,3", "--json", "--save", "ck")
    assert code == 0, err
    report(out)  # (the profiler's own lines leave stdout's JSON whole)
    names = sorted(os.listdir(tmp_path / "prof"))
    assert names == ["rank0-step1.json", "rank0-step3.json", "rank1-step1.json",
                     "rank1-step3.json"]  # (nothing half-written is left beside them)
    for rank, stage in ((0, "stage0"), (1, "stage1")):
        for step in (1, 3):
            trace = json.loads((tmp_path / "prof" / f"rank{rank}-step{step}.json").read_text())
            ranges = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
            blocks = {f"{stage}{part}@{m}" for part in ("", ".b") for m in range(4)}
            assert blocks <= ranges, sorted(ranges)[:40]
            assert not any(n.startswith("stage") and not n.startswith(stage) and "@" in n
                           and " " not in n for n in ranges)  # (this rank's blocks only)
    # A resumed run's steps are known once it has read its checkpoint: a step before them
    # is refused then, on every rank, before anything trains.
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--resume", "ck", "--iterations",
                            2, "--profile", "prof", "--profile-steps", "2,5")
    assert code == 2 and len(err) == 2 and len(set(err)) == 1, err
    assert err[0] == ("error: --profile-steps: step 2 is never profiled: the run trains steps "
                      "4 to 5 (hint: give steps from 4 to 5)"), err


def _whole(folder) -> dict:
    """Every tensor of a checkpoint (model and optimizer state), read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        else:
            flat[prefix] = value
    walk("", torch.load(out, weights_only=False))
    return flat


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.mark.torchrun
def test_async_saves_resume_exactly_as_synchronous_ones(tmp_path):
    """The state is copied when the save starts, so the steps that run while it is written
    change nothing in it: every tensor of both checkpoints is the synchronous run's, bit for
    bit, and a run resumed from the asynchronous one ends where the uninterrupted one did."""
    solved(tmp_path, "two", TWO)
    runs = {}
    for folder, extra in (("sync", ()), ("async", ("--async-save",))):
        code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--iterations", 4, "--save",
                                folder, "--save-every", 2, "--json", *extra)
        assert code == 0, err
        runs[folder] = report(out)
        assert listing(tmp_path / folder) == ["step-00000002", "step-00000004"]
    assert runs["async"]["losses"] == runs["sync"]["losses"]
    assert runs["async"]["checkpoint"] == "async/step-00000004"
    for step in ("step-00000002", "step-00000004"):
        assert _same(_whole(tmp_path / "sync" / step), _whole(tmp_path / "async" / step))
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--resume",
                            "async/step-00000002", "--iterations", 2, "--save", "resumed",
                            "--async-save", "--json")
    assert code == 0, err
    assert report(out)["losses"] == runs["sync"]["losses"][2:]
    assert _same(_whole(tmp_path / "sync" / "step-00000004"),
                 _whole(tmp_path / "resumed" / "step-00000004"))


@pytest.mark.slow
@pytest.mark.torchrun
def test_a_kill_during_an_async_save_leaves_the_previous_checkpoint_intact(tmp_path):
    """Rank 1 is killed in async_save's thread, after writing its part of step 5's checkpoint,
    while the ranks train on: the run fails naming it, step 5 stays under its temporary name,
    and step 4 resumes (its parts' sha256 checked: as it was)."""
    solved(tmp_path, "two", TWO)
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--iterations", 4, "--save",
                            "ck", "--save-every", 2, "--async-save", "--json")
    assert code == 0, err
    kept = {p.name: p.read_bytes() for p in (tmp_path / "ck" / "step-00000004").iterdir()}
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--iterations", 3, "--resume",
                            "ck", "--save", "ck", "--save-every", 1, "--async-save",
                            "--fail-at", "1:save:kill", "--fault-timeout", 3)
    assert code != 0
    assert any("rank 1 died" in e for e in err), err
    assert listing(tmp_path / "ck") == [".step-00000005.partial", "step-00000002",
                                        "step-00000004"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck" / "step-00000004").iterdir()} \
        == kept
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--resume", "ck",
                            "--iterations", 1, "--save", "ck", "--async-save", "--json")
    assert code == 0, err
    assert report(out)["resumed"]["step"] == 4
    assert listing(tmp_path / "ck") == ["step-00000002", "step-00000004", "step-00000005"]
    # A write that fails (a rank raising in the writer thread): seen at a later step's end,
    # one line on every rank, exit 2; its temporary folder goes, the others stay.
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--resume", "ck",
                            "--iterations", 3, "--save", "ck", "--save-every", 1,
                            "--async-save", "--fail-at", "1:save")
    assert code == 2 and len(err) == 2 and len(set(err)) == 1, err
    assert err[0] == ("error: cannot write the checkpoint of step 6 in ck: rank 1: failing on "
                      "purpose (--fail-at RANK:save) (hint: ck/step-00000005 is intact)"), err
    assert listing(tmp_path / "ck") == ["step-00000002", "step-00000004", "step-00000005"]
