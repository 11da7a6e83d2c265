"""Hostile and broken plans: each ends in one `FILE:LINE:COL: error:` line and exit 2, in a
process capped at 1 GiB of memory and 10 s of CPU time (a hang or a blow-up fails the test; the
wall clock only catches a process that waits without computing, with room for a busy machine)."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys

import pytest

HEAD = "pyplan: 1\nname: t\ndevices: 2\nmicro_batches: 4\n"
VSHAPE = "shape: {kind: vshape}\n"


def _laughs() -> str:
    lines = ["pyplan: 1", "a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 30)]
    return "\n".join(lines) + "\n"


def _merge_bomb() -> str:
    lines = ["m0: &m0 {k0: 1}"]
    lines += [f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}], k{i}: 1}}" for i in range(1, 40)]
    return "\n".join(lines) + "\n"


CASES = {
    # YAML structure
    "recursive-alias": ("a: &a [*a]\n", "an alias refers to a node that contains it"),
    "deep-nesting": ("x: " + "[" * 20000 + "]" * 20000 + "\n", "nested"),
    "billion-laughs": (_laughs(), "expands to more than 1,000,000 values"),
    "merge-bomb": (_merge_bomb(), "expands to more than 1,000,000 values"),
    "bad-int-tag": ("pyplan: !!int x\n", "cannot read this value as int"),
    "bad-bool-tag": ("pyplan: !!bool x\n", "cannot read this value as bool"),
    "bad-timestamp-tag": ("pyplan: 1\nt: !!timestamp x\n", "cannot read this value as timestamp"),
    "merge-as-value": ("pyplan: 1\nname: <<\n", "cannot read this value as merge"),
    "merge-of-a-number": ("pyplan: 1\n<<: 5\n", "<< merges a mapping"),
    # numbers
    "thousand-digit-integer": (HEAD + VSHAPE + "memory: " + "9" * 5000 + "\n",
                               "the number has too many digits"),
    "size-beyond-2^60": (HEAD + VSHAPE + 'memory: "999999999999GiB"\n', "2^60"),
    "size-as-exponent": (HEAD + VSHAPE + 'memory: "1e30GiB"\n', "invalid form"),
    "micro-batches-2^31": ("pyplan: 1\nname: t\ndevices: 2\nmicro_batches: 2147483648\n"
                           + VSHAPE, "micro_batches must be <= 100000"),
    "devices-2e9": ("pyplan: 1\nname: t\ndevices: 2e9\nmicro_batches: 2\n" + VSHAPE,
                    "devices must be an integer"),
    "devices-10^5-with-a-shape": ("pyplan: 1\nname: t\ndevices: 100000\nmicro_batches: 2\n"
                                  + VSHAPE, "devices must be <= 4096"),
    "huge-time": (HEAD + "shape: {kind: vshape, stage: {time: 99999999999}}\n",
                  "must be <= 1000000"),
    "nan-ratio": (HEAD + "training: {backward: {time_ratio: .nan}}\n" + VSHAPE,
                  "time_ratio must be a finite number"),
    "inf-ratio": (HEAD + "training: {backward: {time_ratio: .inf}}\n" + VSHAPE,
                  "training.backward.time_ratio must be a finite number, got inf"),
    "huge-shift": (HEAD + VSHAPE + 'constraints: {order: ["stage0.f[m+99999999999] < '
                   'stage0.b[m]"]}\n', "the shift +99999999999 is beyond"),
    "huge-loop": (HEAD + VSHAPE + 'constraints: {order: [{rule: "stage0.f[m+{s}] < '
                  'stage0.b[m]", for: {s: "0..100000000"}}]}\n', "has more than 100,000"),
    # structure the loader cannot recurse into, keys that are not names
    "nested-100000-levels": ("x: " + "[" * 100000 + "]" * 100000 + "\n",
                             "nested more than 64 levels deep"),
    "nested-mappings-100000-levels": ("x: " + "{a: " * 100000 + "1" + "}" * 100000 + "\n",
                                      "nested more than 64 levels deep"),
    "duplicate-anchor": ("pyplan: 1\na: &x 1\nb: &x 2\n", "found duplicate anchor"),
    "loop-variable-integer-key": (HEAD + VSHAPE + 'constraints: {order: [{rule: "stage{s}.f[m] '
                                  '< stage{s}.b[m]", for: {1: "0..1"}}]}\n',
                                  "this key reads as 1, not as a name"),
    "loop-variable-D": (HEAD + VSHAPE + 'constraints: {order: [{rule: "stage{D}.f[m] < '
                        'stage0.b[m]", for: {D: "0..1"}}]}\n', "'D' cannot be a loop variable"),
    "key-yes": (HEAD + VSHAPE + "yes: 1\n", "this key reads as true, not as a name"),
    # model: and round-2 keys that contradict each other
    "model-key-misspelt": (HEAD + VSHAPE + 'model: {stags: {stage0: [a]}, module: "a:b", '
                           'data: "a:b", loss: "a:b"}\n',
                           "unknown key 'stags' in model (hint: did you mean 'stages'?)"),
    "model-module-without-stages": (HEAD + VSHAPE + 'model: {module: "a:b", data: "a:b", '
                                    'loss: "a:b"}\n', "missing required key 'stages' in model"),
    "traced-with-blocks": (HEAD + VSHAPE + 'model: {blocks: "a:b", traced: true, data: "a:b", '
                           'loss: "a:b"}\n', "traced applies to a model given as module"),
    "output-with-transfer": (HEAD + "blocks:\n  - {name: a, devices: [0], time: 1, transfer: 2,"
                             ' output: "1MiB"}\n', "its transfer time or its output size, not"),
    "shape-output-with-transfer": (HEAD + 'shape: {kind: vshape, stage: {transfer: 1, output: '
                                   '"1MiB"}}\n', "its transfer time or its output size, not"),
    "same-unit-in-two-stages": (HEAD + VSHAPE + 'model: {module: "a:b", stages: {stage0: [a, b],'
                                ' stage1: [b]}, data: "a:b", loss: "a:b"}\n',
                                "submodule 'b' is listed again"),
    "parent-and-child-unit": (HEAD + VSHAPE + 'model: {module: "a:b", stages: {stage0: '
                              '[layers.0], stage1: [layers]}, data: "a:b", loss: "a:b"}\n',
                              "submodule 'layers' overlaps 'layers.0'"),
    # what solve would compute from the plan stays in the supported ranges
    "nan-time-unit": (HEAD + VSHAPE + "topology: {time_unit_ms: .nan}\n",
                      "topology.time_unit_ms must be a finite number, got nan"),
    "nan-latency": (HEAD + VSHAPE + "topology: {within_node: {latency_ms: .nan}}\n",
                    "topology.within_node.latency_ms must be a finite number, got nan"),
    "inf-time-limit": (HEAD + VSHAPE + "search: {time_limit: .inf}\n",
                       "search.time_limit must be a finite number, got inf"),
    "huge-time-limit": (HEAD + VSHAPE + "search: {time_limit: 1.0e+300}\n",
                        "search.time_limit must be <= 1000000"),
    "tiny-time-unit": (HEAD + 'shape: {kind: vshape, stage: {output: "1MiB"}}\n'
                       "topology: {time_unit_ms: 1.0e-300}\n",
                       "time units to send, more than the supported 1,000,000"),
    "output-1024PiB": (HEAD + 'shape: {kind: vshape, stage: {output: "1024PiB"}}\n',
                       "the output of 'stage0' takes 11,529,215,046 time units to send"),
    "size-beyond-2^60-true-figure": (HEAD + 'shape: {kind: vshape, stage: {output: "1025PiB"}}'
                                     "\n", "'1025PiB' (1,154,047,404,513,689,600 bytes) is more "
                                     "than the largest supported amount"),
    "derived-backward-too-long": (HEAD + "training: {backward: {time_ratio: 3}}\n"
                                  "shape: {kind: vshape, stage: {time: 1000000}}\n",
                                  "the backward of 'stage0' takes 3,000,000 time units (time "
                                  "1,000,000 x ratio 3)"),
    "recompute-past-the-time-limit": (HEAD + "training: {backward: {time_ratio: 1}, recompute: "
                                      "always}\nshape: {kind: vshape, stage: {time: 600000}}\n",
                                      "recomputing 'stage0' makes its backward take 1,200,000"),
    "summed-weights-beyond-2^60": (HEAD + "blocks:\n" + "".join(
        f'  - {{name: b{i}, devices: [0], time: 1, weights: "1024PiB"}}\n' for i in range(20)),
        "the weights on device 0 sum to 20EiB (23,058,430,092,136,939,520)"),
    "summed-activations-beyond-2^62": (HEAD + "blocks:\n" + "".join(
        f'  - {{name: b{i}, devices: [0], time: 1, memory: "1024PiB"}}\n' for i in range(20)),
        "device 0 could hold 80EiB (92,233,720,368,547,758,080: its weights and 4 micro-batches'"),
    "block-alone-with-its-weights": (HEAD + "memory: 10\nshape: {kind: vshape, stage: {time: 1,"
                                     " memory: 6, weights: 6}}\n", "block 'stage0' alone needs "
                                     "12 per device (6 and the weights on device 0, 6), more "
                                     "than the capacity 10"),
    "loops-multiply": (HEAD + VSHAPE + 'constraints: {order: [{rule: "stage0.f[m+{s}] < '
                       'stage0.b[m+{t}]", for: {s: "0..999", t: "0..999"}}]}\n',
                       "expand to more than 100,000 rules"),
}


CPU_SECONDS = 10  # past it the kernel ends the process (SIGXCPU)
WALL_SECONDS = 120  # a process waiting without computing (a hang) ends here


def _limited(cpu_seconds: int = CPU_SECONDS):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    return limit


def _validate(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyplan", "validate", str(path)],
                          capture_output=True, text=True, timeout=WALL_SECONDS,
                          preexec_fn=_limited(), cwd=path.parent)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_plan_is_one_line_error(name, tmp_path):
    text, expected = CASES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    result = _validate(path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert re.match(rf"{re.escape(str(path))}:\d+:\d+: error: ", result.stderr), result.stderr
    assert expected in result.stderr


def test_files_that_never_end_or_are_too_large(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (9 * 2**20) + "\n")
    for path in (big, tmp_path.parent / "dev-zero-link.yaml"):
        if path.name == "dev-zero-link.yaml":
            path.unlink(missing_ok=True)
            path.symlink_to("/dev/zero")
        result = _validate(path)
        assert result.returncode == 2
        assert result.stderr.endswith("error: the file is larger than 8 MiB, the limit for "
                                      "plans and resolved plans\n")


def _chain(blocks: int) -> str:
    lines = [f"  - {{name: b{i}, devices: [{i * 4 // blocks}], time: {1 + (7 * i) % 5}, "
             "memory: 1}" for i in range(blocks)]
    return ("pyplan: 1\nname: chain\ndevices: 4\nmicro_batches: 16\nmemory: 60\n"
            "training: {backward: {time_ratio: 2}}\nblocks:\n" + "\n".join(lines) + "\n")


@pytest.mark.parametrize("name, text", [
    ("chain-of-50", _chain(50)),
    ("times-of-a-million", "pyplan: 1\nname: big\ndevices: 4\nmicro_batches: 16\nmemory: 6\n"
     "training: {backward: {time_ratio: 2}}\nshape: {kind: nnshape, stage: {time: [500000, "
     "499999, 377777, 1]}, shared: {time: 354321, memory: 0}}\n"),
])
def test_the_time_limit_holds(name, text, tmp_path):
    # --time-limit 1: the best schedule found by then (a hang would hit the 15 s of CPU).
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    result = subprocess.run([sys.executable, "-m", "pyplan", "solve", str(path), "--time-limit",
                             "1", "--json"], capture_output=True, text=True,
                            timeout=WALL_SECONDS, preexec_fn=_limited(15), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["status"] in ("time_limit", "feasible", "optimal")
    assert report["makespan"] >= report["lower_bound"]
