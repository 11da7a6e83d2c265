"""`pyplan plan MODEL --cluster CLUSTER`: which tensor, pipeline and data degrees, chunks,
micro-batch, recomputation and schedule train MODEL fastest on CLUSTER, how long a step takes
and whether it fits; with -o, the layout's pipeline as a plan `pyplan solve` takes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import replace

from pyplan.errors import InfeasibleError, PlanError
from pyplan.options.outputs import check_outputs
from pyplan.files import write_atomic
from pyplan.planfile.units import count

__all__ = ["add_arguments", "run"]

DTYPES = ("bf16", "fp16", "fp32", "fp8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pyplan.cluster import RECOMPUTE, SCHEDULES
    from pyplan.cluster.framework import FRAMEWORKS

    parser.add_argument("model", metavar="MODEL",
                        help="a Hugging Face config.json, or a folder holding one")
    parser.add_argument("--cluster", required=True, metavar="CLUSTER",
                        help="a cluster YAML file (schemas/cluster.schema.json) or a preset: "
                        "dgx-a100-80gb, dgx-h100")
    parser.add_argument("--gpus", type=int, metavar="N",
                        help="GPUs to use (default: all of the cluster's)")
    parser.add_argument("--global-batch", type=int, required=True, metavar="SEQUENCES",
                        help="sequences per optimizer step")
    parser.add_argument("--seq", type=int, required=True, metavar="TOKENS",
                        help="tokens per sequence")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                        help="training precision (default bf16: 16-bit weights and "
                        "activations, fp32 gradients and optimizer state; fp8: the linear "
                        "layers' GEMMs in fp8 at the GPU's fp8 peak, the rest as bf16)")
    parser.add_argument("--framework", choices=tuple(FRAMEWORKS),
                        default="megatron", help="the software that runs it (default "
                        "megatron): which communication overlaps compute, which kernels are "
                        "fused (docs/cluster-planning.md)")
    group = parser.add_argument_group("the layout (each fixed when given, searched when not)")
    group.add_argument("--tp", type=int, metavar="N", help="tensor-parallel degree")
    group.add_argument("--pp", type=int, metavar="N", help="pipeline-parallel degree")
    group.add_argument("--dp", type=int, metavar="N", help="data-parallel degree")
    group.add_argument("--vpp", type=int, metavar="N", help="model chunks per GPU")
    group.add_argument("--micro-batch", type=int, metavar="N",
                       help="sequences per micro-batch")
    group.add_argument("--recompute", choices=RECOMPUTE,
                       help="activation recomputation: none, selective (attention's core), "
                       "block (the first --recompute-layers of each model chunk; searched: "
                       "the fewest that fit) or full (each layer)")
    group.add_argument("--recompute-layers", type=int, metavar="N",
                       help="layers per model chunk block recomputation reruns (Megatron-LM's "
                       "--recompute-num-layers with --recompute-method block; implies "
                       "--recompute block)")
    group.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                       help="Megatron-LM's sequence parallelism inside tensor-parallel groups "
                       "(default: the framework's: off in megatron, on elsewhere)")
    group.add_argument("--schedule", choices=SCHEDULES,
                       help="pipeline schedule (pyplan's templates; search: pyplan's own "
                       "search, on the best layout's degrees); default: the best of the "
                       "framework's own schedules")
    group.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction,
                       help="shard the optimizer's state over the data-parallel ranks "
                       "(default: the framework's: on in nemo, off in megatron)")
    group.add_argument("--cp", type=int, metavar="N",
                       help="context-parallel degree (ring attention over N ranks)")
    group.add_argument("--ep", type=int, metavar="N",
                       help="expert-parallel degree (a mixture's experts over N data ranks)")
    group.add_argument("--fsdp", action=argparse.BooleanOptionalAction,
                       help="ZeRO-3 / FULL_SHARD over the data (and context) ranks (default: "
                       "searched with torchtitan, off otherwise)")
    group.add_argument("--dp-replicate", type=int, metavar="R",
                       help="HSDP: R replicas of FSDP groups of dp / R (needs --fsdp)")
    group.add_argument("--flash-attention", action=argparse.BooleanOptionalAction,
                       help="fused attention (default: on with --cp and in 16-bit, except "
                       "megatron's fp16 and megatron-deepspeed: their scores go through "
                       "memory, as their published runs did)")
    over = parser.add_argument_group("overlaps (default: the framework's)")
    over.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction,
                      help="data-parallel gradient reduction beside the backward")
    over.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction,
                      help="parameter all-gathers (distributed optimizer, FSDP) prefetched")
    over.add_argument("--tp-comm-overlap", action=argparse.BooleanOptionalAction,
                      help="tensor-parallel communication overlapped with its GEMMs")
    over.add_argument("--overlap-p2p", action=argparse.BooleanOptionalAction,
                      help="pipeline sends and receives beside compute")
    over.add_argument("--fused-kernels", action=argparse.BooleanOptionalAction,
                      help="element-wise work fused (Transformer Engine, torch.compile)")
    parser.add_argument("--top", type=int, default=1, metavar="K",
                        help="list the K best layouts (default 1)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of the summary")
    parser.add_argument("-o", "--output", metavar="PLAN",
                        help="write the best layout's pipeline as a plan (YAML)")
    parser.add_argument("--torchtitan", metavar="FILE",
                        help="write the best layout as torchtitan's settings (a Python module, "
                        "as pyplan export --format torchtitan writes them)")
    parser.add_argument("--megatron", metavar="FILE",
                        help="write the best layout as Megatron-LM's arguments (one line; '-' "
                        "for standard output)")


def _positive(args: argparse.Namespace, name: str, high: int = 10**9) -> None:
    value = getattr(args, name)
    if value is not None and not 1 <= value <= high:
        flag = "--" + name.replace("_", "-")
        raise PlanError(f"{flag} must be an integer in 1 .. {high:,}, got {value}",
                        hint=f"give a positive {flag}, or leave it out to let pyplan plan "
                        "search it" if name in ("tp", "pp", "dp", "vpp", "micro_batch") else None)


def run(args: argparse.Namespace) -> int:
    from pyplan.cluster import Batch, Fixed, load_cluster, predict, read_model, search

    from pyplan.cluster.framework import framework

    for name in ("gpus", "global_batch", "seq", "tp", "pp", "dp", "vpp", "micro_batch", "cp",
                 "ep", "dp_replicate", "recompute_layers"):
        _positive(args, name, 10**6 if name != "seq" else 10**7)
    _positive(args, "top", 1000)
    check_outputs({"-o": (args.output, "file"), "--torchtitan": (args.torchtitan, "file"),
                   "--megatron": (args.megatron, "file")}, [args.model, args.cluster])
    model = read_model(args.model)
    cluster = load_cluster(args.cluster)
    gpus = args.gpus or cluster.gpus
    if gpus is None:
        raise PlanError(f"--gpus: the cluster {cluster.name} does not say how many nodes it "
                        "has", hint=f"give --gpus N (whole nodes of {cluster.gpus_per_node}) or "
                        "nodes: in the cluster file")
    if cluster.gpus is not None and gpus > cluster.gpus:
        raise PlanError(f"--gpus {gpus}: the cluster {cluster.name} has {cluster.gpus} GPUs "
                        f"({count(cluster.nodes, 'node')} of {cluster.gpus_per_node})",
                        hint="raise nodes: in the cluster file, or use fewer GPUs")
    if gpus > cluster.gpus_per_node and gpus % cluster.gpus_per_node:
        raise PlanError(f"--gpus {gpus} is not a whole number of nodes of "
                        f"{cluster.gpus_per_node} GPUs", hint="use whole nodes")
    software = framework(args.framework, overlap_grad_reduce=args.overlap_grad_reduce,
                         overlap_param_gather=args.overlap_param_gather,
                         tp_comm_overlap=args.tp_comm_overlap, overlap_p2p=args.overlap_p2p,
                         fused_kernels=args.fused_kernels)
    flash = args.flash_attention
    if flash is None and (args.cp or 1) > 1:  # ring attention runs on fused attention only
        flash = True
    batch = Batch(args.global_batch, args.seq, args.dtype, flash, software)
    recompute = args.recompute
    if args.recompute_layers is not None:
        if recompute not in (None, "block"):
            raise PlanError(f"--recompute-layers needs --recompute block, not --recompute "
                            f"{recompute}", hint="drop one of them")
        recompute = "block"
    fixed = Fixed(args.tp, args.pp, args.dp, args.vpp, args.micro_batch, recompute,
                  args.sequence_parallel, args.schedule, args.distributed_optimizer,
                  args.cp, args.ep, args.fsdp, args.dp_replicate, args.recompute_layers)
    _check_fixed(fixed, model, batch, gpus, cluster)
    started = time.perf_counter()
    if fixed.schedule == "search":  # pyplan's own search: on the templates' best layout
        best, considered, priced = search(model, cluster, batch, gpus,
                                     replace(fixed, schedule=None), 1)
        best = [predict(model, cluster, replace(best[0].layout, schedule="search", vpp=1),
                        batch)] if best else []
    else:
        best, considered, priced = search(model, cluster, batch, gpus, fixed, args.top)
    seconds = time.perf_counter() - started
    if not best:
        if fixed.everything:  # the layout asked for cannot run: say why
            from pyplan.cluster.layout import Layout, check_layout
            layout = Layout(fixed.tp, fixed.pp, fixed.dp, fixed.vpp or 1, fixed.micro_batch,
                            fixed.recompute, bool(fixed.sequence_parallel), fixed.schedule,
                            bool(fixed.distributed_optimizer), fixed.cp or 1, fixed.ep or 1,
                            bool(fixed.fsdp), fixed.dp_replicate or 1,
                            fixed.recompute_layers or 0)
            reason = check_layout(layout, model, batch, gpus, cluster.gpus_per_node)
            raise PlanError(f"the layout given cannot run: {reason}",
                            hint="change the degrees, the schedule or --vpp")
        raise InfeasibleError(f"no layout of {model.family} runs on {gpus} GPUs with a global "
                              f"batch of {args.global_batch}",
                              hint="fix fewer degrees, or change the batch or GPU count")
    exports = _exports(best[0], model, batch, args)  # (refused in one line before writing)
    if args.output:
        write_atomic(args.output, _plan_file(best[0], model, cluster, batch, args))
    for path, text in exports:
        if path == "-":
            sys.stdout.write(text)
        else:
            write_atomic(path, text)
    if args.json:
        print(json.dumps(_json(best, model, cluster, batch, gpus, considered, priced, seconds),
                         sort_keys=True))
    else:
        sys.stdout.write(_text(best, model, cluster, batch, gpus, considered, priced, seconds,
                               args.output))
    if not best[0].fits and not fixed.everything:
        raise InfeasibleError(f"no layout fits {cluster.gpu.memory_gib:g} GiB per GPU; the "
                              f"one shown needs {best[0].memory_bytes / 2**30:.1f} GiB",
                              hint="use more GPUs, a smaller micro-batch or global batch, or "
                              "allow recomputation")
    return 0


def _check_fixed(fixed, model, batch, gpus, cluster) -> None:
    """Degrees the user fixed that cannot work, before any search: one line naming the
    flags."""
    if fixed.tp and model.heads % fixed.tp:
        raise PlanError(f"--tp {fixed.tp}: {model.heads} attention heads do not divide over "
                        f"{fixed.tp} GPUs", hint="use a tensor degree that divides the heads")
    product = math.prod(x for x in (fixed.tp, fixed.cp, fixed.pp, fixed.dp) if x)
    if fixed.tp and fixed.pp and fixed.dp and product != gpus:
        raise PlanError(f"--tp {fixed.tp} x --cp {fixed.cp or 1} x --pp {fixed.pp} x --dp "
                        f"{fixed.dp} = {product} GPUs, not the {gpus} given",
                        hint="degrees multiply to --gpus")
    if gpus % product:
        raise PlanError(f"the fixed degrees ({product} GPUs) do not divide {gpus} GPUs",
                        hint="give degrees whose product divides --gpus")
    node = cluster.gpus_per_node
    if fixed.tp and fixed.tp > node:
        if fixed.tp % node:
            raise PlanError(f"--tp {fixed.tp}: wider than a node of {node} GPUs and not whole "
                            "nodes", hint=f"use a multiple of {node} or at most {node}")
        print(f"pyplan: warning: --tp {fixed.tp} spans {fixed.tp // node} nodes: its "
              "collectives run at the network's bandwidth", file=sys.stderr)
    if fixed.dp and batch.global_batch % fixed.dp:
        raise PlanError(f"--global-batch {batch.global_batch} does not split over --dp "
                        f"{fixed.dp} replicas", hint="use a multiple of the data degree")
    if fixed.micro_batch and batch.global_batch % fixed.micro_batch:
        raise PlanError(f"--global-batch {batch.global_batch} is not a multiple of "
                        f"--micro-batch {fixed.micro_batch}")
    if fixed.recompute_layers and fixed.recompute_layers > model.layers:
        raise PlanError(f"--recompute-layers {fixed.recompute_layers}: more than the model's "
                        f"{model.layers} layers", hint="give at most the layers of a chunk, "
                        "or --recompute full")
    if fixed.pp and fixed.pp > model.layers:
        raise PlanError(f"--pp {fixed.pp}: more pipeline stages than the model's "
                        f"{model.layers} layers")
    if fixed.cp and fixed.cp > 1:
        if not batch.flash_attention:
            raise PlanError(f"--cp {fixed.cp}: ring attention needs fused attention",
                            hint="drop --no-flash-attention")
        tp = fixed.tp or 1
        if batch.sequence % (2 * fixed.cp * tp):
            raise PlanError(f"--cp {fixed.cp}: a sequence of {batch.sequence} does not split "
                            f"into {2 * fixed.cp} chunks of whole tensor slices (tp {tp})",
                            hint="context parallelism splits each sequence into 2 x cp "
                            "chunks for the causal load balance")
    if fixed.ep and fixed.ep > 1:
        if not model.experts:
            raise PlanError(f"--ep {fixed.ep}: {model.family} is not a mixture of experts",
                            hint="expert parallelism needs routed experts")
        if model.experts % fixed.ep:
            raise PlanError(f"--ep {fixed.ep}: {model.experts} experts do not divide over "
                            f"{fixed.ep} ranks", hint="use a divisor of the experts")
        if fixed.dp and fixed.dp % fixed.ep:
            raise PlanError(f"--ep {fixed.ep} does not divide --dp {fixed.dp}",
                            hint="expert parallelism splits the data-parallel ranks")
    for flag, value in (("--ep", fixed.ep), ("--dp-replicate", fixed.dp_replicate)):
        if value and gpus % (product * value if product % value else product):
            raise PlanError(f"{flag} {value}: the data-parallel ranks of {gpus} GPUs with the "
                            f"fixed degrees ({product} GPUs) do not split by {value}",
                            hint=f"give {flag} a divisor of the data-parallel degree")
    if fixed.dp_replicate and fixed.dp_replicate > 1:
        if not fixed.fsdp:
            raise PlanError(f"--dp-replicate {fixed.dp_replicate} needs --fsdp",
                            hint="HSDP replicates FSDP groups")
        if fixed.dp and fixed.dp % fixed.dp_replicate:
            raise PlanError(f"--dp-replicate {fixed.dp_replicate} does not divide --dp "
                            f"{fixed.dp}", hint="replicas of equal FSDP groups")
    if fixed.fsdp and fixed.distributed_optimizer:
        raise PlanError("--fsdp with --distributed-optimizer: FSDP already shards the "
                        "optimizer's state", hint="give one of them")
    if batch.dtype == "fp8" and not cluster.gpu.peak_tflops.get("fp8"):
        raise PlanError(f"--dtype fp8: {cluster.gpu.name} has no fp8 tensor cores in the "
                        "cluster file", hint="add peak_tflops.fp8 to its gpu, or use bf16")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f}"


def _text(best, model, cluster, batch, gpus, considered, priced, seconds, output) -> str:
    from pyplan.cluster.model import parameters_text

    first = best[0]
    lines = [f"{model.family} ({parameters_text(model)}) on {gpus} GPUs of {cluster.name} "
             f"({cluster.gpu.name}), global batch {batch.global_batch} x {batch.sequence} "
             f"tokens, {batch.dtype}"
             f"{'' if batch.flash_attention else ' (attention unfused)'}, "
             f"{batch.framework.describe()}",
             f"  {considered:,} layouts considered, {priced} priced exactly, in {seconds:.1f} s"]
    lines.append(("best: " if len(best) > 1 or considered > 1 else "layout: ") +
                 first.layout.describe())
    lines += _details(first, cluster)
    if len(best) > 1:
        lines.append(f"top {len(best)}:")
        lines.append(f"  {'#':>2}  {'iteration':>9}  {'MFU':>6}  {'GiB':>5}  layout")
        for i, p in enumerate(best, 1):
            lines.append(f"  {i:>2}  {p.seconds:8.3f}s  {p.mfu:6.1%}  {_gib(p.memory_bytes):>5}"
                         f"  {p.layout.describe()}")
    if output:
        lines.append(f"wrote {output}")
    return "\n".join(lines) + "\n"


def _details(p, cluster) -> list[str]:
    memory, b = p.memory, p.breakdown
    fits = "fits" if p.fits else "DOES NOT FIT"
    return [f"  iteration {p.seconds:.3f} s, {p.tokens_per_second_per_gpu:,.0f} tokens/s per "
            f"GPU, MFU {p.mfu:.1%} (HFU {p.hfu:.1%})",
            f"  memory {_gib(p.memory_bytes)} of {cluster.gpu.memory_gib:g} GiB per GPU "
            f"({fits}): weights {_gib(memory['weights'])}, gradients "
            f"{_gib(memory['gradients'])}, optimizer {_gib(memory['optimizer'])}, activations "
            f"{_gib(memory['activations'])}, buffers {_gib(memory['buffers'])}",
            f"  iteration by part: compute {b['compute']:.3f} s, " + "".join(
                f"{what} communication {b[key]:.3f} s, " for what, key in (
                    ("context-parallel", "cp_communication"),
                    ("expert-parallel", "ep_communication"),
                    ("FSDP", "fsdp_communication"), ("pipeline",
                                                     "pp_communication")) if b[key] > 0) +
            "tensor-parallel "
            f"communication {b['tp_communication']:.3f} s, pipeline bubble "
            f"{b['pipeline_bubble']:.3f} s, data-parallel communication "
            f"{b['dp_communication']:.3f} s, optimizer {b['optimizer']:.3f} s"]


def _json(best, model, cluster, batch, gpus, considered, priced, seconds) -> dict:
    out = best[0].as_json()
    out.update({"model": {"family": model.family, "parameters": model.params,
                          "active_parameters": model.active_params, "layers": model.layers,
                          "hidden": model.hidden},
                "cluster": cluster.name, "gpus": gpus,
                "batch": {"global_batch": batch.global_batch, "sequence": batch.sequence,
                          "dtype": batch.dtype, "flash_attention": batch.flash_attention},
                "framework": dataclasses.asdict(batch.framework),
                "search": {"layouts": considered, "priced": priced, "seconds": seconds},
                "top": [p.as_json() for p in best]})
    return out


def _exports(p, model, batch, args) -> list[tuple[str, str]]:
    """(path, text) of the trainer settings asked for, of the layout `p`."""
    if not (args.torchtitan or args.megatron):
        return []
    from pyplan.export.trainers import TrainerLayout, megatron_arguments, torchtitan_config

    software = batch.framework
    overlaps = [name for name, on in (("grad-reduce", software.overlap_grad_reduce),
                                      ("param-gather", software.overlap_param_gather),
                                      ("tp-comm", software.tp_comm_overlap)) if on]
    layout = TrainerLayout.planned(p.layout, name=model.family,
                                   micro_batches=p.layout.micro_batches(batch),
                                   stage_layers=p.layers_per_stage,
                                   sequence_length=batch.sequence, overlaps=tuple(overlaps))
    out = []
    if args.torchtitan:
        out.append((args.torchtitan, torchtitan_config(layout)))
    if args.megatron:
        out.append((args.megatron, megatron_arguments(layout)))
    return out


def _plan_file(p, model, cluster, batch, args) -> str:
    layout = p.layout
    header = (f"# Written by pyplan plan: {model.family} on {layout.gpus} GPUs of {cluster.name}"
              f", {layout.describe()}.\n"
              f"# Predicted: {p.seconds:.3f} s per iteration, MFU {p.mfu:.1%}, "
              f"{_gib(p.memory_bytes)} GiB per GPU. Blocks: one pipeline stage (model chunk) "
              "each, times from the cost model, memory in bytes; mesh: the data and tensor "
              "degrees.\n")
    return header + p.plan
