"""Models beyond causal LMs (issue #59), as their libraries build them (tests/models/classes.py:
transformers, diffusers, plain torch.nn; tiny configurations): each goes through `pyplan
partition --devices 2` -> `solve` -> `run --check` (3 optimizer steps: the loss, every gradient
and every updated value against one process) on 2 gloo ranks, all in one torchrun; the batch
norm CNN also saves and resumes exactly, its running statistics with its weights. And the
calling conventions: a dict of inputs is passed as keywords, a tuple as positional arguments,
a tensor as the one argument, everywhere the model is called."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("diffusers")

MODELS = Path(__file__).resolve().parent / "models"
sys.path.insert(0, str(MODELS))
sys.path.insert(0, str(MODELS.parent))
import classes  # noqa: E402
from warm_torchrun import torchrun  # noqa: E402

from pyplan.cli.main import main  # noqa: E402
from pyplan.models import TRACED, find_units  # noqa: E402
from pyplan.models.calls import arguments, call  # noqa: E402

# The classes that pass today (docs/partition.md's table says what each needed).
PASSING = ("resnet", "mobilenet_v2", "convnext", "vit", "swin", "bert", "recommender", "unet",
           "whisper", "t5", "bart", "clip", "sequential_cnn")
SAVED = ("resnet", "sequential_cnn")  # batch-norm CNNs cut in their forward and as a chain:
# saved and resumed
BATCH_NORMS = ("resnet", "mobilenet_v2", "sequential_cnn", "sequential_cnn-recomputed")
# (--check compares their running statistics too; recomputed: every stage's forward rerun in
# its backward, which must not update them a second time)


def test_inputs_are_passed_as_the_model_takes_them():
    seen = []

    class Takes(torch.nn.Module):
        def forward(self, *args, **kwargs):
            seen.append((len(args), sorted(kwargs)))

    x = torch.zeros(2)
    assert arguments(x) == ((x,), {})
    for inputs in (x, (x, x), {"a": x, "b": x}):
        call(Takes(), inputs)
    assert seen == [(1, []), (2, []), (0, ["a", "b"])]


def test_a_two_tower_model_is_cut_in_the_order_its_forward_calls_its_towers():
    model = classes.clip().eval()
    cut, units = find_units(model, classes.clip_batch(0)[0])
    starts = [u.modules[0] for u in units]
    assert cut.kind == TRACED
    # CLIPModel's forward runs the vision tower first, though it is defined second; its own
    # parameter logit_scale goes with the unit that uses it, the last
    assert starts.index("vision_model.encoder.layers.0") < starts.index(
        "text_model.encoder.layers.0")
    assert units[-1].modules == ("text_projection", "logit_scale")


def test_nested_embedding_modules_make_one_unit():
    model = classes.vit().eval()
    _, units = find_units(model, classes.vit_batch(0)[0][:2])
    assert units[0].modules == ("vit.embeddings",)


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("classes")
    shutil.copy(MODELS / "classes.py", folder / "classes.py")
    found = {}
    for name in PASSING + ("sequential_cnn-recomputed",):
        plan = folder / f"{name}.yaml"
        model, recompute = name.partition("-")[::2]
        assert main(["partition", f"classes:{model}", "--data", f"classes:{model}_batch",
                     "--loss", f"classes:{model}_loss", "--devices", "2", "--repeats", "1",
                     "--unit-time-limit", "120", "--recompute",
                     "always" if recompute else "never", "-o", str(plan)]) == 0, name
        assert main(["solve", str(plan), "--quiet"]) == 0, name
        found[name] = folder / f"{name}.resolved.yaml"
    return found


@pytest.mark.torchrun
def test_every_class_trains_on_two_ranks_as_in_one_process(plans, capsys):
    folder = plans[SAVED[0]].parent
    given = [str(p) + (f"@{folder / f'saved-{name}'}" if name in SAVED else "")
             for name, p in plans.items()]
    result = torchrun(MODELS / "run_classes.py", *given, nproc=2, cwd=folder, timeout=900)
    lines = result.stdout.splitlines()
    failed = []
    for name, plan in plans.items():
        done = f"{plan}: exit 0"
        if done not in lines:
            failed.append(name)
            continue
        report = json.loads(lines[lines.index(done) - 1])
        if not report["check"]["ok"]:
            failed.append(f"{name}: {report['check']}")
        elif name in BATCH_NORMS and "buffers" not in report["check"]["message"]:
            failed.append(f"{name}: its running statistics were not compared")
    assert not failed and result.returncode == 0, (failed, result.stderr[-3000:])
    for name in SAVED:  # 4 steps straight and 2 + 2 resumed: the same weights and statistics
        states = {}
        for kind in ("whole", "resumed"):
            out = folder / f"{name}-{kind}.pt"
            assert main(["consolidate", str(plans[name]), str(folder / f"saved-{name}-{kind}"),
                         "-o", str(out)]) == 0
            states[kind] = torch.load(out, weights_only=True)
        whole, resumed = states["whole"], states["resumed"]
        stats = [k for k in whole if k.endswith(("running_mean", "running_var",
                                                 "num_batches_tracked"))]
        assert stats and set(whole) == set(resumed), name
        micro = int(next(line.split(":")[1] for line in plans[name].read_text().splitlines()
                          if line.startswith("micro_batches:")))
        # each micro-batch's forward updated them once, and the rank that runs a stage saves
        # its statistics (not another rank's copy of them, never updated)
        assert {int(whole[k]) for k in stats if k.endswith("num_batches_tracked")} == \
            {4 * micro}, name
        for key in whole:
            assert torch.equal(whole[key], resumed[key]), (name, key)


def test_an_exactly_zero_gradient_is_compared_at_the_models_scale():
    from pyplan.train.check import compare

    def step(tiny):
        return {"gradients": {"big": torch.ones(4), "key_bias": torch.full((4,), tiny)},
                "values": {"big": torch.ones(4), "key_bias": torch.zeros(4)}}

    mine = [{kind: {(n, "s0"): t for n, t in d.items()} for kind, d in step(3e-10).items()}]
    # rounding noise against noise: the same up to 1e-9 of the largest gradient
    assert compare([1.0], mine, [1.0], [step(-2e-10)], 1e-5).ok
    assert not compare([1.0], mine, [1.0], [step(1e-6)], 1e-5).ok  # a real difference
