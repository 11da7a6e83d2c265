"""The trainer exports without their clients: what each writes, what a TrainerLayout accepts,
and what each client cannot run, refused in one line (the rules of torchtitan 0.3.0 and of
Megatron-LM core_v0.16.1 beyond what megatron-core checks, read from their sources).
test_clients.py runs the exports in the clients themselves."""

from __future__ import annotations

import json
import shlex

import pytest

from conftest import PLANS
from pyplan.errors import PlanError
from pyplan.export.trainers import (LayoutError, TrainerLayout, megatron_argv,
                                    megatron_arguments, megatron_layout, torchtitan_config)

ISSUE = dict(name="gpt-16", tp=2, pp=4, dp_shard=2, vpp=2, micro_batches=8,
             sequence_length=4096, schedule="interleaved-1f1b", sequence_parallel=True,
             recompute="selective", stage_layers=(1, 2, 2, 2, 2, 2, 2, 3))


def _layout(**changes) -> TrainerLayout:
    return TrainerLayout(**{**ISSUE, **changes})


def _pipeline_body(module: str) -> list[str]:
    body = module.split("def pipeline(config):\n", 1)[1].splitlines()
    return [line.strip() for line in body[1:] if line.strip()]


def test_torchtitan_sets_the_whole_layout_and_the_micro_batch_count_as_its_local_batch():
    assert _pipeline_body(torchtitan_config(_layout())) == [
        "parallelism = config.parallelism",
        "parallelism.tensor_parallel_degree = 2",
        "parallelism.enable_sequence_parallel = True",
        "parallelism.context_parallel_degree = 1",
        "parallelism.data_parallel_replicate_degree = 1",
        "parallelism.data_parallel_shard_degree = 2",
        "parallelism.pipeline_parallel_degree = 4",
        "parallelism.module_fqns_per_model_part = MODULE_FQNS_PER_MODEL_PART",
        'parallelism.pipeline_parallel_schedule = "Interleaved1F1B"',
        'parallelism.pipeline_parallel_schedule_csv = ""',
        "# 8 micro-batches per pipeline and step: torchtitan splits each data-parallel",
        "# rank's local batch into local_batch_size // pipeline_parallel_microbatch_size.",
        "parallelism.pipeline_parallel_microbatch_size = 1",
        "config.training.local_batch_size = 8",
        "config.training.global_batch_size = 16",
        "config.training.seq_len = 4096",
        "config.training.disable_cuda_graphs = True  # none with a pipeline",
        "from torchtitan.distributed.activation_checkpoint import SelectiveAC",
        "config.activation_checkpoint = SelectiveAC.Config()",
        "return config"]
    # micro-batches of 2 sequences: the local batch holds 8 of them
    body = _pipeline_body(torchtitan_config(_layout(micro_batch_size=2, recompute=None)))
    assert "parallelism.pipeline_parallel_microbatch_size = 2" in body
    assert "config.training.local_batch_size = 16" in body
    assert not any("activation_checkpoint" in line for line in body)  # the config's own
    assert "config.activation_checkpoint = None" in \
        _pipeline_body(torchtitan_config(_layout(recompute="none")))


def test_megatron_arguments_for_the_layout():
    text = megatron_arguments(_layout(dp_replicate=2, recompute="full"))
    header, line = text.rstrip("\n").rsplit("\n", 1)
    assert all(row.startswith("#") for row in header.splitlines())
    assert "Megatron-LM core_v0.16.1 (megatron-core 0.16.1)" in header
    assert "32 GPUs" in header and "data parallel = GPUs / (tp x pp) = 4" in header
    assert shlex.split(line) == [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
        "--num-layers", "16", "--pipeline-model-parallel-layout",
        "E,t|t*2|t*2|t*2|t*2|t*2|t*2|t*3,L", "--micro-batch-size", "1",
        "--global-batch-size", "32", "--seq-length", "4096", "--sequence-parallel",
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--use-distributed-optimizer",
        "--num-distributed-optimizer-instances", "2"]
    # the layout's | and * stay one quoted word for the shell
    assert "'E,t|t*2|t*2|t*2|t*2|t*2|t*2|t*3,L'" in line
    assert megatron_layout(_layout()) == "E,t|t*2|t*2|t*2|t*2|t*2|t*2|t*3,L\n"
    plain = megatron_argv(_layout(pp=1, vpp=1, tp=1, dp_shard=1, sequence_parallel=False,
                                  recompute=None, schedule="1f1b", stage_layers=(4,)))
    assert plain == ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
                     "1", "--num-layers", "4", "--micro-batch-size", "1",
                     "--global-batch-size", "8", "--seq-length", "4096"]


def test_module_names_as_stages():
    layout = _layout(stage_layers=None, vpp=1, schedule="1f1b", stage_modules=(
        ("model.embed_tokens", "model.layers.0"), ("model.layers.1",), ("model.layers.2",),
        ("model.layers.3", "model.norm", "lm_head")))
    assert megatron_layout(layout) == "E,t|t|t|t,L\n"
    assert '["layers.3", "norm", "lm_head"]' in torchtitan_config(layout)


@pytest.mark.parametrize("changes, field, message", [
    ({"pp": 0}, "pp", "pp must be a whole number of at least 1, not 0"),
    ({"micro_batches": True}, "micro_batches", "micro_batches must be a whole number"),
    ({"stage_layers": (1, 2, 3)}, "stage_layers", "3 stages for pp 4 x vpp 2 = 8"),
    ({"stage_modules": (("a",),) * 8}, "stage_modules", "either as module names"),
    ({"stage_layers": (1, 2, 0, 2, 2, 2, 2, 3)}, "stage_layers",
     "stage 2 has 0 decoder layers; a stage needs at least 1"),
    ({"schedule": "interleaved"}, "schedule", "unknown schedule 'interleaved' (hint: did you "
     "mean 'interleaved-1f1b'?)"),
    ({"recompute": "some"}, "recompute", "unknown recompute 'some'"),
    ({"tp": 1}, "sequence_parallel", "sequence parallelism splits the sequence over the "
     "tensor-parallel ranks, and tp is 1"),
    ({"sequence_length": 4095}, "sequence_length", "a sequence of 4095 tokens does not split "
     "over tp 2"),
    ({"schedule": "1f1b"}, "vpp", "1f1b runs 1 stage per pipeline rank, not 2"),
    ({"vpp": 1, "stage_layers": (4, 4, 4, 4)}, "vpp",
     "interleaved-1f1b runs 2 or more stages per pipeline rank"),
    ({"schedule": "zb-v"}, "placement", "zb-v places its stages in a V, not loop"),
    ({"placement": "v", "schedule": "search", "vpp": 1, "stage_layers": (4, 4, 4, 4)}, "vpp",
     "a V places 2 stages on each rank, not 1"),
    ({"cp": 4, "sequence_length": 4100}, "sequence_length", "a sequence of 4100 tokens does "
     "not split into 2 x cp 4 chunks"),
    ({"ep": 3}, "ep", "ep 3 does not divide the 2 data x context ranks"),
    ({"overlaps": ("p2p",)}, "overlaps", "unknown overlap 'p2p'"),
])
def test_a_layout_says_what_is_wrong_in_one_line(changes, field, message):
    with pytest.raises(LayoutError) as caught:
        _layout(**changes)
    assert caught.value.field == field
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, PlanError)  # the CLI's exit 2


@pytest.mark.parametrize("schedule, changes", [
    ("gpipe", {"vpp": 1, "stage_layers": (4, 4, 4, 4)}),
    ("zb-h1", {}),
    ("zb-v", {"placement": "v", "pp": 4}),
    ("dualpipev", {"placement": "v"}),
])
def test_megatron_refuses_the_schedules_it_has_not(schedule, changes):
    layout = _layout(schedule=schedule, **changes)
    with pytest.raises(LayoutError, match=f"Megatron-LM core_v0.16.1 has no {schedule} "
                       "schedule: it runs 1F1B, interleaved when a pipeline rank holds "
                       "several stages"):
        megatron_arguments(layout)
    assert torchtitan_config(layout)  # torchtitan runs them all


def test_megatron_refuses_what_its_argument_checks_refuse():
    with pytest.raises(LayoutError, match="Megatron-LM places stage s on pipeline rank s mod "
                       "pp, never in a V"):
        megatron_layout(_layout(schedule="search", placement="v"))
    with pytest.raises(LayoutError, match=r"interleaved schedule runs the micro-batches in "
                       r"groups of pp \(4\), and 6 is not a multiple of 4"):
        megatron_argv(_layout(micro_batches=6))
    with pytest.raises(LayoutError, match="interleaves stages only over 2 or more"):
        megatron_argv(_layout(pp=1, tp=2, stage_layers=(4, 4)))


def test_torchtitan_refuses_what_torch_cannot_name_unless_it_has_the_csv():
    for schedule in ("search", "zb-h2", "3f1b"):
        changes = {"vpp": 1, "stage_layers": (4, 4, 4, 4)} if schedule == "zb-h2" else {}
        layout = _layout(schedule=schedule, **changes)
        with pytest.raises(LayoutError, match="torchtitan runs it from its torch CSV"):
            torchtitan_config(layout)
        csv = TrainerLayout(**{**ISSUE, "schedule": schedule, "schedule_csv": "gpt.csv",
                               **changes})
        text = torchtitan_config(csv)
        assert 'pipeline_parallel_schedule_csv = "gpt.csv"' in text
        assert '"InterleavedZeroBubble"' in text if schedule == "zb-h2" else \
            '"Interleaved1F1B"' in text
    with pytest.raises(LayoutError, match="chimera runs two pipelines in opposite directions"):
        torchtitan_config(_layout(schedule="chimera"))
    # torch's interleaved schedules run rounds of pp micro-batches: 10 on 4 ranks is 2 rounds
    # of 5; 9 does not split into 2
    assert torchtitan_config(_layout(micro_batches=10))
    with pytest.raises(LayoutError, match=r"runs the micro-batches in 2 rounds of pp \(4\), "
                       "and 9 does not split into 2"):
        torchtitan_config(_layout(micro_batches=9))


def test_torchtitan_refuses_module_names_it_cannot_cut():
    layout = _layout(stage_layers=None, vpp=1, schedule="1f1b", stage_modules=(
        ("transformer.wte", "transformer.h.0"), ("transformer.h.1",), ("transformer.h.2",),
        ("transformer.ln_f", "lm_head")))
    with pytest.raises(LayoutError, match="torchtitan 0.3.0 cuts a model by its top-level "
                       "modules and the items of a top-level ModuleList or ModuleDict "
                       r"\(layers.3\), so it cannot keep 'transformer.h.0' in a stage"):
        torchtitan_config(layout)
    assert megatron_layout(layout) == "E,t|t|t|L\n"  # Megatron reads the kinds only


# ---------------------------------------------------------------- from a plan

def _plan(tmp_path, name="p", devices=2, micro_batches=4, stages=None, placement=None,
          extra=""):
    stages = stages or [["embed", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "head"]]
    placement = placement or [s % devices for s in range(len(stages))]
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"pyplan: 1\nname: {name}\ndevices: {devices}\nmicro_batches: {micro_batches}\n" +
        ("" if "inference" in extra else "training: {backward: {time_ratio: 2}}\n") +
        f"{extra}blocks:\n" +
        "".join(f"  - {{name: s{s}, devices: [{d}], time: 1, "
                f"memory: {0 if 'inference' in extra else 1}}}\n"
                for s, d in enumerate(placement)) +
        "model:\n  module: m:model\n  cut: forward\n  stages:\n" +
        "".join(f"    s{s}: {json.dumps(u)}\n" for s, u in enumerate(stages)) +
        "  data: m:batch\n  loss: m:loss\n")
    return path


def test_megatron_args_of_a_plan(cli, tmp_path):
    code, out, err = cli("export", PLANS / "gpt24.resolved.yaml", "--format", "megatron-args",
                         "-o", "-")
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == (
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --num-layers 24 "
        "--pipeline-model-parallel-layout 'E,t*6|t*7|t*7|t*4,L' --micro-batch-size 1 "
        "--global-batch-size 8")
    assert "Schedule: Megatron-LM's 1F1B (pyplan's own order is not one Megatron-LM runs" in \
        " ".join(line.lstrip("# ") for line in out.splitlines())
    # a mesh with sharding: data parallel 2, Megatron-LM's distributed optimizer; tensor 2
    plan = _plan(tmp_path, extra="mesh: {data: 2, shard: true, tensor: 2, priced: 2}\n")
    code, out, err = cli("export", plan, "--format", "megatron-args", "-o", tmp_path / "a.txt")
    assert (code, err) == (0, "")
    assert out == (f"wrote {tmp_path / 'a.txt'}: megatron-args, p, for Megatron-LM "
                   "core_v0.16.1\n")
    line = (tmp_path / "a.txt").read_text().splitlines()[-1]
    assert line.endswith("--micro-batch-size 1 --global-batch-size 8 "
                         "--use-distributed-optimizer")
    assert "--pipeline-model-parallel-layout 'E,t|t|t|t,L'" in line
    assert line.startswith("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ")


def test_a_plans_refusals_point_at_its_line(cli, tmp_path):
    # Megatron-LM's interleaving needs micro-batches in groups of pp: at micro_batches
    plan = _plan(tmp_path, micro_batches=3)
    code, out, err = cli("export", plan, "--format", "megatron-args", "-o", "-")
    assert (code, out) == (2, "")
    assert err == (f"{plan}:4:16: error: Megatron-LM's interleaved schedule runs the "
                   "micro-batches in groups of pp (2), and 3 is not a multiple of 2 (hint: "
                   "choose a multiple of 2 micro-batches)\n")
    # torchtitan cannot cut GPT-2's nested names: at model.stages
    plan = _plan(tmp_path, name="gpt2", stages=[["transformer.wte", "transformer.h.0"],
                                                ["transformer.h.1", "lm_head"]])
    code, out, err = cli("export", plan, "--format", "torchtitan", "-o", "-")
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"{plan}:13:5: error: torchtitan 0.3.0 cuts a model by its "
                          "top-level modules")
    # the V is torchtitan's, not Megatron-LM's: at the block
    v = _plan(tmp_path, name="v", placement=[0, 1, 1, 0])
    code, out, err = cli("export", v, "--format", "megatron-args", "-o", "-")
    assert (code, out) == (2, "")
    assert err.startswith(f"{v}:9:5: error: stage 2 ('s2') runs on devices [1], but "
                          "Megatron-LM places stage s on rank s mod the pipeline size")
    # pretrain_gpt.py trains
    infer = _plan(tmp_path, name="i", extra="task: inference\n")
    code, out, err = cli("export", infer, "--format", "megatron-args", "-o", "-")
    assert (code, out) == (2, "") and "is an inference plan, and Megatron-LM's " \
        "pretrain_gpt.py trains" in err


def test_a_template_names_the_schedule_torchtitan_and_megatron_run(cli, tmp_path):
    plan = _plan(tmp_path)
    code, out, err = cli("export", plan, "--format", "torchtitan", "--template",
                         "interleaved-1f1b", "-o", "-")
    assert (code, err) == (0, "")
    assert 'parallelism.pipeline_parallel_schedule = "Interleaved1F1B"' in out
    assert 'parallelism.pipeline_parallel_schedule_csv = ""' in out
    code, out, err = cli("export", plan, "--format", "megatron-args", "--template",
                         "interleaved-1f1b", "-o", "-")
    assert (code, err) == (0, "") and "Schedule: Megatron-LM's interleaved 1F1B." in out
    code, out, err = cli("export", plan, "--format", "torchtitan", "--template", "gpipe",
                         "-o", "-")
    assert (code, out) == (2, "")
    assert err == (f"{plan}:7:5: error: gpipe runs 1 stage per pipeline rank, not 2 (hint: "
                   "choose a template for this placement)\n")


def test_a_cluster_planners_layout_maps_onto_the_trainers():
    """The cluster planner's layouts (tp, pp, dp, vpp, micro_batch, schedule, recompute,
    sequence_parallel, distributed_optimizer): dp shards with a distributed optimizer."""
    from types import SimpleNamespace

    planner = SimpleNamespace(tp=2, pp=4, dp=2, vpp=2, micro_batch=1, recompute="selective",
                              sequence_parallel=True, schedule="interleaved-1f1b",
                              distributed_optimizer=True)
    layout = TrainerLayout.planned(planner, name="gpt-16", micro_batches=8,
                                   stage_layers=(1, 2, 2, 2, 2, 2, 2, 3), sequence_length=4096)
    assert layout == _layout()
    replicated = TrainerLayout.planned(
        SimpleNamespace(**{**vars(planner), "distributed_optimizer": False, "vpp": 2,
                           "schedule": "zb-v", "sequence_parallel": False, "tp": 1}),
        name="v", micro_batches=8, stage_layers=(1, 2, 2, 2, 2, 2, 2, 3))
    assert (replicated.dp_replicate, replicated.dp_shard, replicated.placement) == (2, 1, "v")
    assert '"ZBVZeroBubble"' in torchtitan_config(replicated)


def test_context_and_expert_parallelism_and_the_priced_overlaps_reach_the_trainers():
    layout = _layout(cp=2, ep=4, overlaps=("grad-reduce", "param-gather", "tp-comm"))
    assert layout.gpus == 2 * 2 * 4 * 2 and layout.global_batch == 16  # cp splits sequences
    argv = megatron_argv(layout)
    for flag, value in (("--context-parallel-size", "2"), ("--expert-model-parallel-size", "4")):
        assert argv[argv.index(flag) + 1] == value
    assert {"--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap"} <= set(argv)
    # param-gather needs the distributed optimizer's shards, tp-comm sequence parallelism
    plain = megatron_argv(_layout(dp_shard=1, dp_replicate=2, sequence_parallel=False,
                                  overlaps=("param-gather", "tp-comm")))
    assert "--overlap-param-gather" not in plain and "--tp-comm-overlap" not in plain
    body = _pipeline_body(torchtitan_config(_layout(cp=2)))
    assert "parallelism.context_parallel_degree = 2" in body
    with pytest.raises(LayoutError) as caught:
        torchtitan_config(_layout(ep=2))
    assert caught.value.field == "ep" and "--megatron" in str(caught.value)
