"""Every Hugging Face family tried (tests/models/hf.py's ALL, tiny configs) cut in its own
forward (each stage pruned as on its own rank, chained, computes the whole model's logits; a
stand-in for a layer held elsewhere returns what the layer returns and carries its attributes)
and trained on 2 ranks against one process (one torchrun for all), and checkpoints that `transformers` saves in another layout than the
model's parameters (one tensor per expert, renamed norms, a split convolution) read per stage
in both directions: save_pretrained's folder as a run's start, and the folder `pyplan
consolidate --format safetensors` writes as the next run's start."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MODELS = Path(__file__).resolve().parent / "models"
sys.path.insert(0, str(MODELS.parent))
from models import hf  # noqa: E402
from warm_torchrun import torchrun  # noqa: E402

from pyplan.cli.main import main  # noqa: E402
from pyplan.models import FORWARD, find_units, stage_modules, ties  # noqa: E402
from pyplan.models.forward import decoder_layers, logits, stand_in, whole_forward  # noqa: E402

LAYOUTS = ("qwen3_moe", "olmo_hybrid")  # families whose checkpoints differ from their model
_FOUND: dict = {}


def _cut(family: str):
    """(model, cut, units) of `family` (found once: two tests use it)."""
    if family not in _FOUND:
        torch.manual_seed(0)
        model = hf.build(family).eval()
        _FOUND[family] = (model, *find_units(model, hf.batch(0)[0][:4]))
    return _FOUND[family]


def _returns(out) -> int:
    return len(out) if isinstance(out, tuple) else 0


@pytest.mark.parametrize("family", hf.ALL)
def test_every_family_is_cut_in_its_own_forward(family):
    import copy

    model, cut, units = _cut(family)
    ids = hf.batch(0)[0][:2]
    layers = model.get_submodule(decoder_layers(model))
    returned = []
    hooks = [layer.register_forward_hook(lambda _m, _a, out: returned.append(_returns(out)))
             for layer in layers]
    with torch.no_grad():
        want = logits(whole_forward(model, ids))
    for hook in hooks:
        hook.remove()
    assert cut.kind == FORWARD and returned == [cut.returns] * len(layers)
    # the embeddings (but Zamba2's, which every stage runs), 4 layers, the norm and head
    assert len(units) == (5 if family == "zamba2" else 6)
    per = -(-len(units) // 3)
    stages = [(f"s{k}", tuple(m for u in units[k * per:(k + 1) * per] for m in u.modules))
              for k in range(3)]
    hidden = None
    for s in range(3):  # each stage on a copy pruned as its own rank prunes it
        stage = stage_modules(copy.deepcopy(model), cut, stages, [s], "cpu")[s].eval()
        with torch.no_grad():
            hidden = stage(ids) if s == 0 else stage(ids, hidden)
    torch.testing.assert_close(hidden, want, rtol=0, atol=1e-5)
    tied = {t.parameter for t in ties(model, stages)}
    embedding = model.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is embedding) == \
        ("lm_head.weight" in tied or any("embed" in t or "wte" in t for t in tied)), tied
    for layer in layers:  # what the model's forward may read of a layer held elsewhere
        other = stand_in(layer, cut.returns)
        assert _returns(other(torch.zeros(2, 3, 32))) == cut.returns
        assert not list(other.parameters()) and not list(other.buffers())
        for name, module in layer.named_modules():
            shell = other.get_submodule(name)
            for key, value in vars(module).items():
                if not key.startswith("_") and key != "training":
                    assert getattr(shell, key) is value, (name, key)


def _plan(folder: Path, name: str, family: str, weights: str | None = None) -> Path:
    """A solved 2-stage plan of `family` (its units halved, cut in its own forward)."""
    _, cut, units = _cut(family)
    half = (len(units) + 1) // 2
    stages = {"s0": [m for u in units[:half] for m in u.modules],
              "s1": [m for u in units[half:] for m in u.modules]}
    extra = f", weights: {json.dumps(weights)}" if weights else ""
    (folder / f"{name}.yaml").write_text(
        f"pyplan: 1\nname: {name}\ndevices: 2\nmicro_batches: 2\n"
        f"training: {{backward: {{time_ratio: 2}}}}\nblocks:\n"
        f"  - {{name: s0, devices: [0], time: 1, memory: 1}}\n"
        f"  - {{name: s1, devices: [1], time: 1, memory: 1}}\n"
        f"model: {{module: 'models.hf:{family}', cut: {cut.kind}, "
        f"layer_returns: {cut.layer_returns}, stages: {json.dumps(stages)}, "
        f"data: 'models.hf:batch', loss: 'models.hf:loss', "
        f"path: {json.dumps(str(MODELS.parent))}{extra}}}\n")
    assert main(["solve", str(folder / f"{name}.yaml"), "--quiet"]) == 0
    return folder / f"{name}.resolved.yaml"


def _consolidated(family: str, folder: Path) -> None:
    """What `pyplan consolidate --format safetensors` writes for a trained `family`: its state
    dict loaded into the model, saved by the same function (weights changed, as by training)."""
    from pyplan.cli.consolidate import save_pretrained

    torch.manual_seed(1)
    model = hf.build(family)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    save_pretrained(model, folder)


def _starts(family: str, folder: Path) -> None:
    """A rank's parameters from `folder`, read per stage, are from_pretrained's, bit for bit."""
    from pyplan.models.deferred import defer
    from pyplan.models.weights import open_checkpoint

    want = dict(transformers.AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    deferred = defer(lambda: hf.build(family), 0)
    checkpoint = open_checkpoint(folder)
    deferred.start_from(checkpoint)
    stored = set(checkpoint.files)
    assert stored - set(want), "the checkpoint keeps this family in its model's layout"
    layer = [n for n in want if n.startswith("model.layers.1.")]
    for name, value in deferred.values(layer).items():  # one layer: only its tensors read
        assert torch.equal(value, want[name]), name
    assert checkpoint.read and all(k.startswith("model.layers.1.") for k in checkpoint.read)
    values = deferred.values(list(want))
    for name, value in want.items():
        assert torch.equal(values[name], value), name


@pytest.mark.parametrize("family", LAYOUTS)
def test_a_checkpoint_in_transformers_layout_starts_a_rank_as_from_pretrained(family,
                                                                              tmp_path):
    hf.build(family).save_pretrained(tmp_path / "saved")
    _starts(family, tmp_path / "saved")
    _consolidated(family, tmp_path / "consolidated")
    _starts(family, tmp_path / "consolidated")


@pytest.mark.torchrun
def test_every_family_trains_on_two_ranks_as_in_one_process(tmp_path):
    """One torchrun of 2 ranks runs every family's plan, --check each: the loss and every
    gradient against the unmodified model in one process (and the 4 checkpoint starts)."""
    plans = {family: _plan(tmp_path, family, family) for family in hf.ALL}
    for family in LAYOUTS:
        hf.build(family).save_pretrained(tmp_path / f"{family}-saved")
        _consolidated(family, tmp_path / f"{family}-consolidated")
        for start in ("saved", "consolidated"):
            plans[f"{family} from {start}"] = _plan(tmp_path, f"{family}-{start}", family,
                                                    f"{family}-{start}")
    result = torchrun(MODELS / "run_each.py", *plans.values(), nproc=2, cwd=tmp_path,
                      timeout=1200)
    lines = result.stdout.splitlines()
    failed = []
    for what, plan in plans.items():
        done = f"{plan}: exit 0"
        if done not in lines:
            failed.append(what)
            continue
        report = json.loads(lines[lines.index(done) - 1])
        if not report["check"]["ok"]:
            failed.append(f"{what}: {report['check']}")
    assert not failed and result.returncode == 0, (failed, result.stderr[-3000:])
