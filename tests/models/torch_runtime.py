"""Runs an exported schedule CSV in torch.distributed.pipelining's own runtime
(_PipelineScheduleRuntime, what torchtitan's `pipeline_parallel_schedule_csv` loads) with the
modules pyplan builds for the same plan: the same weights, batches and stages. Rank 0 prints
one line per iteration: the iteration's loss (the mean over micro-batches). A plan with a
data-parallel mesh gets its stage modules wrapped by FSDP2's fully_shard over the mesh's data
ranks, as torchtitan wraps them, before torch's runtime drives them.

    torchrun --nproc-per-node D torch_runtime.py PLAN.resolved.yaml SCHEDULE.csv ITERATIONS
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from pyplan.models import stage_modules
from pyplan.resolved import load_resolved
from pyplan.run.binding import build_whole, load_model, make_batch
from pyplan.comm import leave
from pyplan.run.data import split_batch


def main() -> None:
    resolved, csv, iterations = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = load_resolved(resolved)
    problem = plan.problem
    mesh = problem.mesh
    device, data_index, _ = mesh.coords(rank)
    model = load_model(problem, Path(resolved).resolve().parent)
    forward = [b for b in problem.blocks if b.is_forward]
    stages = [(b.name, model.stages[b.name]) for b in forward]
    mine = [s for s, b in enumerate(forward) if b.devices == (device,)]
    modules = stage_modules(build_whole(model, 0), model.cut, stages, mine, "cpu")
    group = None
    if mesh.data_parallel > 1:
        world = init_device_mesh("cpu", (problem.num_devices, mesh.replicas, mesh.shards),
                                 mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        for module in modules.values():
            fully_shard(module, mesh=world["dp_replicate", "dp_shard"],
                        reshard_after_forward=False)
        group = world["pp"].get_group()
    pipeline_stages = [PipelineStage(modules[s], s, len(stages), torch.device("cpu"),
                                     group=group) for s in mine]
    schedule = _PipelineScheduleRuntime(pipeline_stages, problem.num_micro_batches,
                                        loss_fn=model.loss)
    schedule._load_csv(csv, format="compute_only")
    params = [p for m in modules.values() for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    last = any(s == len(stages) - 1 for s in mine)
    first = 0 in mine
    for step in range(iterations):
        inputs, targets = (split_batch(x, mesh.data_parallel)[data_index] for x in
                           make_batch(model, step, 0, torch.device("cpu")))
        # torch 2.11's PipelineStage checks its inputs' strides: a batch sliced from a longer
        # one (tokens[:, :-1]) is copied contiguous (2.13 no longer checks)
        inputs, targets = inputs.contiguous(), targets.contiguous()
        optimizer.zero_grad(set_to_none=True)
        losses = []
        schedule.step(*([inputs] if first else []),
                      **({"target": targets, "losses": losses} if last else {}))
        optimizer.step()
        value = torch.tensor([float(torch.stack(losses).mean()) if last else 0.0])
        dist.all_reduce(value)
        value /= mesh.data_parallel
        if rank == 0:
            print(f"loss {float(value):.9f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)  # a rank: no interpreter teardown (see pyplan.comm.leave)
