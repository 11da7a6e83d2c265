"""Models at their real size: built on the meta device, each rank materialising only its own
stages' parameters, every copy with the same bits as the single-process model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pyplan.models import TRACED, Cut
from pyplan.models.deferred import DeferredParameter, defer
from pyplan.problem import build_problem
from pyplan.run.binding import Model, build, build_whole
from pyplan.planfile import spec_from_text

MODELS = Path(__file__).resolve().parent / "models"
sys.path.insert(0, str(MODELS))
sys.path.insert(0, str(MODELS.parent))
PYPLAN = str(Path(sys.executable).with_name("pyplan"))


class Custom(nn.Module):
    """Initialised its own way after construction (nanoGPT style), with a scale parameter
    made with a value and a buffer computed in the constructor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.scale = nn.Parameter(torch.full((16,), 0.5))
        self.register_buffer("positions", torch.arange(16.0))
        self.apply(self._init)
        with torch.no_grad():
            self.layers[2].weight.mul_(0.1)  # a scaled last layer

    @staticmethod
    def _init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)


def test_the_factorys_own_initialisation_is_replayed_per_parameter():
    deferred = defer(Custom, seed=5)
    assert not deferred.eager
    assert all(isinstance(p, DeferredParameter) for p in deferred.model.parameters())
    assert not any(b.is_meta for b in deferred.model.buffers())  # computed as usual
    values = deferred.values(list(deferred.names))
    assert torch.equal(values["scale"], torch.full((16,), 0.5))
    assert torch.equal(values["layers.0.bias"], torch.zeros(16))
    assert abs(values["layers.0.weight"].std() - 0.02) < 0.004
    assert abs(values["layers.2.weight"].std() - 0.002) < 0.0004  # normal_, then the scale
    assert abs(values["embed.weight"].std() - 0.02) < 0.003
    # A parameter's value depends on its own recipe alone: asked for alone, in another
    # order or in another build of the model, it is the same.
    again = defer(Custom, seed=5)
    for name in reversed(list(values)):
        assert torch.equal(again.value(name), values[name]), name
    assert not torch.equal(defer(Custom, seed=6).value("layers.0.weight"),
                           values["layers.0.weight"])


def test_a_factory_that_cannot_be_followed_is_built_whole():
    class Derived(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.ones(3))
            self.b = nn.Parameter(self.a.detach() * 2)  # made from another parameter

    deferred = defer(Derived, seed=0)
    assert deferred.eager and "made from another" in deferred.why_eager
    assert torch.equal(deferred.value("b"), torch.full((3,), 2.0))


PLAN = """pyplan: 1
name: nested
devices: {devices}
micro_batches: 4
training: {{backward: {{time_ratio: 2}}}}
blocks:
{blocks}
model:
  module: nested:{factory}
  stages: {{{stages}}}
  data: nested:batch
  loss: nested:loss
  path: "{path}"
"""


def _plan(tmp_path: Path, factory: str, stages: list[list[str]]) -> Path:
    blocks = "\n".join(f"  - {{name: s{i}, devices: [{i}], time: 1, memory: 1}}"
                       for i in range(len(stages)))
    text = ", ".join(f"s{i}: [{', '.join(s)}]" for i, s in enumerate(stages))
    path = tmp_path / f"{factory}.yaml"
    path.write_text(PLAN.format(devices=len(stages), blocks=blocks, factory=factory,
                                stages=text, path=MODELS))
    return path


STAGES = {
    "sequential": [[f"layers.{i}" for i in range(4)], [f"layers.{i}" for i in range(4, 8)]],
    "listed": [["blocks.0", "blocks.1.0", "blocks.1.1"], ["blocks.2", "blocks.3"]],
}


@pytest.mark.parametrize("factory", sorted(STAGES))
def test_each_rank_materialises_only_its_stages_with_the_reference_bits(factory, tmp_path):
    import nested

    problem = build_problem(spec_from_text(_plan(tmp_path, factory, STAGES[factory])
                                           .read_text()))
    model = Model(None, nested.batch, nested.loss, whole=getattr(nested, factory),
                  stages=dict(problem.model.stages), names={})
    reference = dict(build_whole(model, seed=3).named_parameters())
    seen = set()
    for rank in range(2):
        built = build(model, problem, seed=3, device="cpu", rank=rank)
        held = {built.names[id(p)]: p for m in built.modules.values() for p in m.parameters()}
        assert held and all(not p.is_meta for p in held.values())
        for name, param in held.items():
            assert torch.equal(param, reference[name]), name
        # Nothing of the other stage was materialised.
        real = [n for n, p in built.whole.named_parameters() if not p.is_meta]
        assert sorted(real) == sorted(held)
        seen |= set(held)
    assert seen == set(reference)


def test_a_traced_cut_materialises_only_the_ranks_own_pieces(tmp_path, monkeypatch):
    """A model torch's tracer cuts (a long skip connection) is traced on the meta device:
    each rank reads the values of its own stage's parameters only, and they are the
    single-process model's."""
    import skip
    from pyplan.models.deferred import Deferred

    stages = [["a"], ["drop", "b"], ["c"], ["d"]]
    blocks = "".join(f"  - {{name: s{i}, devices: [{i}], time: 1, memory: 1}}\n"
                     for i in range(len(stages)))
    named = ", ".join(f"s{i}: [{', '.join(units)}]" for i, units in enumerate(stages))
    text = (f"pyplan: 1\nname: skip\ndevices: 4\nmicro_batches: 4\n"
            f"training: {{backward: {{time_ratio: 2}}}}\nblocks:\n{blocks}model:\n"
            f"  module: skip:model\n  stages: {{{named}}}\n  cut: traced\n"
            f"  data: skip:batch\n  loss: skip:loss\n  path: \"{MODELS}\"\n")
    problem = build_problem(spec_from_text(text))
    model = Model(None, skip.batch, skip.loss, whole=skip.model,
                  stages=dict(problem.model.stages), names={}, cut=Cut(TRACED))
    reference = dict(build_whole(model, seed=3).named_parameters())
    read, values = [], Deferred.values
    monkeypatch.setattr(Deferred, "values", lambda self, names: read.extend(names) or
                        values(self, names))
    for rank, units in enumerate(stages):
        read.clear()
        built = build(model, problem, seed=3, device="cpu", rank=rank)
        held = {built.names[id(p)]: p for m in built.modules.values() for p in m.parameters()}
        assert all(not p.is_meta for p in held.values())
        for name, param in held.items():
            assert torch.equal(param, reference[name]), name
        assert sorted(read) == sorted(held) == sorted(
            n for n in reference if n.split(".")[0] in units), rank


@pytest.mark.torchrun
def test_hand_written_stages_over_nested_sequentials_train_as_one_process(tmp_path):
    """The regression of round 3: stages naming children of an nn.Sequential failed at the
    first forward ('NoneType' object is not callable)."""
    for factory in sorted(STAGES):
        plan = _plan(tmp_path, factory, STAGES[factory])
        solved = subprocess.run([PYPLAN, "solve", str(plan), "--quiet"], capture_output=True,
                                text=True, timeout=120)
        assert solved.returncode == 0, solved.stderr
        result = subprocess.run([PYPLAN, "run", str(plan.with_suffix(".resolved.yaml")),
                                 "--nproc-per-node", "2", "--check", "--iterations", "2",
                                 "--json"], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(result.stdout.strip().splitlines()[-1])["check"]["ok"]


def _llama(folder: Path, **changes):
    """A tiny Llama saved as save_pretrained does, in shards of a few kilobytes."""
    from models import hf

    model = hf.build("llama", **changes)
    model.save_pretrained(folder, max_shard_size="40KB")
    return model


def _pretrained_plan(tmp_path: Path) -> Path:
    """A 2-stage plan of the tiny Llama starting from its sharded checkpoint in ckpt/."""
    from models import hf
    from pyplan.models import find_units

    _llama(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 3
    units = [u.modules for u in find_units(hf.llama(), hf.batch(0)[0])[1]]
    stages = {"s0": [m for u in units[:3] for m in u], "s1": [m for u in units[3:] for m in u]}
    text = (f"pyplan: 1\nname: llama\ndevices: 2\nmicro_batches: 2\n"
            f"training: {{backward: {{time_ratio: 2}}}}\nblocks:\n"
            f"  - {{name: s0, devices: [0], time: 1, memory: 1}}\n"
            f"  - {{name: s1, devices: [1], time: 1, memory: 1}}\n"
            f"model: {{module: 'models.hf:llama', cut: forward, weights: ckpt, "
            f"stages: {{s0: {stages['s0']}, s1: {stages['s1']}}}, data: 'models.hf:batch', "
            f"loss: 'models.hf:loss', path: {json.dumps(str(MODELS.parent))}}}\n")
    (tmp_path / "plan.yaml").write_text(text)
    return tmp_path / "plan.yaml"


def test_pretrained_weights_are_read_per_stage_under_the_models_names(tmp_path):
    from transformers import AutoModelForCausalLM

    _pretrained_plan(tmp_path)
    from pyplan.problem import load_problem
    from pyplan.run.binding import load_model

    problem = load_problem(tmp_path / "plan.yaml")
    model = load_model(problem, tmp_path)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    want = dict(whole.named_parameters())
    read = []
    for rank in range(2):
        built = build(model, problem, seed=0, device="cpu", rank=rank)
        held = {built.names[id(p)]: p for m in built.modules.values() for p in m.parameters()}
        for name, param in held.items():
            assert torch.equal(param, want[name]), name
        assert set(built.read) <= set(held), set(built.read) - set(held)
        read.append(set(built.read))
    assert not read[0] & read[1] and read[0] | read[1] == set(want)


@pytest.mark.parametrize("damage, message", [
    ("extra", "the checkpoint has a tensor extra.weight that the model does not"),
    ("missing", "the checkpoint has no tensor model.norm.weight"),
    ("shape", "tensor model.norm.weight is shaped [5] in the checkpoint, [32] in the model"),
    ("dtype", "tensor model.norm.weight is float16 in the checkpoint, float32 in the model"),
    ("truncated", "cannot read"),
])
def test_a_checkpoint_that_does_not_fit_is_one_line_naming_the_tensor(damage, message,
                                                                       tmp_path):
    from safetensors.torch import load_file, save_file

    from models import hf
    from pyplan.errors import PlanError
    from pyplan.models.deferred import defer
    from pyplan.models.weights import open_checkpoint

    hf.llama().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    if damage == "extra":
        tensors["extra.weight"] = torch.zeros(2)
    elif damage == "missing":
        del tensors["model.norm.weight"]
    elif damage == "shape":
        tensors["model.norm.weight"] = torch.ones(5)
    elif damage == "dtype":
        tensors["model.norm.weight"] = tensors["model.norm.weight"].half()
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    else:
        save_file(tensors, path)
    with pytest.raises(PlanError) as caught:
        deferred = defer(hf.llama, 0)
        deferred.start_from(open_checkpoint(tmp_path))
        deferred.values(list(deferred.names))
    assert message in caught.value.message and "\n" not in caught.value.message


@pytest.mark.parametrize("command", ["run --dry-run", "run", "consolidate"])
def test_an_index_naming_a_shard_without_the_tensor_is_one_line(command, cli, tmp_path):
    """The index lists model.norm.weight in a shard that lacks it: one line naming the index,
    the tensor and the shard, exit 2 (it was safetensors' traceback; `run` exited 1 with no
    message: it reads the headers now before any worker starts)."""
    plan = _pretrained_plan(tmp_path)
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    record = json.loads(index.read_text())
    shards = sorted(set(record["weight_map"].values()))
    wrong = next(s for s in shards if s != record["weight_map"]["model.norm.weight"])
    record["weight_map"]["model.norm.weight"] = wrong
    index.write_text(json.dumps(record))
    assert cli("solve", plan, "--quiet")[0] == 0
    resolved = plan.with_suffix(".resolved.yaml")
    (tmp_path / "saved").mkdir()
    args = {"run --dry-run": [resolved, "--dry-run"],
            "run": [resolved, "--nproc-per-node", "2", "--iterations", "1"],
            "consolidate": [resolved, tmp_path / "saved", "-o", tmp_path / "out.pt"]}[command]
    code, _, err = cli(command.split()[0], *args)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert f"model.safetensors.index.json lists tensor model.norm.weight in {wrong}, which " \
           "lacks it" in err, err
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.slow
@pytest.mark.torchrun
def test_a_run_from_a_sharded_checkpoint_trains_as_one_process_from_it(tmp_path):
    plan = _pretrained_plan(tmp_path)
    solved = subprocess.run([PYPLAN, "solve", str(plan), "--quiet"], capture_output=True,
                            text=True, timeout=120)
    assert solved.returncode == 0, solved.stderr
    result = subprocess.run([PYPLAN, "run", str(plan.with_suffix(".resolved.yaml")),
                             "--nproc-per-node", "2", "--check", "--iterations", "2", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["check"]["ok"]


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.parametrize("family", ["zamba2"])
def test_hybrid_layer_lists_partition_and_train_as_one_process(family, tmp_path):
    """Zamba2's layer list mixes classes (Mamba and hybrid layers) and its layers also read the
    embeddings' output, so partition gives every stage the embeddings, as a tie. (Every family,
    Jamba included, trains on 2 ranks in tests/test_families.py.)"""
    import shutil

    shutil.copy(MODELS / "hf.py", tmp_path / "hf.py")
    run = lambda *args: subprocess.run([PYPLAN, *args], capture_output=True, text=True,  # noqa
                                       cwd=tmp_path, timeout=600)
    made = run("partition", f"hf:{family}", "--data", "hf:batch", "--loss", "hf:loss",
               "--devices", "4", "--repeats", "1", "-o", "plan.yaml")
    assert made.returncode == 0, made.stderr
    plan = (tmp_path / "plan.yaml").read_text()
    assert "cut: forward" in plan
    if family == "zamba2":
        assert '{parameter: "model.embed_tokens.weight", stages: [stage0, stage1, stage2, ' \
               'stage3]}' in plan
    assert run("solve", "plan.yaml", "--quiet").returncode == 0
    result = run("run", "plan.resolved.yaml", "--nproc-per-node", "4", "--check",
                 "--iterations", "2", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["check"]["ok"]


def test_a_loader_yields_the_same_batches_on_every_rank_pass_after_pass():
    import loaders

    from pyplan.run.binding import seed_everything
    from pyplan.run.data import Source

    def run(steps):
        src = Source(loaders.loader)
        return [src.get(s, lambda *parts: seed_everything(0, *parts))[0] for s in steps]

    first = run(range(25))  # 10 batches a pass: two and a half passes
    assert all(torch.equal(a, b) for a, b in zip(first, run(range(25))))
    assert not torch.equal(torch.cat(first[:10]), torch.cat(first[10:20]))  # reshuffled
    assert torch.equal(torch.cat(first[:10]).sort(0)[0], torch.cat(first[10:20]).sort(0)[0])
    assert torch.equal(run([13])[0], first[13])  # a resumed run skips to its step
    # ... reading only that batch's items: the earlier ones by their sampler indices alone.
    reads = []

    class Counted(torch.utils.data.Dataset):
        def __len__(self):
            return len(loaders._samples)

        def __getitem__(self, i):
            reads.append(i)
            return loaders._samples[i]

    counted = torch.utils.data.DataLoader(Counted(), batch_size=loaders.BATCH, shuffle=True)
    got = Source(counted).get(13, lambda *parts: seed_everything(0, *parts))[0]
    assert torch.equal(got, first[13]) and len(reads) == loaders.BATCH
    dataset = Source(loaders.batches)
    assert torch.equal(dataset.get(4, lambda *parts: None)[0], torch.full((4, 8), 2.0))


@pytest.mark.slow
@pytest.mark.torchrun
def test_only_the_ranks_that_read_a_batch_call_for_it_and_loaders_train_as_one_process(
        tmp_path):
    text = ("pyplan: 1\nname: loaded\ndevices: 3\nmicro_batches: 2\n"
            "training: {backward: {time_ratio: 2}}\nblocks:\n" +
            "".join(f"  - {{name: s{i}, devices: [{i}], time: 1, memory: 1}}\n"
                    for i in range(3)) +
            "model: {module: 'loaders:model', stages: {s0: ['0'], s1: ['1'], s2: ['2']}, "
            "data: 'loaders:DATA', loss: 'loaders:loss', path: " + json.dumps(str(MODELS)) +
            "}\n")
    notes = tmp_path / "notes"
    notes.mkdir()
    for data in ("noted", "loader", "batches"):
        plan = tmp_path / f"{data}.yaml"
        plan.write_text(text.replace("DATA", data))
        assert subprocess.run([PYPLAN, "solve", str(plan), "--quiet"],
                              timeout=120).returncode == 0
        result = subprocess.run(
            [PYPLAN, "run", str(plan.with_suffix(".resolved.yaml")), "--nproc-per-node", "3",
             "--check", "--iterations", "3", "--json"], capture_output=True, text=True,
            timeout=300, env={**os.environ, "PYPLAN_TEST_NOTES": str(notes)})
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(result.stdout.strip().splitlines()[-1])["check"]["ok"]
        if data == "noted":  # the middle stage reads neither inputs nor targets
            called = sorted(p.name for p in notes.iterdir())
            assert called == ["rank0", "rank2"], called


@pytest.mark.slow
@pytest.mark.torchrun
def test_consolidate_writes_what_from_pretrained_loads(tmp_path):
    """Train from a sharded checkpoint, consolidate the run's checkpoint as safetensors, load
    it with from_pretrained: the same tensors as the state dict consolidate writes."""
    from transformers import AutoModelForCausalLM

    plan = _pretrained_plan(tmp_path)
    resolved = plan.with_suffix(".resolved.yaml")
    assert subprocess.run([PYPLAN, "solve", str(plan), "--quiet"], timeout=120).returncode == 0
    run = subprocess.run([PYPLAN, "run", str(resolved), "--nproc-per-node", "2",
                          "--iterations", "2", "--optimizer", "adamw", "--save",
                          str(tmp_path / "ck")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for out, extra in ((tmp_path / "hf", ["--format", "safetensors"]), (tmp_path / "m.pt", [])):
        made = subprocess.run([PYPLAN, "consolidate", str(resolved), str(tmp_path / "ck"),
                               "-o", str(out), *extra], capture_output=True, text=True,
                              timeout=300)
        assert made.returncode == 0, made.stderr
    state = torch.load(tmp_path / "m.pt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    trained = dict(loaded.state_dict())
    assert set(trained) == set(state)
    for name, value in state.items():
        assert torch.equal(trained[name], value), name
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")  # training moved it
    assert not torch.equal(start.state_dict()["lm_head.weight"], trained["lm_head.weight"])


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.parametrize("name", ["unequal", "uneven"])
def test_each_ranks_measured_memory_is_what_its_plan_holds(name, tmp_path):
    """The memory model of each kind of block against the census of live tensor bytes a run
    takes: a loss stage (its logits and what the loss saves), the backward's working set,
    recomputation (only the inputs held, the forward rerun in the backward), a split backward
    (B keeps what W frees), AdamW's step; on a model of unequal units and on a plain MLP of
    uneven widths whose ReLU and Tanh save the tensor the next layer saves. Each rank's peak
    within 0.9-1.1x of its device's in the plan (0.85-1.15x on the small uneven MLP, whose
    transfers between stages weigh more: the plan has room for one send each way, and
    whether a rank's send is still held at its peak depends on when it next hears from the
    peer, so on the machine's load), its static memory (parameters, gradients, optimizer
    state) exact."""
    import shutil

    shutil.copy(MODELS / f"{name}.py", tmp_path / f"{name}.py")
    run = lambda *args: subprocess.run([PYPLAN, *args], capture_output=True, text=True,  # noqa
                                       cwd=tmp_path, timeout=600)
    for kind, extra in (("plain", []), ("recompute", ["--recompute", "always"]),
                        ("split", ["--split-backward"]), ("adamw", ["--optimizer", "adamw"])):
        made = run("partition", f"{name}:model", "--data", f"{name}:batch", "--loss",
                   f"{name}:loss", "--devices", "2", "--micro-batches", "4", "--repeats", "1",
                   *extra, "-o", f"{kind}.yaml")
        assert made.returncode == 0, made.stderr
        assert run("solve", f"{kind}.yaml", "--quiet").returncode == 0
        result = run("run", f"{kind}.resolved.yaml", "--nproc-per-node", "2", "--iterations",
                     "2", "--json", *(["--optimizer", "adamw"] if kind == "adamw" else []))
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        for rank in report["rank_memory"]:
            share = rank["peak_bytes"] / rank["planned_peak_bytes"]
            low, high = (0.9, 1.1) if name == "unequal" else (0.85, 1.15)
            assert low <= share <= high, (kind, rank)
            assert rank["static_bytes"] == rank["planned_static_bytes"], (kind, rank)


@pytest.mark.torchrun
def test_one_iteration_compares_the_static_memory_after_its_step(tmp_path):
    """A run of one iteration takes its census in it, where the gradients and the optimizer's
    state appear only during the step: its static memory is counted after the step, and so
    equals the plan's (it was the parameters alone, half the plan's, before)."""
    import shutil

    shutil.copy(MODELS / "unequal.py", tmp_path / "unequal.py")
    run = lambda *args: subprocess.run([PYPLAN, *args], capture_output=True, text=True,  # noqa
                                       cwd=tmp_path, timeout=600)
    made = run("partition", "unequal:model", "--data", "unequal:batch", "--loss",
               "unequal:loss", "--devices", "2", "--micro-batches", "4", "--repeats", "1",
               "--optimizer", "adamw", "-o", "p.yaml")
    assert made.returncode == 0, made.stderr
    assert run("solve", "p.yaml", "--quiet").returncode == 0
    result = run("run", "p.resolved.yaml", "--nproc-per-node", "2", "--json",
                 "--optimizer", "adamw")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["census_iteration"] == 0
    for rank in report["rank_memory"]:
        assert rank["static_bytes"] == rank["planned_static_bytes"], rank
