"""Options and environment against hostile values, by class: every numeric option the parsers
declare (found by walking them, not listed here) meets a table of values that must be refused,
in one line naming it, with exit 2, before any worker starts; `pyplan run`'s combinations where
an option would do nothing (pyplan.cli.run_rules) meet their rules; every environment variable
the source reads is in pyplan.options.environment's table and meets its hostile values. In-process:
nothing is launched.
"""

from __future__ import annotations

import math
import re

import pytest

from conftest import PLANS
from pyplan.options.numbers import Number
from pyplan.cli.main import _parser

VSHAPE = PLANS / "transformer-vshape.resolved.yaml"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def subcommand(name: str):
    parser = _parser(name)
    return parser._subparsers._group_actions[0].choices[name]


def numeric_options(command: str = "run"):
    return [a for a in subcommand(command)._actions if isinstance(a.type, Number)]


RUN_NUMBERS = numeric_options()

# Texts no numeric option takes, whatever its range.
HOSTILE = ["nan", "NaN", "inf", "-inf", "-1", "1e308", "1e400", str(10**30), "9" * 5000,
           "abc", "", " ", "0x10", "1,5", "None"]


def hostile_values(number: Number) -> list[str]:
    values = list(HOSTILE)
    if number.low > 0 or number.above:
        values.append("0")
    if number.integral:
        values += ["1.5", "1e3"]
    return values


@pytest.fixture
def launch_refused(monkeypatch):
    """pyplan run outside torchrun, its launcher made to fail the test if it starts a worker."""
    from pyplan.cli import run

    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)

    def launch(*_):
        raise AssertionError("workers started")
    monkeypatch.setattr(run, "launch", launch)


def test_the_walk_finds_the_numeric_options():
    names = {a.option_strings[0] for a in RUN_NUMBERS}
    assert {"--lr", "--fault-timeout", "--seed", "--max-time", "--eval-batches",
            "--nproc-per-node", "--master-port"} <= names and len(names) >= 20, names


def test_no_option_takes_an_unbounded_number():
    """A number is declared with its range (pyplan.options.numbers), never as a bare int or float,
    and an option whose metavar is a number's is one of them."""
    numbers = {"N", "K", "S", "D", "T", "EPS", "LR", "W", "PORT", "DURATION", "SEED"}
    not_one = {"--nnodes"}  # N or MIN:MAX: checked against the plan's processes (launch.py)
    for action in subcommand("run")._actions:
        assert action.type not in (int, float), action.option_strings
        if (action.metavar or action.dest.upper()) in numbers and action.option_strings and \
                action.option_strings[0] not in not_one and action.nargs != 0:
            assert isinstance(action.type, Number), action.option_strings


@pytest.mark.parametrize("action", RUN_NUMBERS, ids=lambda a: a.option_strings[0])
def test_every_numeric_option_refuses_every_hostile_value(action, cli, launch_refused):
    option = action.option_strings[0]
    for value in hostile_values(action.type):
        code, out, err = cli("run", VSHAPE, "--nproc-per-node", "4", f"{option}={value}")
        shown = value if len(value) <= 40 else value[:37] + "..."
        assert (code, out) == (2, ""), (option, value, err)
        assert err.startswith(f"error: {option} {shown!r} is not ") and err.count("\n") == 1, \
            (option, value, err)


@pytest.mark.parametrize("action", RUN_NUMBERS, ids=lambda a: a.option_strings[0])
def test_every_numeric_options_range_is_finite_and_its_ends_are_taken(action):
    number = action.type
    assert math.isfinite(number.low) and math.isfinite(number.high) and number.high < 1e30
    ends = [number.high] if number.above else [number.low, number.high]
    for end in ends:
        text = str(int(end)) if number.integral else repr(float(end))
        if number.parse is None or end > 0:
            assert number.value(text) == end, (action.option_strings, text)
    with pytest.raises(ValueError):
        number.value(str(int(number.high) + 1) if number.integral else repr(number.high * 2))


def test_a_config_file_is_checked_by_the_same_types(cli, launch_refused, tmp_path):
    config = tmp_path / "c.yaml"
    for text, message in [("lr: .nan\n", "1:5: error: --config: lr: nan is not a number above "
                                         "0 and at most 1e+06"),
                          ("fault-timeout: 1e308\n", "1:16: error: --config: fault-timeout: "),
                          ("seed: -1\n", "1:7: error: --config: seed: -1 is not a whole number")]:
        config.write_text(text)
        code, out, err = cli("run", VSHAPE, "--config", config)
        assert (code, out) == (2, "") and err.count("\n") == 1, err
        assert err.startswith(f"{config}:{message}"), err


def test_a_worker_reads_the_launchers_values_back(launch_refused):
    """What the launcher hands each worker parses to the same options (a duration's float and
    --eval-batches all included)."""
    from pyplan.cli.run import _worker_arguments

    parser = _parser("run")
    given = ["run", str(VSHAPE), "--max-time", "1e-05", "--eval-batches", "all", "--lr", "3e-4",
             "--fault-timeout", "2.5", "--master-port", "29501"]
    args = parser.parse_args(given)
    again = parser.parse_args(_worker_arguments(args))
    for name in ("max_time", "eval_batches", "lr", "fault_timeout", "seed"):
        assert getattr(again, name) == getattr(args, name), name
    assert (args.max_time, args.eval_batches) == (1e-05, None)


INFERENCE = "--inference"  # (in a combination: run an inference plan instead)


# Each rule of pyplan.cli.run_rules.RULES (by name): a combination it refuses, the message's
# start, and the same combination made to do something, which passes.
COMBINATIONS = {
    "_lr_min_without_decay": (["--lr-min", "0.001"], "--lr-min is where a decay ends",
                              ["--lr-min", "0.001", "--lr-schedule", "cosine"]),
    "_decay_after_the_run": (["--lr-schedule", "linear", "--lr-warmup", "5", "--steps", "5"],
                             "--lr-schedule linear never starts: --lr-warmup 5 lasts the whole "
                             "run (5 steps)",
                             ["--lr-schedule", "linear", "--lr-warmup", "4", "--steps", "5"]),
    "_eval_batches_needs_eval_every": (["--eval-batches", "all"],
                                       "--eval-batches does nothing without --eval-every K",
                                       ["--eval-batches", "all", "--eval-every", "1"]),
    "_eval_every_after_the_run": (["--eval-every", "3", "--iterations", "2"],
                                  "--eval-every 3 never evaluates: the run ends at step 2",
                                  ["--eval-every", "2", "--iterations", "2"]),
    "_tolerance_needs_check": (["--tolerance", "0.1"], "--tolerance does nothing without "
                               "--check", ["--tolerance", "0.1", "--check"]),
    "_check_steps_needs_check": (["--check-steps", "1"], "--check-steps does nothing without "
                                 "--check", ["--check-steps", "1", "--check"]),
    "_save_every_after_the_run": (["--save", "ck", "--save-every", "2"],
                                  "--save-every 2 never saves before the end: the run ends at "
                                  "step 1", ["--save", "ck", "--save-every", "2", "--steps",
                                             "3"]),
    "_launching_under_torchrun": (["--master-port", "29501"], "--master-port is an option of "
                                  "pyplan run's launcher", ["--master-port", "29501",
                                                            "--nproc-per-node", "4"]),
    "_rank_that_does_not_exist": (["--fail-at", "4:0"], "--fail-at 4:0: the plan has ranks 0 "
                                  "to 3, no rank 4", ["--fail-at", "3:0"]),
    "_instruction_that_does_not_exist": (["--fail-at", "1:64"], "--fail-at 1:64: rank 1 runs "
                                         "instructions 0 to 63", ["--fail-at", "1:63"]),
    "_update_without_training": (["--lr", "0.1", INFERENCE], "--lr does nothing on an "
                                 "inference plan", [INFERENCE]),
    "_adam_options_without_adam": (["--adam-betas", "0.9,0.95"], "--adam-betas is AdamW's, "
                                   "and the run trains with sgd",
                                   ["--adam-betas", "0.9,0.95", "--optimizer", "adamw"]),
    "_bf16_parameters_without_bf16": (["--params", "bf16"], "--params bf16 computes in bf16, "
                                      "and --dtype is fp32",
                                      ["--params", "bf16", "--dtype", "bf16"]),
    "_async_save_needs_save": (["--async-save"], "--async-save does nothing without --save "
                               "DIR", ["--async-save", "--save", "ck"]),
    "_profile_steps_needs_profile": (["--profile-steps", "1"], "--profile-steps does nothing "
                                     "without --profile DIR",
                                     ["--profile-steps", "1", "--profile", "p"]),
    "_profile_steps_after_the_run": (["--profile", "p", "--profile-steps", "2"],
                                     "--profile-steps: step 2 is never profiled: the run ends "
                                     "at step 1", ["--profile", "p", "--profile-steps", "1,2",
                                                   "--steps", "2"]),
}


def plan_and_options(options: list[str], folder) -> list[str]:
    """The plan a combination runs, and its options: with INFERENCE, a task: inference plan of
    the same model solved in `folder`."""
    if INFERENCE not in options:
        return [VSHAPE, *options]
    from pyplan.cli.main import main

    (folder / "inf.yaml").write_text(
        "pyplan: 1\nname: inf\ndevices: 4\nmicro_batches: 8\ntask: inference\n"
        "shape: {kind: vshape, stage: {time: 1}}\nmodel:\n"
        "  blocks: pyplan.examples.transformer:build\n"
        "  data: pyplan.examples.transformer:batch\n"
        "  loss: pyplan.examples.transformer:loss\n")
    assert main(["solve", str(folder / "inf.yaml"), "--quiet"]) == 0
    return [folder / "inf.resolved.yaml", *(o for o in options if o != INFERENCE)]


def test_every_rule_has_its_combination():
    from pyplan.cli.run_rules import RULES

    assert sorted(rule.__name__ for rule in RULES) == sorted(COMBINATIONS)


@pytest.mark.parametrize("rule", sorted(COMBINATIONS))
def test_an_option_that_would_do_nothing_is_refused_before_workers_start(
        rule, cli, launch_refused, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused, message, fixed = COMBINATIONS[rule]
    code, out, err = cli("run", *plan_and_options(refused, tmp_path), "--dry-run")
    assert (code, out) == (2, "") and err.startswith(f"error: {message}") and \
        err.count("\n") == 1, err
    from pyplan.cli import run

    monkeypatch.setattr(run, "launch", lambda *_: 0)  # (reached: the rules passed)
    code, out, err = cli("run", *plan_and_options(fixed, tmp_path),
                         *([] if "--nproc-per-node" in fixed else ["--dry-run"]))
    assert code == 0, err


@pytest.mark.parametrize("rule", sorted(COMBINATIONS))
def test_a_config_file_meets_the_same_rules(rule, cli, launch_refused, tmp_path):
    refused, message, _ = COMBINATIONS[rule]
    if any(o in ("--fail-at", "--master-port") for o in refused):
        return  # (options of the command line only)
    options = [o for o in refused if o != INFERENCE]
    config = tmp_path / "c.yaml"
    pairs, i = [], 0
    while i < len(options):  # (a flag is followed by another option or nothing: true)
        flag = i + 1 == len(options) or options[i + 1].startswith("--")
        pairs.append((options[i], "true" if flag else options[i + 1]))
        i += 1 if flag else 2
    config.write_text("".join(f"{o[2:]}: {v}\n" for o, v in pairs))
    code, _, err = cli("run", *plan_and_options([o for o in refused if o == INFERENCE],
                                                tmp_path), "--config", config, "--dry-run")
    assert code == 2 and err.startswith(f"error: {message}"), err


@pytest.mark.parametrize("rule", sorted(COMBINATIONS))
def test_the_workers_command_line_passes_where_the_launchers_did(rule):
    """A worker is given every option that is not its default, as if given: never more than the
    launcher's command line gave, so a rule that passed there passes in each worker."""
    from pyplan.cli.run import _worker_arguments
    from pyplan.cli.run_rules import Facts, check_rules

    parser = _parser("run")
    fixed = COMBINATIONS[rule][2]
    args = parser.parse_args(["run", str(VSHAPE), "--nproc-per-node", "4",
                              *(o for o in fixed if o != INFERENCE)])
    worker = parser.parse_args(_worker_arguments(args))
    given = getattr(worker, "_given", frozenset())
    assert given <= args._given
    for options, known in ((args, args._given), (worker, given)):
        check_rules(options, Facts(known, programs=[64] * 4, training=INFERENCE not in fixed,
                                   optimizer=options.optimizer or "sgd"))


def variables_read() -> set[str]:
    """The environment variables pyplan's source reads, found by reading it."""
    import re
    from pathlib import Path

    import pyplan

    found = set()
    for path in Path(pyplan.__file__).parent.rglob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r'os\.environ(?:\.get|\.pop)?\s*[(\[]\s*"([A-Z_]+)"', text))
        found |= set(re.findall(r'"([A-Z_]+)"\s+(?:not\s+)?in\s+os\.environ', text))
    return found


def test_every_variable_pyplan_reads_is_in_the_table():
    from pyplan.options.environment import ENVIRONMENT

    read = variables_read()
    assert {"PYPLAN_DEVICE", "OMP_NUM_THREADS", "RANK", "MASTER_PORT"} <= read, read
    assert read <= set(ENVIRONMENT), read - set(ENVIRONMENT)


def _checked_variables():
    from pyplan.options.environment import ENVIRONMENT

    return [(n, v) for n, v in ENVIRONMENT.items() if v.rule is not None]


@pytest.mark.parametrize("name, variable", _checked_variables(), ids=lambda x: str(x)[:20])
def test_every_variable_refuses_every_hostile_value_before_workers_start(
        name, variable, cli, launch_refused, monkeypatch):
    words = getattr(variable.rule, "words", ())
    values = [v for v in HOSTILE + ["0", "1.5", "yes"] if v.strip() and v.strip() not in words]
    if isinstance(variable.rule, Number):
        values = [v for v in values if not _takes(variable.rule, v)]
    assert len(values) >= 10
    for value in values:
        monkeypatch.setenv(name, value)
        code, out, err = cli("run", VSHAPE, "--nproc-per-node", "4")
        shown = value if len(value) <= 40 else value[:37] + "..."
        assert (code, out) == (2, ""), (name, value, err)
        assert err.startswith(f"error: ${name} {shown!r} is not ") and err.count("\n") == 1, \
            (name, value, err)


def _takes(number: Number, text: str) -> bool:
    try:
        number.value(text)
    except ValueError:
        return False
    return True


def test_torchruns_ranks_must_fit_their_world(cli, launch_refused, monkeypatch):
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, _, err = cli("run", VSHAPE)
    assert code == 2 and err.startswith("error: $RANK 4 is not a rank of $WORLD_SIZE 4 (0 to "
                                        "3)"), err


def test_a_variable_is_checked_by_the_commands_that_read_it(cli, monkeypatch):
    monkeypatch.setenv("PYPLAN_DEVICE", "gpu")  # read by run alone
    monkeypatch.setenv("OMP_NUM_THREADS", "many")  # read by run, profile and partition
    code, out, err = cli("validate", PLANS / "transformer-vshape.yaml")
    assert code == 0, err
    code, out, err = cli("profile", PLANS / "transformer-vshape.yaml")
    assert code == 2 and err.startswith("error: $OMP_NUM_THREADS 'many' is not a whole number"),\
        err


# Each other command, with what it needs besides the option under test (nothing it would run
# for long: a hostile value must stop it first).
OTHER_COMMANDS = {
    "solve": ["solve", PLANS / "transformer-vshape.yaml", "--quiet", "-o", "{tmp}/x.yaml"],
    "show": ["show", VSHAPE],
    "profile": ["profile", PLANS / "transformer-vshape.yaml"],
    "partition": ["partition", "pyplan.examples.transformer:model", "--data",
                  "pyplan.examples.transformer:batch", "--loss",
                  "pyplan.examples.transformer:loss", "--devices", "2", "-o", "{tmp}/p.yaml"],
    "plan": ["plan", "{tmp}/config.json", "--cluster", "dgx-h100", "--global-batch", "8",
             "--seq", "128"],
}
# Texts no numeric option of any command takes.
NEVER = ["nan", "inf", "-inf", "1e308", "1e400", str(10**30), "abc", "", "0x10", "1,5"]


def other_numeric_options():
    from pyplan.cli.main import _COMMANDS

    return [(command, action.option_strings[0]) for command in sorted(_COMMANDS)
            if command != "run" for action in subcommand(command)._actions
            if action.type in (int, float) or isinstance(action.type, Number)]


def test_the_walk_finds_every_commands_numeric_options():
    found = set(other_numeric_options())
    assert {("solve", "--time-limit"), ("show", "--width"), ("plan", "--gpus"),
            ("partition", "--seed"), ("profile", "--unit-ms")} <= found, found
    assert {command for command, _ in found} <= set(OTHER_COMMANDS), found


@pytest.mark.parametrize("command, option", other_numeric_options())
def test_every_commands_numeric_option_refuses_what_no_number_option_takes(
        command, option, cli, tmp_path):
    base = [str(a).replace("{tmp}", str(tmp_path)) for a in OTHER_COMMANDS[command]]
    words = option.strip("-").replace("-", "[-_ ]")
    for value in NEVER:
        code, out, err = cli(*base, f"{option}={value}")
        assert code == 2 and err.count("\n") == 1, (option, value, err)
        assert re.search(words, err), (option, value, err)
        assert not list(tmp_path.iterdir()), (option, value)


def test_partition_chunks_without_an_interleaved_shape_is_refused(cli, tmp_path):
    base = [str(a).replace("{tmp}", str(tmp_path)) for a in OTHER_COMMANDS["partition"]]
    code, _, err = cli(*base, "--chunks", "3")
    assert code == 2 and err == ("error: --chunks does nothing with --shape vshape (hint: give "
                                 "--shape interleaved (or auto), or leave --chunks out)\n"), err
