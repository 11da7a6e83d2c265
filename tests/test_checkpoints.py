"""Checkpoints a user can trust: step folders written under a temporary name and renamed once
complete, so a rank killed during a save (SIGKILL) or a save that fails (a file-size limit)
leaves the previous checkpoints loadable, and resuming from them continues exactly; every
damage, another model, other shapes, another optimizer or seed, a `--save` under a file and
consolidate's output onto its own inputs are one line and exit 2 on every rank. The model's
middle stage holds no parameter: that rank has no optimizer and still takes part in every
collective of saving and loading."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pyplan.runtime import torch  # noqa: F401  (torch without its numpy warning)

MODELS = Path(__file__).resolve().parent / "models"
PYPLAN = str(Path(sys.executable).with_name("pyplan"))
UNITS = ["0", "1", "2", "3", "4", "5"]


def plan_text(name: str, stages: list[list[str]], factory: str = "longrun:model",
              data: str = "longrun:batch") -> str:
    blocks = "\n".join(f"  - {{name: stage{s}, devices: [{s}], time: 1, memory: 1}}"
                       for s in range(len(stages)))
    lists = "\n".join(f"    stage{s}: {json.dumps(units)}" for s, units in enumerate(stages))
    return (f"pyplan: 1\nname: {name}\ndevices: {len(stages)}\nmicro_batches: 4\n"
            f"training: {{backward: {{time_ratio: 2}}}}\nblocks:\n{blocks}\nmodel:\n"
            f"  module: {factory}\n  stages:\n{lists}\n  data: {data}\n  loss: longrun:loss\n")


def solved(folder: Path, name: str, stages, **model) -> Path:
    """folder/NAME.resolved.yaml of the long-run model cut into `stages`."""
    if not (folder / "longrun.py").exists():
        shutil.copy(MODELS / "longrun.py", folder / "longrun.py")
    (folder / f"{name}.yaml").write_text(plan_text(name, stages, **model))
    result = subprocess.run([PYPLAN, "solve", f"{name}.yaml", "--quiet"], cwd=folder,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return folder / f"{name}.resolved.yaml"


THREE = [["0"], ["1", "2"], ["3", "4", "5"]]  # the middle stage: GELU and Tanh, no parameter


def launch(folder: Path, plan: str, ranks: int, *args, limit: int | None = None,
           env: dict | None = None):
    """`pyplan run` over `ranks` processes: (exit code, stdout, pyplan's lines on stderr)."""
    def limited():  # a file-size limit for the launcher and the ranks it starts
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run([PYPLAN, "run", plan, "--nproc-per-node", str(ranks), "--device",
                             "cpu", "--optimizer", "adamw", *map(str, args)], cwd=folder,
                            capture_output=True, text=True, timeout=300,
                            preexec_fn=limited if limit else None,
                            env={**os.environ, **(env or {})})
    ours = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return result.returncode, result.stdout, ours


def report(out: str) -> dict:
    return json.loads(out.splitlines()[-1])


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.slow
@pytest.mark.torchrun
def test_checkpoints_survive_a_killed_rank_and_a_full_disk(tmp_path):
    solved(tmp_path, "three", THREE)
    ck = tmp_path / "ck"
    code, out, err = launch(tmp_path, "three.resolved.yaml", 3, "--iterations", 4, "--save",
                            "ck", "--save-every", 2, "--json")
    assert code == 0, err
    losses = report(out)["losses"]
    assert listing(ck) == ["step-00000002", "step-00000004"]
    record = json.loads((ck / "step-00000004" / "pyplan.json").read_text())
    assert (record["step"], record["optimizer"]["class"], record["plan"]) == (4, "AdamW", "three")
    assert record["training"]["lr"] == 0.01 and len(record["plan_sha256"]) == 64

    # SIGKILL of rank 1 in the middle of writing its part of step 5's checkpoint.
    code, out, err = launch(tmp_path, "three.resolved.yaml", 3, "--iterations", 1, "--resume",
                            "ck", "--save", "ck", "--fail-at", "1:save:kill",
                            "--fault-timeout", 3)
    assert code != 0
    assert any("rank 1 died" in e and "last seen at a checkpoint save" in e
               for e in err), err
    assert listing(ck) == [".step-00000005.partial", "step-00000002", "step-00000004"]

    # A file-size limit (ulimit -f): the save fails on the rank whose part is too large; every
    # rank says so in the same one line, exit 2; the previous checkpoint stays, the part goes.
    code, out, err = launch(tmp_path, "three.resolved.yaml", 3, "--iterations", 1, "--resume",
                            "ck", "--save", "ck", limit=40_000)
    assert code == 2 and len(err) == 3 and len(set(err)) == 1, err
    assert err[0].startswith("error: cannot write the checkpoint of step 5 in ck: rank ")
    assert "File too large (hint: ck/step-00000004 is intact)" in err[0]
    assert listing(ck) == ["step-00000002", "step-00000004"]

    # Both still load and continue exactly; saving step 4 again replaces it once complete,
    # and --keep-last 1 removes the older one.
    code, out, err = launch(tmp_path, "three.resolved.yaml", 3, "--iterations", 2, "--resume",
                            "ck/step-00000002", "--save", "ck", "--keep-last", 1, "--overwrite",
                            "--json")
    assert code == 0, err
    assert report(out)["losses"] == losses[2:]
    assert listing(ck) == ["step-00000004"]

    # A truncated part: one line, exit 2, on every rank (and consolidate says the same).
    with open(ck / "step-00000004" / "__2_0.distcp", "r+b") as part:
        part.truncate(1000)
    code, out, err = launch(tmp_path, "three.resolved.yaml", 3, "--iterations", 1, "--resume",
                            "ck")
    assert code == 2 and len(err) == 3 and len(set(err)) == 1, err
    assert err[0].startswith("error: the checkpoint ck/step-00000004 is damaged: its part "
                             "__2_0.distcp is truncated (1000 of ")


# ---------------------------------------------------------------- one rank, in this process

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alone(monkeypatch) -> None:
    """This process as the only rank of a world (torchrun's environment)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def one_rank(monkeypatch, capfd):
    """`pyplan ...` in this process as the only rank of a world: (exit code, stdout, stderr)."""
    from pyplan.cli import main

    def run(*args):
        alone(monkeypatch)
        capfd.readouterr()
        code = main([str(a) for a in args])
        out, err = capfd.readouterr()
        return code, out, err
    return run


def test_every_damage_is_one_line_and_exit_2(one_rank, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    one = solved(tmp_path, "one", [UNITS])
    wide = solved(tmp_path, "wide", [UNITS], factory="longrun:wide")
    other = solved(tmp_path, "other", [[*UNITS, "6"]], factory="longrun:other")
    assert one_rank("run", one, "--optimizer", "adamw", "--save", "ck", "--json")[0] == 0
    step = Path("ck/step-00000001")
    hint = "(hint: resume with a plan of the model it was saved from"

    def refused(*args) -> str:
        code, out, err = one_rank(*args)
        assert code == 2 and err.count("\n") == 1, (code, out, err)
        return err

    resume = ("run", one, "--optimizer", "adamw", "--resume", "ck")
    assert refused("run", one, "--resume", "ck") == (
        f"error: the checkpoint {step} holds adamw's state, and this run's optimizer is sgd "
        "(hint: resume with --optimizer adamw)\n")
    assert "was trained with --seed 0, not 3 (hint: resume with --seed 0)" in \
        refused(*resume, "--seed", 3)
    assert refused("run", wide, "--optimizer", "adamw", "--resume", "ck").startswith(
        f"error: 0.weight is shaped (16, 8) in the checkpoint {step}, (32, 8) in this model "
        + hint)
    assert refused("run", other, "--optimizer", "adamw", "--resume", "ck").startswith(
        f"error: the checkpoint {step} (saved from longrun:model) has no '1.weight' " + hint)
    assert refused("consolidate", wide, "ck", "-o", "m.pt").startswith(
        "error: 0.weight is shaped (16, 8) in the checkpoint, (32, 8) in the model")
    assert refused("consolidate", other, "ck", "-o", "m.pt").startswith(
        f"error: the checkpoint {step} has no '1.weight'")
    # Output onto what consolidate reads: refused before anything is written.
    kept = {p: p.read_bytes() for p in [one, tmp_path / "one.yaml", tmp_path / step / ".metadata"]}
    for output in kept:
        assert "refusing to write" in refused("consolidate", one, "ck", "-o", output)
    assert all(p.read_bytes() == data for p, data in kept.items())
    assert not (tmp_path / "m.pt").exists()
    # --save under a path that is a file, or a file for --resume.
    (tmp_path / "afile").write_text("mine")
    assert refused("run", one, "--save", "afile/ck") == (
        f"error: --save afile/ck: {tmp_path}/afile exists and is not a directory (hint: "
        "choose another folder for the checkpoints)\n")
    assert "--resume afile: is not a directory" in refused("run", one, "--resume", "afile")
    assert (tmp_path / "afile").read_text() == "mine"
    # Damaged parts and records: named, on resume and in consolidate alike.
    part = step / "__0_0.distcp"
    whole = part.read_bytes()
    part.write_bytes(whole[:100])
    truncated = f"is damaged: its part __0_0.distcp is truncated (100 of {len(whole)} bytes)"
    assert truncated in refused(*resume) and truncated in refused("consolidate", one, "ck",
                                                                  "-o", "m.pt")
    part.unlink()
    assert "its part __0_0.distcp is missing" in refused(*resume)
    assert "its part __0_0.distcp is missing" in refused("consolidate", one, "ck", "-o", "m.pt")
    # One flipped bit in the middle of a tensor: the sha256 recorded at save refuses it.
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0x10
    part.write_bytes(bytes(flipped))
    damaged = (f"error: the checkpoint {step} is damaged: its part __0_0.distcp does not match "
               "the sha256 recorded when it was saved")
    assert refused(*resume).startswith(damaged)
    assert refused("consolidate", one, "ck", "-o", "m.pt").startswith(damaged)
    # Without the record's sums (a checkpoint of an older pyplan), DCP's reader still refuses
    # bytes it cannot read.
    record = json.loads((step / "pyplan.json").read_text())
    (step / "pyplan.json").write_text(json.dumps({**record, "sha256": {}}))
    part.write_bytes(bytes((b + 13) % 256 if i % 7 == 0 else b for i, b in enumerate(whole)))
    damaged = f"error: cannot read the checkpoint {step}, its data is damaged: rank 0: "
    assert refused(*resume).startswith(damaged)
    assert refused("consolidate", one, "ck", "-o", "m.pt").startswith(damaged)
    part.write_bytes(whole)
    (step / "pyplan.json").write_text("{")
    assert f"{step}/pyplan.json is damaged" in refused(*resume)
    (step / "pyplan.json").unlink()
    assert refused(*resume) == ("error: ck holds no complete checkpoint (hint: give the "
                                "directory --save wrote)\n")
    assert not (tmp_path / "m.pt").exists()
