"""Every example plan validates; the schema is a valid JSON Schema; shapes expand as documented."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import PLANS, example_plans, spec_plans
from pyplan.resolved.seal import reseal
from pyplan.problem import load_problem
from pyplan.planfile import spec_from_text
from pyplan.problem import build_problem
from pyplan.planfile.schema import schema_path


def test_schema_is_valid_json_schema():
    schema = json.loads(schema_path().read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize("plan", spec_plans(), ids=lambda p: p.stem)
def test_example_plan_validates(plan, cli):
    code, out, err = cli("validate", plan)
    assert (code, err) == (0, "")
    assert out.startswith(f"{plan}: ok: ")


def test_validate_every_file_in_plans_including_resolved_ones(cli, tmp_path):
    code, out, err = cli("validate", *example_plans())
    assert (code, err) == (0, "")
    assert out.count("verified and fresh") == len(example_plans()) - len(spec_plans())
    # An edited resolved plan fails as a resolved plan, at its own line.
    edited = tmp_path / "v.resolved.yaml"
    text = (PLANS / "tessel-vshape.resolved.yaml").read_text()
    edited.write_text(text.replace("makespan: 76", "makespan: 75"))
    code, out, err = cli("validate", edited)
    assert code == 2 and err.startswith(f"{edited}:") and \
        "'makespan' is not as pyplan wrote it" in err
    edited.write_text(reseal(text.replace("makespan: 76", "makespan: 75")))
    code, out, err = cli("validate", edited)
    assert code == 2 and err.startswith(f"{edited}:") and "makespan does not match" in err


def test_example_plans_cover_the_papers():
    names = {p.stem for p in spec_plans()}
    for required in ("tessel-vshape", "tessel-xshape", "tessel-mshape", "tessel-nnshape",
                     "tessel-kshape", "tessel-kshape-inference", "1f1b-4stage", "1f1b-8stage",
                     "interleaved-1f1b", "zero-bubble", "alphafold2-3f1b", "mshape-32"):
        assert required in names


@pytest.mark.parametrize("plan", spec_plans(), ids=lambda p: p.stem)
def test_a_plan_that_names_its_time_unit_sets_it(plan):
    """A description saying what one time unit is (as partition writes it) comes with
    topology.time_unit_ms of that value, or pyplan run predicts no time for it."""
    import re

    from pyplan.planfile import load_spec

    spec = load_spec(plan)
    said = re.search(r"one time unit\s*=\s*([0-9.]+) ms", spec.description or "")
    if said:
        assert spec.topology.time_unit_ms == pytest.approx(float(said.group(1)), rel=1e-3), \
            plan.name


def test_editor_schema_comment_points_at_the_schema():
    for plan in spec_plans():
        first = plan.read_text().splitlines()[0]
        assert first == "# yaml-language-server: $schema=../schemas/plan.schema.json", plan


def test_validate_many_reports_each(cli):
    code, out, err = cli("validate", PLANS / "tessel-vshape.yaml",
                         PLANS.parent / "tests/plans/invalid/zero-time.yaml")
    assert code == 2
    assert out.count("ok:") == 1
    assert err.count("error:") == 1


def test_vshape_summary(cli):
    code, out, _ = cli("validate", PLANS / "tessel-vshape.yaml")
    assert code == 0
    assert out.strip().endswith("load per device [4 4 4 4], repetend period >= 4")
    assert "8 blocks (4 forward, 4 backward) on 4 devices, 16 micro-batches, memory 8" in out


def _problem(text):
    return build_problem(spec_from_text(text))


HEAD = "pyplan: 1\nname: t\ndevices: 4\nmicro_batches: 4\n"


def test_mshape_expansion():
    p = _problem(HEAD + "training: {backward: {time_ratio: 3}}\n"
                 "shape: {kind: mshape, stage: {time: 1, memory: 1}, "
                 "shared: {time: 1, memory: 0, backward: {time: 1, memory: 0}}}\n")
    names = [b.name for b in p.blocks]
    assert names[:5] == ["embed", "stage0", "stage1", "stage2", "stage3"]
    embed_b = p.block("embed.b")
    assert (embed_b.time, embed_b.memory, embed_b.devices) == (1, 0, (0, 1, 2, 3))
    assert p.block("stage2.b").time == 3 and p.block("stage2.b").memory == -1
    edges = {(p.blocks[a].name, p.blocks[b].name) for a, b in p.edges}
    assert ("stage3", "stage3.b") in edges
    assert ("stage0.b", "embed.b") in edges
    assert ("stage3.b", "stage2.b") in edges
    assert p.load_bound() == 6


def test_kshape_branches_join_at_cross():
    p = _problem(HEAD + "training: {backward: {time_ratio: 3}}\n"
                 "shape: {kind: kshape, stage: {time: 1, memory: 1}, "
                 "shared: {time: 1, memory: 1, backward: {time: 1, memory: -1}}}\n")
    edges = {(p.blocks[a].name, p.blocks[b].name) for a, b in p.edges}
    assert {("left1", "cross"), ("right1", "cross"), ("left0", "left1"),
            ("right0", "right1"), ("cross", "cross.b"), ("cross.b", "left1.b"),
            ("cross.b", "right1.b")} <= edges
    assert ("left1", "right0") not in edges
    assert p.block("right0").devices == (2,)


def test_interleaved_round_robin_and_xshape_directions():
    p = _problem(HEAD + "training: {backward: {time_ratio: 2}}\n"
                 "shape: {kind: interleaved, chunks: 3}\n")
    assert [p.block(f"stage{s}").devices for s in range(12)] == [(s % 4,) for s in range(12)]
    x = _problem(HEAD + "training: {backward: {time_ratio: 2}}\nshape: {kind: xshape}\n")
    assert x.block("up0").devices == (3,) and x.block("down0").devices == (0,)
    assert not any(x.blocks[b].name == "up0" for _, b in x.edges)
    w = _problem(HEAD + "training: {backward: {time_ratio: 2}}\nshape: {kind: wave}\n")
    assert [w.block(f"stage{s}").devices[0] for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_training_without_options_takes_the_schemas_defaults():
    # No training: section: a backward per forward block, twice its time (time_ratio 2).
    p = _problem(HEAD + "shape: {kind: vshape, stage: {time: 3, memory: 1}}\n")
    assert [(b.name, b.time, b.memory) for b in p.blocks if b.kind == "backward"] == \
        [(f"stage{s}.b", 6, -1) for s in range(4)]


def test_split_backward_and_weight_memory():
    p = _problem(HEAD + "training: {backward: {time_ratio: 1, weight_time_ratio: 2, "
                 "weight_memory_ratio: 0.5}}\nshape: {kind: vshape, stage: {time: 2, memory: 4}}\n")
    b, w = p.block("stage1.b"), p.block("stage1.w")
    assert (b.kind, b.time, b.memory) == ("backward", 2, -2)
    assert (w.kind, w.time, w.memory) == ("weight", 4, -2)
    edges = {(p.blocks[a].name, p.blocks[c].name) for a, c in p.edges}
    assert ("stage1.b", "stage1.w") in edges and ("stage1.b", "stage0.b") in edges


def test_memory_sizes_are_bytes():
    p = _problem("pyplan: 1\nname: t\ndevices: 2\nmemory: 1GiB\nmicro_batches: 2\n"
                 "training: {backward: {time_ratio: 2}}\n"
                 "blocks:\n  - {name: a, time: 1, memory: 512MiB, devices: [0]}\n"
                 "  - {name: c, time: 1, memory: 0.25GiB, devices: all}\n")
    assert p.memory_capacity == 2**30
    assert p.block("a").memory == 2**29 and p.block("c.b").memory == -(2**28)
    assert p.show_memory(p.memory_capacity) == "1GiB"


def test_templated_rules_expand_per_stage():
    p = load_problem(PLANS / "1f1b-4stage.yaml")
    texts = [r.text for r in p.rules]
    assert "stage0.f[m+3] < stage0.b[m]" in texts
    assert "stage3.b[m] < stage3.f[m+1]" in texts
    rule = next(r for r in p.rules if r.text == "stage1.f[m+2] < stage1.b[m]")
    assert (p.blocks[rule.before].name, rule.before_shift) == ("stage1", 2)
    assert (p.blocks[rule.after].name, rule.after_shift) == ("stage1.b", 0)


def test_af2_condition_sets_min_m():
    p = load_problem(PLANS / "alphafold2-3f1b.yaml")
    rule = next(r for r in p.rules if r.text.startswith("f3_s1[m] < f3_s1.b"))
    assert rule.text == "f3_s1[m] < f3_s1.b[m-2] if m > 2"
    assert (rule.after_shift, rule.min_m) == (-2, 3)


def test_validate_names_replicas_and_weights(cli):
    code, out, err = cli("validate", PLANS / "transformer-vshape-dp2.yaml", PLANS / "gpt24.yaml")
    assert (code, err) == (0, "")
    dp2, gpt24 = out.splitlines()
    assert "on 2 devices x 2 data-parallel replicas," in dp2
    assert "memory 64MiB, weights per device [" in gpt24
