"""A resolved plan is a sealed record: every field run, show and export use is covered by the
seal pyplan writes (and, where the plan file is present and fresh, derived again and compared),
so an edit is one error line naming the field, exit 2 -- `plan: null` included."""

from __future__ import annotations

import re
import shutil

import pytest

from conftest import PLANS
from pyplan.resolved.seal import reseal
from pyplan.resolved import load_resolved

# (plan, edit as (pattern, replacement), the field the error names)
EDITS = {
    "mesh-shard-flipped": ("transformer-vshape-dp2", (r"shard: false", "shard: true"), "mesh"),
    "mesh-more-replicas": ("transformer-vshape-dp2", (r"mesh: \{data: 2", "mesh: {data: 3"),
                           "mesh"),
    "mesh-removed": ("transformer-vshape-dp2", (r"^mesh: .*\n", ""), "mesh"),
    "devices": ("tessel-vshape", (r"^devices: 4", "devices: 5"), "devices"),
    "model-builder": ("transformer-vshape", (r"transformer:build", "transformer:other"),
                      "model"),
    "recompute-flag": ("gpt24-recompute", (r"recomputed: true", "recomputed: false"),
                       "blocks"),
    "rematerialised-memory": ("gpt24-recompute", (r"rematerialised: \d+", "rematerialised: 1"),
                              "blocks"),
    "weights": ("gpt24", (r"weights: \d+", "weights: 1"), "blocks"),
    "capacity": ("tessel-vshape", (r"^memory: \d+", "memory: 99"), "memory"),
    "capacity-and-peak": ("1f1b-4stage", (r"^(memory: )4((?:.|\n)*peak_memory: )\[[^]]*\]",
                                          r"\g<1>1\g<2>[1, 1, 1, 1]"), "memory"),
    "order-rule": ("1f1b-4stage", (r"stage0.f\[m\+3\] < stage0.b\[m\]",
                                   "stage0.f[m+2] < stage0.b[m]"), "order_rules"),
    "order-rules-as-an-integer": ("1f1b-4stage", (r"order_rules:\n(  - .*\n)+",
                                                  "order_rules: 5\n"), "order_rules"),
    "micro-batch-beyond-int32": ("1f1b-4stage", (r"stage0@0 0", "stage0@99999999999 0"),
                                 "schedule"),
    "transfer": ("transformer-2node", (r"(\[stage\d, stage\d), (\d+)\]", r"\1, 7]"),
                 "dependencies"),
    "dependency-deleted": ("1f1b-4stage", (r"  - \[stage0, stage1\]\n", ""), "dependencies"),
    "backward-frees-less": ("1f1b-4stage", (r"time: 1, memory: -1", "time: 1, memory: 0"),
                            "blocks"),
    "time-unit": ("gpt24-recompute", (r"^time_unit_ms: .*", "time_unit_ms: 1.0e-300"),
                  "time_unit_ms"),
    "gradient-syncs": ("transformer-vshape-dp2", (r"(gradient_syncs:.*\n  0:\n    - \S+ )\d+",
                                                  r"\g<1>1"), "gradient_syncs"),
    "status": ("tessel-nnshape", (r"^status: feasible", "status: optimal"), "status"),
    "plan-null": ("tessel-vshape", (r"^plan: .*", "plan: null"), "plan"),
    "field-added": ("tessel-vshape", (r"^status:", "surprise: 1\nstatus:"), "surprise"),
    "field-removed": ("tessel-vshape", (r"^origin: .*\n", ""), "origin"),
    "seal-removed": ("tessel-vshape", (r"^seal:(.|\n)*", ""), "seal"),
}


def _edited(tmp_path, plan: str, edit) -> str:
    """The committed resolved plan of `plan`, edited, beside a copy of its plan."""
    shutil.copy(PLANS / f"{plan}.yaml", tmp_path / f"{plan}.yaml")
    text = (PLANS / f"{plan}.resolved.yaml").read_text()
    edited, count = re.subn(edit[0], edit[1], text, count=1, flags=re.MULTILINE)
    assert count == 1 and edited != text
    return edited


@pytest.mark.parametrize("name", sorted(EDITS))
def test_any_edit_is_one_error_naming_the_field(name, cli, tmp_path):
    plan, edit, field = EDITS[name]
    path = tmp_path / f"{plan}.resolved.yaml"
    path.write_text(_edited(tmp_path, plan, edit))
    for command in (("validate", path), ("show", path),
                    ("export", path, "--format", "chrome", "-o", tmp_path / "t.json")):
        code, out, err = cli(*command)
        assert (code, out) == (2, ""), (command, err)
        assert err.count("\n") == 1 and err.startswith(f"{path}:"), err
        assert f"'{field}'" in err and "re-run pyplan solve" in err, err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("name", ["mesh-shard-flipped", "model-builder", "weights",
                                  "recompute-flag", "time-unit", "plan-null"])
def test_run_refuses_an_edited_plan_before_anything_runs(name, cli, tmp_path):
    plan, edit, field = EDITS[name]
    path = tmp_path / f"{plan}.resolved.yaml"
    path.write_text(_edited(tmp_path, plan, edit))
    code, out, err = cli("run", path, "--dry-run")
    assert (code, out) == (2, "") and err.count("\n") == 1 and f"'{field}'" in err, err


# Edits whose seal was made to match (someone who read pyplan/resolved/seal.py): with the plan file
# present and fresh, what the plan determines is derived again and compared.
FORGED = {
    "mesh-shard-flipped": "'mesh' does not match the plan",
    "mesh-more-replicas": "'mesh' does not match the plan",
    "model-builder": "'model' does not match the plan",
    "recompute-flag": "block 'stage0': its recompute fields (recompute, recompute_memory, "
                      "recomputed, rematerialised, memory) do not agree",
    "weights": "'blocks' does not match the plan",
    "order-rule": "'order_rules' does not match the plan",
    "transfer": "'dependencies' does not match the plan",
    "time-unit": "'time_unit_ms' does not match the plan",
    "backward-frees-less": "memory does not balance on device 0",
    "capacity-and-peak": "the schedule does not run",
    "dependency-deleted": "'dependencies' does not match the plan",
    "order-rules-as-an-integer": "'order_rules' must be a list",
    "capacity": "'memory' does not match baseline gpipe, which exceeds it with a peak of 16",
    "micro-batch-beyond-int32": "names a micro-batch or a start outside the schedule",
    "gradient-syncs": "the gradient synchronisations do not match the schedule",
}


@pytest.mark.parametrize("name", sorted(FORGED))
def test_edits_with_a_matching_seal_are_still_refused(name, cli, tmp_path):
    plan, edit, _ = EDITS[name]
    path = tmp_path / f"{plan}.resolved.yaml"
    path.write_text(reseal(_edited(tmp_path, plan, edit)))
    code, out, err = cli("validate", path)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert FORGED[name] in err, err


# Without the plan file (moved away, or `plan: null`), the schedule itself still tells.
UNDERIVED = {
    "weights": "'peak_memory' does not match the schedule",
    "recompute-flag": "block 'stage0': its recompute fields",
    "rematerialised-memory": "'peak_memory' does not match the schedule",
    "dependency-deleted": "does not match its order",
    "capacity-and-peak": "the schedule does not run",
    "backward-frees-less": "memory does not balance on device 0",
    "capacity": "'memory' does not match baseline gpipe",
}


@pytest.mark.parametrize("name", sorted(UNDERIVED))
def test_forged_edits_without_the_plan_are_refused(name, cli, tmp_path):
    plan, edit, _ = EDITS[name]
    path = tmp_path / f"{plan}.resolved.yaml"
    path.write_text(reseal(re.sub(r"^plan: .*", "plan: null", _edited(tmp_path, plan, edit),
                                  count=1, flags=re.MULTILINE)))
    code, out, err = cli("show", path)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert UNDERIVED[name] in err, err


def test_the_seal_ignores_layout_and_comments(tmp_path):
    text = (PLANS / "transformer-vshape.resolved.yaml").read_text()
    shutil.copy(PLANS / "transformer-vshape.yaml", tmp_path)
    path = tmp_path / "transformer-vshape.resolved.yaml"
    # The same data written another way (a comment, a flow list as a block list).
    text = text.replace("\nmakespan: 33\n", "\nmakespan: 33  # checked\n")
    path.write_text(text.replace("\npeak_memory: [4, 3, 2, 1]\n",
                                 "\npeak_memory:\n  - 4\n  - 3\n  - 2\n  - 1\n"))
    assert load_resolved(path).schedule.makespan == 33


def test_a_plan_given_as_text_is_sealed_too(cli, tmp_path):
    import pyplan

    plan = pyplan.load_plan((PLANS / "tessel-vshape.yaml").read_text())
    out = pyplan.solve(plan, micro_batches=8).write(tmp_path / "t.resolved.yaml")
    text = out.read_text()
    assert "\nplan: null\n" in text and "\nseal:" in text
    assert load_resolved(out).schedule.makespan == pyplan.solve(plan, micro_batches=8).makespan
    out.write_text(text.replace("status: optimal", "status: feasible"))
    code, _, err = cli("show", out)
    assert code == 2 and "'status' is not as pyplan wrote it" in err


NAMES = ["1.5", "null", "yes", "2001-12-14", "-x", "..."]


@pytest.mark.parametrize("name", NAMES)
def test_what_solve_writes_reads_back_whatever_the_names(name, tmp_path):
    # Names and paths that YAML would read as something else, or that need escapes.
    folder = tmp_path / 'a "quoted" \\ folder #x'
    folder.mkdir()
    plan = folder / "p: q.yaml"
    block = name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", name) else "b"
    plan.write_text(f"pyplan: 1\nname: '{name}'\ndevices: 1\nmicro_batches: 2\nblocks:\n"
                    f"  - {{name: '{block}', devices: [0], time: 1}}\n"
                    f"  - {{name: 'off', devices: [0], time: 1}}\n"
                    "model: {blocks: 'm:b', data: 'm:d', loss: 'm:l', path: 'a\"b\\c'}\n")
    from pyplan.api import load_plan, solve
    out = solve(load_plan(plan)).write(folder / "out.resolved.yaml")
    loaded = load_resolved(out)
    assert loaded.problem.name == name and loaded.plan == "p: q.yaml"
    assert loaded.problem.model.path == 'a"b\\c'
    assert [b.name for b in loaded.problem.blocks][:2] == [block, "off"]
    loaded.check_fresh()


def test_a_nul_in_the_model_path_is_refused_in_the_plan(cli, tmp_path):
    plan = tmp_path / "p.yaml"
    plan.write_text("pyplan: 1\nname: p\ndevices: 1\nmicro_batches: 2\nblocks:\n"
                    "  - {name: a, devices: [0], time: 1}\n"
                    "model: {blocks: 'm:b', data: 'm:d', loss: 'm:l', path: \"a\\0b\"}\n")
    code, _, err = cli("solve", plan)
    assert code == 2 and err.startswith(f"{plan}:7:") and "NUL" in err, err
    assert not (tmp_path / "p.resolved.yaml").exists()


@pytest.mark.parametrize("unit", ["1.0e-300", "1.0e-7", "0.03191", "1000000"])
def test_time_units_read_back(unit, cli, tmp_path):
    # repr(1e-300) is "1e-300", which YAML 1.1 reads as a string: solve wrote what it refused.
    plan = tmp_path / "t.yaml"
    plan.write_text("pyplan: 1\nname: t\ndevices: 2\nmicro_batches: 4\nshape: {kind: vshape}\n"
                    f"topology: {{time_unit_ms: {unit}}}\n")
    assert cli("solve", plan, "--quiet") == (0, "", "")
    assert load_resolved(tmp_path / "t.resolved.yaml").problem.time_unit_ms == float(unit)


def _peaks(text: str) -> list[int]:
    found = re.search(r"^peak_memory: \[(.*)\]", text, re.M)
    return [int(x) for x in found[1].split(",")] if found else []


@pytest.mark.parametrize("plan", sorted(p.name[:-len(".resolved.yaml")]
                                        for p in PLANS.glob("*.resolved.yaml")
                                        if max(_peaks(p.read_text()), default=0) > 1))
def test_a_capacity_below_the_schedules_peak_is_refused_wherever_it_is_read(cli, tmp_path,
                                                                            plan):
    """Round 5's leftover, generated over every committed plan: `memory:` (or a device's
    device_memory) edited below the schedule's peak and sealed again is refused by show and
    validate, with the plan file beside it or `plan: null` (the seal proves who wrote the
    file, the schedule whether it fits)."""
    text = (PLANS / f"{plan}.resolved.yaml").read_text()
    shutil.copy(PLANS / f"{plan}.yaml", tmp_path / f"{plan}.yaml")
    peaks = _peaks(text)
    low = max(peaks) - 1  # (a capacity is at least 1)
    capacity = re.sub(r"^memory: .*$", f"memory: {low}", text, count=1, flags=re.M)
    devices = re.sub(r"^(memory: .*\n)", rf"\g<1>device_memory: {[low] * len(peaks)}\n",
                     text, count=1, flags=re.M)
    for edited in (capacity, devices):
        for text_plan in (False, True):
            if text_plan:
                edited = re.sub(r"^plan: .*$", "plan: null", edited, count=1, flags=re.M)
            path = tmp_path / f"{plan}.resolved.yaml"
            path.write_text(reseal(edited))
            for command in ("show", "validate"):
                code, out, err = cli(command, path)
                assert (code, out) == (2, "") and err.count("\n") == 1, (command, err)
