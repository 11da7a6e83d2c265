"""Vocabulary-parallel M-shape from a model (`pyplan partition --shape mshape`) and `--shape
auto`: the embedding and head found and sharded, the loss fused when it is a cross-entropy
(else DTensor's loss_parallel), the all-reduces against one process, their per-rank costs
with collectives, the placements ranked by predicted makespan, the plan through solve, show,
export and `pyplan run --check` on 4 ranks (the example GPT and tied GPT-2 from Hugging Face)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import pyplan
from pyplan.partition import UnitCost
from warm_torchrun import torchrun

MODELS = Path(__file__).resolve().parent / "models"
PYPLAN = str(Path(sys.executable).with_name("pyplan"))


def _units(layer_ms: float, head_ms: float) -> list[UnitCost]:
    names = ["embed"] + [f"layers.{i}" for i in range(8)] + ["head"]
    return [UnitCost(n, head_ms / 2 if n in ("embed", "head") else layer_ms,
                     head_ms if n in ("embed", "head") else 2 * layer_ms, 1000, 5000,
                     parameters=(f"{n}.weight",) if n not in ("embed", "head") else
                     ("embed.weight",)) for n in names]


def _sharded(units, devices: int = 4):
    from dataclasses import replace

    from pyplan.measure.placements import Sharded

    # One rank's share of the heavy ends (plus a little for the collectives).
    return Sharded(replace(units[0], forward_ms=units[0].forward_ms / devices + 0.1,
                           backward_ms=units[0].backward_ms / devices + 0.1),
                   replace(units[-1], forward_ms=units[-1].forward_ms / devices + 0.1,
                           backward_ms=units[-1].backward_ms / devices + 0.1),
                   ("embed.tokens", "head.out"))


_OPTIONS = dict(name="p", factory="m:model", data="m:batch", loss="m:loss", micro_batches=8)


@pytest.mark.parametrize("head_ms, winner", [(40.0, "mshape"), (0.2, None)])
def test_auto_ranks_the_placements_by_predicted_makespan(head_ms, winner):
    from pyplan.measure.placements import CHUNKS, placements

    units = _units(1.0, head_ms)
    shapes = ("vshape", *(f"interleaved-{c}" for c in CHUNKS), "mshape")
    tried = placements(units, devices=4, shapes=shapes, sharded=_sharded(units), **_OPTIONS)
    solved = [p for p in tried if p.best is not None]
    assert [p.shape for p in tried if p.best is None] == ["interleaved-3", "interleaved-4"]
    assert all("12 stages" in p.reason or "16 stages" in p.reason
               for p in tried if p.best is None)
    times = [p.best.makespan_ms for p in solved]
    assert times == sorted(times) and len(solved) == 3
    # Each placement's best plan is the shortest of its own candidates.
    assert all(p.best.makespan_ms == min(c.makespan_ms for c in p.plans) for p in solved)
    if winner is not None:  # heavy ends: sharding them over 4 devices wins
        assert tried[0].shape == winner
    else:  # light ends: two more blocks on every device only cost
        assert tried[0].shape != "mshape"


def test_ranks_sharing_cores_rank_the_placements_by_what_the_cores_can_do():
    from dataclasses import replace

    from pyplan.measure.placements import Sharded, placements

    units = _units(1.0, 40.0)  # heavy ends: 20 + 40 ms each, whole
    # Each rank's share of an end costs 0.4 of the whole: with a core per device the M-shape
    # wins, but its four ranks together compute 1.6x the ends' work.
    share = lambda u: replace(u, forward_ms=0.4 * u.forward_ms,  # noqa: E731
                              backward_ms=0.4 * u.backward_ms)
    sharded = Sharded(share(units[0]), share(units[-1]), ("embed.tokens", "head.out"))
    shapes = ("vshape", "mshape")
    alone = placements(units, devices=4, shapes=shapes, sharded=sharded, **_OPTIONS)
    shared = placements(units, devices=4, shapes=shapes, sharded=sharded, cores=2, **_OPTIONS)
    assert alone[0].shape == "mshape" and alone[0].cores is None
    # Per iteration (8 micro-batches) over all devices: the layers' 8 x 3 ms and the ends',
    # once whole (V-shape) or on each of the 4 ranks (M-shape).
    by_shape = {p.shape: p for p in shared}
    assert by_shape["mshape"].busy_ms == pytest.approx(8 * (24 + 4 * 2 * 24))
    assert by_shape["vshape"].busy_ms == pytest.approx(8 * (24 + 2 * 60))
    assert shared[0].shape == "vshape"
    assert all(p.expected_ms == max(p.best.makespan_ms, p.busy_ms / 2) for p in shared)
    # With as many cores as devices nothing changes.
    assert placements(units, devices=4, shapes=shapes, sharded=sharded, cores=4,
                      **_OPTIONS)[0].cores is None


def test_mshape_plan_puts_the_sharded_units_on_all_devices_and_records_the_tie():
    from pyplan.measure.placements import mshape_plans
    from pyplan.problem import build_problem
    from pyplan.planfile import spec_from_text

    units = _units(1.0, 8.0)
    units[-1] = UnitCost("head", 4.0, 8.0, 1000, 5000, parameters=("embed.weight",))
    plans = mshape_plans(units, _sharded(units), devices=4, **_OPTIONS)
    best = plans[0]
    problem = build_problem(spec_from_text(best.text))
    forward = [b for b in problem.blocks if b.is_forward]
    assert [b.name for b in forward] == ["embed", "stage0", "stage1", "stage2", "stage3",
                                        "head"]
    assert forward[0].devices == forward[-1].devices == (0, 1, 2, 3)
    assert [b.devices for b in forward[1:-1]] == [(0,), (1,), (2,), (3,)]
    assert problem.model.vocab_parallel == ("embed.tokens", "head.out")
    assert problem.model.ties == (("embed.weight", ("embed", "head")),)
    stages = dict(problem.model.stages)
    assert stages["embed"] == ("embed",) and stages["head"] == ("head",)
    assert [u for s in range(4) for u in stages[f"stage{s}"]] == \
        [f"layers.{i}" for i in range(8)]
    assert best.makespan_ms == min(p.makespan_ms for p in plans)


def test_mshape_needs_units_between_the_ends():
    from pyplan.errors import PlanError
    from pyplan.measure.placements import mshape_plans

    units = _units(1.0, 1.0)[:4]
    with pytest.raises(PlanError, match="needs at least 4 units between the first and the "
                                        "last, the model has 2"):
        mshape_plans(units, _sharded(units), devices=4, **_OPTIONS)


# ---------------------------------------------------------------- with torch

def test_the_vocabulary_modules_are_found_in_the_models_own_terms():
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(MODELS))
    import hf

    from pyplan.examples import gpt_chain
    from pyplan.models import find_units
    from pyplan.models.forward import logits, whole_forward
    from pyplan.models.vocab import Vocab, find

    def found(model, inputs):
        _, units = find_units(model, inputs)
        with torch.no_grad():
            out = logits(whole_forward(model, inputs))
        return find(model, inputs, units[0].modules, units[-1].modules, out)

    ids = gpt_chain.batch(0)[0][:2]
    assert found(gpt_chain.model(), ids) == Vocab("embed.tokens", "head.out", gpt_chain.VOCAB)
    ids = hf.batch(0)[0][:2]
    assert found(hf.gpt2(), ids) == Vocab("transformer.wte", "lm_head", hf.VOCAB)
    assert found(hf.llama(), ids) == Vocab("model.embed_tokens", "lm_head", hf.VOCAB)
    # GPT-2's position embedding has as many rows as the vocabulary here, but is not called
    # with the token ids.
    model = hf.build("gpt2", n_positions=hf.VOCAB)
    assert found(model, ids).embedding == "transformer.wte"


def test_sharded_units_cost_a_share_and_their_collectives():
    pytest.importorskip("torch")
    import torch.distributed as dist

    from pyplan.examples import gpt
    from pyplan.models import find_units
    from pyplan.models.vocab import Vocab
    from pyplan.measure.profile import profile_units
    from pyplan.measure.sharded import collective_ms, profile_sharded
    from pyplan.planfile.plan import LinkSpec

    model = gpt.model()
    inputs, targets = gpt.batch(0)
    inputs, targets = inputs[:2], targets[:2]
    costs, cut = profile_units(model, inputs, targets, gpt.loss, repeats=2)
    _, units = find_units(model, inputs)
    vocab = Vocab("embed.tokens", "head.out", gpt.VOCAB)
    found = profile_sharded(model, inputs, targets, gpt.loss, cut=cut, units=units,
                            costs=costs, vocab=vocab, devices=4, repeats=2)
    assert not dist.is_initialized()  # its fake process group is gone
    tokens = units[0].name
    activations = 2 * gpt.SEQUENCE * gpt.DIM * 4  # one micro-batch's hidden states, fp32
    assert [(c.kind, c.bytes, c.backward) for c in found.collectives[tokens]] == \
        [("all_reduce", activations, False), ("all_reduce", activations, True)]
    # The fused cross-entropy reduces a max per token, then a sum and a target logit per token
    # stacked; backward, only the loss's seed is summed.
    per_token = 2 * gpt.SEQUENCE * 4
    assert [(c.kind, c.bytes, c.backward) for c in found.collectives[units[-1].name]] == \
        [("all_reduce", per_token, False), ("all_reduce", 2 * per_token, False),
         ("all_reduce", 4, True)]
    # Weights: the token embedding and the projection keep a quarter of their rows.
    whole_embed = sum(p.numel() for p in model.embed.parameters()) * 4 * 2
    rows = gpt.VOCAB * gpt.DIM * 4 * 2
    assert found.first.weight_bytes == whole_embed - rows + rows // 4
    assert found.first.weight_bytes == costs[0].weight_bytes - rows * 3 // 4
    link = LinkSpec(bandwidth=10**9, latency_ms=1.0)  # an all-reduce: 2 x 3 ring steps
    assert collective_ms(found.collectives[tokens], 4, link, False) == \
        pytest.approx(6 * (1.0 + activations / 4 / 1e6))


def test_collectives_are_timed_as_measured_where_measured():
    pytest.importorskip("torch")
    from pyplan.measure.sharded import Collective, collective_ms, measure_collectives
    from pyplan.planfile.plan import LinkSpec

    found = [Collective("all_reduce", 64, False), Collective("all_reduce", 4096, True),
             Collective("all_gather_into_tensor", 4096, False)]
    times = measure_collectives(found, 2, __import__("torch").device("cpu"))
    assert sorted(times) == [64, 4096] and all(0 < ms < 1000 for ms in times.values())
    link = LinkSpec(bandwidth=10**9, latency_ms=1.0)
    # Forward: the measured all-reduce, and the all-gather (never measured) as a ring.
    assert collective_ms(found, 2, link, False, times) == \
        pytest.approx(times[64] + 1 * (1.0 + 2048 / 1e6))
    assert collective_ms(found, 2, link, True, times) == pytest.approx(times[4096])
    assert collective_ms(found, 2, link, True) == pytest.approx(2 * (1.0 + 2048 / 1e6))


def test_measuring_is_not_shadowed_by_a_source_tree_on_sys_path(tmp_path, monkeypatch):
    """The CLI puts the working directory on sys.path for the user's model; from a pyplan
    checkout without a build, the spawned measuring processes must still import this pyplan."""
    pytest.importorskip("torch")
    from pyplan.measure.links import _without_other_pyplans, measure_all_reduces

    (tmp_path / "pyplan").mkdir()
    (tmp_path / "pyplan" / "__init__.py").write_text("raise ImportError('not this pyplan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(sys.path)
    # Dropped: every folder holding a pyplan other than the imported one (this fake tree, and
    # the repository root when pyplan is installed from a wheel); kept: everything else.
    imported = Path(pyplan.__file__).resolve().parent

    def shadows(folder):
        tree = Path(folder or ".") / "pyplan"
        return (tree / "__init__.py").is_file() and tree.resolve() != imported
    kept = _without_other_pyplans(before)
    assert str(tmp_path) not in kept
    assert kept == [p for p in before if not shadows(p)]
    times = measure_all_reduces(2, [64], repeats=2)
    assert len(times) == 1 and 0 < times[0] < 1000
    assert sys.path == before  # restored for the caller


def test_measuring_processes_meet_without_a_port_another_program_could_take(monkeypatch):
    """The measuring processes rendezvous in a file: a free port looked up here, closed and
    bound later by the children could be taken in between (EADDRINUSE, seen once)."""
    pytest.importorskip("torch")
    import socket

    from pyplan.measure.links import measure_all_reduces

    def no_ports(self, address):
        raise AssertionError(f"the launching process bound {address}")
    monkeypatch.setattr(socket.socket, "bind", no_ports)
    times = measure_all_reduces(2, [64], repeats=1)
    assert len(times) == 1 and 0 < times[0] < 1000


def test_a_vocabulary_that_does_not_split_evenly_is_refused():
    pytest.importorskip("torch")
    from pyplan.errors import PlanError
    from pyplan.models.vocab import Vocab, check_divisible

    with pytest.raises(PlanError, match=r"the vocabulary of 50257 tokens \(wte, lm_head\) does "
                                        r"not split evenly over 4 devices") as info:
        check_divisible(Vocab("wte", "lm_head", 50257), 4)
    assert "pad_to_multiple_of=4" in info.value.hint


NO_EMBEDDING = """\
import torch
from torch import nn


def model():
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))


def batch(step):
    return torch.randn(8, 8), torch.randn(8, 8)


def loss(out, target):
    return ((out - target) ** 2).mean()
"""


def test_mshape_on_a_model_without_an_embedding_is_one_line(cli, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    (tmp_path / "no_embedding.py").write_text(NO_EMBEDDING)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = cli("partition", "no_embedding:model", "--data", "no_embedding:batch",
                         "--loss", "no_embedding:loss", "--devices", "2", "--shape", "mshape",
                         "--repeats", "1", "-o", tmp_path / "p.yaml")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: shape mshape: the first unit has no token embedding")
    # auto leaves the M-shape out and says why
    code, out, err = cli("partition", "no_embedding:model", "--data", "no_embedding:batch",
                         "--loss", "no_embedding:loss", "--devices", "2", "--shape", "auto",
                         "--repeats", "1", "-o", tmp_path / "p.yaml")
    assert code == 0, err
    assert re.search(r"mshape +not applicable: the first unit has no token embedding", out)


@pytest.mark.slow
def test_auto_writes_the_shortest_predicted_placement(cli, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(MODELS))  # plain: embedding, 8 layers, head
    monkeypatch.delitem(sys.modules, "plain", raising=False)  # another test's plain.py
    out_path = tmp_path / "auto.yaml"
    code, out, err = cli("partition", "plain:model", "--data", "plain:batch", "--loss",
                         "plain:loss", "--devices", "2", "--shape", "auto",
                         "--micro-batches", "8", "--repeats", "2", "-o", out_path)
    assert code == 0, err
    rows = re.findall(r"^  (\S+(?:, \d chunks)?) +([\d.]+) ms \((\w+)\)(.*)$", out, re.M)
    labels = [r[0] for r in rows]
    assert set(labels) == {"vshape", "interleaved, 2 chunks", "interleaved, 3 chunks",
                           "interleaved, 4 chunks", "mshape"}, out
    times = [float(r[1]) for r in rows]
    assert times == sorted(times) and "the shortest: written" in rows[0][3]
    for label, time, _, rest in rows[1:]:  # the others' ratios to the written one, taken
        # before the times were rounded to 0.01 ms (and the ratio to 0.01)
        ratio, t, first = float(re.search(r"([\d.]+)x as long", rest)[1]), float(time), times[0]
        assert (t - 0.005) / (first + 0.005) - 0.005 <= ratio <= \
            (t + 0.005) / (first - 0.005) + 0.005, (label, time, times[0], rest)
    text = out_path.read_text()
    written = rows[0][0]
    if written == "mshape":
        assert "vocab_parallel:" in text and "{name: embed, devices: all" in text
    else:
        chunks = int(written.split(", ")[1][0]) if "," in written else 1
        assert text.count("{name: stage") == 2 * chunks


def test_layout_exports_refuse_the_mshape_with_the_reason(cli):
    from conftest import PLANS

    for fmt, trainer in (("megatron-layout", "Megatron-LM"), ("torchtitan", "torchtitan")):
        code, out, err = cli("export", PLANS / "gpt-mshape.resolved.yaml", "--format", fmt,
                             "-o", "-")
        assert (code, out) == (2, "")
        assert (f"block 'embed' runs on devices [0, 1, 2, 3] at once (sharded over the "
                f"vocabulary, model.vocab_parallel), but {trainer} gives each pipeline stage "
                "to one pipeline rank") in err


def test_show_draws_the_sharded_blocks_on_every_device(cli):
    from conftest import PLANS

    code, out, err = cli("show", PLANS / "gpt-mshape.resolved.yaml", "--width", "100",
                         "--color", "never")
    assert (code, err) == (0, "")
    rows = [line for line in out.splitlines() if re.match(r"d[0-3] ", line)]
    assert all("f0" in row for row in rows[:4])  # embed@0 on all four devices at once


def test_a_loss_is_fused_only_when_it_is_exactly_a_mean_cross_entropy():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from pyplan.models.vocab import _cross_entropy_form

    def form(loss, dtype=torch.float32):
        return _cross_entropy_form(loss, (2, 3, 16), dtype, (2, 3), torch.int64)

    flat = lambda l: l.reshape(-1, l.shape[-1])  # noqa: E731
    assert form(lambda l, t: F.cross_entropy(flat(l), t.reshape(-1))) == (-100, torch.float32)
    assert form(lambda l, t: F.cross_entropy(flat(l).float(), t.view(-1), ignore_index=0),
                torch.bfloat16) == (0, torch.float32)
    assert form(lambda l, t: F.nll_loss(F.log_softmax(flat(l), -1), t.flatten())) == \
        (-100, torch.float32)
    for other in (
            lambda l, t: F.cross_entropy(flat(l), t.reshape(-1), reduction="sum"),
            lambda l, t: F.cross_entropy(flat(l), t.reshape(-1), label_smoothing=0.1),
            lambda l, t: F.cross_entropy(flat(l), t.reshape(-1), weight=torch.ones(16)),
            lambda l, t: 2 * F.cross_entropy(flat(l), t.reshape(-1)),
            lambda l, t: F.cross_entropy(flat(l), t.reshape(-1)) + l.logsumexp(-1).pow(2).mean(),
            lambda l, t: F.cross_entropy(flat(l[:, :-1]), t[:, 1:].reshape(-1)),
            lambda l, t: F.cross_entropy(l.transpose(1, 2), t),
            lambda l, t: F.cross_entropy(flat(l), t.reshape(-1)) * float(t.sum().item()),
            lambda l, t: (torch._foreach_add_([l], 1.0), F.cross_entropy(flat(l),
                                                                         t.reshape(-1)))[1]):
        assert form(other) is None


@pytest.mark.torchrun
def test_the_vocabulary_parallel_loss_and_all_reduces_match_one_process():
    script = MODELS / "vocab_losses.py"
    result = torchrun(script, nproc=4, cwd=tempfile.gettempdir())
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", result.stdout)]
    assert len(rows) == 4 * 11, result.stdout
    for row in rows:
        if "fused" in row:
            assert row["fused"] == (row["case"] != "sum"), row
            assert row["loss"] < 1e-5 and row["grad"] < 1e-6, row
        else:
            assert row["error"] == 0, row


# ---------------------------------------------------------------- under torchrun

def _partition_solve_run(tmp_path, factory: str, data: str, loss: str, *run_args: str,
                         micro_batches: int = 8) -> tuple[str, str, dict]:
    run = lambda *args: subprocess.run([PYPLAN, *args], capture_output=True, text=True,  # noqa
                                       cwd=tmp_path, timeout=600)
    made = run("partition", factory, "--data", data, "--loss", loss, "--devices", "4",
               "--shape", "mshape", "--micro-batches", str(micro_batches), "--repeats", "2",
               "-o", "plan.yaml")
    assert made.returncode == 0, made.stderr
    solved = run("solve", "plan.yaml", "--quiet")
    assert solved.returncode == 0, solved.stderr
    result = run("run", "plan.resolved.yaml", "--nproc-per-node", "4", "--check",
                 "--iterations", "3", "--json", "--device", "cpu", *run_args)
    assert result.returncode == 0, result.stderr[-3000:]
    return (tmp_path / "plan.yaml").read_text(), made.stdout, \
        json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.torchrun
def test_example_gpt_in_mshape_trains_the_same_model(tmp_path):
    plan, out, report = _partition_solve_run(
        tmp_path, "pyplan.examples.gpt_chain:model", "pyplan.examples.gpt_chain:batch",
        "pyplan.examples.gpt_chain:loss")
    assert '{embedding: "embed.tokens", head: "head.out"}' in plan
    assert "sharded over the vocabulary on all 4 devices: embed.tokens (block embed) and " \
        "head.out (block head)" in out
    assert re.search(r"embed: per rank of 4, .* 2 collectives \(16,384 bytes", out), out
    assert report["check"]["ok"], report


@pytest.mark.torchrun
def test_tied_gpt2_in_mshape_with_adamw_and_clipping_trains_the_same_model(tmp_path):
    shutil.copy(MODELS / "hf.py", tmp_path / "hf.py")
    plan, _, report = _partition_solve_run(
        tmp_path, "hf:gpt2", "hf:batch", "hf:loss", "--optimizer", "adamw", "--lr", "0.001",
        "--clip-grad-norm", "0.5", micro_batches=4)
    assert "cut: forward" in plan
    assert '{embedding: "transformer.wte", head: "lm_head"}' in plan
    # The tied weight: one chunk per rank, used by both all-device blocks (nothing to sum).
    assert '- {parameter: "transformer.wte.weight", stages: [embed, head]}' in plan
    assert report["check"]["ok"] and report["ties"] == [], report


def test_profile_measures_the_sharded_blocks_as_one_rank_runs_them(cli):
    pytest.importorskip("torch")
    from conftest import PLANS

    code, out, err = cli("profile", PLANS / "gpt-mshape.yaml", "--repeats", "1", "--json")
    assert code == 0, err
    blocks = {b["name"]: b for b in json.loads(out)["blocks"]}
    assert blocks["embed"]["devices"] == [0, 1, 2, 3] and blocks["head"]["backward_ms"] > 0
    code, out, err = cli("profile", PLANS / "gpt-mshape.yaml", "--repeats", "1")
    assert "blocks on several devices: one rank's share of the vocabulary" in out
    code, out, err = cli("profile", PLANS / "gpt-mshape-blocks.yaml", "--repeats", "1")
    assert "blocks on several devices are measured whole on one device" in out


def test_dry_run_refuses_vocabulary_modules_the_model_does_not_have(cli, tmp_path):
    pytest.importorskip("torch")
    from conftest import PLANS

    text = (PLANS / "gpt-mshape.yaml").read_text().replace('head: "head.out"',
                                                           'head: "head.norm"')
    (tmp_path / "bad.yaml").write_text(text)
    assert cli("solve", tmp_path / "bad.yaml", "--quiet", "--time-limit", "2")[0] == 0
    code, out, err = cli("run", tmp_path / "bad.resolved.yaml", "--dry-run")
    assert code == 2 and err.count("\n") == 1
    assert "model.vocab_parallel: head.norm is not an nn.Linear in the model" in err
