"""`pyplan export --format svg|chrome`: valid files holding every block execution, memory curves
that agree with the core, atomic writes and one-line errors."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest

from conftest import PLANS, solved
from pyplan.resolved.seal import reseal
from pyplan.export._layout import memory_steps

SVG = "{http://www.w3.org/2000/svg}"
NAMES = ["1f1b-4stage", "zero-bubble", "interleaved-1f1b", "tessel-mshape", "tessel-kshape"]


def executions(schedule) -> list[tuple[int, str, int]]:
    """(device, block name, micro-batch) of every block execution on every device."""
    blocks = schedule.problem.blocks
    return sorted((d, blocks[b].name, m) for d, order in enumerate(schedule.orders)
                  for b, m in order)


@pytest.mark.parametrize("name", NAMES)
def test_memory_curve_peaks_where_the_core_says(name):
    schedule = solved(name)
    for d in range(schedule.problem.num_devices):
        steps = memory_steps(schedule, d)
        assert max(level for _, level in steps) == schedule.peak_memory[d]
        assert steps[-1][1] == 0  # every plan's memory balances per micro-batch
        assert [t for t, _ in steps] == sorted({t for t, _ in steps})


@pytest.mark.parametrize("name", NAMES)
def test_svg_is_xml_with_every_block_execution(name, cli, tmp_path):
    out = tmp_path / f"{name}.svg"
    plan = PLANS / f"{name}.yaml"
    code, stdout, err = cli("export", plan, "--format", "svg", "-o", out)
    assert (code, err) == (0, "")
    schedule = solved(name)
    assert stdout == (f"wrote {out}: svg, {schedule.problem.num_micro_batches} micro-batches on "
                      f"{schedule.problem.num_devices} devices, makespan {schedule.makespan}\n")
    root = ET.parse(out).getroot()
    assert root.tag == f"{SVG}svg"
    blocks = [r for r in root.iter(f"{SVG}rect") if r.get("class", "").startswith("block")]
    found = sorted((int(r.get("data-device")), r.get("data-block"), int(r.get("data-mb")))
                   for r in blocks)
    assert found == executions(schedule)
    curves = [p for p in root.iter(f"{SVG}polyline") if p.get("class") == "memory"]
    assert [int(p.get("data-device")) for p in curves] == \
        list(range(schedule.problem.num_devices))
    bars = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "repetition"]
    assert len(bars) == schedule.repetend_count


def test_svg_block_geometry_follows_the_times(tmp_path, cli):
    schedule = solved("1f1b-4stage")
    out = tmp_path / "a.svg"
    assert cli("export", PLANS / "1f1b-4stage.yaml", "--format", "svg", "-o", out)[0] == 0
    rects = {(int(r.get("data-device")), r.get("data-block"), int(r.get("data-mb"))): r
             for r in ET.parse(out).getroot().iter(f"{SVG}rect") if r.get("data-block")}
    problem = schedule.problem
    x0 = float(rects[(0, "stage0", 0)].get("x"))
    scale = float(rects[(0, "stage0", 0)].get("width")) / problem.block("stage0").time
    for d in range(problem.num_devices):
        for b, m, start, end in schedule.entries(d):
            rect = rects[(d, problem.blocks[b].name, m)]
            assert float(rect.get("x")) == pytest.approx(x0 + start * scale, abs=0.01)
            assert float(rect.get("width")) == pytest.approx((end - start) * scale, abs=0.01)


@pytest.mark.parametrize("name", NAMES)
def test_chrome_trace_has_one_event_per_block_execution(name, cli, tmp_path):
    out = tmp_path / f"{name}.json"
    code, _, err = cli("export", PLANS / f"{name}.yaml", "--format", "chrome", "-o", out)
    assert (code, err) == (0, "")
    schedule = solved(name)
    problem = schedule.problem
    trace = json.loads(out.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["tid"], e["name"].split("@")[0], e["args"]["micro_batch"])
                  for e in events) == executions(schedule)
    for e in events:
        block, mb = e["name"].split("@")
        b = problem.block(block).index
        assert (e["ts"], e["dur"]) == (schedule.start_of(b, int(mb)), problem.blocks[b].time)
    tracks = {e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == set(range(problem.num_devices))
    for d in range(problem.num_devices):
        levels = [e["args"]["memory"] for e in trace["traceEvents"]
                  if e["ph"] == "C" and e["name"] == f"memory device {d}"]
        assert max(levels) == schedule.peak_memory[d]
    assert trace["otherData"]["makespan"] == schedule.makespan


def test_resolved_plan_exports_and_stdout(cli, tmp_path):
    resolved = tmp_path / "v.resolved.yaml"
    assert cli("solve", PLANS / "1f1b-4stage.yaml", "-o", resolved, "--quiet")[0] == 0
    code, out, err = cli("export", resolved, "--format", "chrome", "-o", "-")
    assert (code, err) == (0, "")
    assert len([e for e in json.loads(out)["traceEvents"] if e["ph"] == "X"]) == 64


def test_unknown_format(cli, tmp_path):
    code, out, err = cli("export", PLANS / "1f1b-4stage.yaml", "--format", "svgz",
                         "-o", tmp_path / "x")
    assert (code, out) == (2, "")
    assert err == "error: unknown export format 'svgz' (hint: did you mean 'svg'?)\n"
    code, _, err = cli("export", PLANS / "1f1b-4stage.yaml", "--format", "png",
                       "-o", tmp_path / "x")
    assert err == ("error: unknown export format 'png' (hint: choose svg, chrome, torch-csv, "
                   "megatron-layout, megatron-args, torchtitan)\n")
    assert not (tmp_path / "x").exists()


def test_unwritable_output(cli, tmp_path):
    target = tmp_path / "missing-dir" / "a.svg"
    code, out, err = cli("export", PLANS / "1f1b-4stage.yaml", "--format", "svg", "-o", target)
    assert (code, out) == (2, "")
    assert err == (f"error: -o {target}: its directory does not exist (hint: create "
                   "the directory first, or choose another output)\n")


def test_stale_or_edited_resolved_plan_is_refused(cli, tmp_path):
    resolved = tmp_path / "v.resolved.yaml"
    assert cli("solve", PLANS / "1f1b-4stage.yaml", "-o", resolved, "--quiet")[0] == 0
    text = resolved.read_text().replace("makespan: 22", "makespan: 21")
    resolved.write_text(text)
    code, _, err = cli("export", resolved, "--format", "svg", "-o", tmp_path / "a.svg")
    assert code == 2 and err.count("\n") == 1
    assert "'makespan' is not as pyplan wrote it: it does not match the seal" in err
    # With a seal made to match the edit, the schedule itself tells.
    resolved.write_text(reseal(text))
    code, _, err = cli("export", resolved, "--format", "svg", "-o", tmp_path / "a.svg")
    assert code == 2 and err.count("\n") == 1
    assert "makespan does not match the schedule" in err
    # A repetend index that is not a micro-batch number (the fuzz test found it crashing).
    for bad in ("1 5", "-1", "99"):
        resolved.write_text(reseal(re.sub(r"indices: \[(\d+), ", f"indices: [{bad}, ", text)))
        code, _, err = cli("show", resolved)
        assert code == 2 and err.count("\n") == 1
        assert "needs one index per block, each a micro-batch in 0 .. 7" in err


def test_show_and_exports_work_without_torch(tmp_path):
    # torch is optional: only `pyplan run` needs it, so none of these may import it.
    import subprocess
    import sys

    script = f"""
import sys
from pyplan.cli import main
plan = {str(PLANS / "1f1b-4stage.yaml")!r}
out = {str(tmp_path)!r}
assert main(["show", plan]) == 0
for fmt in ("svg", "chrome", "torch-csv"):
    assert main(["export", plan, "--format", fmt, "-o", f"{{out}}/a.{{fmt}}"]) == 0
assert main(["import", "torch-csv", f"{{out}}/a.torch-csv", "--plan", plan]) == 0
assert "torch" not in sys.modules, "torch was imported"
"""
    # Run outside the source tree: there, `import pyplan` would find the sources (without the
    # compiled core of a non-editable install) before the installed package.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_gradient_syncs_are_drawn_and_traced(cli, tmp_path):
    resolved = PLANS / "transformer-vshape-dp2.resolved.yaml"
    assert cli("export", resolved, "--format", "svg", "-o", tmp_path / "t.svg")[0] == 0
    svg = (tmp_path / "t.svg").read_text()
    assert svg.count('class="sync"') == 2
    assert "stage0 gradients across 2 replicas on device 0: t=30..33" in svg
    assert cli("export", resolved, "--format", "chrome", "-o", tmp_path / "t.json")[0] == 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    syncs = [(e["tid"], e["ts"], e["dur"]) for e in events if e.get("cat") == "sync"]
    assert sorted(syncs) == [(2, 30, 3), (3, 26, 3)]
