"""torch-csv: exported schedules load, validate and simulate in the installed torch's own
pipelining runtime; importing them back (or torch's own schedules) evaluates in the core."""

from __future__ import annotations

import csv
import json
import re
import warnings
from pathlib import Path

import pytest

from conftest import PLANS, solved
from pyplan.export.torch_csv import read_torch_csv, torch_stages
from pyplan.problem import load_problem
from pyplan.solver.templates import baselines
from warm_torchrun import torchrun

SEARCHED = ["1f1b-4stage", "1f1b-8stage", "interleaved-1f1b", "zero-bubble"]
TEMPLATES = [("1f1b-4stage", "gpipe"), ("1f1b-4stage", "1f1b"), ("1f1b-8stage", "1f1b"),
             ("interleaved-1f1b", "interleaved-1f1b"), ("zero-bubble", "zb-h1"),
             ("zero-bubble", "1f1b")]


@pytest.fixture(scope="module")
def schedules():
    """torch.distributed.pipelining.schedules (importing torch warns that numpy is missing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return pytest.importorskip("torch.distributed.pipelining.schedules")


class Stage:
    """What torch's schedule classes read from a pipeline stage to build a schedule."""

    def __init__(self, num_stages: int, group_size: int, group_rank: int = 0,
                 stage_index: int = 0) -> None:
        self.num_stages, self.group_size = num_stages, group_size
        self.group_rank, self.stage_index = group_rank, stage_index


def torch_accepts(schedules, path, num_stages: int, num_ranks: int, n: int) -> dict:
    """Load the CSV with torch's runtime (which runs _validate_schedule), validate it again
    explicitly, lower it with send/recv and simulate it; returns torch's stage -> rank."""
    runtime = schedules._PipelineScheduleRuntime([Stage(num_stages, num_ranks)], n)
    runtime._load_csv(str(path))
    order = {rank: list(actions) for rank, actions in runtime.pipeline_order.items()}
    to_rank = schedules._validate_schedule(order, num_ranks, num_stages, n)
    assert to_rank == runtime.stage_index_to_group_rank
    comms = schedules._add_send_recv({r: list(a) for r, a in order.items()},
                                     stage_to_rank=to_rank.__getitem__, num_stages=num_stages)
    simulated = schedules._simulate_comms_compute(comms, to_rank.__getitem__, num_stages)
    ran = sorted(str(a) for actions in simulated.values() for a in actions
                 if a is not None and a.is_compute_op)
    assert ran == sorted(str(a) for actions in order.values() for a in actions if a is not None)
    return to_rank


def import_json(cli, path, plan) -> dict:
    code, out, err = cli("import", "torch-csv", path, "--plan", plan, "--json")
    assert (code, err) == (0, "")
    return json.loads(out)


@pytest.mark.parametrize("name", SEARCHED)
def test_searched_schedule_round_trip(name, cli, schedules, tmp_path):
    schedule = solved(name)
    problem = schedule.problem
    out = tmp_path / f"{name}.csv"
    code, stdout, err = cli("export", PLANS / f"{name}.yaml", "--format", "torch-csv", "-o", out)
    stages = torch_stages(problem)
    assert (code, err) == (0, "")
    assert stdout == (f"wrote {out}: torch-csv, {problem.num_micro_batches} micro-batches on "
                      f"{problem.num_devices} devices as {len(stages)} torch stages, makespan "
                      f"{schedule.makespan}\n")
    to_rank = torch_accepts(schedules, out, len(stages), problem.num_devices,
                            problem.num_micro_batches)
    assert to_rank == {st.index: st.rank for st in stages}
    imported = read_torch_csv(out, problem)
    assert imported.num_micro_batches == problem.num_micro_batches
    assert [tuple(o) for o in imported.orders] == [tuple(o) for o in schedule.orders]
    result = import_json(cli, out, PLANS / f"{name}.yaml")
    assert result["makespan"] == schedule.makespan
    assert result["peak_memory"] == list(schedule.peak_memory)
    assert result["fits_memory"] is True
    assert result["follows_order_rules"] in (True, None)


def test_csv_cells_sit_at_their_start_step(cli, tmp_path):
    out = tmp_path / "v.csv"
    assert cli("export", PLANS / "1f1b-4stage.yaml", "--format", "torch-csv", "-o", out)[0] == 0
    schedule = solved("1f1b-4stage")
    rows = list(csv.reader(out.read_text().splitlines()))
    for d, row in enumerate(rows):
        starts = [schedule.start_of(b, m) for b, m in schedule.orders[d]]
        assert [i for i, cell in enumerate(row) if cell] == starts
    assert rows[3][3:5] == ["3F0", "3B0"]


@pytest.mark.parametrize("name, template", TEMPLATES, ids=lambda x: x)
def test_template_round_trip(name, template, cli, schedules, tmp_path):
    problem = load_problem(PLANS / f"{name}.yaml")
    out = tmp_path / f"{template}.csv"
    code, _, err = cli("export", PLANS / f"{name}.yaml", "--template", template,
                       "--format", "torch-csv", "-o", out)
    assert (code, err) == (0, "")
    torch_accepts(schedules, out, len(torch_stages(problem)), problem.num_devices,
                  problem.num_micro_batches)
    expected = baselines(problem)[template]
    result = import_json(cli, out, PLANS / f"{name}.yaml")
    assert (result["makespan"], result["fits_memory"]) == (expected.makespan,
                                                           expected.fits_memory)
    assert result["peak_memory"] == list(expected.peak_memory)


def write_rows(path, pipeline_order) -> None:
    with open(path, "w", newline="") as handle:
        csv.writer(handle).writerows(
            ["" if a is None else str(a) for a in actions]
            for _, actions in sorted(pipeline_order.items()))


@pytest.mark.parametrize("name, makespan", [("1f1b-4stage", 22), ("1f1b-8stage", 78)])
def test_torch_gpipe_costs_the_textbook_makespan(name, makespan, cli, schedules, tmp_path):
    # (m + p - 1)(F + B) with F = B = 1; torch's rows end with REDUCE_GRAD, which is skipped.
    problem = load_problem(PLANS / f"{name}.yaml")
    p, m = problem.num_devices, problem.num_micro_batches
    gpipe = schedules.ScheduleGPipe(Stage(p, p), m)
    path = tmp_path / "gpipe.csv"
    write_rows(path, gpipe._get_pipeline_order())
    assert "REDUCE_GRAD" in path.read_text()
    result = import_json(cli, path, PLANS / f"{name}.yaml")
    assert result["makespan"] == makespan == (m + p - 1) * 2
    assert result["fits_memory"] is False  # GPipe holds every micro-batch's activations


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_torch_interleaved_1f1b_matches_pyplans_template(fmt, cli, schedules, tmp_path):
    problem = load_problem(PLANS / "interleaved-1f1b.yaml")
    D, n = problem.num_devices, problem.num_micro_batches
    stages = [Stage(2 * D, D, 0, 0), Stage(2 * D, D, 0, D)]
    interleaved = schedules.ScheduleInterleaved1F1B(stages, n)
    path = tmp_path / f"{fmt}.csv"
    if fmt == "compute_comms":
        interleaved._prepare_schedule_with_comms(interleaved.pipeline_order)
    interleaved._dump_csv(str(path), format=fmt)
    result = import_json(cli, path, PLANS / "interleaved-1f1b.yaml")
    assert result["makespan"] == baselines(problem)["interleaved-1f1b"].makespan == 57


def test_import_compares_with_the_resolved_plan(cli, tmp_path):
    resolved = tmp_path / "v.resolved.yaml"
    assert cli("solve", PLANS / "1f1b-4stage.yaml", "-o", resolved, "--quiet")[0] == 0
    gpipe = tmp_path / "gpipe.csv"
    assert cli("export", resolved, "--template", "gpipe", "--format", "torch-csv",
               "-o", gpipe)[0] == 0
    code, out, err = cli("import", "torch-csv", gpipe, "--plan", resolved)
    assert (code, err) == (0, "")
    assert out == (
        f"{gpipe}: 8 micro-batches on 4 devices as 4 torch stages, costs from 1f1b-4stage: "
        "makespan 22, bubble 27.3%\n"
        "  peak memory: 8 8 8 8 (capacity 4)\n"
        "  exceeds the memory capacity: device 0 reaches 8\n"
        "  breaks the plan's order rules (evaluated as written)\n"
        f"  searched schedule ({resolved}): makespan 22, bubble 27.3%; this one takes 1.00x as "
        "long\n")


def test_import_more_micro_batches_than_the_plan(cli, tmp_path):
    # Four ranks, 16 micro-batches in 1F1B: the resolved plan extends to 16 for comparison.
    resolved = tmp_path / "v.resolved.yaml"
    assert cli("solve", PLANS / "1f1b-4stage.yaml", "-o", resolved, "--quiet")[0] == 0
    rows = []
    for r in range(4):
        ops = [f"{r}F{m}" for m in range(4 - r)]
        for m in range(16 - (4 - r)):
            ops += [f"{r}B{m}", f"{r}F{m + 4 - r}"]
        rows.append(ops + [f"{r}B{m}" for m in range(16 - (4 - r), 16)])
    path = tmp_path / "one-f-one-b.csv"
    path.write_text("\n".join(",".join(r) for r in rows) + "\n")
    result = import_json(cli, path, resolved)
    assert result["micro_batches"] == 16
    assert result["makespan"] == (16 + 4 - 1) * 2 == result["searched"]["makespan"]
    assert result["peak_memory"] == [4, 3, 2, 1] and result["fits_memory"]


def test_mshape_has_no_torch_form(cli, tmp_path):
    out = tmp_path / "m.csv"
    code, stdout, err = cli("export", PLANS / "tessel-mshape.yaml", "--format", "torch-csv",
                            "-o", out)
    assert (code, stdout) == (2, "")
    assert err == ("error: tessel-mshape cannot be a torch.distributed.pipelining schedule: "
                   "block 'embed' runs on devices [0, 1, 2, 3] at once, but a torch stage runs "
                   "on one rank (hint: torch-csv needs one chain of single-device stages, each "
                   "with its backward; export svg or chrome instead)\n")
    assert not out.exists()


@pytest.mark.parametrize("name, why", [
    ("tessel-xshape", "the forward blocks form 2 chains (starting at 'down0', 'up0'), but "
                      "torch's stages form one"),
    ("tessel-kshape-inference", "it is an inference plan, and torch's schedule runtime needs "
                                "a backward for every stage"),
    ("alphafold2-3f1b", "forward block 'f1_s0' has no backward block 'f1_s0.b'"),
])
def test_other_placements_without_torch_form(name, why, cli, tmp_path):
    code, _, err = cli("export", PLANS / f"{name}.yaml", "--format", "torch-csv",
                       "-o", tmp_path / "x.csv")
    assert code == 2
    assert err.startswith(f"error: {name} cannot be a torch.distributed.pipelining schedule: "
                          f"{why} (hint: ")


V_ROWS = ["0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1"]  # a 2-stage 1F1B; edited per case below


@pytest.mark.parametrize("rows, message", [
    (["0F0,1F1,0B0,0B1", V_ROWS[1]],
     "1:5: error: 1F1 runs stage 1 ('stage1') on rank 0, but the plan places it on device 1 "
     "(hint: torch's rank r is pyplan's device r)"),
    (["0F0,0F1,0B0, 2B1", V_ROWS[1]],
     "1:14: error: 2B1 names stage 2, but the plan has 2 stages (0..1)"),
    (["0F0,0F1,0I0,0B1", V_ROWS[1]],
     "1:9: error: 0I0 splits the backward of stage 0, but the plan has one backward block "
     "'stage0.b' (hint: split it with training.backward.weight_time_ratio)"),
    (["0F0,0F1,0B0,0F1", V_ROWS[1]],
     "1:13: error: 0F1 runs stage0@1 again (first on line 1, column 5)"),
    (["0F0,0F1,0B0", V_ROWS[1]],
     "1:1: error: micro-batch 1 never runs stage0.b (action 0B1) (hint: every stage runs every "
     "micro-batch 0..1)"),
    (["0F0,0X1,0B0,0B1", V_ROWS[1]],
     "1:5: error: '0X1' is not a torch action (hint: write STAGE, F|B|I|W, MICRO-BATCH like "
     "0F1, 3B0, 2I4, 2W4)"),
    ([V_ROWS[0]], "1:1: error: 1 rows, but the plan has 2 devices (hint: write one row per "
                  "rank; torch's rank r is pyplan's device r)"),
    (["0F0,0B1,0F1,0B0", V_ROWS[1]],
     "1:5: error: the schedule cannot run: deadlock: stage0.b@1 waits for stage1.b@1 "
     "(dependency); stage1.b@1 waits for stage1@1 (ahead of it on device 1); stage1@1 waits "
     "for stage0@1 (dependency); stage0@1 waits for stage0.b@1 (ahead of it on device 0) "
     "(hint: each rank's actions must follow the dependencies)"),
])
def test_import_errors_point_at_the_cell(rows, message, cli, tmp_path):
    plan = tmp_path / "two.yaml"
    plan.write_text("pyplan: 1\nname: two\ndevices: 2\nmemory: 2\nmicro_batches: 2\n"
                    "training:\n  backward: {time_ratio: 1}\n"
                    "shape:\n  kind: vshape\n  stage: {time: 1, memory: 1}\n")
    path = tmp_path / "s.csv"
    path.write_text("\n".join(rows) + "\n")
    code, out, err = cli("import", "torch-csv", path, "--plan", plan)
    assert (code, out) == (2, "")
    assert err == f"{path}:{message}\n"


def test_import_unknown_format_and_missing_file(cli, tmp_path):
    code, _, err = cli("import", "torch-cvs", tmp_path / "x.csv", "--plan",
                       PLANS / "1f1b-4stage.yaml")
    assert (code, err) == (2, "error: unknown import format 'torch-cvs' (hint: did you mean "
                              "'torch-csv'?)\n")
    code, _, err = cli("import", "torch-csv", tmp_path / "x.csv", "--plan",
                       PLANS / "1f1b-4stage.yaml")
    assert (code, err) == (2, f"error: cannot read {tmp_path / 'x.csv'}: No such file or "
                              "directory\n")


# ---------------------------------------------------------------- in torch's own runtime

_PLAIN = """\
pyplan: 1
name: {name}
devices: {devices}
micro_batches: {n}
training: {{backward: {{time_ratio: 2{split}}}}}
blocks:
{blocks}
model:
  module: plain:model
  stages:
{stages}
  data: plain:batch
  loss: plain:loss
"""


def _plain_plan(name: str, devices: list[int], units: list[list[str]], n: int, split: str):
    blocks = "\n".join(f"  - {{name: stage{s}, devices: [{d}], time: 2, memory: 1}}"
                       for s, d in enumerate(devices))
    stages = "\n".join(f"    stage{s}: {json.dumps(u)}" for s, u in enumerate(units))
    return _PLAIN.format(name=name, devices=max(devices) + 1, n=n, split=split, blocks=blocks,
                         stages=stages)


@pytest.mark.torchrun
@pytest.mark.parametrize("placement", ["interleaved", "zb-v", "zb-v-fsdp"])
def test_an_exported_schedule_trains_the_same_losses_in_torchs_runtime(tmp_path, placement):
    """torch-csv of an interleaved plan (8 stages on 4 ranks), of a ZB-V plan (the wave
    placement with a split backward: 4 stages on 2 ranks, I and W actions) and of the same
    with two FSDP2 shards of each stage (2 x 2 ranks: the stage modules wrapped by
    fully_shard) runs in torch.distributed.pipelining's _PipelineScheduleRuntime, which
    torchtitan uses for `pipeline_parallel_schedule_csv`, with the same modules, batches and
    SGD: the same losses as `pyplan run`."""
    import shutil
    import subprocess
    import sys

    models = Path(__file__).resolve().parent / "models"
    for name in ("plain.py", "torch_runtime.py"):
        shutil.copy(models / name, tmp_path / name)
    layers = [f"layers.{i}" for i in range(8)]
    if placement == "interleaved":
        units = [["embed", layers[0]]] + [[x] for x in layers[1:7]] + [[layers[7], "head"]]
        text = _plain_plan(placement, [s % 4 for s in range(8)], units, 8, "")
    else:
        units = [["embed"] + layers[:2], layers[2:4], layers[4:6], layers[6:] + ["head"]]
        text = _plain_plan("zb-v", [0, 1, 1, 0], units, 4, ", weight_time_ratio: 1")
        if placement == "zb-v-fsdp":
            text = text.replace("micro_batches: ", "mesh: {data: 2, shard: true}\nmicro_batches: ")
    (tmp_path / f"{placement}.yaml").write_text(text)
    ranks = 2 if placement == "zb-v" else 4
    pyplan = str(Path(sys.executable).with_name("pyplan"))

    def run(*args, command=(pyplan,)):
        result = subprocess.run([*command, *map(str, args)], capture_output=True, text=True,
                                cwd=tmp_path, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    run("solve", f"{placement}.yaml", "--quiet")
    resolved = f"{placement}.resolved.yaml"
    run("export", resolved, "--format", "torch-csv", "-o", "schedule.csv")
    ours = json.loads(run("run", resolved, "--nproc-per-node", ranks, "--iterations", 3,
                          "--json", "--device", "cpu").splitlines()[-1])["losses"]
    done = torchrun("torch_runtime.py", resolved, "schedule.csv", 3, nproc=ranks, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = [float(x) for x in re.findall(r"loss ([0-9.]+)", done.stdout)]
    assert len(theirs) == 3
    assert theirs == pytest.approx(ours, abs=1e-5)
