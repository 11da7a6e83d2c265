"""The search's effort: it stops on its own once more work stops paying (counted in work
units, so the same plan gives the same bytes on any machine), --time-limit stays a hard cap,
and --effort asks for more."""

from __future__ import annotations

import json
import time

import pytest

from pyplan.api import PlanError, solve
from pyplan.problem import build_problem
from pyplan.planfile import spec_from_text

# An M-shape under a memory that 1F1B exactly fills: the fast path finds a repetend of period
# 6 at once; period 5 (the load) can neither be found nor ruled out cheaply. Before the effort,
# the search went on until its time limit.
EARLY = """\
pyplan: 1
name: early
devices: 8
memory: 8
micro_batches: 64
training: {backward: {time_ratio: 2}}
shape:
  kind: mshape
  stage: {time: 1, memory: 1}
  shared: {time: 1, memory: 0, backward: {time: 1, memory: 0}}
search: {time_limit: 60}
"""


def test_default_effort_stops_early_when_the_answer_is_found_early():
    problem = build_problem(spec_from_text(EARLY))
    cpu = time.process_time()
    default = solve(problem)
    default_cpu = time.process_time() - cpu  # (CPU time: a busy machine stretches the clock)
    more = solve(problem, effort=4)
    # The answer comes from the fast path: four times the effort finds nothing shorter ...
    assert default.makespan == more.makespan
    assert default.schedule.repetend.period == more.schedule.repetend.period == 6
    # ... so the default stops after a fraction of that work, well before the time limit, and
    # says why; the status is "feasible", not "time_limit".
    assert default.status == "feasible" and default.period_status == "feasible"
    assert default.stats.work * 2 < more.stats.work
    assert default_cpu < 30
    assert any(n.startswith("search: no shorter period after") for n in default.stats.notes)


def test_work_is_counted_not_timed():
    problem = build_problem(spec_from_text(EARLY))
    first, second = solve(problem), solve(problem)
    assert first.stats.work == second.stats.work
    assert first.schedule.orders == second.schedule.orders


def test_time_limit_stays_a_hard_cap():
    problem = build_problem(spec_from_text(EARLY))
    capped = solve(problem, effort=1000, time_limit=0.5)
    assert capped.status == "time_limit"
    assert capped.search_seconds < 10  # the cap, plus laying out what was found


@pytest.mark.parametrize("effort", [0, -1, 1001, float("nan"), True, "2"])
def test_bad_effort_is_refused(effort):
    with pytest.raises(PlanError, match="effort"):
        solve(build_problem(spec_from_text(EARLY)), effort=effort)


def test_effort_in_the_plan_and_on_the_command_line(cli, tmp_path):
    plan = tmp_path / "early.yaml"
    plan.write_text(EARLY.replace("time_limit: 60", "time_limit: 60, effort: 0.5"))
    code, out, err = cli("solve", plan, "--json", "-o", tmp_path / "a.yaml")
    assert code == 0, err
    half = json.loads(out)
    code, out, err = cli("solve", plan, "--json", "--effort", "2", "-o", tmp_path / "b.yaml")
    assert code == 0, err
    assert json.loads(out)["makespan"] == half["makespan"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(EARLY.replace("time_limit: 60", "effort: 0"))
    code, out, err = cli("validate", bad)
    assert code == 2 and "effort" in err and err.count("\n") == 1


def test_the_time_split_covers_the_search():
    # benchmarks/search.py prints it: where a solve spent its time, by phase.
    problem = build_problem(spec_from_text(EARLY))
    solution = solve(problem)
    assert set(solution.phase_seconds) <= {"templates", "search", "completion", "proof"}
    assert {"templates", "search", "completion"} <= set(solution.phase_seconds)
    assert 0 <= sum(solution.phase_seconds.values()) <= solution.search_seconds + 1e-3
