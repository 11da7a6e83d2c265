"""The trainer exports checked by the released clients' own code, not by a copy of their field
names: torchtitan 0.3.0 and megatron-core 0.16.1, the versions the exports name.

- torchtitan: the exported module's `pipeline(config)` sets a Trainer.Config made of
  torchtitan's own configuration dataclasses (slots: a field torchtitan lacks raises), then
  runs Trainer.Config's own checks (compiled from torchtitan's trainer.py: that module imports
  the data stack, so it is not imported whole) and rebuilds the parallelism and training
  configs as torchtitan's CLI parser does; ParallelDims validates the degrees against the
  world, and on a fake process group of that world (rank 0) torchtitan's pipeline code splits
  a model with the exported module names into rank 0's stages and builds the schedule, whose
  micro-batch count it derives itself (with pyplan's CSV loaded into torch's runtime where
  the export names one).
- Megatron-LM: the argument line's flags are what Megatron-LM builds megatron-core's configs
  from (the TransformerConfig and DDP config fields of the same names) or parameters of
  megatron-core's own functions (batch sizes, sequence length); TransformerConfig, built from
  them as Megatron-LM builds it, validates the layout (PipelineParallelLayerLayout) against
  the layers, pipeline and virtual pipeline; megatron-core's parallel_state lays out the
  model-parallel groups on a fake world of the layout's size, its micro-batch calculator
  derives the micro-batch count, and the layout's stages hold the layers pyplan put there.
  (Megatron-LM's own arguments.py is not on PyPI; its rules beyond megatron-core's, read at
  its tag core_v0.16.1, are pyplan's refusals, tested in test_export_trainers.py.)

The clients' wheels come from PyPI (`pip download --no-deps`, once, into pytest's cache;
with PYPLAN_CLIENT_WHEELS=DIR, from that directory first, offline) and are unpacked, not
installed: torchtitan without its data, logging and kernel stack (datasets, tensorboard,
wandb, triton: over a gigabyte), with the four small packages its configuration and pipeline
modules import; megatron-core with einops (its own extra, for the groups of several
distributed-optimizer instances), on the torch, numpy and packaging installed here. Each
client runs in a process of its own (this file as a script), so nothing it registers with
torch reaches other tests. Where a wheel cannot be had (no network), the tests skip and say
why.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from pyplan.export.trainers import (MEGATRON_CORE, TORCHTITAN, TrainerLayout,
                                    megatron_arguments, torchtitan_config)

CLIENTS = {
    "torchtitan": (f"torchtitan=={TORCHTITAN}", "tyro==1.0.17", "docstring_parser==0.18.0",
                   "typeguard==4.6.1", "spmd_types==0.2.3"),
    # einops: megatron-core's own extras; its parallel_state needs it for several
    # distributed-optimizer instances
    "megatron-core": (f"megatron-core=={MEGATRON_CORE}", "einops==0.8.2"),
}
# One wheel of each release, the same on every machine: only their Python code is run.
_TARGET = ("--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
           "--abi", "cp311", "--platform", "manylinux_2_28_x86_64")

# Layouts as the cluster planner gives them, torchtitan's and Megatron-LM's degrees at once.
LAYOUTS = {
    "tp2-pp4-dp2-vpp2": TrainerLayout(
        name="gpt-16", tp=2, pp=4, dp_shard=2, vpp=2, micro_batches=8, micro_batch_size=1,
        sequence_length=4096, schedule="interleaved-1f1b", sequence_parallel=True,
        recompute="selective", stage_layers=(1, 2, 2, 2, 2, 2, 2, 3)),
    "hsdp-1f1b": TrainerLayout(
        name="hsdp", tp=2, pp=2, dp_replicate=2, dp_shard=2, micro_batches=4,
        micro_batch_size=2, sequence_length=2048, schedule="1f1b", sequence_parallel=True,
        recompute="full", stage_layers=(3, 3)),
    "ddp-zb-h1": TrainerLayout(name="zb", pp=4, dp_replicate=2, micro_batches=8,
                               schedule="zb-h1", recompute="none", stage_layers=(1, 2, 2, 1)),
    "zb-v": TrainerLayout(name="v", pp=2, vpp=2, placement="v", micro_batches=4,
                          schedule="zb-v", stage_layers=(1, 1, 1, 1)),
    "gpipe": TrainerLayout(name="g", tp=4, pp=2, micro_batches=4, schedule="gpipe",
                           stage_layers=(2, 2)),
}


def _planned(**fixed) -> TrainerLayout:
    """A layout as pyplan's cluster planner prices it (pyplan plan): the layers it gives each
    stage of a 16-layer GPT on DGX H100s, a global batch of 16 sequences of 4096 tokens."""
    from pyplan.cluster import Batch, Layout, load_cluster, predict
    from pyplan.cluster.model import gpt

    batch, layout = Batch(16, 4096), Layout(**fixed)
    priced = predict(gpt(16, 1024, 16, sequence=4096), load_cluster("dgx-h100"), layout, batch)
    return TrainerLayout.planned(priced.layout, name="planned", stage_layers=priced.
                                 layers_per_stage, micro_batches=layout.micro_batches(batch),
                                 sequence_length=batch.sequence)


LAYOUTS["planner-tp2-pp4-dp2-vpp2"] = _planned(
    tp=2, pp=4, dp=2, vpp=2, recompute="selective", sequence_parallel=True,
    schedule="interleaved-1f1b", distributed_optimizer=True)
LAYOUTS["planner-zb-v"] = _planned(tp=2, pp=4, dp=2, vpp=2, recompute="full",
                                   schedule="zb-v")
# the rest are schedules Megatron-LM has not
MEGATRON_LAYOUTS = ("tp2-pp4-dp2-vpp2", "hsdp-1f1b", "planner-tp2-pp4-dp2-vpp2")
# torch's schedule class torchtitan builds for each (with a CSV: torch's runtime runs it)
TORCH_CLASSES = {"interleaved-1f1b": "ScheduleInterleaved1F1B", "1f1b": "Schedule1F1B",
                 "zb-h1": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble",
                 "gpipe": "ScheduleGPipe", "search": "_PipelineScheduleRuntime"}
# recompute None leaves the config's own (here Trainer.Config's default, SelectiveAC)
AC_CLASSES = {None: "SelectiveAC", "none": None, "selective": "SelectiveAC", "full": "FullAC"}

# Plans as pyplan partition writes them (units: Hugging Face Llama names, or a GPT's own).
_LLAMA = (["model.embed_tokens"] + [f"model.layers.{i}" for i in range(6)] +
          ["model.norm", "lm_head"])
PLANS = {
    # one stage per rank: pyplan's order from its CSV, torchtitan's names for the Llama units
    "llama-loop": dict(devices=4, stages=[_LLAMA[:2], _LLAMA[2:4], _LLAMA[4:6], _LLAMA[6:]],
                       micro_batches=8),
    # two stages per rank, two replicas sharding the state (mesh shard: FSDP, distributed
    # optimizer), each stage over 2 tensor-parallel GPUs
    "gpt-interleaved-dp": dict(devices=2, stages=[["embed", "layers.0"], ["layers.1"],
                                                  ["layers.2"], ["layers.3", "head"]],
                               micro_batches=4, dp=2, tp=2),
    # the V with a split backward: torch's ZBVZeroBubble places it
    "gpt-v": dict(devices=2, stages=[["embed", "layers.0"], ["layers.1"], ["layers.2"],
                                     ["layers.3", "head"]],
                  placement=[0, 1, 1, 0], split=True, micro_batches=4),
}
MEGATRON_PLANS = ("llama-loop", "gpt-interleaved-dp")


def test_the_exports_name_the_versions_tested_here():
    assert CLIENTS["torchtitan"][0] == f"torchtitan=={TORCHTITAN}" == "torchtitan==0.3.0"
    assert CLIENTS["megatron-core"][0] == f"megatron-core=={MEGATRON_CORE}" == \
        "megatron-core==0.16.1"
    layout = LAYOUTS["tp2-pp4-dp2-vpp2"]
    assert "for torchtitan 0.3.0" in torchtitan_config(layout)
    assert "for Megatron-LM core_v0.16.1 (megatron-core 0.16.1)" in megatron_arguments(layout)


# ---------------------------------------------------------------- fetching the clients

@pytest.fixture(scope="session")
def client_site(request, tmp_path_factory):
    """site(NAME): the directory the client's wheels are unpacked into (skips when they cannot
    be had)."""
    cache = getattr(request.config, "cache", None)
    root = Path(cache.mkdir("pyplan-clients")) if cache is not None else \
        tmp_path_factory.mktemp("pyplan-clients")
    found: dict[str, Path | str] = {}

    def site(name: str) -> Path:
        if name not in found:
            found[name] = _fetch(name, root)
        if isinstance(found[name], str):
            pytest.skip(found[name])
        return found[name]

    return site


def _fetch(name: str, root: Path) -> Path | str:
    """The client's unpacked wheels, downloaded once; a reason to skip when they cannot be."""
    if name == "torchtitan" and sys.version_info < (3, 11):
        return f"torchtitan {TORCHTITAN} needs Python 3.11 or newer"
    specs = CLIENTS[name]
    home = root / f"{name}-{hashlib.sha256(' '.join(specs).encode()).hexdigest()[:12]}"
    if (home / "ready").exists():
        return home / "site"
    work = Path(tempfile.mkdtemp(dir=root, prefix=".fetch-"))
    try:
        wheels = work / "wheels"
        given = os.environ.get("PYPLAN_CLIENT_WHEELS")
        sources = ([["--no-index", "--find-links", given]] if given else []) + [[]]
        for source in sources:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", *_TARGET, "--quiet",
                 "--retries", "1", "--timeout", "30", "--dest", str(wheels), *source, *specs],
                capture_output=True, text=True, timeout=900)
            if done.returncode == 0:
                break
        else:
            said = [line for line in done.stderr.splitlines() if line.strip()] or ["no output"]
            return f"cannot download {' '.join(specs)} with pip: {said[-1].strip()}"
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(work / "site")
        (work / "ready").touch()
        shutil.rmtree(home, ignore_errors=True)
        os.replace(work, home)
        return home / "site"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _in_client(site: Path, check: str, cases: dict, cwd: Path) -> dict:
    """Run CHECK on each case in a process that imports the client from `site`."""
    (cwd / "cases.json").write_text(json.dumps(cases))
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__, check, str(cwd / "cases.json"),
                           str(cwd / "facts.json")], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"},
                          timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads((cwd / "facts.json").read_text())


def _plan(path: Path, name: str, devices: int, stages: list, micro_batches: int,
          placement: list | None = None, split: bool = False, dp: int = 1,
          tp: int = 1) -> Path:
    """A plan as pyplan partition writes it; dp replicas shard the state (mesh shard)."""
    placement = placement or [s % devices for s in range(len(stages))]
    backward = "{time_ratio: 2" + (", weight_time_ratio: 1}" if split else "}")
    mesh = f"mesh: {{data: {dp}, shard: {'true' if dp > 1 else 'false'}, tensor: {tp}, priced: {tp}}}\n"
    text = (f"pyplan: 1\nname: {name}\ndevices: {devices}\nmicro_batches: {micro_batches}\n"
            f"training: {{backward: {backward}}}\n" + mesh +
            "blocks:\n" +
            "".join(f"  - {{name: s{s}, devices: [{d}], time: 1, memory: 1}}\n"
                    for s, d in enumerate(placement)) +
            "model:\n  module: m:model\n  cut: forward\n  stages:\n" +
            "".join(f"    s{s}: {json.dumps(units)}\n" for s, units in enumerate(stages)) +
            "  data: m:batch\n  loss: m:loss\n")
    path.write_text(text)
    return path


def _export(*args) -> None:
    from pyplan.cli import main

    assert main([str(a) for a in args]) == 0, args


# ---------------------------------------------------------------- torchtitan

@pytest.fixture(scope="module")
def torchtitan_runs(client_site, tmp_path_factory) -> dict:
    """What torchtitan makes of each export (one process for all)."""
    site = client_site("torchtitan")
    work = tmp_path_factory.mktemp("torchtitan")
    cases = {}
    for key, layout in LAYOUTS.items():
        (work / f"{key}.py").write_text(torchtitan_config(layout))
        cases[key] = {"path": f"{key}.py", "world": layout.gpus}
    for key, given in PLANS.items():
        plan = _plan(work / f"{key}.yaml", key, **given)
        _export("export", plan, "--format", "torchtitan", "-o", work / f"{key}.py")
        _export("export", plan, "--format", "torch-csv", "-o", work / f"{key}.csv")
        world = given["devices"] * given.get("dp", 1) * given.get("tp", 1)
        cases[key] = {"path": f"{key}.py", "world": world}
    return _in_client(site, "torchtitan", cases, work)


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_torchtitan_builds_the_layouts_pipeline(key, torchtitan_runs):
    layout = LAYOUTS[key]
    facts = torchtitan_runs[key]
    assert "error" not in facts, facts.get("error")
    assert facts["version"] == TORCHTITAN
    assert facts["dims"] == {"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard,
                             "cp": 1, "tp": layout.tp, "pp": layout.pp,
                             "world_size": layout.gpus}
    assert facts["schedule"] == TORCH_CLASSES[layout.schedule]
    assert facts["micro_batches"] == layout.micro_batches  # torchtitan's own count
    assert facts["stages_of_rank"] == [list(layout.stage_of_rank(r)) for r in range(layout.pp)]
    parts = facts["module_fqns_per_model_part"]
    assert facts["rank0_modules"] == [parts[s] for s in layout.stage_of_rank(0)]
    assert sum(len([m for m in part if m.startswith("layers.")]) for part in parts) == \
        sum(layout.stage_layers)
    assert facts["activation_checkpoint"] == AC_CLASSES[layout.recompute]
    assert facts["seq_len"] == (layout.sequence_length or 2048)  # else torchtitan's default
    assert facts["enable_sequence_parallel"] == layout.sequence_parallel
    assert facts["global_batch_size"] == layout.global_batch == \
        facts["local_batch_size"] * layout.dp  # one pipeline iteration per step


def test_torchtitan_gets_the_issues_layout_as_planned(torchtitan_runs):
    """tp 2 x pp 4 x dp 2 (FSDP) with 2 stages per rank: rank 0 builds stages 0 and 4."""
    facts = torchtitan_runs["tp2-pp4-dp2-vpp2"]
    assert facts["rank0_modules"] == [["tok_embeddings", "layers.0"], ["layers.7", "layers.8"]]
    assert facts["module_fqns_per_model_part"][-1] == \
        ["layers.13", "layers.14", "layers.15", "norm", "lm_head"]
    assert (facts["schedule"], facts["micro_batches"]) == ("ScheduleInterleaved1F1B", 8)


@pytest.mark.parametrize("key", list(PLANS))
def test_torchtitan_runs_a_plans_order_from_its_csv(key, torchtitan_runs):
    given = PLANS[key]
    facts = torchtitan_runs[key]
    assert "error" not in facts, facts.get("error")
    dp, tp = given.get("dp", 1), given.get("tp", 1)
    assert facts["dims"] == {"dp_replicate": 1, "dp_shard": dp, "cp": 1, "tp": tp,
                             "pp": given["devices"], "world_size": given["devices"] * dp * tp}
    # torch's runtime runs pyplan's CSV; the named schedule placed the stages
    assert facts["schedule"] == "_PipelineScheduleRuntime" and facts["csv_actions"] > 0
    assert facts["micro_batches"] == given["micro_batches"]
    placement = given.get("placement") or [s % given["devices"]
                                           for s in range(len(given["stages"]))]
    assert facts["stages_of_rank"] == [[s for s, d in enumerate(placement) if d == r]
                                       for r in range(given["devices"])]
    assert facts["named_schedule"] == {"llama-loop": "1F1B",
                                       "gpt-interleaved-dp": "Interleaved1F1B",
                                       "gpt-v": "ZBVZeroBubble"}[key]
    if key == "llama-loop":  # Hugging Face names as torchtitan's Llama names them
        assert facts["module_fqns_per_model_part"] == [
            ["tok_embeddings", "layers.0"], ["layers.1", "layers.2"],
            ["layers.3", "layers.4"], ["layers.5", "norm", "lm_head"]]


# ---------------------------------------------------------------- Megatron-LM

@pytest.fixture(scope="module")
def megatron_runs(client_site, tmp_path_factory) -> dict:
    site = client_site("megatron-core")
    work = tmp_path_factory.mktemp("megatron")
    cases = {}
    for key in MEGATRON_LAYOUTS:
        layout = LAYOUTS[key]
        (work / f"{key}.args").write_text(megatron_arguments(layout))
        cases[key] = {"path": f"{key}.args", "world": layout.gpus}
    for key in MEGATRON_PLANS:
        given = PLANS[key]
        plan = _plan(work / f"{key}.yaml", key, **given)
        _export("export", plan, "--format", "megatron-args", "-o", work / f"{key}.args")
        _export("export", plan, "--format", "megatron-layout", "-o", work / f"{key}.layout")
        world = given["devices"] * given.get("dp", 1) * given.get("tp", 1)
        cases[key] = {"path": f"{key}.args", "world": world, "layout": f"{key}.layout",
                      "pp": given["devices"]}
    return _in_client(site, "megatron", cases, work)


def _megatron_stages(layers: tuple[int, ...]) -> list[dict]:
    last = len(layers) - 1
    return [{"E": int(s == 0), "t": n, "L": int(s == last)} for s, n in enumerate(layers)]


@pytest.mark.parametrize("key", MEGATRON_LAYOUTS)
def test_megatron_accepts_the_layouts_arguments(key, megatron_runs):
    layout = LAYOUTS[key]
    facts = megatron_runs[key]
    assert "error" not in facts, facts.get("error")
    assert facts["version"] == MEGATRON_CORE
    assert facts["unknown_flags"] == []
    assert facts["groups"] == {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                               "vpp": layout.vpp if layout.vpp > 1 else None}
    assert facts["micro_batches"] == layout.micro_batches  # megatron-core's own count
    assert facts["stages"] == _megatron_stages(layout.stage_layers)
    assert facts["sequence_parallel"] == layout.sequence_parallel
    assert facts["recompute_granularity"] == {"none": None, None: None}.get(
        layout.recompute, layout.recompute)
    assert facts["use_distributed_optimizer"] == layout.distributed_optimizer
    assert facts["distributed_optimizer_instances"] == (
        layout.dp_replicate if layout.distributed_optimizer else 1)


def test_megatron_gets_the_issues_layout_as_planned(megatron_runs):
    facts = megatron_runs["tp2-pp4-dp2-vpp2"]
    assert facts["argv"] == [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
        "--num-layers", "16", "--pipeline-model-parallel-layout", "E,t|t*2|t*2|t*2|t*2|t*2|"
        "t*2|t*3,L", "--micro-batch-size", "1", "--global-batch-size", "16", "--seq-length",
        "4096", "--sequence-parallel", "--recompute-granularity", "selective",
        "--use-distributed-optimizer"]
    assert facts["groups"] == {"tp": 2, "pp": 4, "dp": 2, "vpp": 2}


@pytest.mark.parametrize("key", MEGATRON_PLANS)
def test_megatron_accepts_a_plans_layout_and_arguments(key, megatron_runs):
    given = PLANS[key]
    facts = megatron_runs[key]
    assert "error" not in facts, facts.get("error")
    assert facts["unknown_flags"] == []
    layers = [sum(u.rsplit(".", 1)[-1].isdigit() for u in units) for units in given["stages"]]
    assert facts["stages"] == _megatron_stages(tuple(layers))
    assert facts["layout_stages"] == facts["stages"]  # --format megatron-layout, parsed alone
    dp = given.get("dp", 1)
    vpp = len(given["stages"]) // given["devices"]
    assert facts["groups"] == {"tp": given.get("tp", 1), "pp": given["devices"], "dp": dp,
                               "vpp": vpp if vpp > 1 else None}
    assert facts["micro_batches"] == given["micro_batches"]
    assert facts["use_distributed_optimizer"] == (dp > 1)


# ---------------------------------------------------------------- in the client's process

def _torchtitan_case(case: dict) -> dict:
    import dataclasses
    import importlib.util

    import torch
    import torch.distributed as dist

    import torchtitan
    from torchtitan.config.configs import (CommConfig, CompileConfig, DebugConfig,
                                           ParallelismConfig, TrainingConfig)
    from torchtitan.distributed import pipeline_parallel
    from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC, SelectiveAC
    from torchtitan.distributed.parallel_dims import ParallelDims

    spec = importlib.util.spec_from_file_location(Path(case["path"]).stem, case["path"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Trainer.Config as torchtitan's registry functions return it: its fields, torchtitan's
    # defaults for the configs pipeline() and the checks touch.
    config = _trainer_config_class(Path(torchtitan.__file__).parent / "trainer.py",
                                   {"SelectiveAC": SelectiveAC,
                                    "MemoryBudgetAC": MemoryBudgetAC})()
    for name, value in {"parallelism": ParallelismConfig(), "training": TrainingConfig(),
                        "compile": CompileConfig(), "debug": DebugConfig(),
                        "comm": CommConfig(), "activation_checkpoint": SelectiveAC.Config(),
                        "model_spec": None}.items():
        setattr(config, name, value)
    config = module.pipeline(config)
    # torchtitan's CLI parser builds the final Trainer.Config from the one the function returns
    # (tyro, default=...): every config's __post_init__ runs again on what was set.
    config.parallelism = dataclasses.replace(config.parallelism)
    config.training = dataclasses.replace(config.training)
    config.__post_init__()
    parallelism, training = config.parallelism, config.training
    world = case["world"]
    dims = ParallelDims.from_config(parallelism, world)
    parts = parallelism.module_fqns_per_model_part
    facts = {"version": torchtitan.__version__,
             "dims": {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp",
                                                     "pp", "world_size")},
             "module_fqns_per_model_part": parts,
             "named_schedule": parallelism.pipeline_parallel_schedule,
             "activation_checkpoint": None if config.activation_checkpoint is None else
             type(config.activation_checkpoint).__qualname__.split(".")[0],
             "seq_len": training.seq_len,
             "enable_sequence_parallel": parallelism.enable_sequence_parallel,
             "local_batch_size": training.local_batch_size,
             "global_batch_size": training.global_batch_size}
    facts["stages_of_rank"] = [
        list(pipeline_parallel._get_pp_rank_to_stage_indices_mapping(
            r, dims.pp, parallelism.pipeline_parallel_schedule, len(parts)))
        for r in range(dims.pp)]
    dist.init_process_group("fake", rank=0, world_size=world)
    try:
        dims.world_mesh  # noqa: B018  (builds the meshes)
        stages, chunks = pipeline_parallel._pipeline_module_split(
            _model_with(parts), dims.get_mesh("pp"), parallelism.pipeline_parallel_schedule,
            torch.device("cpu"), parts)
        schedule = pipeline_parallel._build_pipeline_schedule(
            parallelism=parallelism, local_batch_size=training.local_batch_size,
            stages=stages, loss_fn=lambda *args, **kwargs: (torch.zeros(()), None))
    finally:
        dist.destroy_process_group()
    facts["rank0_modules"] = [_module_names(chunk) for chunk in chunks]
    facts["schedule"] = type(schedule).__name__
    facts["micro_batches"] = schedule._n_microbatches
    if parallelism.pipeline_parallel_schedule_csv:
        facts["csv_actions"] = sum(a is not None for actions in
                                   schedule.pipeline_order.values() for a in actions)
    return facts


def _trainer_config_class(path: Path, names: dict) -> type:
    """A class with torchtitan's Trainer.Config fields as slots and its own checks
    (__post_init__, _validate_cuda_graphs), compiled from trainer.py's source."""
    import ast
    import textwrap

    source = path.read_text()
    tree = ast.parse(source)
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    config = next(n for n in trainer.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    fields = tuple(n.target.id for n in config.body if isinstance(n, ast.AnnAssign))
    checks = [textwrap.dedent(ast.get_source_segment(source, n, padded=True))
              for n in config.body if isinstance(n, ast.FunctionDef) and
              n.name in ("__post_init__", "_validate_cuda_graphs")]
    assert len(checks) == 2 and {"parallelism", "training"} <= set(fields), fields
    code = (f"class TrainerConfig:\n    __slots__ = {fields!r}\n\n" +
            "".join(textwrap.indent(check, "    ") + "\n" for check in checks))
    namespace = dict(names)
    exec(compile(code, str(path), "exec"), namespace)
    return namespace["TrainerConfig"]


def _model_with(parts: list[list[str]]):
    """A model with the modules the parts name: NAME a module, NAME.KEY an item of NAME, a
    ModuleDict (as torchtitan's decoders hold their layers)."""
    import torch.nn as nn

    model = nn.Module()
    for name in (n for part in parts for n in part):
        top, _, key = name.partition(".")
        if key:
            if top not in model._modules:
                model.add_module(top, nn.ModuleDict())
            model._modules[top][key] = nn.Linear(2, 2)
        else:
            model.add_module(top, nn.Linear(2, 2))
    return model


def _module_names(chunk) -> list[str]:
    import torch.nn as nn

    names = []
    for name, child in chunk.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            names += [f"{name}.{key}" for key, _ in child.named_children()]
        else:
            names.append(name)
    return names


def _megatron_case(case: dict) -> dict:
    import dataclasses
    import inspect
    import shlex

    import torch
    import torch.distributed as dist

    from megatron.core import package_info, parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import (ConstantNumMicroBatchesCalculator,
                                                           init_num_microbatches_calculator)
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout)
    from megatron.core.transformer.transformer_config import TransformerConfig

    text = Path(case["path"]).read_text()
    argv = shlex.split(" ".join(line for line in text.splitlines()
                                if not line.startswith("#")))
    args, i = {}, 0
    while i < len(argv):  # as argparse reads them: --a-b VALUE -> a_b, a lone --flag -> True
        assert argv[i].startswith("--"), argv[i]
        name = argv[i][2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            args[name] = int(argv[i + 1]) if argv[i + 1].isdigit() else argv[i + 1]
            i += 2
        else:
            args[name], i = True, i + 1
    transformer = {f.name for f in dataclasses.fields(TransformerConfig)}
    ddp = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    batch = set(inspect.signature(init_num_microbatches_calculator).parameters)
    step = set(inspect.signature(schedules.forward_backward_pipelining_with_interleaving)
               .parameters)
    facts = {"version": package_info.__version__, "argv": argv,
             "unknown_flags": sorted(set(args) - transformer - ddp - batch - step)}
    # Megatron-LM's core_transformer_config_from_args: the arguments of TransformerConfig's
    # field names, the model's sizes (the user's arguments) and the pipeline's dtype.
    config = TransformerConfig(**{k: v for k, v in args.items() if k in transformer},
                               hidden_size=64, num_attention_heads=8,
                               pipeline_dtype=torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(**{k: v for k, v in args.items() if k in ddp})
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    dist.init_process_group("fake", rank=0, world_size=case["world"])
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tensor_model_parallel_size,
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
            num_distributed_optimizer_instances=ddp_config.num_distributed_optimizer_instances,
            create_gloo_process_groups=False)
        facts["groups"] = {
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size()}
        facts["micro_batches"] = ConstantNumMicroBatchesCalculator(
            args["global_batch_size"], args["micro_batch_size"], facts["groups"]["dp"],
            False, 0).get()
        layouts = [config.pipeline_model_parallel_layout]
        if "layout" in case:  # --format megatron-layout's string, as megatron-core parses it
            alone = PipelineParallelLayerLayout.from_str(
                Path(case["layout"]).read_text().strip(), case["pp"])
            alone.validate_layer_layout(num_layers=config.num_layers, mtp_num_layers=None)
            layouts.append(alone)
        found = []
        for layout in layouts:
            found.append([])
            for s in range(pp * (vpp or 1)):
                rank, chunk = s % pp, s // pp
                layers = layout.layout[rank][chunk]
                found[-1].append({
                    "E": layers.count(LayerType.embedding),
                    "t": layout.get_num_layers_to_build(LayerType.decoder, vp_stage=chunk,
                                                        pp_rank=rank),
                    "L": layers.count(LayerType.loss)})
        facts["stages"] = found[0]
        if len(found) > 1:
            facts["layout_stages"] = found[1]
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    facts["sequence_parallel"] = config.sequence_parallel
    facts["recompute_granularity"] = config.recompute_granularity
    facts["use_distributed_optimizer"] = ddp_config.use_distributed_optimizer
    facts["distributed_optimizer_instances"] = ddp_config.num_distributed_optimizer_instances
    return facts


def _client_main(check: str, cases_path: str, facts_path: str) -> None:
    """Run in the client's process: each case's facts, or the error the client raised."""
    import traceback

    run = {"torchtitan": _torchtitan_case, "megatron": _megatron_case}[check]
    facts = {}
    for key, case in json.loads(Path(cases_path).read_text()).items():
        try:
            facts[key] = run(case)
        except BaseException as exc:  # the client's refusal is the test's finding
            facts[key] = {"error": "".join(traceback.format_exception(exc))[-3000:]}
    Path(facts_path).write_text(json.dumps(facts))


if __name__ == "__main__":
    _client_main(*sys.argv[1:])
