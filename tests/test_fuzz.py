"""Seeded mutation fuzzing of every input pyplan reads: the example plans, their resolved plans
and exported torch CSVs, each mutated line by line (values replaced by wrong types, huge or
negative numbers, NULs; lines dropped or duplicated), then validated, shown, exported and
dry-run; and the extension called with random arguments. Every case runs in a worker process
under a memory limit (1 GiB of data) and a time limit per case, and must end in exit 0, 2 or 3
with error lines only (at most ten), never a traceback, a hang or a signal.

The suite runs a quick profile; a long run (the closing notes quote one):

    PYPLAN_FUZZ_CASES=20000 PYPLAN_FUZZ_SEED=1 pytest tests/test_fuzz.py
"""

from __future__ import annotations

import io
import json
import os
import random
import resource
import signal
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from conftest import PLANS, example_plans
from pyplan.cli import main
from pyplan.errors import MAX_REPORTED

CASES = int(os.environ.get("PYPLAN_FUZZ_CASES", "300"))
SEED = int(os.environ.get("PYPLAN_FUZZ_SEED", "0"))
CASE_SECONDS = 20         # per command; the solver's own limit in the cases is 2 s
MEMORY_BYTES = 2**30      # data segment of the worker (the contract: 1 GiB)
REPLACEMENTS = ["x", "-1", "0", "99999999999999999999", "1e308", ".nan", "[]", "{}", "null",
                "'\\0'", "-2147483649", "2147483648", "[1, [2, [3]]]", "!!int x", "*nope",
                "&a [*a]", '"9999999999GiB"', "true"]


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


class _Hang(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Hang


def _run(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, err.getvalue()


def fuzz_inputs(cases: int, seed: int, workdir: Path) -> list:
    """Run the mutated-input cases here; the failures, as (case, command, source, what)."""
    rng = random.Random(seed)
    sources = [p for p in example_plans()]
    csv = workdir / "source.csv"
    assert _run("export", PLANS / "1f1b-4stage.resolved.yaml", "--format", "torch-csv",
                "-o", csv)[0] == 0
    signal.signal(signal.SIGALRM, _on_alarm)
    failures = []
    for case in range(cases):
        source = rng.choice(sources + [csv])
        text = _mutate(source.read_text(), rng)
        path = workdir / f"mutated-{source.name}"
        path.write_text(text)
        if source == csv:
            commands = [("import", "torch-csv", path, "--plan", PLANS / "1f1b-4stage.yaml")]
        elif source.name.endswith(".resolved.yaml"):
            # beside its plan, so that staleness is checked as well
            plan = PLANS / source.name.replace(".resolved", "")
            path = workdir / source.name  # `plan:` names the plan beside it
            path.write_text(text)
            (workdir / plan.name).write_text(plan.read_text())
            commands = [("validate", path), ("show", path, "--width", "80"),
                        ("export", path, "--format", "chrome", "-o", workdir / "t.json"),
                        ("run", path, "--dry-run")]
        else:
            commands = [("validate", path), ("solve", path, "--time-limit", "2", "--quiet",
                                             "-o", workdir / "out.resolved.yaml")]
        for command in commands:
            print(case, command[0], source.name, file=sys.stderr, flush=True)  # if it dies
            signal.alarm(CASE_SECONDS)
            try:
                code, err = _run(*command)
            except _Hang:
                failures.append((case, command[0], source.name, "hang"))
                continue
            except SystemExit as exc:  # argparse on odd arguments
                code, err = exc.code, ""
            except Exception as exc:  # a traceback a user would see (MemoryError included)
                failures.append((case, command[0], source.name, repr(exc)[:200]))
                continue
            finally:
                signal.alarm(0)
            lines = err.splitlines()
            errors = [line for line in lines if "error: " in line]
            if code not in (0, 2, 3) or len(errors) > MAX_REPORTED or \
                    any("error: " not in line and "warning: " not in line for line in lines):
                failures.append((case, command[0], source.name, f"exit {code}: {err[:200]}"))
    return failures


def fuzz_core(cases: int, seed: int) -> list:
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

    def orders():
        return [[(number(), number()) for _ in range(rng.randint(0, 4))]
                for _ in range(rng.randint(0, 3))]

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
        lambda: _core.periodic_orders(graph(), _core.list_schedule_repetend(graph(), devices()),
                                      number()),
        lambda: _core.warmup_blocks(devices()),
        lambda: _core.cooldown_blocks(devices()),
        lambda: graph().makespan_bound(number(), number()),
        lambda: _core.longest_paths(graph()),
        lambda: _core.rank_repetends(graph(), number(), number(), number(), number(), number(),
                                     number(), rng.random()),
        lambda: _core.periodic_makespan(graph(), _core.list_schedule_repetend(graph(),
                                                                              devices()),
                                        number(), number()),
        lambda: _core.extend(graph(), orders(), _core.list_schedule_repetend(graph(), devices()),
                             orders(), number()),
        lambda: _core.memory_fits(_core.list_schedule_repetend(graph(), devices()), number()),
        lambda: _core.repetend_bound(graph(), devices()),
    ]
    signal.signal(signal.SIGALRM, _on_alarm)
    failures = []
    for case in range(cases):
        index = rng.randrange(len(calls))
        print(case, "core", index, file=sys.stderr, flush=True)  # if it dies
        signal.alarm(CASE_SECONDS)
        try:
            calls[index]()
        except (ValueError, IndexError, TypeError):
            pass
        except _Hang:
            failures.append((case, "core", index, "hang"))
        except Exception as exc:
            failures.append((case, "core", index, repr(exc)[:200]))
        finally:
            signal.alarm(0)
    return failures


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_BYTES, MEMORY_BYTES))


def _in_worker(kind: str, tmp_path: Path) -> None:
    # Outside the source tree, which would shadow an installed, compiled pyplan.
    result = subprocess.run([sys.executable, __file__, kind, str(CASES), str(SEED), str(tmp_path)],
                            capture_output=True, text=True, preexec_fn=_limited, cwd=tmp_path,
                            timeout=CASES * CASE_SECONDS * 5)
    last = result.stderr.splitlines()[-1:]
    assert result.returncode == 0, f"the worker died ({result.returncode}) at {last}"
    failures = json.loads(result.stdout.splitlines()[-1])
    assert not failures, f"{len(failures)} of {CASES} cases failed; first: {failures[:5]}"


def test_mutated_inputs_fail_cleanly(tmp_path):
    _in_worker("inputs", tmp_path)


def test_random_core_arguments_raise_python_errors(tmp_path):
    _in_worker("core", tmp_path)


if __name__ == "__main__":
    kind, cases, seed, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    found = (fuzz_inputs(cases, seed, Path(workdir)) if kind == "inputs" else
             fuzz_core(cases * 10, seed))
    print(json.dumps(found, default=str))
