"""`Pipeline(resolved)`: a resolved plan as a training engine inside a torchrun worker, driven
by the user's own loop (torch.distributed.pipelining's `schedule.step`, DeepSpeed's
`train_batch`):

    pipe = Pipeline("plans/mine.resolved.yaml")          # joins the process group
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-4) if pipe.parameters() else None
    for step in range(steps):
        inputs, targets = next(batches)                   # the global batch, on every rank
        if optimizer is not None:
            optimizer.zero_grad()
        loss = pipe.step(inputs, targets)                 # forward + backward, every micro-batch
        pipe.clip_grad_norm_(1.0)                         # every rank: an all-reduce
        pipe.step_optimizer(optimizer)                    # not after an fp16 overflow

After `step`, every parameter of this rank has its gradient in `.grad`, already summed over the
copies of tied parameters and averaged over data-parallel replicas; the returned loss is the
global batch's (the mean over micro-batches and replicas), on every rank. Every rank calls
every method, whatever its stages hold (a stage of parameter-free or frozen modules has no
parameters, and torch.optim refuses an empty list): each may enter a collective.

Parameters are named as in the user's model (`module:` plans: the whole model's names, a tied
parameter under the first of its names; `blocks:` plans: `block.parameter`).

What a step does with the gradients (ties, accumulation, fp16's unscaling, `clip_grad_norm_`)
is the base class pyplan.run.gradients.PipelineGradients; the state dicts are pyplan.mesh.state's.
"""

from __future__ import annotations

import os
from datetime import timedelta
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from pyplan.errors import PlanError, RunError
from pyplan.models import FORWARD, TRACED
from pyplan.lower import Lowered, channels, check_runnable, forward_only, lower
from pyplan.resolved import ResolvedPlan, load_resolved
import pyplan.mesh.state as state_dicts
from pyplan.run.binding import (Built, Model, block_inputs, build, kept_rng, load_model,
                                loss_function, shared_across_devices)
from pyplan.run.data import batch_problem, describe, split_batch, to_device
from pyplan.comm import Comm
from pyplan.run import arguments
from pyplan.comm.devices import agree_on_error, all_gather_objects, join_world
from pyplan.run.executor import Executor, IterationResult
from pyplan.run.gradients import MasterWeights, PipelineGradients
from pyplan.mesh import DataParallel, world_mesh
from pyplan.mesh.tensor import TensorRandom, packed_layouts, parallelize, tensor_plan
from pyplan.comm.values import concatenated
from pyplan.lower.verify import verify

__all__ = ["DTYPES", "PARAMS", "Pipeline", "compiled_graphs"]

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PARAMS = ("fp32", "bf16")


class Pipeline(PipelineGradients):
    def __init__(self, plan: str | Path | ResolvedPlan, *, device: str | None = None,
                 seed: int = 0, dtype: str = "fp32", blocking: bool = False,
                 sync_at_end: bool = False, model: Model | None = None,
                 fail_at: tuple[int, int, str] | None = None, timeout: float = 600.0,
                 compile: str | None = None, params: str = "fp32",
                 agree_arguments: bool = True) -> None:
        """Load, lower and verify the plan, join the default process group (creating it from
        torchrun's environment unless the caller did; its backend decides the device, else
        `device` (None: $PYPLAN_DEVICE, else auto = CUDA when every rank has a GPU);
        collectives time out after `timeout` seconds), and build this rank's modules;
        `compile`: torch.compile each block's module with that backend ("inductor", ...);
        `params="bf16"` (with dtype bf16): the blocks hold bf16 parameters, which the optimizer
        trains through fp32 masters (pyplan.run.gradients.MasterWeights; with data
        parallelism FSDP2's fp32 shards are those, its unsharded parameters bf16);
        `agree_arguments=False`: `step`, `eval_step`, `step_optimizer`, `grad_norm` and
        `clip_grad_norm_` raise a refused argument on its rank alone, without agreeing first
        with the others (a small collective each): for a loop that checks what it passes and
        stops every rank when one fails (pyplan run's, whose watchdog does)."""
        resolved = plan if isinstance(plan, ResolvedPlan) else load_resolved(plan)
        resolved.check_fresh()
        problem = resolved.problem
        if problem.model is None and model is None:
            raise PlanError("the plan has no model: section, so there is nothing to run",
                            hint="add model: {module: ..., data: ..., loss: ...} and re-run "
                            "pyplan solve", file=resolved.plan_path and str(resolved.plan_path))
        if dtype not in DTYPES:
            raise PlanError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if params not in PARAMS or (params == "bf16" and dtype != "bf16"):
            raise PlanError(f"parameters in {params!r} with dtype {dtype!r}: the parameters "
                            "are fp32, or bf16 with dtype bf16",
                            hint="--params bf16 --dtype bf16, or leave --params out")
        self.resolved, self.problem, self.seed = resolved, problem, seed
        self.output = check_runnable(problem)
        self.lowered: Lowered = lower(problem, resolved.schedule, early_receives=not blocking)
        verify(self.lowered, blocking=blocking)
        self.evaluation = forward_only(self.lowered)
        verify(self.evaluation)
        plan_dir = (resolved.plan_path or Path(resolved.path)).parent
        source = resolved.plan_path if resolved.plan_path is not None and \
            resolved.plan_path.is_file() else resolved.path
        self.model = model or load_model(problem, plan_dir, str(source))
        mesh = problem.mesh
        world = mesh.world(problem.num_devices)
        if (error := arguments.seconds("timeout", timeout)) is not None:  # joining needs it
            raise error
        if "RANK" not in os.environ and not dist.is_initialized():
            raise RunError("a Pipeline runs in one process per device, under torchrun",
                           hint=f"torchrun --nproc-per-node {world} your_script.py")
        self.device, self.owns_group = join_world(
            device or os.environ.get("PYPLAN_DEVICE") or "auto", timeout=timeout)
        self.backend = dist.get_backend()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != world:
            self.close()
            raise RunError(f"the plan needs {world} processes ({mesh.describe(problem.num_devices)}) but the "
                           f"world has {self.world}",
                           hint=f"launch it with --nproc-per-node {world}")
        self.device_index, self.data_index, self.tensor_index = mesh.coords(self.rank)
        self.autocast = DTYPES[dtype]
        self.dtype = dtype
        # fp16 (dynamic loss scaling, as torch.amp.GradScaler): the loss is scaled up before
        # the backward so small gradients do not underflow, the gradients scaled back down;
        # 2000 clean steps double the scale. In every dtype, a step whose gradients or loss
        # are not finite anywhere sets `overflow` (and `nonfinite`: which ranks), leaves no
        # gradient to apply (step_optimizer skips the step) and, in fp16, halves the scale.
        self.loss_scale = 2.0 ** 16 if dtype == "fp16" else 1.0
        self.overflow = False
        self.nonfinite: list[tuple[int, bool, bool]] = []
        self._overflowed = False  # since the optimizer last stepped (steps may accumulate)
        self.step_norm: torch.Tensor | None = None  # step(grad_norm=True)'s
        self._clean_steps = 0
        self.executor: Executor | None = None
        self.iteration = -1
        self.closed = False
        self.timeout = timedelta(seconds=timeout)
        self.compiled = compile
        self.param_dtype = params
        self.masters: MasterWeights | None = None
        try:
            self._agree_on_arguments(seed, blocking=blocking, sync_at_end=sync_at_end,
                                     agree_arguments=agree_arguments)
            self.agree_arguments = agree_arguments
            self._build(blocking, sync_at_end, fail_at)
        except BaseException:
            self.close()  # a group this call created does not outlive it
            raise

    # -- building

    def _agree_on_arguments(self, seed, **flags) -> None:
        """The constructor's arguments checked on every rank, which raise the same error; the
        seed the same everywhere (each block's weights and dropout masks follow it)."""
        error = arguments.seed(seed)
        for name, value in flags.items():
            error = error or arguments.flag("Pipeline", name, value)
        agree_on_error(error)
        seeds = all_gather_objects(seed) if self.world > 1 else [seed]
        if len(set(seeds)) > 1:
            other = next(r for r, s in enumerate(seeds) if s != seeds[0])
            raise RunError(f"Pipeline: rank {other} has seed {seeds[other]}, rank 0 seed "
                           f"{seeds[0]}: each block's weights and dropout follow the seed",
                           hint="pass the same seed on every rank")

    def _build(self, blocking: bool, sync_at_end: bool, fail_at) -> None:
        problem, mesh = self.problem, self.problem.mesh
        replicas = mesh.data_parallel
        # Every rank creates every group, in the same order, as new_group requires: the
        # multi-device blocks' groups of every data and tensor index (the user's build gets
        # them: the default group's backend), the mesh's (DeviceMesh: each of its dims), the
        # ties', the channels' (the device's backend: a group pyplan alone uses carries only
        # what pyplan sends).
        sets = sorted({b.devices for b in problem.blocks if len(b.devices) > 1})
        made = {(i, t, ds): self._group([mesh.rank(d, i, t) for d in ds])
                for i in range(replicas) for t in range(mesh.tensor) for ds in sets}
        self.groups = {b.index: made[(self.data_index, self.tensor_index, b.devices)]
                       for b in problem.blocks if len(b.devices) > 1}
        self.mesh = world_mesh(problem, self.device) \
            if mesh.data_parallel * mesh.tensor > 1 else None
        built: Built = build(self.model, problem, seed=self.seed, device=self.device,
                             rank=self.device_index, groups=self.groups)
        self.built, self.modules = built, built.modules
        _refuse_dtensors(problem, self.modules)  # (the user's; pyplan makes its own below)
        # Tensor, then data parallelism (torchtitan's order); both put new parameter objects
        # where the old ones were: names follow the places.
        places = [(owner, attr, built.names.get(id(p))) for module in self.modules.values()
                  for name, p in module.named_parameters(remove_duplicate=False)
                  for path, _, attr in [name.rpartition(".")]
                  for owner in [module.get_submodule(path) if path else module]]
        self.tensor_random = TensorRandom(self.tensor_index, self.device) \
            if mesh.tensor > 1 else None
        if mesh.tensor > 1:
            self._tensor_parallel()
        self.packed = packed_layouts(places)
        """Packed parameters' layouts by name (pyplan.mesh.tensor.rank_major)."""
        if self.param_dtype == "bf16" and replicas == 1:
            self._master_weights()
        if self.compiled is not None:  # after tensor, before data parallelism (torchtitan's)
            for module in self.modules.values():
                _compile_forward(module, self.compiled)
        self.data_parallel = self._data_parallel() \
            if problem.training and replicas > 1 else None
        for owner, attr, name in places:
            if name is not None:
                built.names[id(owner._parameters[attr])] = name
        preds = block_inputs(problem, self.modules)
        self.takes_inputs = any(not preds[b] or b in built.wants_inputs for b in self.modules)
        """Whether a block of this rank reads the micro-batches' inputs (only these ranks need
        the batch's inputs)."""
        self.takes_targets = self.output in self.modules
        """Whether this rank computes the loss (only these ranks need the targets)."""
        if built.whole is None and self.model.whole is None:
            with torch.device("meta"):
                everything = build(self.model, problem, seed=self.seed, device="meta")
            shared_across_devices(problem, everything.modules)
        self.ties = self._tie_groups(built)
        self.comm = Comm(self.device, channels(self.lowered), blocking=blocking,
                         timeout=self.timeout)
        self._params = list({id(p): p for m in self.modules.values() for p in m.parameters()
                             if p.requires_grad}.values())
        if self.masters is not None:
            self._params = [self.masters.of[id(p)] for p in self._params]
        options = dict(seed=self.seed, wants_inputs=built.wants_inputs, autocast=self.autocast,
                       tensor_random=self.tensor_random, compiled=self.compiled is not None)
        loss = loss_function(self.model)
        self.executor = Executor(self.lowered, self.rank, self.modules, self.groups, self.comm,
                                 loss, self.output, data_parallel=self.data_parallel,
                                 sync_at_end=sync_at_end, fail_at=fail_at,
                                 tied=frozenset(id(p) for _, p, _ in self.ties), **options)
        self.evaluator = Executor(self.evaluation, self.rank, self.modules, self.groups,
                                  self.comm, loss, self.output, **options)
        self._evaluators: dict[int, Executor] = {}

    def _master_weights(self) -> None:
        """bf16 parameters in the blocks, fp32 masters for the optimizer, named as they are."""
        if self.problem.mesh.tensor > 1:
            where = str(self.resolved.plan_path or self.resolved.path)
            raise PlanError(f"{where}: bf16 parameters with mesh.tensor need data parallelism "
                            "(FSDP2 keeps their fp32 masters)",
                            hint="add mesh.data, or train fp32 parameters (no --params bf16)")
        trained = {id(p): p for m in self.modules.values() for p in m.parameters()
                   if p.requires_grad and p.is_floating_point()}
        self.masters = MasterWeights(list(trained.values()))
        self.masters.cast()
        names = self.built.names
        for p, master in self.masters.pairs:
            if id(p) in names:
                names[id(master)] = names[id(p)]

    def _data_parallel(self) -> DataParallel:
        """FSDP2 over this rank's stages: each stage's listed modules a unit (with the stage's
        own module after them, where it is its own), a model cut in its own forward (one pruned
        copy per rank, shared by its stages) the root; parameter names follow the objects
        FSDP puts in their places."""
        model, built = self.model, self.built
        units, shared = {}, []
        for b, module in self.modules.items():
            listed = model.stages.get(self.problem.blocks[b].name, ()) \
                if model.whole is not None and model.cut.kind != TRACED else ()
            whole = built.whole
            units[b] = [whole.get_submodule(name) for name in listed] + (
                [] if model.cut.kind == FORWARD and listed else [module])
        if model.whole is not None and model.cut.kind == FORWARD:
            shared = [built.whole]
        # (A split backward's W runs apart from its B, where no FSDP hook gathers the
        # parameters again: with one, units stay whole.)
        return DataParallel(units, shared, self.mesh, self.autocast,
                            reshard=self.problem.mesh.shards > 1
                            and not self.problem.split_layers)

    def _tensor_parallel(self) -> None:
        """Each stage's layers sharded over the tensor ranks (pyplan.mesh.tensor): a model cut
        into its own modules (model: {module: ...}), with a plan of its own or the plan's."""
        problem, model = self.problem, self.model
        where = str(self.resolved.plan_path or self.resolved.path)
        if model.whole is None or model.cut.kind == TRACED:
            raise PlanError(f"{where}: mesh.tensor needs a model given as one module cut into "
                            "its own submodules (model: {module, stages})",
                            hint="partition the model with pyplan partition")
        shared = next((b for b in problem.blocks if len(b.devices) > 1), None)
        if shared is not None:
            raise PlanError(f"{where}: block '{shared.name}' runs on several devices, which "
                            "mesh.tensor does not combine with", hint="use mesh.tensor: 1")
        config = getattr(self.built.whole, "config", None)
        for key in ("num_attention_heads", "num_key_value_heads", "hidden_size"):
            count = getattr(config, key, None)
            if isinstance(count, int) and count % problem.mesh.tensor:
                raise PlanError(f"{where}: mesh.tensor {problem.mesh.tensor} does not divide "
                                f"the model's {key} ({count})",
                                hint="use a tensor degree that divides the heads and the width")
        plan = tensor_plan(self.built.whole, dict(problem.mesh.tensor_plan))
        sharded, around = parallelize(self.built.whole, plan, self.mesh["tp"], where=where,
                                      sequence=problem.mesh.sequence_parallel)
        self.tensor_random.watch(self.built.whole, sharded, around)
        if not sharded:
            raise PlanError(f"{where}: {type(self.built.whole).__name__} has no tensor-parallel "
                            "plan pyplan can read (a Hugging Face config's base_model_tp_plan)",
                            hint="give mesh.tensor_plan: {MODULE_PATH: colwise|rowwise, ...}")

    def _group(self, ranks: list[int], backend: str | None = None):
        """A new group (every rank calls this in the same order) whose collectives time out
        as the Pipeline's do; `backend` None: the default group's."""
        return dist.new_group(ranks, backend=backend, timeout=self.timeout)

    # -- what the user's loop sees

    def parameters(self) -> list[torch.Tensor]:
        """This rank's trainable parameters (with data parallelism: FSDP2's DTensors, each
        this rank's shard; `.full_tensor()` gathers the whole)."""
        return list(self._params)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        names = self.built.names
        return [(names.get(id(p), f"parameter{i}"), p) for i, p in enumerate(self._params)]

    def step(self, inputs, targets, *, trace: bool = False, share_loss: bool = True,
             grad_norm: bool = False) -> torch.Tensor | None:
        """One iteration of the schedule on the global batch: forward and backward of every
        micro-batch; gradients accumulate into .grad (zero them between steps, as usual).
        Returns the global batch's loss on every rank; with `share_loss=False` the collective
        that shares it is skipped: the rank that computes a replica's loss gets that replica's
        mean loss and the others None, as torch.distributed.pipelining's schedules and
        Megatron-LM hand it out. With `grad_norm`, `step_norm` is then the 2-norm of the
        gradients in .grad after the step (as `grad_norm()`; inf or NaN when one is not
        finite), on every rank, found in the collective that checks them for inf/NaN: clip by
        it with `clip_grads_with_norm_` and the step has no other collective."""
        self._open("step")
        self._needs(inputs, targets, "step", trace=trace, share_loss=share_loss,
                    grad_norm=grad_norm)
        self._before_accumulating()
        self.executor.loss_scale = self.loss_scale
        result = self._run(self.executor, inputs, targets, trace=trace)
        self.last = result
        if self.masters is not None:  # this step's bf16 gradients into the fp32 masters'
            self.masters.gather()
        self._unscale(result.loss, grad_norm)  # fp16's unscaling; inf/NaN skip the step
        return self._global_loss(result.loss) if share_loss else result.loss

    def step_optimizer(self, optimizer) -> bool:
        """`optimizer.step()`, unless the gradients or loss of a step since the last call were
        not finite (an fp16 overflow, a NaN; GradScaler's `step` contract; with gradients
        accumulated over several steps, any of them); None (a rank whose stages train no
        parameter) does nothing. Returns whether the optimizer stepped (step a learning-rate
        schedule only then). Every rank calls it: the ranks agree on their arguments."""
        self._open("step_optimizer")
        self._agreed(arguments.optimizer("Pipeline.step_optimizer", optimizer,
                                         len(self._params)))
        skip, self._overflowed = self._overflowed, False
        if optimizer is None or skip:
            return False
        optimizer.step()
        if self.masters is not None:
            self.masters.publish()
        return True

    def eval_step(self, inputs, targets=None, *, loss: bool | None = None):
        """Forward only (no gradients, no dropout randomness beyond the plan's seeding). Without
        targets: the last block's output for the whole batch (its micro-batches concatenated)
        on the last block's ranks, None on the others; with targets (or `loss=True`, on ranks
        that do not compute the loss and pass None): the batch's loss (the mean over
        micro-batches and replicas) on every rank. A batch of another size than the training
        batch runs in fewer micro-batches when it does not split into the plan's number: the
        most, up to that number, that divide each replica's share (the ranks agree on it)."""
        self._open("eval_step")
        loss = targets is not None if loss is None else loss
        self._needs(inputs, targets if loss else (), "eval_step", loss=loss)
        n = self._agreed_micro_batches(inputs)
        with torch.no_grad():
            result = self._run(self._evaluator(n), inputs, targets, forward_only=True,
                               training=False, micro_batches=n)
        if loss:
            return self._global_loss(result.loss)
        if not result.outputs:
            return None
        outputs = result.outputs
        if isinstance(outputs[0], torch.Tensor):
            return concatenated(outputs, f"block '{self.problem.blocks[self.output].name}'")
        return outputs

    def _open(self, what: str) -> None:
        if self.closed:
            raise RunError(f"Pipeline.{what}: the pipeline is closed (close() was called)",
                           hint="create a new Pipeline to train again")

    def _needs(self, inputs, targets, what: str, **flags) -> None:
        """The same RunError on every rank when any rank's batch (`_refusal`) or flag is
        refused: the ranks agree first, so that none waits in a transfer for a rank that
        raised (a traceback from the collective)."""
        error = next((e for name, value in flags.items()
                      if (e := arguments.flag(f"Pipeline.{what}", name, value)) is not None), None)
        self._agreed(error or self._refusal(inputs, targets, what))

    def _agreed(self, error: RunError | None) -> None:
        """Raise `error` (None: nothing) on every rank, the lowest rank's when several have
        one (agree_on_error), or, without agree_arguments, on its own rank alone."""
        if self.agree_arguments:
            agree_on_error(error, self.comm.cpu_group)
        elif error is not None:
            raise error

    def _refusal(self, inputs, targets, what: str) -> RunError | None:
        """Why this rank cannot run `what` on its batch: None given for what its blocks read,
        or a batch that is not tensors with the batch along dim 0
        (pyplan.run.data.batch_problem)."""
        parts = {}
        for given, needed, name in ((inputs, self.takes_inputs, "inputs"),
                                    (targets, self.takes_targets, "targets")):
            if given is None and needed:
                return RunError(f"Pipeline.{what}: rank {self.rank} runs a block that reads the "
                                f"{name}, but got None for them",
                                hint="pass the global batch on the ranks whose takes_inputs / "
                                     "takes_targets is True (any rank may get it)")
            if given is not None and needed and not (name == "targets" and given == ()):
                parts[name] = given
        why = batch_problem(parts) if parts else None
        if why is not None:
            return RunError(f"Pipeline.{what} got {why}", hint="pass tensors (or tuples, lists "
                            "or dicts of them) with the batch along dim 0")
        return None

    def _agreed_micro_batches(self, inputs) -> int:
        """The micro-batches an evaluation batch runs in, the same on every rank (the ranks
        that take no inputs learn it from those that do)."""
        n = self._eval_micro_batches(inputs) if self.takes_inputs else 0
        agreed = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.comm.cpu_group)
        return int(agreed)

    def _eval_micro_batches(self, inputs) -> int:
        replicas, n = self.problem.mesh.data_parallel, self.problem.num_micro_batches
        leaves = [x for x in torch.utils._pytree.tree_leaves(inputs)
                  if isinstance(x, torch.Tensor) and x.dim() > 0]
        if not leaves:
            return n
        size = leaves[0].shape[0]
        if size == 0:
            raise PlanError("an evaluation batch of 0 samples: an empty batch",
                            hint="give eval_step at least one sample")
        if size % replicas:
            raise PlanError(f"an evaluation batch of {size} samples does not split over the "
                            f"plan's {replicas} data-parallel replicas",
                            hint=f"give eval_step a batch of a multiple of {replicas} samples")
        share = size // replicas
        return next(k for k in range(min(n, share), 0, -1) if share % k == 0)

    def _evaluator(self, n: int) -> Executor:
        if n == self.problem.num_micro_batches:
            return self.evaluator
        if n not in self._evaluators:  # the forward programs of the first n micro-batches
            lowered = _first_micro_batches(self.evaluation, n)
            verify(lowered)
            self._evaluators[n] = Executor(lowered, self.rank, self.modules, self.groups,
                                           self.comm, self.evaluator.loss_fn, self.output,
                                           seed=self.seed, wants_inputs=self.built.wants_inputs,
                                           autocast=self.autocast,
                                           tensor_random=self.tensor_random,
                                           compiled=self.compiled is not None)
        return self._evaluators[n]

    def state_dict(self, optimizer=None) -> dict:
        """This rank's part of the model's state (and the optimizer's): {"model": ...,
        "optimizer": ...}, keyed by the model's own names, for torch.distributed.checkpoint
        (`dcp.save(pipe.state_dict(opt), checkpoint_id=DIR)`; pyplan.runtime.save does that
        safely, in step folders). Every rank calls it, one without an optimizer too."""
        self._open("state_dict")
        agree_on_error(arguments.optimizer("Pipeline.state_dict", optimizer, 0), self.comm.cpu_group)
        return state_dicts.state_dict(self, optimizer)

    def load_state_dict(self, state: dict, optimizer=None) -> None:
        """Put `state` (a state_dict() that DCP loaded into) into this rank's parameters,
        buffers and optimizer."""
        self._open("load_state_dict")
        error = arguments.optimizer("Pipeline.load_state_dict", optimizer, 0)
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            error = error or RunError(f"Pipeline.load_state_dict: got {describe(state)}, not "
                                      "what state_dict() returns ({'model': ..., "
                                      "'optimizer': ...})")
        elif optimizer is not None:  # (a rank without parameters has no optimizer)
            error = error or arguments.optimizer_state("Pipeline.load_state_dict",
                                                       state.get("optimizer", {}), optimizer)
        agree_on_error(error, self.comm.cpu_group)
        state_dicts.load_state_dict(self, state, optimizer)
        if self.masters is not None:
            self.masters.publish()

    def _run(self, executor: Executor, inputs, targets, *, training: bool = True, micro_batches: int | None = None,
             **kwargs) -> IterationResult:
        n = micro_batches or self.problem.num_micro_batches
        # Only what this rank's blocks read: the inputs where a block takes them, the targets
        # where the loss is computed.
        inputs = self._micro_batches(inputs, n) if self.takes_inputs else [None] * n
        targets = self._micro_batches(targets, n) \
            if targets is not None and self.takes_targets else None
        if training:  # an evaluation between two steps does not move the random numbers
            self.iteration += 1
        with kept_rng(self.device):
            result = executor.run(inputs, targets, iteration=max(self.iteration, 0), **kwargs)
        if training:
            executor.reductions.finish()
            self._sum_ties()
        return result

    def _micro_batches(self, tree, n: int) -> list:
        """This replica's share of a global batch on the device, in n micro-batches."""
        tree = to_device(tree, self.device, non_blocking=True)
        if self.problem.mesh.data_parallel > 1:  # this rank's slice of the global batch
            tree = split_batch(tree, self.problem.mesh.data_parallel)[self.data_index]
        return split_batch(tree, n)

    def _global_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The loss of the global batch on every rank: each replica's (owned by one rank)
        summed over the world, divided by the replicas."""
        value = torch.zeros((), dtype=torch.float32, device=self.device) if loss is None \
            else loss.detach().float().reshape(())
        dist.all_reduce(value)
        return value / self.problem.mesh.data_parallel

    def train(self, mode: bool = True) -> "Pipeline":
        """Training mode for every module of this rank (dropout on), as nn.Module.train."""
        if (error := arguments.flag("Pipeline.train", "mode", mode)) is not None:  # no collective here
            raise error
        for module in self.modules.values():
            module.train(mode)
        return self

    def eval(self) -> "Pipeline":
        return self.train(False)

    def close(self) -> None:
        """Leave the process group this Pipeline created (if it did); the Pipeline cannot
        step after."""
        self.closed = True
        if getattr(self, "comm", None) is not None:
            self.comm.close()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def _compile_forward(module: torch.nn.Module, backend: str) -> None:
    """torch.compile the module's forward in place: its hooks (FSDP's gathers) stay eager, and
    torch.nn's own classes compile too (Module.compile leaves their frames to eager Python)."""
    forward = module.forward
    if torch.__version__ < "2.13":  # 2.11's compiled backward refuses retain_graph (the split
        torch._functorch.config.donated_buffer = False  # B's) with buffers donated to it

    def block_forward(*args, **kwargs):
        return forward(*args, **kwargs)

    module.forward = torch.compile(block_forward, backend=backend)


def compiled_graphs() -> int:
    """The graphs torch.compile has captured in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _first_micro_batches(lowered: Lowered, n: int) -> Lowered:
    """The programs restricted to micro-batches 0 .. n-1: whole micro-batches dropped, both
    halves of every transfer with them, so the global order still holds."""
    return replace(lowered, order=tuple(i for i in lowered.order if i[1] < n),
                   programs=tuple(tuple(i for i in program if i.micro_batch < n)
                                  for program in lowered.programs))


def _refuse_dtensors(problem, modules: dict) -> None:
    """PlanError naming a block parameter that is a DTensor (parallelize_module): pyplan sums,
    synchronises, clips, checks and saves gradients as plain tensors."""
    from torch.distributed.tensor import DTensor

    for b, module in modules.items():
        for name, param in module.named_parameters():
            if isinstance(param, DTensor):
                raise PlanError(f"block '{problem.blocks[b].name}': parameter {name} is a "
                                "DTensor (parallelize_module?); pyplan handles a block's "
                                "parameters as plain tensors",
                                hint="keep this rank's chunk as a plain parameter marked "
                                     "with pyplan.runtime.shard(param, dim)")

