"""pyplan.models: how a model is cut into stages. Tied embeddings are found; partition -> solve
-> run --check on 4 ranks trains the same model as the unmodified one in one process (dropout
included). Every Hugging Face family tried is cut and trained in tests/test_families.py."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyplan.runtime import torch
from pyplan.errors import RunError
from pyplan.models import CHAIN, Unit, find_units, stage_modules, ties

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MODELS = Path(__file__).resolve().parent / "models"
sys.path.insert(0, str(MODELS))
import hf  # noqa: E402  (tests/models/hf.py)

PYPLAN = str(Path(sys.executable).with_name("pyplan"))


def _stages(units: list[Unit], count: int) -> list[tuple[str, tuple[str, ...]]]:
    per = -(-len(units) // count)
    return [(f"stage{s}", tuple(m for u in units[s * per:(s + 1) * per] for m in u.modules))
            for s in range(count) if units[s * per:(s + 1) * per]]


def test_a_stage_holds_only_its_own_parameters():
    model = hf.gpt2()
    cut, units = find_units(model, torch.randint(3, hf.VOCAB, (2, 8)))
    stages = _stages(units, 3)  # wte+wpe, h.0 | h.1, h.2 | h.3, ln_f, lm_head
    middle = stage_modules(copy.deepcopy(model), cut, stages, [1], "cpu")[1]
    names = {n for n, _ in middle.model.named_parameters()}
    assert names and all(n.startswith(("transformer.h.1.", "transformer.h.2.")) for n in names)
    wte = middle.model.transformer.wte.weight  # a zero view of one element, not a parameter
    assert wte.stride() == (0, 0) and wte.untyped_storage().nbytes() == 4
    last = stage_modules(copy.deepcopy(model), cut, stages, [2], "cpu")[2]
    names = {n for n, _ in last.model.named_parameters()}
    assert "lm_head.weight" in names and not any(n.startswith("transformer.h.0") for n in names)


def test_ties_are_found_by_identity():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(self.body(self.embed(x)))

    model = Shared()
    cut, units = find_units(model, torch.randint(0, 10, (2, 3)))
    assert cut.kind == CHAIN and [u.name for u in units] == ["embed", "body", "head"]
    found = ties(model, [("stage0", ("embed",)), ("stage1", ("body", "head"))])
    assert [(t.parameter, t.stages) for t in found] == [("embed.weight", ("stage0", "stage1"))]
    assert ties(model, [("stage0", ("embed", "body", "head"))]) == []


def test_hand_written_blocks_sharing_a_parameter_across_devices_are_refused():
    from pyplan.problem import load_problem
    from pyplan.run.binding import build, shared_across_devices

    shared = torch.nn.Linear(4, 4)
    plan = Path(__file__).parent / "plans" / "_shared.yaml"
    plan.write_text("pyplan: 1\nname: shared\ndevices: 2\nmicro_batches: 2\n"
                    "training: {backward: {time_ratio: 1}}\nblocks:\n"
                    "  - {name: a, devices: [0], time: 1, memory: 1}\n"
                    "  - {name: b, devices: [1], time: 1, memory: 1}\n")
    try:
        problem = load_problem(plan)
    finally:
        plan.unlink()
    modules = {0: torch.nn.Sequential(shared), 1: torch.nn.Sequential(shared)}
    with pytest.raises(RunError, match=r"blocks 'a' and 'b' share the parameter 0.weight, but "
                                       r"run on different devices"):
        shared_across_devices(problem, modules)
    del build


def _partition_solve_run(tmp_path, factory: str, *extra: str, devices: int = 4,
                         run_args: tuple = ()) -> tuple[str, dict]:
    shutil.copy(MODELS / "hf.py", tmp_path / "hf.py")
    run = lambda *args: subprocess.run([PYPLAN, *args], capture_output=True, text=True,  # noqa
                                       cwd=tmp_path, timeout=600)
    made = run("partition", f"hf:{factory}", "--data", "hf:batch", "--loss", "hf:loss",
               "--devices", str(devices), "--repeats", "2", "-o", "plan.yaml", *extra)
    assert made.returncode == 0, made.stderr
    plan = (tmp_path / "plan.yaml").read_text()
    solved = run("solve", "plan.yaml", "--quiet")
    assert solved.returncode == 0, solved.stderr
    result = run("run", "plan.resolved.yaml", "--nproc-per-node", str(devices), "--check",
                 "--iterations", "3", "--json", "--device", "cpu", *run_args)
    assert result.returncode == 0, result.stderr[-3000:]
    return plan, json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.torchrun
def test_tied_gpt2_partitioned_and_run_trains_the_same_model(tmp_path):
    plan, report = _partition_solve_run(tmp_path, "gpt2")
    assert "cut: forward" in plan
    assert '- {parameter: "transformer.wte.weight", stages: [stage0, stage3]}' in plan
    assert report["check"]["ok"] and report["ties"] == ["transformer.wte.weight"], report


@pytest.mark.torchrun
def test_llama_interleaved_with_adamw_and_clipping_trains_the_same_model(tmp_path):
    # Rotary embeddings and the causal mask are recomputed on every stage by Llama's own
    # forward; 2 devices x 2 chunks.
    plan, report = _partition_solve_run(
        tmp_path, "llama", "--shape", "interleaved", "--chunks", "2", devices=2,
        run_args=("--optimizer", "adamw", "--lr", "0.001", "--clip-grad-norm", "0.5"))
    assert "ties:" not in plan and plan.count("{name: stage") == 4
    assert report["check"]["ok"], report


@pytest.mark.parametrize("factory, message", [
    ("rooted", "error: the model cannot be cut: not at its layers (it has no nn.ModuleList of "
               "layers), and torch's tracer would copy its parameter scale into the units of "
               "embed and of b, which use it (hint: move the parameter into a submodule of the "
               "model, called where it is used)"),
    ("branchy", "error: the model cannot be cut: not at its layers (its forward does not call "
                "the 4 layers of layers once each, in order (called: 3, 2, 1, 0)), and torch's "
                "pipeline tracer stops at GuardOnDataDependentSymNode: Could not guard on "
                "data-dependent expression"),
])
def test_a_model_no_cut_runs_is_refused_by_partition_in_one_line(factory, message, tmp_path):
    """Not a plan that `pyplan run` refuses later ("parameter scale is in none of them"); the
    cause first, torch's generic words ("cannot capture your model as a full graph") at most in
    the hint, and none of the graphs torch prints on the way."""
    shutil.copy(MODELS / "uncuttable.py", tmp_path / "uncuttable.py")
    made = subprocess.run([PYPLAN, "partition", f"uncuttable:{factory}", "--data",
                           "uncuttable:batch", "--loss", "uncuttable:loss", "--devices", "2",
                           "--repeats", "1", "-o", "plan.yaml"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert made.returncode == 2 and made.stdout == "", made.stderr
    assert made.stderr.startswith(message) and made.stderr.count("\n") == 1, made.stderr
    assert "full graph" not in made.stderr and len(made.stderr) < 600
    assert not (tmp_path / "plan.yaml").exists()


def test_the_plans_layer_returns_name_the_structure_stand_ins_return():
    from pyplan.models import FORWARD, Cut
    from pyplan.planfile.types import LAYER_RETURNS

    for text in LAYER_RETURNS:
        assert Cut.of(FORWARD, text).layer_returns == text
    assert Cut.of(FORWARD, "tuple of 3").returns == 3 and Cut.of(FORWARD).returns == 0
    assert Cut.of(FORWARD, "tuple").returns == 1  # plans written before: (hidden,) as then


class _Pooled(torch.nn.Module):
    """What broke encoder-decoders and two towers traced on the meta device: the ids moved to
    the hidden states' device (CLIP's pooled text: a positional device the trace recorded as
    meta), and a buffer the model computes on the CPU (Marian's, mBART's final_logits_bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 3)
        self.register_buffer("bias", torch.arange(3.0))

    def forward(self, ids):
        hidden = self.embed(ids)
        last = ids.to(hidden.device, torch.int32).argmax(-1)
        return self.head(hidden[torch.arange(ids.shape[0]), last]) + self.bias


def test_pieces_traced_on_the_meta_device_compute_what_the_model_does():
    from pyplan.models import traced
    from pyplan.models.deferred import defer

    deferred = defer(_Pooled, 0)
    ids = torch.tensor([[1, 5, 2], [7, 3, 3]])
    pieces = traced.pieces(deferred.model, ["embed", "head"], ids.to("meta"))
    made: dict = {}
    for piece in pieces:
        traced.materialize(piece, deferred, "cpu", made)
        traced.place(piece, "cpu")
    deferred.materialize(deferred.model, "cpu")
    assert torch.equal(pieces[1](pieces[0](ids)), deferred.model(ids))
