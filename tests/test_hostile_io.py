"""Hostile input to the exports, the CSV import and the Python API: each is one error line and
exit 2 (a PlanError from the API), never a traceback, a hang or a file written over its input."""

from __future__ import annotations

import math
import shutil

import pytest

import pyplan
from conftest import PLANS
from pyplan.partition import UnitCost

PLAN = "pyplan: 1\nname: t\ndevices: 2\nmicro_batches: 4\n"


# ---------------------------------------------------------------- exports

@pytest.mark.parametrize("source", ["plan", "resolved", "plan-behind-the-resolved"])
def test_export_never_writes_over_what_it_reads(source, cli, tmp_path):
    for name in ("tessel-vshape.yaml", "tessel-vshape.resolved.yaml"):
        shutil.copy(PLANS / name, tmp_path / name)
    given = tmp_path / ("tessel-vshape.yaml" if source == "plan" else
                        "tessel-vshape.resolved.yaml")
    target = tmp_path / ("tessel-vshape.resolved.yaml" if source == "resolved" else
                         "tessel-vshape.yaml")
    before = target.read_bytes()
    for fmt in ("svg", "megatron-layout"):
        code, out, err = cli("export", given, "--format", fmt, "-o", target)
        assert (code, out) == (2, "") and err.count("\n") == 1, err
        assert "refusing to write over" in err
    assert target.read_bytes() == before


def test_solve_never_writes_over_its_plan(cli, tmp_path):
    plan = tmp_path / "p.yaml"
    shutil.copy(PLANS / "tessel-vshape.yaml", plan)
    before = plan.read_bytes()
    code, _, err = cli("solve", plan, "-o", plan, "--quiet")
    assert code == 2 and "refusing to write over" in err
    assert plan.read_bytes() == before


def test_torchtitan_settings_are_for_training_plans(cli, tmp_path):
    plan = tmp_path / "i.yaml"
    plan.write_text(PLAN + "task: inference\nshape: {kind: vshape}\nmodel: {module: 'a:b', "
                    "stages: {stage0: [a], stage1: [b]}, data: 'a:b', loss: 'a:b'}\n")
    code, out, err = cli("export", plan, "--format", "torchtitan", "-o", "-")
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert "is an inference plan, and torchtitan's pipeline settings are for training" in err
    # Megatron-LM's layout needs an embedding first and an output last: units a, b have none.
    code, out, err = cli("export", plan, "--format", "megatron-layout", "-o", "-")
    assert (code, out) == (2, "") and "but these modules read t|t" in err


def test_trainer_exports_need_every_stage(tmp_path):
    from pyplan.export.trainers import megatron_layout, torchtitan_config
    import dataclasses

    plan = pyplan.load_plan(PLAN + "shape: {kind: vshape}\nmodel: {module: 'a:b', stages: "
                            "{stage0: [a], stage1: [b]}, data: 'a:b', loss: 'a:b'}\n")
    for stages in ((("stage0", ("a",)),), (("stage0", ("a",)), ("stage1", ()))):
        broken = dataclasses.replace(plan, model=dataclasses.replace(plan.model, stages=stages))
        for export in (megatron_layout, torchtitan_config):
            with pytest.raises(pyplan.PlanError, match="lists no submodules for block 'stage1'"):
                export(broken)


# ---------------------------------------------------------------- torch CSV import

def _csv(tmp_path, rows: list[str]):
    path = tmp_path / "s.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("rows, expected", [
    (["0F0," + "x" * 200_000, "1F0", "2F0", "3F0"], "1:1: error: not a CSV row: field larger"),
    (['"' + "x" * 200_000 + '"', "1F0", "2F0", "3F0"], "1:1: error: not a CSV row"),
    (["0F" + "9" * 5000, "1F0", "2F0", "3F0"], "a stage or micro-batch number of 5,000 digits"),
    (["9" * 5000 + "F0", "1F0", "2F0", "3F0"], "a stage or micro-batch number of 5,000 digits"),
    (["0F999999", "1F0", "2F0", "3F0"], "names micro-batch 999,999, beyond the supported"),
    (["0F0", "1F0\0", "2F0", "3F0"], "2:1: error: "),
])
def test_hostile_torch_csv_is_one_error(rows, expected, cli, tmp_path):
    code, out, err = cli("import", "torch-csv", _csv(tmp_path, rows), "--plan",
                         PLANS / "1f1b-4stage.yaml")
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert expected in err, err


def test_a_csv_that_never_ends_is_refused(cli, tmp_path):
    link = tmp_path / "zero.csv"
    link.symlink_to("/dev/zero")
    code, _, err = cli("import", "torch-csv", link, "--plan", PLANS / "1f1b-4stage.yaml")
    assert code == 2 and err == f"{link}:1:1: error: the file is larger than 8 MiB, the " \
        "limit for schedule CSVs\n"


# ---------------------------------------------------------------- the Python API

@pytest.mark.parametrize("source", [2, None, 2.5, b"plans/x.yaml", ["a"]])
def test_load_plan_takes_a_file_name_or_text(source, capfd):
    with pytest.raises(pyplan.PlanError, match="load_plan takes a file name or YAML text"):
        pyplan.load_plan(source)
    with pytest.raises(pyplan.PlanError, match="load_resolved takes a file name"):
        pyplan.load_resolved(source)
    print("stderr still open", file=__import__("sys").stderr)  # fd 2 was not taken and closed
    assert "stderr still open" in capfd.readouterr().err


@pytest.mark.parametrize("overrides, expected", [
    ({"micro_batches": math.nan}, "micro-batches must be an integer"),
    ({"micro_batches": True}, "micro-batches must be an integer"),
    ({"micro_batches": "8"}, "micro-batches must be an integer"),
    ({"memory": math.nan}, "memory nan is not an amount"),
    ({"memory": [1]}, "is not an amount"),
    ({"time_limit": "x"}, "the time limit must be positive and finite (seconds)"),
    ({"time_limit": math.inf}, "the time limit must be positive and finite (seconds)"),
    ({"time_limit": math.nan}, "the time limit must be positive and finite (seconds)"),
    ({"time_limit": 1e308}, "the time limit must be positive and finite (seconds), at most "
                            "1e+06"),
])
def test_with_overrides_refuses_what_makes_no_sense(overrides, expected):
    plan = pyplan.load_plan(PLANS / "tessel-vshape.yaml")
    with pytest.raises(pyplan.PlanError) as info:
        pyplan.with_overrides(plan, **overrides)
    assert expected in str(info.value)
    with pytest.raises(pyplan.PlanError):
        pyplan.solve(plan, **overrides)


def test_with_overrides_refuses_micro_batches_whose_memory_overflows():
    plan = pyplan.load_plan(PLAN + "blocks:\n" + "".join(
        f'  - {{name: b{i}, devices: [0], time: 1, memory: "16PiB"}}\n' for i in range(4)))
    with pytest.raises(pyplan.PlanError, match="more than the supported 2\\^62"):
        pyplan.with_overrides(plan, micro_batches=100_000)


UNITS = [UnitCost(f"layers.{i}", 1.0, 2.0, 100, 100) for i in range(4)]
ARGUMENTS = dict(devices=2, name="m", factory="a:b", data="a:b", loss="a:b", micro_batches=4)


@pytest.mark.parametrize("units, change, expected", [
    ([], {}, "units must be a non-empty list"),
    ("abc", {}, "units must be a non-empty list"),
    ([UnitCost("a", math.nan, 1.0, 1, 1)], {}, "units[0].forward_ms must be a finite number"),
    ([UnitCost("a", 1.0, math.inf, 1, 1)], {}, "units[0].backward_ms must be a finite number"),
    ([UnitCost("a", 1.0, 1.0, -1, 1)], {}, "units[0].activation_bytes must be an integer"),
    ([UnitCost("a", 1.0, 1.0, 1.5, 1)], {}, "units[0].activation_bytes must be an integer"),
    ([UnitCost("a", 1.0, 1.0, 1, 2**59)] * 3, {}, "units[1].name 'a' repeats units[0]"),
    ([UnitCost(f"u{i}", 1.0, 1.0, 1, 2**59) for i in range(3)], {},
     "the units' weight_bytes sum to 1,729,382,256,910,270,464"),
    ([UnitCost("a", 0.0, 0.0, 1, 1), UnitCost("b", 0.0, 0.0, 1, 1)], {}, "takes no time"),
    (UNITS, {"devices": "2"}, "devices must be an integer"),
    (UNITS, {"micro_batches": 2.5}, "micro_batches must be an integer"),
    (UNITS, {"memory": math.nan}, "memory (bytes per device) must be an integer"),
    (UNITS, {"time_limit": math.nan}, "time_limit must be a finite number"),
    (UNITS, {"time_limit": 1e7}, "time_limit must be a finite number in 0.001 .. "),
    (UNITS, {"name": "a b"}, "name must use letters"),
    (UNITS, {"factory": 3}, "factory must be an import path"),
    (UNITS, {"recompute": "sometimes"}, "recompute must be never, always or auto"),
    (UNITS, {"devices": 3, "chunks": 2}, "4 units cannot fill 6 stages (3 devices x 2 chunks)"),
])
def test_partition_plans_checks_its_arguments(units, change, expected):
    with pytest.raises(pyplan.PlanError) as info:
        pyplan.partition_plans(units, **{**ARGUMENTS, **change})
    assert expected in str(info.value)
    assert str(info.value).count("\n") == 0


# ---------------------------------------------------------------- bounded time and memory

def _pyplan(*args, cwd, seconds: int = 30):
    """pyplan in a process capped at 2 GiB of address space and `seconds` of CPU time (the
    kernel ends it past them: SIGXCPU); ten times as long on the wall clock catches a process
    that waits without computing, with room for a busy machine."""
    import resource
    import subprocess
    import sys

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))

    return subprocess.run([sys.executable, "-m", "pyplan", *map(str, args)],
                          capture_output=True, text=True, timeout=10 * seconds,
                          preexec_fn=limited, cwd=cwd)


def test_show_of_a_hundred_thousand_micro_batches_is_quick(tmp_path):
    plan = tmp_path / "long.yaml"
    plan.write_text(PLAN.replace("micro_batches: 4", "micro_batches: 100000")
                    + "shape: {kind: vshape}\n")
    assert _pyplan("solve", plan, "--quiet", cwd=tmp_path).returncode == 0
    shown = _pyplan("show", tmp_path / "long.resolved.yaml", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "~: 99995 periods elided" in shown.stdout
    # 32 devices: past what show draws, refused at once; fewer micro-batches are drawn.
    wide = tmp_path / "wide.yaml"
    wide.write_text((PLANS / "mshape-32.yaml").read_text().replace("micro_batches: 256",
                                                                    "micro_batches: 15000"))
    assert _pyplan("solve", wide, "--quiet", cwd=tmp_path, seconds=60).returncode == 0
    for args in ((), ("--full",)):
        shown = _pyplan("show", tmp_path / "wide.resolved.yaml", *args, cwd=tmp_path)
        assert shown.returncode == 2 and shown.stderr.count("\n") == 1
        assert "more than show draws (2,000,000 cells)" in shown.stderr
    shown = _pyplan("show", tmp_path / "wide.resolved.yaml", "--micro-batches", "64",
                    cwd=tmp_path)
    assert shown.returncode == 0 and "mshape-32: 64 micro-batches on 32 devices" in shown.stdout
    for fmt, limit in (("svg", "more than svg draws"), ("chrome", "more than chrome exports")):
        done = _pyplan("export", tmp_path / "wide.resolved.yaml", "--format", fmt, "-o",
                       tmp_path / "out", cwd=tmp_path)
        assert done.returncode == 2 and limit in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_times_without_a_common_step_are_refused_not_drawn(tmp_path):
    plan = tmp_path / "odd.yaml"
    plan.write_text(PLAN.replace("micro_batches: 4", "micro_batches: 1000") + "blocks:\n"
                    "  - {name: a, devices: [0], time: 400000}\n"
                    "  - {name: b, devices: [1], time: 399999}\n")
    assert _pyplan("solve", plan, "--quiet", cwd=tmp_path).returncode == 0
    for command in (("show", tmp_path / "odd.resolved.yaml"),
                    ("export", tmp_path / "odd.resolved.yaml", "--format", "svg", "-o",
                     tmp_path / "o.svg"),
                    ("export", tmp_path / "odd.resolved.yaml", "--format", "torch-csv", "-o",
                     tmp_path / "o.csv")):
        done = _pyplan(*command, cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr


def test_a_schedule_too_large_to_lay_out_is_refused_where_it_is_set(cli, tmp_path):
    plan = tmp_path / "huge.yaml"
    plan.write_text("pyplan: 1\nname: huge\ndevices: 64\nmicro_batches: 100000\n"
                    "shape: {kind: interleaved, chunks: 64}\n")
    code, _, err = cli("solve", plan)
    assert code == 2 and err == (
        f"{plan}:4:16: error: 8,192 blocks x 100,000 micro-batches make 819,200,000 block "
        "instances, more than the supported 1,000,000 (hint: fewer micro-batches or blocks)\n")
    small = tmp_path / "small.yaml"
    small.write_text(plan.read_text().replace("100000", "8"))
    code, _, err = cli("solve", small, "--micro-batches", "100000")
    assert code == 2 and "more than the supported 1,000,000" in err


def test_svg_of_long_blocks_scales_by_their_common_step(cli, tmp_path):
    plan = tmp_path / "long.yaml"
    plan.write_text(PLAN + "shape: {kind: vshape, stage: {time: 500000}}\n")
    assert cli("solve", plan, "--quiet")[0] == 0
    code, _, err = cli("export", tmp_path / "long.resolved.yaml", "--format", "svg", "-o",
                       tmp_path / "l.svg")
    assert code == 0, err
    svg = (tmp_path / "l.svg").read_text()
    assert svg.count("<line") < 200  # ticks about 40 px apart, not one per 10 units


def test_a_named_pipe_nobody_writes_to_does_not_block(tmp_path):
    import os

    pipe = tmp_path / "pipe.yaml"
    os.mkfifo(pipe)
    for command in (("validate", pipe), ("show", pipe),
                    ("import", "torch-csv", pipe, "--plan", PLANS / "1f1b-4stage.yaml")):
        done = _pyplan(*command, cwd=tmp_path, seconds=20)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
