"""`pyplan consolidate RESOLVED DIR -o OUT`: a checkpoint `pyplan run --save DIR` wrote (one
part per rank, torch.distributed.checkpoint; DIR's newest complete step folder, or the step
folder DIR) as the whole model's state dict, under the keys the model's own `state_dict()`
has. OUT a file (model.pt): saved with torch.save, for `load_state_dict(strict=True)` into the
model the plan's factory builds; OUT a folder (`--format safetensors`, or an OUT ending in /):
safetensors as `save_pretrained` writes them (model.safetensors, shards and an index when
large, config.json for a Hugging Face model), so `from_pretrained(OUT)` loads the trained
model, and a plan's `model.weights` can start from it. One process, no torchrun. An output
that is one of its inputs (the plans, a file of the checkpoint) is refused before anything is
written; a folder is written beside its place and renamed into it once complete."""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path

from pyplan.cli._torch import require_torch
from pyplan.errors import PlanError
from pyplan.options.outputs import check_outputs, checkpoint_reads, model_reads
from pyplan.files import write_atomic
from pyplan.resolved import load_resolved

__all__ = ["add_arguments", "run"]



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="RESOLVED", help="a resolved plan of the model")
    parser.add_argument("checkpoint", metavar="DIR",
                        help="what pyplan run --save wrote (its newest checkpoint) or one "
                        "step folder in it")
    parser.add_argument("-o", "--output", required=True, metavar="OUT",
                        help="where to write the state dict: a file (torch.save), or with "
                        "--format safetensors a folder for from_pretrained")
    parser.add_argument("--format", choices=("pt", "safetensors"),
                        help="pt: torch.save to a file; safetensors: a folder as "
                        "save_pretrained writes (default: safetensors when OUT ends in / or "
                        "is a folder, else pt)")


def run(args: argparse.Namespace) -> int:
    plan = load_resolved(args.plan)
    problem = plan.problem
    if problem.model is None:
        raise PlanError("the plan has no model: section, so there is no model to consolidate",
                        file=args.plan)
    _check_output(args, plan)
    require_torch("consolidate")
    import torch

    from pyplan.run.binding import build, build_whole, load_model
    from pyplan.train.checkpoint import consolidate, find

    source = plan.plan_path if plan.plan_path is not None and plan.plan_path.is_file() \
        else plan.path
    model = load_model(problem, Path(source).resolve().parent, str(source))
    if model.whole is not None:
        whole = build_whole(model, 0)
        names = {id(p): n for n, p in
                 reversed(list(whole.named_parameters(remove_duplicate=False)))}
    else:  # hand-written blocks: the model is the blocks, named block.parameter
        built = build(model, problem, seed=0, device="cpu")
        whole = torch.nn.ModuleDict({problem.blocks[b].name: m
                                     for b, m in built.modules.items()})
        names = {}
    state = consolidate(args.checkpoint, whole, names)
    if _folder(args):
        with torch.no_grad():
            whole.load_state_dict(state, strict=True)
        save_pretrained(whole, Path(args.output))
        what = "safetensors"
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_atomic(args.output, buffer.getvalue())
        what = "state dict"
    print(f"wrote {args.output}: {len(state)} entries of {problem.model.builder}'s {what} "
          f"from {find(args.checkpoint)}")
    return 0


def _folder(args) -> bool:
    if args.format is not None:
        return args.format == "safetensors"
    return args.output.endswith("/") or Path(args.output).is_dir()


def save_pretrained(model, folder: Path) -> None:
    """`model`'s weights as safetensors in `folder`: a Hugging Face model's own save_pretrained
    (config included); another model's state dict in model.safetensors (tied parameters once).
    Written to a folder beside `folder` and renamed into place once complete (an existing
    `folder` is replaced only then)."""
    import shutil
    import tempfile

    folder = Path(str(folder).rstrip("/") or ".")
    if folder.exists() and not folder.is_dir():
        raise PlanError(f"{folder} exists and is not a folder",
                        hint="name a folder for the safetensors")
    parent = folder.resolve().parent
    try:
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=parent))
    except OSError as exc:
        raise PlanError(f"cannot write {folder}: {exc.strerror}") from None
    try:
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(work)
        else:
            from safetensors.torch import save_model

            save_model(model, str(work / "model.safetensors"))
        old = None
        if folder.exists():
            old = parent / f".{folder.name}.replaced"
            os.replace(folder, old)
        os.replace(work, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise PlanError(f"cannot write {folder}: {exc.strerror}") from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _check_output(args, plan) -> None:
    """Refuse to write over what this command reads: the resolved plan, its plan, the model's
    code and weights, the checkpoint's folder or anything inside it."""
    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        raise PlanError(f"{checkpoint}: " + ("not a directory" if checkpoint.exists() else
                                              "does not exist"),
                        hint="give the directory pyplan run --save wrote")
    source = plan.plan_path if plan.plan_path is not None and plan.plan_path.is_file() \
        else Path(plan.path)
    check_outputs({"-o": (args.output, "replaced folder" if _folder(args) else "file")},
                  [plan.path, plan.plan_path, checkpoint, *checkpoint_reads(checkpoint),
                   *model_reads(plan.problem.model, source.resolve().parent)])
