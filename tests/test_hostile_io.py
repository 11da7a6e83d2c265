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
    code, out, _ = cli("export", plan, "--format", "megatron-layout", "-o", "-")
    assert (code, out) == (0, "t|t\n")


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
    ({"time_limit": "x"}, "the time limit (seconds) must be a finite number"),
    ({"time_limit": math.inf}, "the time limit (seconds) must be a finite number"),
    ({"time_limit": math.nan}, "the time limit (seconds) must be a finite number"),
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
    (UNITS, {"name": "a b"}, "name must use letters"),
    (UNITS, {"factory": 3}, "factory must be an import path"),
    (UNITS, {"recompute": "sometimes"}, "recompute must be never, always or auto"),
])
def test_partition_plans_checks_its_arguments(units, change, expected):
    with pytest.raises(pyplan.PlanError) as info:
        pyplan.partition_plans(units, **{**ARGUMENTS, **change})
    assert expected in str(info.value)
    assert str(info.value).count("\n") == 0
