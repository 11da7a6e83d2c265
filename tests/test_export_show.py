"""`pyplan show`: golden terminal output, wrapping, elision of repeated periods, colours."""

from __future__ import annotations

import os
import re

import pytest

from conftest import PLANS, solved
from pyplan.export.timeline import render_plain, timeline

GOLDEN = PLANS.parent / "tests" / "golden"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def check_golden(name: str, text: str) -> None:
    """Compare with tests/golden/NAME; PYPLAN_UPDATE_GOLDEN=1 rewrites it instead."""
    path = GOLDEN / name
    if os.environ.get("PYPLAN_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text()


def test_vshape_1f1b_golden(cli):
    code, out, err = cli("show", PLANS / "1f1b-4stage.yaml")
    assert (code, err) == (0, "")
    check_golden("1f1b-4stage.show.txt", out)  # (docs/exports.md shows it: tests/test_docs.py)


def test_resolved_plan_shows_the_same(cli, tmp_path):
    resolved = tmp_path / "1f1b-4stage.resolved.yaml"
    assert cli("solve", PLANS / "1f1b-4stage.yaml", "-o", resolved, "--quiet")[0] == 0
    code, out, err = cli("show", resolved)
    assert (code, err) == (0, "")
    assert out == (GOLDEN / "1f1b-4stage.show.txt").read_text()


def labels(text: str, device: int) -> list[str]:
    """Block labels on a device's rows, in order across bands."""
    rows = [line[5:] for line in text.splitlines() if line.startswith(f"d{device} ")]
    return re.findall(r"[FBWOfbwo]\d+'*", "".join(rows))


@pytest.mark.parametrize("name", ["1f1b-8stage", "tessel-mshape", "interleaved-1f1b"])
def test_full_view_wraps_and_keeps_every_block(name):
    schedule = solved(name)
    text = render_plain(timeline(schedule, width=60, compress=False))
    assert max(map(len, text.splitlines())) <= 60
    for d in range(schedule.problem.num_devices):
        expected = []
        for b, m in schedule.orders[d]:
            block = schedule.problem.blocks[b]
            letter = {"forward": "F", "backward": "B", "weight": "W"}.get(block.kind, "O")
            label = letter + str(m)
            expected.append(label.lower() if len(block.devices) > 1 else label)
        assert [x.rstrip("'") for x in labels(text, d)] == expected


def test_long_schedule_elides_whole_periods():
    schedule = solved("1f1b-8stage")  # 32 micro-batches, period 2
    text = render_plain(timeline(schedule, width=100))
    assert max(map(len, text.splitlines())) <= 100
    legend = re.search(r"~: (\d+) periods elided \(t=(\d+)\.\.(\d+)\)", text)
    periods, start, end = map(int, legend.groups())
    assert periods >= 2 and end - start == periods * schedule.repetend.period
    # Across the cut every device resumes where it would be: the labels skipped are exactly the
    # blocks that start inside the elided window.
    for d in range(schedule.problem.num_devices):
        kept = [(b, m) for b, m, s, _ in schedule.entries(d) if not start <= s < end]
        shown = labels(text, d)
        assert len(shown) == len(kept)
        assert shown == [("F" if schedule.problem.blocks[b].kind == "forward" else "B") + str(m)
                         for b, m in kept]


def test_short_schedule_is_not_elided():
    text = render_plain(timeline(solved("1f1b-4stage"), width=100))
    assert "elided" not in text and " ~ " not in text


def test_colour_is_the_plain_text_with_styles(cli):
    code, coloured, _ = cli("show", PLANS / "1f1b-4stage.yaml", "--color", "always")
    assert code == 0 and "\x1b[" in coloured
    assert ANSI.sub("", coloured) == (GOLDEN / "1f1b-4stage.show.txt").read_text()


def test_width_option(cli):
    code, out, _ = cli("show", PLANS / "1f1b-4stage.yaml", "--width", "30")
    assert code == 0 and max(map(len, out.splitlines()[:14])) <= 30
    assert out.count("\nt ") == 3  # 22 steps of 3 characters in bands of 25


def test_a_width_out_of_range_is_an_error(cli):
    hint = "(hint: use 20 to 10,000 columns (--full draws every step))\n"
    assert cli("show", PLANS / "1f1b-4stage.yaml", "--width", "5") == \
        (2, "", "error: --width 5 is too narrow " + hint)
    # A line that never wraps would elide nothing: 100,000 micro-batches drawn in full.
    assert cli("show", PLANS / "1f1b-4stage.yaml", "--width", "1000000000") == \
        (2, "", "error: --width 1000000000 is too wide " + hint)


def test_missing_file(cli, tmp_path):
    code, out, err = cli("show", tmp_path / "nope.yaml")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "nope.yaml" in err and "Traceback" not in err


def test_template(cli):
    code, out, err = cli("show", PLANS / "1f1b-4stage.yaml", "--template", "gpipe")
    assert (code, err) == (0, "")
    assert "d0   F0-F1-F2-F3-F4-F5-F6-F7-" in out and "rep" not in out
    assert out.endswith("makespan 22, bubble 27.3%, peak memory 8/4 8/4 8/4 8/4\n")
    code, _, err = cli("show", PLANS / "1f1b-4stage.yaml", "--template", "gpip")
    assert (code, err) == (2, "error: unknown template 'gpip' (hint: did you mean 'gpipe'?)\n")
    code, _, err = cli("show", PLANS / "1f1b-4stage.yaml", "--template", "chimera")
    assert (code, err) == (2, "error: template chimera does not fit 1f1b-4stage: needs two "
                              "chains of stages in opposite directions (an X-shape)\n")


def test_stale_resolved_plan_is_shown_with_a_warning(cli, tmp_path):
    plan = tmp_path / "v.yaml"
    plan.write_text((PLANS / "1f1b-4stage.yaml").read_text())
    assert cli("solve", plan, "--quiet")[0] == 0
    plan.write_text(plan.read_text() + "# edited\n")
    code, out, err = cli("show", tmp_path / "v.resolved.yaml")
    assert code == 0 and out
    assert err == (f"{tmp_path / 'v.resolved.yaml'}:1:1: warning: stale: {plan} changed since "
                   f"this plan was resolved (hint: re-run pyplan solve {plan})\n")


def test_two_digit_labels_stay_apart(cli, tmp_path):
    resolved = tmp_path / "12.resolved.yaml"
    assert cli("solve", PLANS / "1f1b-4stage.yaml", "--micro-batches", "12", "-o", resolved,
               "--quiet")[0] == 0
    code, out, _ = cli("show", resolved, "--width", "400", "--full")
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("d")]
    assert "F10-B" in rows[0]
    for row in rows:  # every label is followed by a fill or idle character
        assert not re.search(r"[FB]\d+[FB]", row), row
