"""Property tests: whatever a user writes, loading a plan fails only with PlanError."""

from __future__ import annotations

import copy

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import spec_plans
from pyplan.errors import PlanError
from pyplan.problem import build_problem
from pyplan.planfile import spec_from_text

PLAN_DATA = [yaml.safe_load(p.read_text()) for p in spec_plans()]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 40), st.floats(allow_nan=False),
                    st.text(max_size=12), st.sampled_from(["all", "0..3", "4GiB", "m", "a.b"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)


def load_text(text: str) -> None:
    try:
        build_problem(spec_from_text(text, "fuzz.yaml"))
    except PlanError as exc:
        rendered = str(exc)
        assert rendered.startswith("fuzz.yaml:") and "\n" not in rendered


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated_plans(draw):
    doc = copy.deepcopy(draw(st.sampled_from(PLAN_DATA)))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        path = draw(st.sampled_from(paths))
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        action = draw(st.sampled_from(["replace", "delete", "add", "duplicate"]))
        key = path[-1]
        if action == "replace":
            parent[key] = draw(values)
        elif action == "delete":
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(values)
        elif action == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
    return yaml.safe_dump(doc, sort_keys=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_plans())
def test_mutated_plans_fail_only_with_plan_error(text):
    load_text(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_random_text_fails_only_with_plan_error(text):
    load_text(text)


@settings(max_examples=200, deadline=None)
@given(values)
def test_random_yaml_documents_fail_only_with_plan_error(doc):
    load_text(yaml.safe_dump(doc))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["pyplan", "name", "devices", "micro_batches", "memory",
                                        "task", "blocks", "shape", "constraints", "training"]),
                       values, max_size=9))
def test_random_plan_shaped_documents_fail_only_with_plan_error(doc):
    load_text(yaml.safe_dump(doc))
