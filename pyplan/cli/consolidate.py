"""`pyplan consolidate RESOLVED DIR -o FILE`: a checkpoint `pyplan run --save DIR` wrote (one
part per rank, torch.distributed.checkpoint) as the whole model's state dict, under the keys
the model's own `state_dict()` has, saved with torch.save: `load_state_dict(strict=True)` into
the model the plan's factory builds (a Hugging Face model then `save_pretrained`s it). One
process, no torchrun."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from pyplan.cli._torch import require_torch
from pyplan.errors import PlanError
from pyplan.fileio import write_atomic
from pyplan.resolved import load_resolved

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="RESOLVED", help="a resolved plan of the model")
    parser.add_argument("checkpoint", metavar="DIR", help="what pyplan run --save wrote")
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="where to write the state dict (torch.save)")


def run(args: argparse.Namespace) -> int:
    plan = load_resolved(args.plan)
    problem = plan.problem
    if problem.model is None:
        raise PlanError("the plan has no model: section, so there is no model to consolidate",
                        file=args.plan)
    if not (Path(args.checkpoint) / ".metadata").is_file():
        raise PlanError(f"{args.checkpoint}: not a checkpoint written by pyplan run --save",
                        hint="give the directory --save wrote")
    require_torch("consolidate")
    import torch

    from pyplan.runtime.binding import build, build_whole, load_model
    from pyplan.runtime.checkpoint import consolidate

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
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(args.output, buffer.getvalue())
    print(f"wrote {args.output}: {len(state)} entries of {problem.model.builder}'s state dict "
          f"from {args.checkpoint}")
    return 0
