"""Seeded mutation fuzzing of every input pyplan reads: the example plans, their resolved plans
and exported torch CSVs, each mutated line by line (values replaced by wrong types, huge or
negative numbers, NULs; lines dropped or duplicated), then validated, shown, exported and
dry-run. Every case must end in exit 0, 2 or 3 with at most one error line, never a traceback.

The suite runs a quick profile; a long run (the closing notes quote one):

    PYPLAN_FUZZ_CASES=20000 PYPLAN_FUZZ_SEED=1 pytest tests/test_fuzz.py
"""

from __future__ import annotations

import io
import os
import random
import signal
from contextlib import redirect_stderr, redirect_stdout

from conftest import PLANS, example_plans
from pyplan.cli import main

CASES = int(os.environ.get("PYPLAN_FUZZ_CASES", "300"))
SEED = int(os.environ.get("PYPLAN_FUZZ_SEED", "0"))
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


def test_mutated_inputs_fail_cleanly(tmp_path, monkeypatch):
    rng = random.Random(SEED)
    sources = [p for p in example_plans()]
    csv = tmp_path / "source.csv"
    assert _run("export", PLANS / "1f1b-4stage.resolved.yaml", "--format", "torch-csv",
                "-o", csv)[0] == 0
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    failures = []
    try:
        for case in range(CASES):
            source = rng.choice(sources + [csv])
            text = _mutate(source.read_text(), rng)
            path = tmp_path / f"mutated-{source.name}"
            path.write_text(text)
            if source == csv:
                commands = [("import", "torch-csv", path, "--plan", PLANS / "1f1b-4stage.yaml")]
            elif source.name.endswith(".resolved.yaml"):
                # beside its plan, so that staleness is checked as well
                plan = PLANS / source.name.replace(".resolved", "")
                path = tmp_path / source.name  # `plan:` names the plan beside it
                path.write_text(text)
                (tmp_path / plan.name).write_text(plan.read_text())
                commands = [("validate", path), ("show", path, "--width", "80"),
                            ("export", path, "--format", "chrome", "-o", tmp_path / "t.json"),
                            ("run", path, "--dry-run")]
            else:
                commands = [("validate", path), ("solve", path, "--time-limit", "2", "--quiet",
                                                 "-o", tmp_path / "out.resolved.yaml")]
            for command in commands:
                signal.alarm(20)
                try:
                    code, err = _run(*command)
                except _Hang:
                    failures.append((case, command[0], source.name, "hang"))
                    continue
                except SystemExit as exc:  # argparse on odd arguments
                    code, err = exc.code, ""
                except Exception as exc:  # a traceback a user would see
                    failures.append((case, command[0], source.name, repr(exc)[:200]))
                    continue
                finally:
                    signal.alarm(0)
                lines = [line for line in err.splitlines() if "error:" in line]
                if code not in (0, 2, 3) or len(lines) > 1:
                    failures.append((case, command[0], source.name, f"exit {code}: {err[:200]}"))
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert not failures, f"{len(failures)} of {CASES} cases failed; first: {failures[:5]}"
