"""`pyplan profile`: block costs measured on this machine, activation memory exactly."""

from __future__ import annotations

import json

from conftest import PLANS

TOY = """pyplan: 1
name: toy
devices: 2
micro_batches: 2
training: {backward: {time_ratio: 2}}
blocks:
  - {name: a, time: 1, memory: 1, devices: [0]}
  - {name: b, time: 1, memory: 1, devices: [1]}
model: {blocks: "toy:build", data: "toy:batch", loss: "toy:loss", path: MODELS}
"""


def toy_plan(tmp_path):
    from pathlib import Path

    models = Path(__file__).resolve().parent / "models"
    plan = tmp_path / "toy.yaml"
    plan.write_text(TOY.replace("MODELS", str(models)))
    return plan


def test_activation_memory_is_what_autograd_saves(cli, tmp_path):
    code, out, err = cli("profile", toy_plan(tmp_path), "--json", "--repeats", "2")
    assert (code, err) == (0, "")
    blocks = {b["name"]: b for b in json.loads(out)["blocks"]}
    # A micro-batch is 4 rows: block a saves its 4x8 float input, block b its 4x32 one, and
    # its loss, ((output - target) ** 2).mean(), the 4x4 difference it squares.
    assert blocks["a"]["activation_bytes"] == 4 * 8 * 4
    assert blocks["b"]["activation_bytes"] == 4 * 32 * 4 + 4 * 4 * 4
    assert all(b["forward_ms"] > 0 and b["backward_ms"] > 0 for b in blocks.values())


def test_suggested_costs_validate(cli, tmp_path):
    code, out, _ = cli("profile", PLANS / "flava-kshape.yaml", "--repeats", "1", "--unit-ms",
                       "0.01")
    assert code == 0
    snippet = out.split("suggested costs")[1].split("\n", 1)[1]
    lines = [line[2:] for line in snippet.splitlines()]
    plan = tmp_path / "measured.yaml"
    plan.write_text("pyplan: 1\nname: measured\ndevices: 4\nmicro_batches: 4\n"
                    "training: {backward: {time_ratio: 2}}\n" + "\n".join(lines) + "\n")
    code, out, err = cli("validate", plan)
    assert (code, err) == (0, ""), err
    assert "after: [" in snippet  # the two branches join at the cross encoder


def test_plan_without_model_is_an_error(cli):
    code, _, err = cli("profile", PLANS / "tessel-vshape.yaml")
    assert code == 2
    assert err.endswith("error: the plan has no model: section, so there is nothing to measure "
                        "(hint: add model: {blocks: ..., data: ..., loss: ...})\n")


def test_spread_times_are_repeated_then_named_and_a_busy_machine_is_flagged(monkeypatch):
    import itertools
    import torch

    from pyplan.measure import measure

    measured = measure.Measured()
    timer = measure.Timer(torch.device("cpu"), 5, measured)
    steady = itertools.cycle([1.0, 1.01, 0.99])
    calls = []
    assert timer.median(lambda: calls.append(1) or next(steady), "steady") == 1.0
    assert len(calls) == 6 and not measured.warnings  # a warm-up and 5 runs: stable
    noisy = itertools.cycle([1.0, 3.0, 0.5, 2.0])
    calls.clear()
    timer.median(lambda: calls.append(1) or next(noisy), "unit x forward")
    assert len(calls) == 1 + measure.MORE * 5  # runs added up to 8x, still spread
    assert measured.warnings[0].startswith("the times of 1 measurements spread more than 10% "
                                           "around their medians however often repeated "
                                           "(worst: unit x forward")
    monkeypatch.setattr(measure.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(measure.os, "cpu_count", lambda: 2)
    measure.busy(measured)
    assert measured.warnings[-1].startswith("the machine looks busy (load average 9.0 on 2 "
                                            "cores)")
