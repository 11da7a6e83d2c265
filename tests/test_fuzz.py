"""Seeded fuzzing of every input pyplan reads, each case drawn from one generator:

- mutated: an example plan, resolved plan or exported torch CSV mutated line by line (values
  replaced by wrong types, huge or negative numbers, NULs; lines dropped or duplicated);
- forged: a mutated resolved plan whose seal was made to match (the checks behind the seal);
- features: plans written from the round-2 features (topology, transfers, output sizes,
  recompute, weights, mesh, model: sections) with hostile values at random places;
- exports: every export format of example and generated plans, odd widths, outputs onto inputs;
- csv: torch schedule CSVs of random cells (huge fields, long numbers, NULs, wrong ranks);
- arguments: the command lines of solve, show, export, import, run (its preemption options
  too), partition, profile and plan with numbers and names they cannot take;
- api: the Python API called with arguments of the wrong type, NaN, huge or negative.

Every command runs in a worker process under a memory limit (1 GiB of data) and a limit of CPU
time per command (so that a busy machine, which stretches the wall clock, does not trip it), and
must end in exit 0, 2 or 3 with error lines only (at most ten) -- never a
traceback, a hang or a signal; an API call returns or raises PlanError/InfeasibleError with a
one-line message. The extension is called with random arguments too. The test prints how many
cases it ran. The suite runs a quick profile; a long run (the closing notes quote one):

    PYPLAN_FUZZ_CASES=20000 PYPLAN_FUZZ_SEED=1 pytest tests/test_fuzz.py
"""

from __future__ import annotations

import collections
import faulthandler
import io
import json
import math
import os
import random
import resource
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import yaml

from conftest import PLANS, example_plans
from pyplan.cli import main
from pyplan.errors import MAX_REPORTED, PyplanError

CASES = int(os.environ.get("PYPLAN_FUZZ_CASES", "300"))
SEED = int(os.environ.get("PYPLAN_FUZZ_SEED", "0"))
CASE_SECONDS = 20         # CPU seconds per command; the solver's own limit in the cases is 2 s
STUCK_SECONDS = 10 * CASE_SECONDS  # wall clock: a command this long without ending is stuck
MEMORY_BYTES = 2**30      # data segment of the worker (the contract: 1 GiB)
REPLACEMENTS = ["x", "-1", "0", "99999999999999999999", "1e308", ".nan", "[]", "{}", "null",
                "'\\0'", "-2147483649", "2147483648", "[1, [2, [3]]]", "!!int x", "*nope",
                "&a [*a]", '"9999999999GiB"', "true"]
HOSTILE = [math.nan, math.inf, -math.inf, -1, 0, 2**31, 2**63, 10**40, -10**40, 1.0e-300,
           "x", "", "\0", "1025PiB", "-1GiB", "1e400GiB", True, None, [], {}, [[[1]]],
           "a" * 2000, {"a": {"b": {"c": 1}}}, 0.5, "all", "0..9999999"]


# ---------------------------------------------------------------- running commands

class _Hang(BaseException):  # (not caught where user code failing is caught)
    pass


def _on_limit(signum, frame):
    raise _Hang


def _watchdog() -> None:
    """A command blocked in C code (waiting, using no CPU) never reaches its CPU limit, and one
    inside C code never returns to Python, where the limit is raised: past STUCK_SECONDS of
    wall-clock time, end the worker, which the test reports (with the case it was at)."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(1)
            if _DEADLINE[0] and time.monotonic() > _DEADLINE[0]:
                print(f"stuck for {STUCK_SECONDS} s", file=sys.stderr, flush=True)
                os._exit(99)

    threading.Thread(target=watch, daemon=True).start()


_DEADLINE = [0.0]


def _limit(seconds: int) -> None:
    """The next command's limit (0: none): `seconds` of this process's CPU time (SIGPROF), and
    the watchdog's wall-clock deadline."""
    signal.setitimer(signal.ITIMER_PROF, seconds)
    _DEADLINE[0] = time.monotonic() + STUCK_SECONDS if seconds else 0.0


def _stopped(failures: list) -> bool:
    """After a hang the worker stops: the exception that ended it was raised wherever the
    command was, possibly inside an import (a half-initialised torch or numpy crashes the
    process the next time the garbage collector meets it), so nothing after it would be a fair
    test."""
    return bool(failures) and failures[-1][3] == "hang"


def _run(*args) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, err.getvalue()


def _check(command: tuple, failures: list, case: int, source: str) -> int | None:
    """Run one command; record a failure (traceback, hang, odd exit, non-error output)."""
    print(case, command[0], source, file=sys.stderr, flush=True)  # where it died, if it does
    _limit(CASE_SECONDS)
    try:
        code, err = _run(*command)
    except _Hang:
        failures.append((case, command[0], source, "hang"))
        return None
    except SystemExit as exc:  # argparse on odd arguments
        code, err = exc.code, ""
    except Exception as exc:  # a traceback a user would see (MemoryError included)
        failures.append((case, command[0], source, repr(exc)[:200]))
        return None
    finally:
        _limit(0)
    lines = err.splitlines()
    errors = [line for line in lines if "error: " in line]
    if code not in (0, 2, 3) or len(errors) > MAX_REPORTED or \
            any("error: " not in line and "warning: " not in line for line in lines):
        failures.append((case, command[0], source, f"exit {code}: {err[:200]}"))
    return code


# ---------------------------------------------------------------- generators

def _mutate(text: str, rng: random.Random) -> str:
    lines = text.splitlines()
    i = rng.randrange(len(lines))
    line = lines[i]
    kind = rng.randrange(4)
    if kind == 0:
        del lines[i]
    elif kind == 1:
        lines.insert(i, line)
    elif ":" in line and kind == 2:
        key = line[:line.index(":") + 1]
        lines[i] = f"{key} {rng.choice(REPLACEMENTS)}"
    else:  # a number or word inside the line replaced
        words = line.split(" ")
        j = rng.randrange(len(words))
        words[j] = rng.choice(REPLACEMENTS + [str(rng.randint(-5, 10**6))])
        lines[i] = " ".join(words)
    return "\n".join(lines) + "\n"


def _resolved_commands(path: Path, work: Path) -> list[tuple]:
    return [("validate", path), ("show", path, "--width", "80"),
            ("export", path, "--format", "chrome", "-o", work / "t.json"),
            ("run", path, "--dry-run")]


def gen_mutated(rng, work: Path, sources: list[Path], csv: Path) -> tuple[str, list[tuple]]:
    source = rng.choice(sources + [csv])
    text = _mutate(source.read_text(), rng)
    if source == csv:
        path = work / "mutated.csv"
        path.write_text(text)
        return source.name, [("import", "torch-csv", path, "--plan",
                              PLANS / "1f1b-4stage.yaml")]
    if source.name.endswith(".resolved.yaml"):
        # beside its plan, so that staleness and the plan's derivation are checked as well
        plan = PLANS / source.name.replace(".resolved", "")
        (work / plan.name).write_text(plan.read_text())
        path = work / source.name
        path.write_text(text)
        return source.name, _resolved_commands(path, work)
    path = work / f"mutated-{source.name}"
    path.write_text(text)
    return source.name, [("validate", path), ("solve", path, "--time-limit", "2", "--quiet",
                                              "-o", work / "out.resolved.yaml")]


def gen_forged(rng, work: Path, sources: list[Path], csv: Path) -> tuple[str, list[tuple]]:
    from pyplan.resolved.seal import reseal

    source = rng.choice([p for p in sources if p.name.endswith(".resolved.yaml")])
    text = _mutate(source.read_text(), rng)
    try:
        text = reseal(text)
    except PyplanError:
        pass  # not YAML any more: the plain mutation
    plan = PLANS / source.name.replace(".resolved", "")
    if rng.random() < 0.5:
        (work / plan.name).write_text(plan.read_text())
    else:
        (work / plan.name).unlink(missing_ok=True)  # the checks without the plan
    path = work / source.name
    path.write_text(text)
    return source.name, _resolved_commands(path, work)


def _hostile(rng, value):
    return rng.choice(HOSTILE) if rng.random() < 0.15 else value


def _key(rng, value):
    """A mapping key, now and then one YAML reads as a number, true or null."""
    return rng.choice([1, 2.5, True, None, "", "x y"]) if rng.random() < 0.15 else value


def feature_plan(rng) -> dict:
    """A plan of the round-2 features, each value now and then replaced by a hostile one."""
    h = lambda value: _hostile(rng, value)  # noqa: E731
    devices = rng.randint(1, 4)
    training = rng.random() < 0.7
    size = rng.random() < 0.5
    amount = (lambda x: f"{x}MiB") if size else (lambda x: x)
    plan: dict = {"pyplan": 1, "name": h("fz"), "devices": h(devices),
                  "micro_batches": h(rng.randint(1, 12))}
    if rng.random() < 0.6:
        plan["memory"] = h(amount(rng.randint(4, 64)))
    if training:
        backward = {"time_ratio": h(rng.choice([1, 2, 1.5]))}
        if rng.random() < 0.3:
            backward["weight_time_ratio"] = h(1)
            backward["weight_memory_ratio"] = h(rng.choice([0, 0.5]))
        plan["training"] = {"backward": backward,
                            "recompute": h(rng.choice(["never", "always", "auto"]))}
    else:
        plan["task"] = "inference"
    if rng.random() < 0.5:
        plan["topology"] = {"devices_per_node": h(rng.randint(1, 4)),
                            "time_unit_ms": h(rng.choice([0.01, 1, 1e-6, 1000])),
                            "within_node": {"bandwidth": h("100GB"), "latency_ms": h(0.01)},
                            "across_nodes": {"bandwidth": h(rng.choice(["1GB", "1B"])),
                                             "latency_ms": h(0.5)}}
    if training and rng.random() < 0.4:
        plan["mesh"] = {"data": h(rng.randint(1, 3)), "shard": h(rng.random() < 0.5),
                        "sync": h(rng.randint(0, 4))}
    names = [f"b{i}" for i in range(rng.randint(1, 6))]
    if rng.random() < 0.3:
        plan["shape"] = {"kind": h(rng.choice(["vshape", "mshape", "kshape", "interleaved",
                                               "xshape", "nnshape", "wave"])),
                         "stage": {"time": h(rng.randint(1, 4)),
                                   "memory": h(amount(rng.randint(0, 3) if training else 0)),
                                   "weights": h(amount(rng.randint(0, 2))),
                                   rng.choice(["transfer", "output"]):
                                       h(rng.choice([1, "64MiB", "1024PiB"]))}}
        names = None
    else:
        blocks = []
        for i, name in enumerate(names):
            memory = rng.randint(0, 3) if training else 0
            block = {"name": h(name), "devices": h(rng.choice(["all", [rng.randrange(devices)]])),
                     "time": h(rng.randint(1, 5)), "memory": h(amount(memory))}
            if rng.random() < 0.4:
                block["weights"] = h(amount(rng.randint(0, 3)))
            if rng.random() < 0.3:
                block[rng.choice(["transfer", "output"])] = h(rng.choice([2, "64MiB"]))
            if training and rng.random() < 0.3:
                block["recompute"] = h(rng.choice(["never", "always", "auto"]))
                block["recompute_memory"] = h(amount(min(memory, 1)))
            if i and rng.random() < 0.3:
                block["after"] = h([rng.choice(names[:i])])
            blocks.append(block)
        plan["blocks"] = blocks
    if rng.random() < 0.5:
        model = {"data": h("fzmodel:batch"), "loss": h("fzmodel:loss")}
        if names is None or rng.random() < 0.5:
            model["blocks"] = h("fzmodel:build")
        else:
            model["module"] = h("fzmodel:whole")
            model["stages"] = {_key(rng, n): h([f"{i}"]) for i, n in enumerate(names)}
            if rng.random() < 0.2:
                model["traced"] = h(True)
        if rng.random() < 0.3:
            model["path"] = h(".")
        plan["model"] = model
    if rng.random() < 0.2:
        plan["constraints"] = {"order": [h({"rule": "b{s}.f[m+1] < b{s}.b[m]",
                                            "for": h({"s": h("0..1")})})]}
    return plan


FZMODEL = """import torch
def build(name, group):
    return torch.nn.Linear(4, 4)
def whole():
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
def batch(step):
    return torch.randn(8, 4), torch.randn(8, 4)
def loss(output, target):
    return ((output - target) ** 2).mean()
"""


def _write_feature_plan(rng, work: Path) -> Path:
    (work / "fzmodel.py").write_text(FZMODEL)
    path = work / "features.yaml"
    path.write_text(yaml.safe_dump(feature_plan(rng), sort_keys=False, width=200))
    return path


def gen_features(rng, work: Path, *_) -> tuple[str, list[tuple]]:
    path = _write_feature_plan(rng, work)
    out = work / "features.resolved.yaml"
    out.unlink(missing_ok=True)
    return "features", [("validate", path),
                        ("solve", path, "--time-limit", "2", "--quiet", "-o", out),
                        ("show", out, "--width", str(rng.choice([20, 80, 200]))),
                        ("export", out, "--format", rng.choice(_FORMATS), "-o", work / "e"),
                        ("run", out, "--dry-run")]


_FORMATS = ["svg", "chrome", "torch-csv", "megatron-layout", "torchtitan", "dot", ""]


def gen_exports(rng, work: Path, sources: list[Path], _) -> tuple[str, list[tuple]]:
    source = _write_feature_plan(rng, work) if rng.random() < 0.3 else rng.choice(sources)
    fmt = rng.choice(_FORMATS)
    output = rng.choice([work / "e.out", "-", source, work / "missing" / "e.out", work])
    command = ["export", source, "--format", fmt, "-o", output]
    if rng.random() < 0.3:
        command += ["--template", rng.choice(["gpipe", "1f1b", "zb-v", "nope", ""])]
    show = ["show", source, "--width", str(rng.choice([-5, 0, 19, 20, 10**9])),
            "--color", rng.choice(["never", "always"])]
    if rng.random() < 0.3:
        show += ["--micro-batches", str(rng.choice([0, 1, 3, 100000, -2, 10**12]))]
    return source.name, [tuple(command), tuple(show)]


_ACTIONS = ["0F0", "1B3", "2I1", "3W0", "0SEND_F1", "(0F1;1B0)OVERLAP_F_B", "", " ", "x",
            "9" * 400 + "F0", "0F" + "9" * 5000, "0Z1", "-1F0", "0F-1", "\0", '"', "0F99999"]


def gen_csv(rng, work: Path, *_) -> tuple[str, list[tuple]]:
    rows = []
    for _ in range(rng.choice([0, 1, 3, 4, 4, 4, 5])):
        cells = [rng.choice(_ACTIONS) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.05:
            cells.append("x" * rng.choice([10**3, 2 * 10**5]))
        rows.append(",".join(cells))
    path = work / "fuzz.csv"
    path.write_text("\n".join(rows) + "\n")
    plan = rng.choice([PLANS / "1f1b-4stage.yaml", PLANS / "zero-bubble.yaml",
                       PLANS / "1f1b-4stage.resolved.yaml", PLANS / "tessel-mshape.yaml"])
    return "csv", [("import", rng.choice(["torch-csv", "torch", ""]), path, "--plan", plan)]


_NUMBERS = ["0", "-1", "1", "nan", "inf", "-inf", "1e400", "99999999999999999999", "2.5", "x",
            "", "4", "100000", "1e-300"]


def gen_arguments(rng, work: Path, *_) -> tuple[str, list[tuple]]:
    n = lambda: rng.choice(_NUMBERS)  # noqa: E731
    m = lambda plausible: rng.choice([plausible, plausible, n()])  # noqa: E731
    plan = PLANS / rng.choice(["tessel-vshape.yaml", "transformer-vshape.yaml",
                               "gpt24-recompute.yaml"])
    resolved = PLANS / rng.choice(["tessel-vshape.resolved.yaml",
                                   "transformer-vshape.resolved.yaml"])
    memory = rng.choice(["nan", "-1GiB", "1e400GiB", "0", "lots", "1025PiB", "4", "24GiB"])
    commands = [
        ("solve", plan, "--micro-batches", n(), "--memory", memory, "--time-limit", n(),
         "--quiet", "-o", work / "a.resolved.yaml"),
        ("show", resolved, "--width", n(), "--micro-batches", n()),
        ("run", resolved, "--dry-run", "--iterations", n(), "--fault-timeout", n(),
         "--tolerance", n()),
        # invalid on purpose (at least one argument out of range): profiling takes seconds
        ("partition", rng.choice(["pyplan.examples.transformer:model", "x", "nope.mod:fn",
                                  "pyplan.examples.transformer:nope"]),
         "--data", rng.choice(["pyplan.examples.transformer:batch", "x:y", "1"]),
         "--loss", rng.choice(["pyplan.examples.transformer:loss", ":"]),
         "--devices", rng.choice(["0", "-1", "x", "5000", "2.5"]), "--micro-batches", n(),
         "--memory", memory, "--chunks", n(), "--repeats", n(), "-o", work / "p.yaml"),
        # (not yet: --repeats 99999999999999999999 profiles for ever, --unit-ms nan is a
        # traceback and inf a nonsense suggestion: reported, pyplan/cli/profile.py)
        ("profile", rng.choice([plan, resolved, work / "none.yaml"]), "--repeats",
         rng.choice(["0", "-1", "x"]), "--unit-ms",
         rng.choice([v for v in _NUMBERS if v not in ("nan", "inf")])),
        # round 5: preemption (a time budget, resuming, a save folder to replace)
        ("run", resolved, "--dry-run", "--max-time", rng.choice(_NUMBERS + ["1h", "-5m", "2d",
                                                                          "1h", "30s"]),
         *rng.choice([(), ("--resume", rng.choice(["auto", "", work / "none", work]))]),
         *rng.choice([(), ("--save", rng.choice(["", work / "saved", _config_json(work)])),
                      ("--save", work / "saved", "--overwrite", "--keep-last", n())])),
        # cluster planning: a model's config.json on a preset or missing cluster
        # (mostly plausible values, so that cases get past the options' own ranges)
        ("plan", rng.choice([_config_json(work), _config_json(work), resolved,
                             work / "none.json"]), "--cluster",
         rng.choice(["dgx-h100", "dgx-a100-80gb", "nope", str(resolved)]), "--gpus", m("8"),
         "--global-batch", m("16"), "--seq", m("128"),
         *rng.choice([(), ("--tp", m("2")), ("--pp", m("2"), "--vpp", m("2")),
                      ("--dp", m("4")), ("--micro-batch", m("1")), ("--top", m("3"))]),
         # (outputs in the work folder only: a write the user asked for replaces what it names)
         *rng.choice([(), ("-o", work / "c.yaml"), ("-o", _config_json(work)),
                      ("--megatron", "-"),
                      ("--torchtitan", work / "c.yaml", "-o", work / "c.yaml")])),
    ]
    return "arguments", [rng.choice(commands)]


def _config_json(work: Path) -> Path:
    """A small Llama's config.json (pyplan plan's MODEL), written once per work folder."""
    path = work / "config.json"
    if not path.exists():
        path.write_text(json.dumps({"model_type": "llama", "hidden_size": 256,
                                    "intermediate_size": 512, "num_hidden_layers": 4,
                                    "num_attention_heads": 8, "num_key_value_heads": 2,
                                    "vocab_size": 1000}))
    return path


# ---------------------------------------------------------------- the API

def _api_value(rng):
    return rng.choice(HOSTILE + [2, "4GiB", 1.5, PLANS / "nope.yaml", b"x", object()])


def fuzz_api(rng, failures: list, case: int) -> None:
    import pyplan
    from pyplan.partition import UnitCost

    plan = pyplan.load_plan(PLANS / "tessel-vshape.yaml")
    keys = ["micro_batches", "memory", "time_limit"]
    units = [UnitCost(f"u{i}", _hostile(rng, 1.0), _hostile(rng, 2.0), _hostile(rng, 100),
                      _hostile(rng, 100)) for i in range(rng.randint(0, 5))]
    calls = [
        lambda: pyplan.load_plan(_api_value(rng)),
        lambda: pyplan.load_resolved(_api_value(rng)),
        lambda: pyplan.templates(rng.choice([plan, _api_value(rng)])),
        lambda: pyplan.with_overrides(rng.choice([plan, plan, _api_value(rng)]),
                                      **{rng.choice(keys): _api_value(rng)}),
        lambda: pyplan.solve(plan, time_limit=1, **{rng.choice(keys[:2]): _api_value(rng)}),
        lambda: pyplan.partition_plans(
            rng.choice([units, units, _api_value(rng)]), devices=_hostile(rng, 2),
            name=_hostile(rng, "m"), factory=_hostile(rng, "a:b"), data="a:b", loss="a:b",
            micro_batches=_hostile(rng, 4), memory=rng.choice([None, _api_value(rng)]),
            time_limit=1, keep=_hostile(rng, 1)),
    ]
    index = rng.randrange(len(calls))
    print(case, "api", index, file=sys.stderr, flush=True)
    _limit(CASE_SECONDS)
    try:
        calls[index]()
    except (pyplan.PlanError, pyplan.InfeasibleError) as exc:
        if "\n" in str(exc):
            failures.append((case, "api", index, f"several lines: {str(exc)[:200]}"))
    except _Hang:
        failures.append((case, "api", index, "hang"))
    except Exception as exc:
        failures.append((case, "api", index, repr(exc)[:200]))
    finally:
        _limit(0)


GENERATORS = {"mutated": gen_mutated, "forged": gen_forged, "features": gen_features,
              "exports": gen_exports, "csv": gen_csv, "arguments": gen_arguments, "api": None}
WEIGHTS = {"mutated": 4, "forged": 2, "features": 4, "exports": 2, "csv": 1, "arguments": 1,
           "api": 1}


def fuzz_inputs(cases: int, seed: int, workdir: Path) -> dict:
    """Run the input cases here: how many of each generator, and the failures as (case,
    command, source, what)."""
    rng = random.Random(seed)
    sources = example_plans()
    csv = workdir / "source.csv"
    assert _run("export", PLANS / "1f1b-4stage.resolved.yaml", "--format", "torch-csv",
                "-o", csv)[0] == 0
    signal.signal(signal.SIGPROF, _on_limit)
    counts: collections.Counter = collections.Counter()
    commands = 0
    failures: list = []
    names = list(GENERATORS)
    for case in range(cases):
        if _stopped(failures):
            break
        kind = rng.choices(names, [WEIGHTS[k] for k in names])[0]
        counts[kind] += 1
        if kind == "api":
            fuzz_api(rng, failures, case)
            commands += 1
            continue
        source, todo = GENERATORS[kind](rng, workdir, sources, csv)
        for command in todo:
            commands += 1
            _check(command, failures, case, f"{kind}:{source}")
    return {"cases": dict(counts), "commands": commands, "failures": failures}


def fuzz_core(cases: int, seed: int) -> dict:
    """Call the extension's functions with random, mostly wrong arguments: each call returns or
    raises ValueError, IndexError or TypeError (pybind11's answer to a wrong type)."""
    from pyplan import _core

    rng = random.Random(seed)
    numbers = [0, 1, -1, 2, 3, 7, 2**31 - 1, -2**31, 2**31, 2**63 - 1, -2**63, 2**64, 10**7]

    def number():  # mostly plausible, so that calls get past the graph's own checks
        return rng.choice(numbers) if rng.random() < 0.2 else rng.randint(-1, 6)

    def devices():
        return [number() for _ in range(rng.randint(0, 3))]

    def graph():
        k = rng.randint(0, 5)
        blocks = [_core.Block(f"b{i}", number(), number(), devices()) for i in range(k)]
        edges = [(number(), number()) for _ in range(rng.randint(0, 5))]
        delays = [number() for _ in edges] if rng.random() < 0.5 else []
        return _core.Graph(number(), blocks, edges, [], [], delays)

    def indices(g):  # one per block (so that calls get past the length check)
        return [number() for _ in range(g.num_blocks)]

    def orders():
        return [[(number(), number()) for _ in range(rng.randint(0, 4))]
                for _ in range(rng.randint(0, 3))]

    def repetend():
        g = graph()
        return _core.list_schedule_repetend(g, indices(g))

    calls = [
        lambda: _core.evaluate(graph(), orders(), memory_capacity=number(),
                               complete_micro_batches=number()),
        lambda: _core.evaluate_repetend(graph(), devices(), [devices() for _ in range(2)]),
        lambda: _core.modulo_schedule(graph(), number(), number(), number(), number(),
                                      rng.random()),
        lambda: _core.search_repetends(graph(), number(), number(), number(), number(),
                                       number(), rng.random()),
        lambda: _core.list_schedule_repetend(graph(), devices()),
        lambda: _core.repetend_from_starts(graph(), devices(), number()),
        lambda: _core.periodic_orders(graph(), repetend(), number()),
        lambda: _core.warmup_blocks(devices()),
        lambda: _core.cooldown_blocks(devices()),
        lambda: graph().makespan_bound(number(), number()),
        lambda: _core.longest_paths(graph()),
        lambda: _core.rank_repetends(graph(), number(), number(), number(), number(), number(),
                                     number(), rng.random()),
        lambda: _core.periodic_makespan(graph(), repetend(), number(), number()),
        lambda: _core.extend(graph(), orders(), repetend(), orders(), number()),
        lambda: _core.memory_fits(repetend(), number()),
        lambda: _core.repetend_bound(graph(), devices()),
        # every index a call takes, checked
        lambda: graph().successors(number()),
        lambda: graph().predecessors(number()),
        lambda: graph().blocks_on(number()),
        lambda: (lambda g: _core.repetend_bound(g, indices(g)))(graph()),
        lambda: (lambda g: _core.list_schedule_repetend(g, indices(g)))(graph()),
        lambda: (lambda g: _core.repetend_from_starts(g, indices(g), number()))(graph()),
        lambda: repetend().bubble_rate(graph()),
        lambda: next(iter(_core.RepetendEnumerator(graph(), number(), number(), number()))),
        lambda: (lambda g: _core.list_schedule_phase(g, [(number(), number())], indices(g),
                                                     devices(), number()))(graph()),
    ]
    signal.signal(signal.SIGPROF, _on_limit)
    failures: list = []
    for case in range(cases):
        if _stopped(failures):
            break
        index = rng.randrange(len(calls))
        print(case, "core", index, file=sys.stderr, flush=True)  # if it dies
        _limit(CASE_SECONDS)
        try:
            calls[index]()
        except (ValueError, IndexError, TypeError, StopIteration):
            pass
        except _Hang:
            failures.append((case, "core", index, "hang"))
        except Exception as exc:
            failures.append((case, "core", index, repr(exc)[:200]))
        finally:
            _limit(0)
    return {"cases": {"core": cases}, "commands": cases, "failures": failures}


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_BYTES, MEMORY_BYTES))


def _in_worker(kind: str, tmp_path: Path, capsys) -> None:
    # Outside the source tree, which would shadow an installed, compiled pyplan.
    result = subprocess.run([sys.executable, __file__, kind, str(CASES), str(SEED), str(tmp_path)],
                            capture_output=True, text=True, preexec_fn=_limited, cwd=tmp_path,
                            timeout=CASES * CASE_SECONDS * 5)
    # (the case it was at, and where it crashed: faulthandler's dump)
    assert result.returncode == 0, \
        f"the worker died ({result.returncode}):\n" + "\n".join(result.stderr.splitlines()[-40:])
    found = json.loads(result.stdout.splitlines()[-1])
    ran = sum(found["cases"].values())
    with capsys.disabled():  # the figures, whatever pytest's verbosity
        print(f"\nfuzz {kind} (seed {SEED}): {ran} cases, {found['commands']} calls ("
              + ", ".join(f"{k} {n}" for k, n in sorted(found["cases"].items()))
              + f"), {len(found['failures'])} failures")
    failures = found["failures"]
    assert not failures, f"{len(failures)} of {ran} cases failed; first: {failures[:5]}"
    assert ran == (CASES if kind == "inputs" else CASES * 10)


def test_hostile_inputs_fail_cleanly(tmp_path, capsys):
    _in_worker("inputs", tmp_path, capsys)


def test_random_core_arguments_raise_python_errors(tmp_path, capsys):
    _in_worker("core", tmp_path, capsys)


if __name__ == "__main__":
    kind, cases, seed, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    faulthandler.enable()  # a crash prints where it happened
    _watchdog()
    found = (fuzz_inputs(cases, seed, Path(workdir)) if kind == "inputs" else
             fuzz_core(cases * 10, seed))
    print(json.dumps(found, default=str))
