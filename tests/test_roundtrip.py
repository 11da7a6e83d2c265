"""What solve writes, pyplan reads back: for random plans drawn from every round-2 feature
(topology, transfers, output sizes, recompute, weights, mesh, model: sections, shapes), every
plan solve accepts gives a resolved plan that validates, shows, exports and dry-runs."""

from __future__ import annotations

import itertools
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyplan.cli import main

EXAMPLES = int(os.environ.get("PYPLAN_ROUNDTRIP_EXAMPLES", "30"))
_MODULES = itertools.count()

MODEL = '''
import torch

def build(name, group):
    return torch.nn.Linear(4, 4)

def whole():
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(UNITS)])

def batch(step):
    return torch.randn(8, 4), torch.randn(8, 4)

def loss(output, target):
    return ((output - target) ** 2).mean()
'''


@st.composite
def plans(draw) -> str:
    """A plan text using the round-2 features (mostly valid: blocks with balanced memory)."""
    devices = draw(st.integers(1, 4))
    training = draw(st.booleans())
    lines = ["pyplan: 1", "name: rt", f"devices: {devices}",
             f"micro_batches: {draw(st.integers(1, 8))}"]
    sizes = draw(st.booleans())
    unit = (lambda x: f'"{x}KiB"') if sizes else str
    if draw(st.booleans()):
        lines.append(f"memory: {unit(draw(st.integers(20, 60)))}")
    if training:
        ratio = draw(st.sampled_from(["1", "2", "1.5"]))
        split = draw(st.booleans())
        lines.append(f"training: {{backward: {{time_ratio: {ratio}"
                     + (", weight_time_ratio: 1" if split else "") + "}, recompute: "
                     + draw(st.sampled_from(["never", "always", "auto"])) + "}")
    else:
        lines.append("task: inference")
    if draw(st.booleans()):
        time_unit = draw(st.sampled_from(["0.5", "1", "0.01", "1.0e-7", "1.0e+5"]))
        latency = draw(st.sampled_from(["0", "0.5"]))
        lines.append(f"topology: {{devices_per_node: {draw(st.integers(1, 4))}, time_unit_ms: "
                     f"{time_unit}, across_nodes: {{bandwidth: \"1GB\", latency_ms: {latency}}}}}")
    if training and devices > 1 and draw(st.booleans()):
        lines.append(f"mesh: {{data: {draw(st.integers(1, 3))}, shard: "
                     f"{str(draw(st.booleans())).lower()}, sync: {draw(st.integers(0, 3))}}}")
    count = draw(st.integers(1, 6))
    lines.append("blocks:")
    for i in range(count):
        memory = draw(st.integers(0, 4)) if training else 0
        extra = []
        if draw(st.booleans()):
            extra.append(f"weights: {unit(draw(st.integers(0, 3)))}")
        transfer = draw(st.sampled_from([None, "transfer: 2", 'output: "64MiB"']))
        if transfer:
            extra.append(transfer)
        if training and draw(st.integers(0, 3)) == 0:
            extra.append(f"recompute: {draw(st.sampled_from(['never', 'always', 'auto']))}")
            extra.append(f"recompute_memory: {unit(min(memory, 1))}")
        if i and draw(st.integers(0, 3)) == 0:
            extra.append(f"after: [b{draw(st.integers(0, i - 1))}]")
        where = draw(st.sampled_from(["one", "one", "all"]))
        on = "all" if where == "all" else f"[{draw(st.integers(0, devices - 1))}]"
        lines.append(f"  - {{name: b{i}, devices: {on}, time: {draw(st.integers(1, 5))}, "
                     f"memory: {unit(memory)}" + "".join(f", {x}" for x in extra) + "}")
    if draw(st.booleans()):
        lines.append("model: {blocks: 'rtmodel:build', data: 'rtmodel:batch', "
                     "loss: 'rtmodel:loss', path: '.'}")
    else:
        stages = ", ".join(f"b{i}: ['{i}']" for i in range(count))
        lines.append(f"model: {{module: 'rtmodel:whole', stages: {{{stages}}}, "
                     "data: 'rtmodel:batch', loss: 'rtmodel:loss', path: '.'}")
    return "\n".join(lines) + "\n", count


def _run(*args) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, err.getvalue()


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(drawn=plans())
def test_every_plan_solve_accepts_reads_back(drawn, tmp_path):
    text, units = drawn
    module = f"rtmodel{next(_MODULES)}"  # (a module imported once stays imported here)
    text = text.replace("rtmodel:", f"{module}:")
    (tmp_path / f"{module}.py").write_text(MODEL.replace("UNITS", str(units)))
    plan = tmp_path / "rt.yaml"
    plan.write_text(text)
    out = tmp_path / "rt.resolved.yaml"
    out.unlink(missing_ok=True)
    code, err = _run("solve", plan, "--time-limit", "2", "--quiet")
    assert code in (0, 2, 3) and err.count("\n") <= 10, err
    if code != 0:
        assert not out.exists()
        return
    for command in (("validate", out), ("show", out), ("show", out, "--full"),
                    ("export", out, "--format", "svg", "-o", tmp_path / "o.svg"),
                    ("export", out, "--format", "chrome", "-o", tmp_path / "o.json"),
                    ("run", out, "--dry-run")):
        code, err = _run(*command)
        assert (code, err) == (0, ""), (command, text)
    # The trainers' formats fit some placements only: they say which when they do not.
    for fmt in ("torch-csv", "megatron-layout", "torchtitan"):
        code, err = _run("export", out, "--format", fmt, "-o", tmp_path / "o.txt")
        assert code in (0, 2) and err.count("\n") == (code == 2), (fmt, err, text)
    if _run("export", out, "--format", "torch-csv", "-o", tmp_path / "o.csv")[0] == 0:
        code, err = _run("import", "torch-csv", tmp_path / "o.csv", "--plan", out)
        assert (code, err) == (0, ""), text
