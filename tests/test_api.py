"""The Python API: what `import pyplan` offers, and that it agrees with the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pyplan
from conftest import PLANS

VSHAPE = PLANS / "tessel-vshape.yaml"


def test_import_pyplan_is_cheap_and_lists_the_api(tmp_path):
    # The API loads on first use: a bare import pulls in neither z3 nor jsonschema nor torch.
    code = ("import sys, pyplan; print(sorted(m for m in ('z3', 'jsonschema', 'torch', "
            "'pyplan.api') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout
    assert out.strip() == "[]"
    for name in ("load_plan", "solve", "load_resolved", "templates", "PlanError",
                 "InfeasibleError"):
        assert name in dir(pyplan) and getattr(pyplan, name).__doc__


def test_solve_matches_the_cli(cli, tmp_path):
    solution = pyplan.solve(pyplan.load_plan(VSHAPE), micro_batches=8, memory=3)
    out = tmp_path / "cli.resolved.yaml"
    code, stdout, _ = cli("solve", VSHAPE, "--micro-batches", "8", "--memory", "3", "-o", out,
                          "--json")
    assert code == 0
    from_cli = json.loads(stdout)
    mine = solution.to_json(str(out))
    for key in ("status", "makespan", "lower_bound", "peak_memory", "origin", "baselines"):
        assert mine[key] == from_cli[key], key
    assert solution.makespan == from_cli["makespan"]
    assert solution.peak_memory == tuple(from_cli["peak_memory"])
    assert max(solution.peak_memory) <= 3
    written = solution.write(tmp_path / "api.resolved.yaml")
    assert written.read_text() == out.read_text()
    assert pyplan.load_resolved(written).schedule.makespan == solution.makespan


def test_a_plan_from_text_writes_no_dangling_plan_path(tmp_path):
    solution = pyplan.solve(VSHAPE.read_text(), micro_batches=4)
    path = solution.write(tmp_path / "text.resolved.yaml")
    assert "\nplan: null\n" in path.read_text()
    loaded = pyplan.load_resolved(path)
    loaded.check_fresh()  # nothing to be stale against
    assert loaded.schedule.makespan == solution.makespan == 4 * 4 + 12


def test_templates_and_bad_arguments():
    found = pyplan.templates(PLANS / "1f1b-4stage.yaml")
    assert found["1f1b"].makespan == 22 and not found["chimera"].applicable
    plan = pyplan.load_plan(VSHAPE)
    for kwargs, message in (({"memory": "lots"}, "not an amount"),
                            ({"memory": "4GiB"}, "plan's unit"),
                            ({"micro_batches": 0}, "an integer in 1 .. 100000"),
                            ({"time_limit": -1}, "must be positive")):
        with pytest.raises(pyplan.PlanError, match=message):
            pyplan.solve(plan, **kwargs)
    with pytest.raises(pyplan.InfeasibleError, match="smallest memory"):
        pyplan.solve(PLANS / "tessel-kshape.yaml", memory=1)
