"""No command writes over what it reads or must keep: every output flag of every command is
tried against every input that command reads (the plan, the resolved plan, the model's module,
its pretrained weights and their shards, the checkpoint being resumed and the files in it, run's
--config), each reached directly, through a symlink, a hard link or `..`, and inside a folder.
Each is one line naming the flag (exit 2) before anything starts, and every file is unchanged.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from conftest import PLANS

MODULE = """\
def model():
    raise AssertionError("never built: the outputs are checked first")


def batch(step):
    raise AssertionError("never called")


def loss(output, target):
    raise AssertionError("never called")
"""


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A plan of a model given as a module with pretrained weights, its resolved plan, a
    checkpoint of it, a --config file and a `pyplan plan` model config."""
    from pyplan.cli.main import main

    root = tmp_path_factory.mktemp("ws")
    text = (PLANS / "gpt24.yaml").read_text().replace("pyplan.examples.gpt_chain:", "overlapmodel:")
    (root / "m.yaml").write_text(text.replace("  module: overlapmodel:model\n",
                                              "  module: overlapmodel:model\n  weights: weights\n"))
    (root / "overlapmodel.py").write_text(MODULE)
    (root / "weights").mkdir()
    (root / "weights" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-1.safetensors", "b": "../extra/model-2.safetensors"}}')
    (root / "weights" / "model-1.safetensors").write_bytes(b"w1")
    (root / "extra").mkdir()
    (root / "extra" / "model-2.safetensors").write_bytes(b"w2")
    step = root / "ckpt" / "step-00000002"
    step.mkdir(parents=True)
    for name in ("pyplan.json", ".metadata", "__0_0.distcp"):
        (step / name).write_text(name)
    (root / "config.yaml").write_text("lr: 0.01\n")
    (root / "config.json").write_text("{}\n")
    assert main(["solve", str(root / "m.yaml"), "--quiet"]) == 0
    return root


# What each command reads (relative to the workspace; a folder ends in /), and its command line
# with OUT.
INPUTS = {
    "run": ["m.resolved.yaml", "m.yaml", "overlapmodel.py", "weights/", "extra/model-2.safetensors",
            "weights/model.safetensors.index.json", "ckpt/step-00000002/",
            "ckpt/step-00000002/pyplan.json", "ckpt/step-00000002/.metadata", "config.yaml"],
    "consolidate": ["m.resolved.yaml", "m.yaml", "overlapmodel.py", "weights/",
                    "extra/model-2.safetensors", "ckpt/step-00000002/.metadata",
                    "ckpt/step-00000002/pyplan.json"],
    "export": ["m.resolved.yaml", "m.yaml"],
    "solve": ["m.yaml"],
    "partition": ["overlapmodel.py", "weights/", "weights/model.safetensors.index.json"],
    "plan": ["config.json"],
}
LAYOUT = "plan config.json --cluster dgx-a100-80gb --global-batch 8 --seq 128"
COMMANDS = {  # (command, output flag): its arguments, OUT standing for the output
    ("run", "--log"): "run m.resolved.yaml --dry-run --resume ckpt --config config.yaml --log OUT",
    ("run", "--trace"): "run m.resolved.yaml --dry-run --resume ckpt --trace OUT --config "
                        "config.yaml",
    ("run", "--tensorboard"): "run m.resolved.yaml --dry-run --resume ckpt --tensorboard OUT "
                              "--config config.yaml",
    ("run", "--profile"): "run m.resolved.yaml --dry-run --resume ckpt --profile OUT --config "
                          "config.yaml",
    ("run", "--save"): "run m.resolved.yaml --dry-run --resume ckpt/step-00000002 --save OUT "
                       "--config config.yaml",
    ("consolidate", "-o"): "consolidate m.resolved.yaml ckpt -o OUT",
    ("consolidate", "-o safetensors"): "consolidate m.resolved.yaml ckpt --format safetensors "
                                       "-o OUT",
    ("export", "-o"): "export m.resolved.yaml --format svg -o OUT",
    ("solve", "-o"): "solve m.yaml --quiet -o OUT",
    ("partition", "-o"): "partition overlapmodel:model --data overlapmodel:batch --loss "
                         "overlapmodel:loss --devices 2 --weights weights -o OUT",
    ("plan", "-o"): f"{LAYOUT} -o OUT",
    ("plan", "--torchtitan"): f"{LAYOUT} --torchtitan OUT",
    ("plan", "--megatron"): f"{LAYOUT} --megatron OUT",
}
WAYS = ["itself", "symlink", "hard link", "dotdot", "inside"]


def _cases():
    for (command, flag), line in COMMANDS.items():
        for given in INPUTS[command]:
            for way in WAYS:
                if way == ("inside" if not given.endswith("/") else "hard link"):
                    continue  # nothing is inside a file; a folder has no hard link
                yield pytest.param(line, flag.split()[0], given, way,
                                   id=f"{command}-{flag}-{given}-{way}")


def _alias(ws: Path, given: str, way: str, tmp_path: Path) -> Path:
    """A path that reaches `given` (or a place inside it) another way."""
    path = ws / given.rstrip("/")
    if way == "itself":
        return path
    if way == "symlink":
        (tmp_path / "link").symlink_to(path)
        return tmp_path / "link"
    if way == "dotdot":
        return ws / "extra" / ".." / given.rstrip("/")
    if way == "hard link":
        os.link(path, tmp_path / "hard")
        return tmp_path / "hard"
    return path / "new"  # inside


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("line, flag, given, way", list(_cases()))
def test_no_output_lands_on_what_the_command_reads(line, flag, given, way, ws, tmp_path, cli,
                                                   monkeypatch):
    out = _alias(ws, given, way, tmp_path)
    monkeypatch.chdir(ws)
    monkeypatch.delitem(sys.modules, "overlapmodel", raising=False)  # imported from ws
    before = _snapshot(ws)
    code, stdout, err = cli(*line.replace("OUT", str(out)).split())
    assert (code, stdout) == (2, ""), err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag} {out}"), err
    assert re.search(r"refusing to|exists and is", err), err
    assert _snapshot(ws) == before


def test_a_replaced_folder_may_not_hold_an_input(ws, cli, monkeypatch):
    """consolidate's safetensors folder is replaced whole: not over a folder holding the
    plan, the model or the checkpoint."""
    monkeypatch.chdir(ws)
    before = _snapshot(ws)
    code, _, err = cli("consolidate", "m.resolved.yaml", "ckpt", "--format", "safetensors",
                       "-o", str(ws))
    assert code == 2 and "refusing to replace a folder holding" in err, err
    assert _snapshot(ws) == before


def test_outputs_may_not_name_each_other_nor_be_empty(ws, cli, monkeypatch, tmp_path):
    monkeypatch.chdir(ws)
    code, _, err = cli("run", "m.resolved.yaml", "--dry-run", "--log", tmp_path / "x",
                       "--tensorboard", tmp_path / "x")
    assert code == 2 and err == (f"error: --log and --tensorboard both name {tmp_path / 'x'} "
                                 "(hint: give them different files)\n")
    for flag in ("--save", "--log", "--tensorboard", "--trace", "--profile"):
        code, _, err = cli("run", "m.resolved.yaml", "--dry-run", flag, "")
        assert code == 2 and err.startswith(f"error: {flag} '': an empty path"), err
        code, _, err = cli("run", "m.resolved.yaml", "--dry-run", flag, "a\0b")
        assert code == 2 and err.startswith(f"error: {flag} 'a\\x00b': a NUL character"), err


def test_outputs_beside_the_inputs_are_written(ws, cli, monkeypatch, tmp_path):
    """The refusals are not every output: a fresh file beside the plan, and --save into the
    folder the checkpoint being resumed is in (resuming where it saves), pass the check."""
    monkeypatch.chdir(ws)
    code, out, err = cli("run", "m.resolved.yaml", "--dry-run", "--resume", "ckpt", "--save",
                         "ckpt", "--log", tmp_path / "log.jsonl", "--tensorboard", tmp_path / "tb")
    assert "refusing" not in err and "both name" not in err, err


def test_a_folder_output_that_is_a_file_fifo_or_device_is_refused_first(ws, cli, monkeypatch,
                                                                         tmp_path):
    """--tensorboard and --save name folders: an existing file, named pipe, device or /proc
    entry is refused before anything starts (TensorBoard's writer raised FileExistsError in the
    ranks, after they started)."""
    monkeypatch.chdir(ws)
    (tmp_path / "file").write_text("mine")
    os.mkfifo(tmp_path / "fifo")
    for flag in ("--tensorboard", "--save", "--profile"):
        for path in (tmp_path / "file", tmp_path / "fifo", "/dev/null", "/proc/self/status"):
            code, out, err = cli("run", "m.resolved.yaml", "--dry-run", flag, path)
            assert (code, out) == (2, "")
            assert err.startswith(f"error: {flag} {path}: ") and err.count("\n") == 1, err
            assert "exists and is not a folder" in err or \
                f"{path} exists and is not a directory" in err, err
    assert (tmp_path / "file").read_text() == "mine"


def test_a_dangling_symlink_output_is_not_its_folder(ws, cli, monkeypatch, tmp_path):
    """An output that is a link to nothing yet names a new file where the link points: inside
    the weights folder, refused as inside it (not as the folder itself); elsewhere, written."""
    monkeypatch.chdir(ws)
    (tmp_path / "into").symlink_to(ws / "weights" / "later.json")
    code, out, err = cli("run", "m.resolved.yaml", "--dry-run", "--log", tmp_path / "into")
    assert code == 2 and err.startswith(f"error: --log {tmp_path / 'into'}: refusing to write "
                                        "inside weights, which"), err
    (tmp_path / "here").symlink_to(tmp_path / "nothing.json")
    code, out, err = cli("run", "m.resolved.yaml", "--dry-run", "--trace", tmp_path / "here")
    assert "refusing" not in err, err
