"""A corpus of broken plans, each asserting its exact one-line error and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import INVALID, PLANS

EXPECTED = {
    'backward-in-inference':
        "8:26: error: block 'a_grad' is a backward block in an inference plan (hint: set task: training or remove the block)",
    'bad-memory-size':
        '4:9: error: memory has an invalid form: \'16 gigs\' (hint: write an integer or a size like "32GiB", "512MiB", "1.5GB")',
    'bad-model-path':
        "9:11: error: model.blocks has an invalid form: 'examples/gpt.py' (hint: write module.path:function)",
    'bad-name':
        "7:12: error: blocks[0].name has an invalid form: 'stage 0' (hint: start with a letter or '_' and use letters, digits, '_' and '-')",
    'bad-task':
        "5:7: error: task must be one of training, inference; got 'inferense' (hint: did you mean 'inference'?)",
    'block-exceeds-memory':
        "9:36: error: block 'embed' alone needs 20GiB per device, more than the capacity 16GiB (hint: split the block over more devices or raise memory:)",
    'constraint-bad-index':
        '12:7: error: malformed order rule: expected a block reference like name[m+1] at \'s0.f[n+2] < s0.b[m]\' (hint: write rules like "stage0.f[m+4] < stage0.b[m]" (optionally ending with "if m >= 2"))',
    'constraint-malformed':
        '12:19: error: malformed order rule: expected a block reference like name[m+1] at \'= s0.b[m]\' (hint: write rules like "stage0.f[m+4] < stage0.b[m]" (optionally ending with "if m >= 2"))',
    'constraint-template-name':
        "10:14: error: malformed order rule: unknown name 'P' in {P-s} (hint: known: D, N, s)",
    'constraint-trailing':
        '10:34: error: malformed order rule: unexpected text \'when m > 2\' (hint: write rules like "stage0.f[m+4] < stage0.b[m]" (optionally ending with "if m >= 2"))',
    'constraint-contradicts-dependency':
        "13:7: error: order rule 'stage0.b[m+2] < stage1.f[m+2]' contradicts the dependencies: stage0.b depends on stage1 within a micro-batch (hint: swap the two sides or change a shift)",
    'constraint-unknown-block':
        "12:24: error: order rule 'stage0.f[m+1] < stage9.b[m]' names unknown block 'stage9.b' (hint: did you mean 'stage1.b'?)",
    'cycle':
        '7:38: error: dependency cycle: a -> b -> c -> a (hint: a block cannot depend, directly or not, on itself; fix after:)',
    'device-listed-twice':
        "7:33: error: block 'a' lists a device twice",
    'device-out-of-range':
        "8:37: error: block 'b' uses device 2, but the plan has 2 devices (0..1) (hint: raise devices: or fix the device id)",
    'duplicate-block-name':
        "9:12: error: duplicate block name 'embed' (hint: first declared on line 7; block names must be unique)",
    'duplicate-key-nested':
        "10:5: error: duplicate key 'time' (hint: it was first set on line 8; remove one of them)",
    'duplicate-key':
        "5:1: error: duplicate key 'devices' (hint: it was first set on line 3; remove one of them)",
    'empty':
        '1:1: error: the file is empty (hint: start from an example in plans/)',
    'inference-with-training':
        '6:1: error: an inference plan has no training options (hint: remove training: or set task: training)',
    'interleaved-stages':
        '7:36: error: interleaved needs stages to be a multiple of devices (4), got 6',
    'memory-unbalanced':
        '8:32: error: memory does not balance on device 1: one micro-batch leaves 2 allocated (hint: backward blocks must free what forward blocks allocate (for inference plans use memory 0))',
    'missing-block-time':
        "7:5: error: missing required key 'time' in blocks[0] (hint: Execution time in integer steps (1 .. 1000000).)",
    'missing-required':
        "1:1: error: missing required key 'micro_batches' in the plan (hint: Number of micro-batches per iteration (N), at most 100000.)",
    'mixed-memory-units':
        '10:32: error: memory is a plain integer here but not on line 4 (hint: use one unit per plan: all sizes like "2GiB" or all integers)',
    'negative-time':
        "7:21: error: block 'a' has time -2; times must be positive integers (hint: use 1 for negligible work)",
    'neither-shape-nor-blocks':
        '1:1: error: the plan has neither blocks nor a shape (hint: add blocks: (one micro-batch) or shape: {kind: vshape})',
    'not-a-mapping':
        '1:1: error: a plan must be a mapping of keys to values (hint: start from an example in plans/)',
    'python-tag':
        "2:7: error: YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed in a plan (hint: plans hold plain data: remove the tag)",
    'self-dependency':
        "8:46: error: block 'b' depends on itself",
    'shape-and-blocks':
        '6:1: error: a plan has either blocks or a shape, not both (hint: remove shape: to list blocks by hand)',
    'shape-stage-list-length':
        '9:17: error: time lists 3 values for 4 stage blocks (hint: give one number for all stages or exactly 4 values)',
    'shape-stages-mismatch':
        '7:31: error: vshape places one stage per device: stages must be 4, got 8 (hint: use kind: interleaved for several stages per device)',
    'unknown-after':
        "8:52: error: block 'decoder' depends on unknown block 'encodr' (hint: did you mean 'encoder'?)",
    'unknown-key-block':
        "8:15: error: unknown key 'tme' in blocks[1] (hint: did you mean 'time'?)",
    'unknown-key-search':
        "9:3: error: unknown key 'time_limt' in search (hint: did you mean 'time_limit'?)",
    'unknown-key-top':
        "4:1: error: unknown key 'micro_batchs' (hint: did you mean 'micro_batches'?)",
    'unknown-shape':
        "6:15: error: shape.kind must be one of vshape, interleaved, xshape, mshape, nnshape, kshape, wave; got 'wshape' (hint: did you mean 'xshape'?)",
    'version-missing':
        "1:1: error: missing the format version 'pyplan: 1' (hint: add `pyplan: 1` as the first line)",
    'version-unsupported':
        '1:9: error: unsupported plan format version 2 (hint: this pyplan reads version 1; upgrade pyplan or convert the plan)',
    'wrong-block-devices':
        "7:33: error: blocks[0].devices has the wrong form: 'everywhere' (hint: write a device id, a list like [0, 1], or all)",
    'wrong-type-devices':
        "3:10: error: devices must be an integer or a list, got 'four'",
    'wrong-type-time':
        "7:21: error: blocks[0].time must be an integer, got 'fast'",
    'yaml-syntax':
        "4:14: error: YAML syntax: did not find expected ',' or ']' (hint: check indentation, quotes and colons)",
    'yaml-tab-indent':
        '4:1: error: YAML syntax: found character that cannot start any token (hint: check indentation, quotes and colons)',
    'zero-micro-batches':
        '4:16: error: micro_batches must be >= 1, got 0',
    'zero-time':
        "8:21: error: block 'b' has time 0; times must be positive integers (hint: use 1 for negligible work)",
}


def test_corpus_is_complete():
    files = {p.stem for p in INVALID.glob("*.yaml")}
    assert files == set(EXPECTED)
    assert len(files) >= 30


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_plan_reports_one_line(name, cli):
    path = INVALID / f"{name}.yaml"
    code, out, err = cli("validate", path)
    assert code == 2
    assert out == ""
    assert err == f"{path}:{EXPECTED[name]}\n"


def test_missing_file(cli, tmp_path):
    code, _, err = cli("validate", tmp_path / "nope.yaml")
    assert code == 2
    assert err == f"{tmp_path / 'nope.yaml'}:1:1: error: no such file (hint: check the path)\n"


def test_not_utf8(cli, tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"pyplan: 1\nname: caf\xe9\n")
    code, _, err = cli("validate", path)
    assert code == 2
    assert err == f"{path}:2:1: error: the file is not valid UTF-8 text (hint: save it as UTF-8)\n"


def test_a_plan_that_passed_the_schema_skips_it_next_time(tmp_path):
    # The second load of the same text does not import jsonschema (a tenth of a second);
    # a text that fails is never remembered, so it fails every time.
    cache = tmp_path / "cache"
    plan = tmp_path / "plan.yaml"
    plan.write_text((PLANS / "tessel-vshape.yaml").read_text())
    bad = tmp_path / "bad.yaml"
    bad.write_text((PLANS / "tessel-vshape.yaml").read_text() + "surprise: 1\n")
    code = ("import sys; from pyplan.planfile import load_spec\n"
            "try:\n    load_spec(sys.argv[1]); print('ok')\n"
            "except Exception as exc: print(type(exc).__name__)\n"
            "print('jsonschema' in sys.modules)")
    env = dict(os.environ, PYPLAN_CACHE_DIR=str(cache))

    def load(path, environ=env):
        out = subprocess.run([sys.executable, "-c", code, str(path)], env=environ,
                             capture_output=True, text=True, timeout=60).stdout.split()
        return out[0], out[1] == "True"

    assert load(plan) == ("ok", True)
    assert load(plan) == ("ok", False)
    assert load(bad) == ("PlanError", True) and load(bad) == ("PlanError", True)
    assert len(list((cache / "valid-plans").iterdir())) == 1
    # Turned off, or where nothing can be written, it validates every time.
    assert load(plan, dict(env, PYPLAN_CACHE_DIR="")) == ("ok", True)
    (tmp_path / "file").write_text("")
    assert load(plan, dict(env, PYPLAN_CACHE_DIR=str(tmp_path / "file"))) == ("ok", True)
    assert load(plan, dict(env, PYPLAN_CACHE_DIR=str(tmp_path / ("x" * 300)))) == ("ok", True)
