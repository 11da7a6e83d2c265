"""`pyplan run PLAN.resolved.yaml`: execute a resolved plan, one process per device:

    pyplan run PLAN.resolved.yaml --nproc-per-node D [--check] [--optimizer adamw] ...
    torchrun --nproc-per-node D -m pyplan run PLAN.resolved.yaml [...]     (multi-node too)

With --nproc-per-node and not under torchrun, pyplan starts the workers itself through torch's
launcher (torch.distributed.run: the same rendezvous, log lines and exit codes), forked from a
process that has imported torch already (pyplan.cli.launch). Every rank
loads the plan, lowers it to per-rank programs and verifies them before anything runs; then
init -> build -> train (pyplan.train.session over pyplan.runtime.Pipeline) -> close.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pyplan.options.outputs import (check_outputs, check_resume, check_save, check_save_folder,
                                 checkpoint_reads, lock_save, model_reads)
from pyplan.options.choices import OPTIMIZERS, optimizer
from pyplan.options.numbers import SEED, Number, Steps, duration, number, whole
from pyplan.cli._torch import require_torch
from pyplan.cli.launch import LAUNCH_NUMBERS, LAUNCH_OPTIONS, check_processes, launch
from pyplan.cli.run_rules import Facts, check_rules
from pyplan.errors import EXIT_PREEMPTED, PlanError, RunError, did_you_mean
from pyplan.lower import COMPUTE, RECV, SEND, SYNC, WAIT, check_runnable, describe, lower
from pyplan.resolved import load_resolved
from pyplan.lower.verify import verify

__all__ = ["DEVICES", "DTYPES", "OPTIMIZERS", "PARAMS", "SCHEDULES", "add_arguments", "run"]

# The runtime's choices (pyplan.comm.devices, pyplan.run.pipeline, pyplan.train.training), spelled
# here so that the CLI parses without importing torch (tests/test_run_cli.py checks they agree).
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("fp32", "bf16", "fp16")
PARAMS = ("fp32", "bf16")
SCHEDULES = ("constant", "linear", "cosine")
FAULT_TIMEOUT = 300.0  # pyplan.train.faults.TIMEOUT, which says why
# The numeric options' ceilings: far above any real run, far below what overflows a count,
# a timeout or a float32.
COUNT = 10**9  # steps, iterations, batches
MAX_SECONDS = 10**8  # about three years
MAX_PROCESSES = 4096  # a plan's most devices


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN", help="resolved plan written by pyplan solve")
    parser.add_argument("--iterations", type=whole(1, COUNT), metavar="N",
                        help="optimizer steps to train, from where the run starts (a resumed "
                        "run: this many more; default 1)")
    parser.add_argument("--steps", type=whole(1, COUNT), metavar="N",
                        help="train until step N in total (a resumed run: the steps left), so "
                        "one command line serves the first start and every restart")
    parser.add_argument("--max-time", type=duration(MAX_SECONDS),
                        metavar="DURATION",
                        help="save (with --save) and stop, exit 75, before a step would end "
                        "after DURATION from the start (5400, 90m, 1h30m, 1:30:00)")
    parser.add_argument("--max-bad-steps", type=whole(1, COUNT), default=3, metavar="N",
                        help="stop after N steps in a row whose loss or gradients were not "
                        "finite (each one is skipped and logged; default 3)")
    parser.add_argument("--check", action="store_true",
                        help="also train the model in one process with the same seed and "
                        "batches; over the first --check-steps optimizer steps compare every "
                        "parameter's gradient (before the update) and value (after it) and "
                        "the losses; exit 1 naming the worst parameter if one differs")
    parser.add_argument("--check-steps", type=whole(1, 10**6), default=3, metavar="N",
                        help="--check: the optimizer steps compared (default 3)")
    parser.add_argument("--blocking", action="store_true",
                        help="blocking sends and receives (to compare with the default, "
                        "non-blocking communication)")
    parser.add_argument("--sync-at-end", action="store_true",
                        help="with data-parallel replicas: synchronise all gradients after the "
                        "last block instead of each stage's after its last backward (to "
                        "compare)")
    parser.add_argument("--trace", metavar="FILE",
                        help="write a Chrome/Perfetto trace of the last iteration (microseconds)")
    parser.add_argument("--profile", metavar="DIR",
                        help="torch.profiler around the --profile-steps: a Chrome trace per rank "
                        "and step, DIR/rank{R}-step{S}.json (CUDA kernels too on a GPU)")
    parser.add_argument("--profile-steps", type=Steps(1, COUNT), metavar="N,...",
                        help="--profile: the steps profiled, as the log numbers them (default: "
                        "the run's last)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the results instead of the summary")
    parser.add_argument("--seed", type=SEED, default=0,
                        help="seed of weights and batches")
    parser.add_argument("--optimizer", type=optimizer, metavar="{sgd,adamw}",
                        help="torch.optim optimizer, sgd or adamw (default: the plan's model.optimizer, "
                        "which pyplan partition --optimizer writes, else sgd)")
    parser.add_argument("--lr", type=number(0, 1e6, above=True), default=0.01,
                        help="learning rate (default 0.01)")
    parser.add_argument("--weight-decay", type=number(0, 1e6), default=0.0, metavar="W",
                        help="weight decay of the parameters of two or more dimensions; "
                        "biases and norms' weights take none (default 0)")
    parser.add_argument("--adam-betas", default="0.9,0.999", metavar="B1,B2",
                        help="AdamW's betas (default 0.9,0.999)")
    parser.add_argument("--adam-eps", type=number(0, 1, above=True), default=1e-8,
                        metavar="EPS",
                        help="AdamW's eps (default 1e-8)")
    parser.add_argument("--clip-grad-norm", type=number(0, 1e12, above=True),
                        metavar="N",
                        help="clip gradients to this global norm (over all stages and replicas)")
    parser.add_argument("--lr-warmup", type=whole(0, COUNT), default=0, metavar="K",
                        help="linear learning-rate warm-up over the first K steps")
    parser.add_argument("--lr-schedule", choices=SCHEDULES, default="constant",
                        help="after the warm-up: constant (default), or linear or cosine decay "
                        "to --lr-min at the run's last step (torch.optim.lr_scheduler)")
    parser.add_argument("--lr-min", type=number(0, 1e6), default=0.0, metavar="LR",
                        help="the learning rate a decay ends at (default 0)")
    parser.add_argument("--accumulate", type=whole(1, 10**6), default=1, metavar="K",
                        help="add up the gradients of K global batches (plan iterations) per "
                        "optimizer step (default 1)")
    parser.add_argument("--eval-every", type=whole(1, COUNT), metavar="K",
                        help="every K steps, the mean loss over --eval-batches batches of the "
                        "data's eval split: data(i, split='eval')")
    parser.add_argument("--eval-batches", type=whole(1, COUNT, all=None), default=1,
                        metavar="N",
                        help="batches per evaluation, or 'all': the whole eval split, until "
                        "the data returns None (default 1); the loss is the mean over the "
                        "batches' target tokens")
    parser.add_argument("--log", metavar="FILE",
                        help="append a JSON object per step and evaluation to FILE, flushed as "
                        "it happens (step, loss, lr, grad_norm, seconds, samples/tokens per "
                        "second, memory)")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="also write the scalars for TensorBoard to DIR "
                        "(torch.utils.tensorboard; needs the tensorboard package)")
    parser.add_argument("--save", metavar="DIR",
                        help="write a checkpoint (torch.distributed.checkpoint) at the end, in "
                        "its own folder DIR/step-NNNNNNNN")
    parser.add_argument("--overwrite", action="store_true",
                        help="with --save: let this run replace the checkpoints DIR holds "
                        "when it does not continue from their newest")
    parser.add_argument("--save-every", type=whole(1, COUNT), metavar="K",
                        help="with --save: also every K steps")
    parser.add_argument("--async-save", action="store_true",
                        help="with --save: write each checkpoint while the next steps run "
                        "(torch.distributed.checkpoint.async_save); it is renamed into place "
                        "once every rank has written it, the last before the run ends")
    parser.add_argument("--keep-last", type=whole(1, 10**6), metavar="N",
                        help="with --save: keep only the newest N checkpoints in DIR")
    parser.add_argument("--resume", metavar="DIR",
                        help="continue from the newest complete checkpoint in DIR (or the step "
                        "folder DIR): its step, model and optimizer state; any plan of the "
                        "same model; changed settings are applied and said. 'auto': from the "
                        "newest checkpoint in --save if there is one, else a fresh start")
    parser.add_argument("--device", choices=DEVICES,
                        help="cpu or cuda for every rank (default: $PYPLAN_DEVICE, else auto: "
                        "cuda when every rank has a GPU)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="compute dtype under autocast (weights and gradients stay fp32 "
                        "unless --params bf16)")
    parser.add_argument("--params", choices=PARAMS, default="fp32",
                        help="the blocks' parameters: fp32 (default), or bf16 with --dtype bf16, "
                        "which the optimizer, clipping and checkpoints see as fp32 master "
                        "weights (Megatron-LM's --bf16)")
    parser.add_argument("--compile", metavar="BACKEND",
                        help="torch.compile each block's forward with BACKEND (inductor, "
                        "aot_eager, ...: torch._dynamo.list_backends()); pyplan's hooks stay "
                        "eager and a split backward runs each compiled region's backward once")
    parser.add_argument("--tolerance", type=number(0, 1), metavar="T",
                        help="--check: largest allowed relative error ||a-b|| / ||b|| of a "
                        "parameter's gradient (default 1e-5 in fp32, 2e-2 in bf16, 1e-2 in "
                        "fp16); its updated value: at least 1e-3")
    parser.add_argument("--fault-timeout", type=number(1, 1e6), default=FAULT_TIMEOUT,
                        metavar="S", help="a rank that hangs for S seconds (stopped, or in "
                        "the data or loss function) has failed; one that dies is named at once "
                        f"(default {FAULT_TIMEOUT:g})")
    parser.add_argument("--dry-run", action="store_true",
                        help="lower and verify the plan and print each rank's program; "
                        "run nothing (no torchrun needed)")
    parser.add_argument("--fail-at", metavar="RANK:INDEX[:kill]",
                        help="testing aid: RANK raises (or kills itself) at instruction INDEX "
                        "of iteration 0; INDEX 'save': in the middle of writing its part of "
                        "the first checkpoint")
    parser.add_argument("--config", metavar="FILE",
                        help="a YAML mapping of run's options by their long names (lr: 3e-4, "
                        "clip-grad-norm: 1.0, ...); options given on the command line win; "
                        "recorded in each checkpoint")
    parser.add_argument("--perturb", metavar="RANK:PARAMETER", help=argparse.SUPPRESS)
    # (testing aid: RANK adds a small error to PARAMETER's gradient before each update)
    launch = parser.add_argument_group(
        "launching (torchrun's options; used when pyplan run starts the workers itself)")
    launch.add_argument("--nproc-per-node", type=whole(1, MAX_PROCESSES), metavar="D",
                        help="start D worker processes on this machine through torch's launcher")
    for option, (metavar, what) in LAUNCH_OPTIONS.items():
        launch.add_argument(f"--{option}", type=LAUNCH_NUMBERS.get(option), metavar=metavar,
                            help=what)
    for action in parser._actions:  # which options the command line gives (--config's rule)
        if action.option_strings and action.dest != "help":
            action.__class__ = _given(action.__class__)
            _CONFIGURABLE[action.option_strings[0][2:]] = action


_CONFIGURABLE: dict[str, argparse.Action] = {}
_NOT_IN_CONFIG = {"config", "dry_run", "nproc_per_node", "json", "perturb", "fail_at",
                  *(o.replace("-", "_") for o in LAUNCH_OPTIONS)}


def _given(cls):
    """An argparse action class that also notes its option in the namespace's `_given`."""
    class Given(cls):
        def __call__(self, parser, namespace, values, option_string=None):
            namespace._given = getattr(namespace, "_given", frozenset()) | {self.dest}
            super().__call__(parser, namespace, values, option_string)
    Given.__name__ = cls.__name__
    return Given


def _apply_config(args: argparse.Namespace) -> dict | None:
    """--config FILE's options into `args`, where the command line did not give them; the
    options as the file has them (for the checkpoints), or None without --config. Errors at
    FILE:LINE:COL."""
    if args.config is None:
        return None
    from pyplan.planfile.source import load_yaml

    source = load_yaml(args.config)
    if not isinstance(source.data, dict):
        raise source.error((), "a --config file is a mapping of run's options",
                           hint="write one option a line: lr: 3e-4")
    given = getattr(args, "_given", frozenset())
    for key, value in source.data.items():
        name = str(key).replace("_", "-")
        action = _CONFIGURABLE.get(name)
        if action is None or action.dest in _NOT_IN_CONFIG:
            known = [k for k, a in _CONFIGURABLE.items() if a.dest not in _NOT_IN_CONFIG]
            raise source.error((key,), f"--config: {key!r} is " +
                               ("not an option of pyplan run" if action is None else
                                "an option of the command line only"),
                               hint=did_you_mean(name, known) or "keys are run's long option "
                               "names: lr, clip-grad-norm, save-every, ...", key=True)
        if action.dest in given:
            continue
        setattr(args, action.dest, _config_value(source, key, value, action))
        args._given = getattr(args, "_given", frozenset()) | {action.dest}  # (the rules')
    return {"file": str(args.config), "options": source.data}


def _config_value(source, key, value, action: argparse.Action):
    """`value` as the command line's parser would give it for `action`."""
    if action.nargs == 0:  # a flag: true or false
        if not isinstance(value, bool):
            raise source.error((key,), f"--config: {key} is a flag: true or false")
        return value
    if isinstance(value, (dict, list)) or value is None or isinstance(value, bool):
        raise source.error((key,), f"--config: {key} takes one value, not "
                           f"{'nothing' if value is None else type(value).__name__}")
    numeric = isinstance(action.type, (Number, Steps))
    try:
        converted = action.type.value(str(value)) if numeric else (action.type or str)(str(value))
    except (TypeError, ValueError, OverflowError):
        raise source.error((key,), f"--config: {key}: {value!r} is not "
                           f"{action.type.describe() if numeric else 'valid'}",
                           hint=action.help and action.help.split(";")[0]) from None
    except PlanError as exc:  # a type of words (--optimizer): its own message and hint
        raise source.error((key,), f"--config: {key}: {exc.message}", hint=exc.hint) from None
    if action.choices is not None and converted not in action.choices:
        raise source.error((key,), f"--config: {key}: {value!r} is not one of "
                           f"{', '.join(map(str, action.choices))}")
    return converted


def run(args: argparse.Namespace) -> int:
    args.config_record = _apply_config(args)
    fail_at = _options(args)
    plan = load_resolved(args.plan)
    _check_outputs(args, plan)
    plan.check_fresh()
    problem = plan.problem
    if problem.model is None:
        raise PlanError("the plan has no model: section, so there is nothing to run",
                        hint="add model: {blocks: ..., data: ..., loss: ...} and re-run "
                        "pyplan solve", file=plan.plan_path and str(plan.plan_path))
    check_runnable(problem)
    lowered = lower(problem, plan.schedule, early_receives=not args.blocking)
    verify(lowered, blocking=args.blocking)
    check_rules(args, Facts(getattr(args, "_given", frozenset()),
                            programs=[len(p) for p in lowered.programs],
                            optimizer=_trains_with(args.optimizer, problem.model),
                            training=problem.training))
    if args.compile is not None:
        _check_backend(args.compile)
    plan_dir = (plan.plan_path or Path(plan.path)).parent
    if args.dry_run:
        _print_programs(lowered, args.blocking)
        print(_model_check(problem, plan_dir, _source(plan)))
        return 0
    lock_save(args.save)
    devices = problem.mesh.world(problem.num_devices)
    command = f"pyplan run {args.plan} --nproc-per-node {devices}"
    if args.tensorboard is not None:
        require_torch("run --tensorboard")
        from pyplan.train.logs import summary_writer

        summary_writer()  # a missing tensorboard package is said before any worker starts
    layout = (f"devices: {devices}" if devices == problem.num_devices else
              problem.mesh.describe(problem.num_devices))
    if args.nproc_per_node is not None and "RANK" not in os.environ:
        check_processes(args, devices, layout, command)  # before any worker starts, as
        if args.eval_every is not None:  # is a data function without an eval split
            require_torch("run")
            from pyplan.run.binding import load_model
            _check_eval_split(load_model(problem, plan_dir, _source(plan)), problem)
        if getattr(problem.model, "weights", None) is not None:  # its headers, read now
            require_torch("run")
            from pyplan.run.binding import check_weights
            check_weights(problem, plan_dir, _source(plan))
        return launch(args, _worker_arguments(args))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RunError("pyplan run runs one process per device under torchrun",
                       hint=f"launch it with: {command}")
    if int(os.environ["WORLD_SIZE"]) != devices:
        raise RunError(f"the plan needs {devices} processes ({layout}) but torchrun "
                       f"started {os.environ['WORLD_SIZE']}", hint=f"launch it with: {command}")
    require_torch("run")
    from torch.distributed.elastic.multiprocessing.errors import record
    from pyplan.run.binding import load_model

    model = load_model(problem, plan_dir, _source(plan))
    if args.eval_every is not None:
        _check_eval_split(model, problem)
    return record(_session)(args, plan, model, fail_at)


def _check_outputs(args: argparse.Namespace, plan) -> None:
    """No output of this run lands on what it reads or keeps (pyplan.options.outputs)."""
    plan_dir = (plan.plan_path or Path(plan.path)).parent
    check_outputs({"--trace": (args.trace, "file"), "--log": (args.log, "file"),
                   "--tensorboard": (args.tensorboard, "folder"),
                   "--profile": (args.profile, "folder"),
                   "--save": (args.save, "folder")},
                  [args.plan, plan.plan_path, args.config,
                   *model_reads(plan.problem.model, plan_dir),
                   *checkpoint_reads(args.resume), *checkpoint_reads(args.save)])
    check_save_folder(args.save, args.resume, args.overwrite,
                      plan.problem.model and plan.problem.model.builder)


def _optimizer(given: str | None, model) -> str:
    """--optimizer, else the one the plan was partitioned for, else sgd. One that differs from
    the plan's is said once (rank 0): the plan's memory counts the other's state."""
    planned = model.optimizer
    if given is not None and planned is not None and given != planned and \
            os.environ.get("RANK", "0") == "0":
        print(f"warning: --optimizer {given}: the plan was partitioned for {planned} "
              f"(model.optimizer), so its memory counts {planned}'s state, not {given}'s "
              f"(hint: re-run pyplan partition with --optimizer {given})", file=sys.stderr)
    return _trains_with(given, model)


def _trains_with(given: str | None, model) -> str:
    return given or model.optimizer or "sgd"


def _check_backend(name: str) -> None:
    """--compile names a backend torch.compile has (before any worker starts)."""
    require_torch("run --compile")
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if name not in known:
        raise PlanError(f"--compile {name!r} is not a torch.compile backend",
                        hint=did_you_mean(name, known) or "one of: " + ", ".join(known))


def _check_eval_split(model, problem) -> None:
    """--eval-every reads batches of the data's eval split: data(i, split="eval")."""
    import inspect

    from pyplan.run.binding import located

    try:
        inspect.signature(model.data).bind(0, split="eval")
    except TypeError:
        raise located(model.source, ("model", "data"),
                      f"--eval-every: {problem.model.data} takes no split argument",
                      hint="define it as batch(step, split='train') and return batch step of "
                      "the evaluation data for split='eval'") from None
    except ValueError:  # no signature to read (a builtin): it will say so when called
        pass


def _source(plan) -> str:
    """The file messages about the model point into: the plan where it is, else the resolved
    plan (whose model: section is a copy)."""
    return str(plan.plan_path) if plan.plan_path is not None and plan.plan_path.is_file() \
        else plan.path


def _model_check(problem, plan_dir: Path, source: str) -> str:
    """Build the model's blocks on the meta device when torch is there; say so either way."""
    try:
        require_torch("run --dry-run")
    except RunError:
        return "model: not imported (torch is not installed)"
    from pyplan.run.binding import check_model

    count = check_model(problem, plan_dir, source)
    return (f"model: {problem.model.builder} built all {count} declared blocks (on the meta "
            "device); data and loss import")


def _worker_arguments(args: argparse.Namespace) -> list[str]:
    """The command line of one worker: this run's options, without the launcher's, and only
    those that are not their defaults (as if given: pyplan.cli.run_rules)."""
    out = ["run", args.plan]
    for flag in ("check", "blocking", "sync_at_end", "json", "overwrite", "async_save"):
        if getattr(args, flag):
            out.append(f"--{flag.replace('_', '-')}")
    for option in ("seed", "lr", "weight_decay", "lr_warmup", "fault_timeout", "dtype",
                   "lr_schedule", "lr_min", "accumulate", "eval_batches", "check_steps",
                   "max_bad_steps", "adam_betas", "adam_eps", "optimizer", "config",
                   "iterations", "steps", "max_time", "trace", "fail_at", "perturb",
                   "tolerance", "clip_grad_norm", "save", "save_every", "resume", "device",
                   "keep_last", "eval_every", "log", "tensorboard", "params", "compile",
                   "profile", "profile_steps"):
        value, name = getattr(args, option), option.replace("_", "-")
        if option == "eval_batches" and value is None:
            value = "all"
        if option == "profile_steps" and value is not None:
            value = ",".join(map(str, value))
        if value is not None and value != _CONFIGURABLE[name].default:
            out += [f"--{name}", repr(value) if isinstance(value, float) else str(value)]
    return out


def _session(args, plan, model, fail_at) -> int:
    """What torchrun runs on every rank: init -> build -> train -> close."""
    from pyplan.train.checkpoint import CheckpointError
    from pyplan.train.report import Options, as_json, summary
    from pyplan.train.session import Session
    from pyplan.train.training import Training

    training = Training(optimizer=_optimizer(args.optimizer, plan.problem.model), lr=args.lr,
                        weight_decay=args.weight_decay, clip_grad_norm=args.clip_grad_norm, lr_warmup=args.lr_warmup,
                        lr_schedule=args.lr_schedule, lr_min=args.lr_min,
                        accumulate=args.accumulate, betas=_betas(args.adam_betas),
                        eps=args.adam_eps)
    options = Options(iterations=args.iterations or 1, steps=args.steps,
                      max_time=args.max_time,
                      max_bad_steps=args.max_bad_steps, seed=args.seed, training=training,
                      config=args.config_record,
                      blocking=args.blocking, sync_at_end=args.sync_at_end,
                      check=args.check, tolerance=args.tolerance, trace=args.trace,
                      check_steps=args.check_steps, perturb=_perturb(args.perturb),
                      fault_timeout=args.fault_timeout, fail_at=fail_at[0], device=args.device,
                      dtype=args.dtype, params=args.params, compile=args.compile,
                      profile=args.profile, profile_steps=args.profile_steps,
                      save=args.save, async_save=args.async_save, save_every=args.save_every,
                      keep_last=args.keep_last, resume=args.resume, lines=not args.json,
                      log=args.log, tensorboard=args.tensorboard, eval_every=args.eval_every,
                      eval_batches=args.eval_batches, fail_save=fail_at[1])
    session = None
    try:
        session = Session(plan, model, options)
        report = session.train()
    except CheckpointError:  # every rank raised it together: each says it and exits 2
        session.close()
        raise
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: this one ends saying so (not
        if session is not None and session.watchdog is not None:  # as a death to the others)
            session.watchdog.close()
        raise
    except Exception as exc:  # every rank agrees on the first failure, then exits
        if session is None:
            raise
        error = session.failed(exc)
        session.close()
        raise error from None
    session.close()
    if report is None:  # --steps reached before: nothing to train
        return 0
    ok = report.verdict is None or report.verdict.ok
    done = EXIT_PREEMPTED if session.stopped else 0
    if session.rank != 0:  # the verdict is rank 0's to say: a rank failing here could end the
        return done        # run (torchrun stops the others) before rank 0 has said why
    lowered = session.lowered
    if args.json:
        print(json.dumps(as_json(report, lowered, options), sort_keys=True))
    else:
        print("\n".join(summary(report, lowered, options)))
    if not ok:
        raise RunError(f"check failed: {report.verdict.message}",
                       hint="the pipelined run does not compute what the model computes")
    return done


def _options(args: argparse.Namespace):
    if args.iterations is not None and args.steps is not None:
        raise PlanError("--iterations and --steps both say how long to train",
                        hint="give --steps N (until step N in total) or --iterations N (N "
                        "more), not both")
    # (each number's range is its option's type: pyplan.options.numbers)
    if args.lr_min > args.lr:
        raise PlanError(f"--lr-min {args.lr_min:g} must be at most --lr {args.lr:g}")
    _perturb(args.perturb)
    _betas(args.adam_betas)
    for name, needs in (("save_every", "save"), ("keep_last", "save")):
        if getattr(args, name) is not None and getattr(args, needs) is None:
            raise PlanError(f"--{name.replace('_', '-')} needs --{needs} DIR")
    if args.resume == "auto":
        if args.save is None:
            raise PlanError("--resume auto resumes from --save's folder, and there is no --save",
                            hint="give --save DIR with --resume auto")
    elif args.resume is not None:
        check_resume(Path(args.resume))
    if args.save is not None:
        check_save(Path(args.save))
    if args.fail_at is None:
        return None, None
    parts = args.fail_at.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "kill"):
            raise ValueError
        how = parts[2] if len(parts) == 3 else "raise"
        if parts[1] == "save":
            return None, (int(parts[0]), how)
        return (int(parts[0]), int(parts[1]), how), None
    except ValueError:
        raise PlanError(f"--fail-at {args.fail_at!r} is not RANK:INDEX or RANK:INDEX:kill "
                        "(INDEX a number or 'save')") from None


def _betas(text: str) -> tuple[float, float]:
    """--adam-betas B1,B2, each in [0, 1)."""
    try:
        b1, b2 = (float(x) for x in text.split(","))
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError
    except ValueError:
        raise PlanError(f"--adam-betas {text!r} is not two numbers B1,B2 in [0, 1)",
                        hint="e.g. --adam-betas 0.9,0.95") from None
    return b1, b2


def _perturb(value: str | None) -> tuple[int, str] | None:
    """--perturb RANK:PARAMETER (a testing aid) as (rank, parameter name)."""
    if value is None:
        return None
    rank, _, name = value.partition(":")
    if not rank.isdigit() or not name:
        raise PlanError(f"--perturb {value!r} is not RANK:PARAMETER")
    return int(rank), name


def _print_programs(lowered, blocking: bool) -> None:
    problem = lowered.problem
    ranks = len(lowered.programs)
    where = f"{ranks} ranks" if ranks == problem.num_devices else \
        f"{problem.mesh.describe(problem.num_devices)} ({ranks} ranks)"
    print(f"{problem.name}: {len(lowered.order)} block instances on {where}; "
          "verified: no send/recv pair can cross or block forever, and every "
          "collective is reached by all its ranks in the same order ("
          f"{'blocking' if blocking else 'non-blocking'} communication)")
    for rank, program in enumerate(lowered.programs):
        counts = {op: sum(1 for i in program if i.op == op)
                  for op in (COMPUTE, SEND, RECV, WAIT, SYNC)}
        counts = {op: n for op, n in counts.items() if n or op != SYNC}
        print(f"rank {rank}: {len(program)} instructions (" +
              ", ".join(f"{n} {op}" for op, n in counts.items()) + ")")
        for index, ins in enumerate(program):
            print(f"  {index:4} {describe(lowered, ins)}")
