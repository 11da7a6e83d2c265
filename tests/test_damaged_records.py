"""A damaged checkpoint record (pyplan.json) is one line naming the file and the field, exit 2:
every field of a real record is replaced by each kind of damage (a list, a mapping, a string,
null, a negative number, a step of 10^12, a fraction, a boolean), and each is either refused
naming that field or one of the few values pyplan itself could have written there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_checkpoints import UNITS, one_rank, solved  # noqa: F401 - one_rank is a fixture

pytest.importorskip("torch")

DAMAGE = {"list": [], "mapping": {}, "string": "3", "null": None, "negative": -5,
          "huge": 10**12, "fraction": 1.5, "boolean": True}
NULLABLE = {"model", "optimizer", "config", "clip_grad_norm"}  # null is pyplan's own value
FLOATS = {"lr", "weight_decay", "lr_min", "eps", "clip_grad_norm", "loss_scale"}


def accepted(name: str, kind: str, original) -> bool:
    """Whether the damage is a value of the kind pyplan writes there (the range of a float
    setting is run's options' business): a string for a string, an empty mapping or list for
    one, null where pyplan writes null, any finite float for a float setting, any integer
    seed, a string or null for compile."""
    last = name.rpartition(".")[2]
    if last == "compile":  # a backend's name, or null: eager
        return kind in ("null", "string")
    if kind == "null":
        return last in NULLABLE
    if last in FLOATS:
        return kind in ("fraction", "huge")
    if last == "seed":
        return kind in ("negative", "huge")
    return {"string": str, "mapping": dict, "list": list}.get(kind) is type(original)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint of the long-run model (one rank, adamw, a decaying schedule)."""
    root = tmp_path_factory.mktemp("records")
    mp = pytest.MonkeyPatch()
    try:
        mp.chdir(root)
        mp.syspath_prepend(str(root))
        one = solved(root, "one", [UNITS])
        from test_checkpoints import alone
        from pyplan.cli import main

        alone(mp)
        assert main(["run", str(one), "--optimizer", "adamw", "--lr-schedule", "cosine",
                     "--iterations", "2", "--save", "ck"]) == 0
    finally:
        mp.undo()
    return root / "ck" / "step-00000002"


def _places(record: dict):
    """Every field the generator damages, as (name, container, key)."""
    for key in record:
        if key != "format":
            yield key, record, key
    for key in record["training"]:
        yield f"training.{key}", record["training"], key
    yield "optimizer.class", record["optimizer"], "class"
    yield "optimizer.hyper", record["optimizer"], "hyper"
    for key in record["history"][0]:
        yield f"history[0].{key}", record["history"][0], key
    first = sorted(record["sha256"])[0]
    yield f"sha256[{first!r}]", record["sha256"], first


def test_every_damaged_field_is_named(saved, tmp_path):
    from pyplan.train.checkpoint import CheckpointError, read_meta

    original = json.loads((saved / "pyplan.json").read_text())
    assert {"training", "optimizer", "history", "sha256", "batches"} <= set(original)
    names = [name for name, _, _ in _places(original)]
    refused = 0
    for i, name in enumerate(names):
        for kind, value in DAMAGE.items():
            record = json.loads(json.dumps(original))
            _, container, key = list(_places(record))[i]
            before = container[key]
            container[key] = value
            folder = tmp_path / f"{i}-{kind}"
            folder.mkdir()
            (folder / "pyplan.json").write_text(json.dumps(record))
            try:
                read_meta(folder)
            except CheckpointError as exc:
                text = str(exc.message)
                assert "\n" not in text and text.startswith(f"{folder / 'pyplan.json'} is "
                                                            f"damaged: {name}"), text
                refused += 1
                continue
            assert accepted(name, kind, before), (name, kind)
    assert refused > len(names) * 4  # most damage is refused, by field


@pytest.mark.parametrize("field, value, said", [
    ("step", -5, "step is -5, not an integer in 0 .. 10,000,000"),
    ("step", 10**12, "step is 1000000000000, not an integer in 0 .. 10,000,000"),
    ("training", [1], "training is [1] (a list), not a mapping"),
    ("batches", "2", "batches is '2' (a string), not an integer")])
def test_a_damaged_record_stops_resume_and_consolidate_in_one_line(
        field, value, said, saved, tmp_path, one_rank, monkeypatch):
    import shutil

    monkeypatch.chdir(saved.parent.parent)
    monkeypatch.syspath_prepend(str(saved.parent.parent))
    copy = tmp_path / "ck" / saved.name
    shutil.copytree(saved, copy)
    record = json.loads((copy / "pyplan.json").read_text())
    record[field] = value
    (copy / "pyplan.json").write_text(json.dumps(record))
    line = f"error: {copy / 'pyplan.json'} is damaged: {said} (hint: resume from another " \
        "checkpoint (or repair the field))\n"
    code, out, err = one_rank("run", "one.resolved.yaml", "--optimizer", "adamw",
                              "--lr-schedule", "cosine", "--resume", copy)
    assert (code, err) == (2, line), err
    code, out, err = one_rank("consolidate", "one.resolved.yaml", copy, "-o", tmp_path / "m.pt")
    assert (code, out, err) == (2, "", line)
