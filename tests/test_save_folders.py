"""A --save folder holds one timeline, written by one run at a time, and survives a kill at
any point of a save: a run that does not continue from its newest checkpoint is refused unless
--overwrite (whose saves then remove the steps after their own, --keep-last keeping the step
just saved); a second run saving there at once is refused in one line; a step a kill left under
its hidden names between the renames that replace it is found and put back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_checkpoints import UNITS, one_rank, solved  # noqa: F401 - one_rank is a fixture


def _fake_step(root: Path, name: str, model: str = "longrun:model") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / ".metadata").write_text("m")
    (folder / "pyplan.json").write_text(json.dumps({"format": 1, "step": 1, "model": model}))
    return folder


def test_a_save_folder_is_continued_or_overwritten_on_purpose(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "one.resolved.yaml"
    (tmp_path / "one.yaml").write_text((Path(__file__).parent.parent / "plans" /
                                        "transformer-vshape.yaml").read_text())
    assert cli("solve", "one.yaml", "--quiet")[0] == 0
    _fake_step(tmp_path, "ck/step-00000001")
    _fake_step(tmp_path, "ck/step-00000003", model="other:model")
    _fake_step(tmp_path, "elsewhere/step-00000005")
    hint = ("(hint: continue them with --resume auto, save into another folder, or give "
            "--overwrite to let this run's checkpoints replace them)\n")
    for resume, how in ((), "starts afresh"), (("--resume", "ck/step-00000001"),
                                               "starts from ck/step-00000001"), \
            (("--resume", "elsewhere"), "starts from elsewhere"):
        code, out, err = cli("run", plan, "--dry-run", "--save", "ck", *resume)
        assert (code, out) == (2, ""), err
        assert err == ("error: --save ck: holds checkpoints of another model (other:model) up "
                       f"to step-00000003, and this run {how}, not from its newest " + hint)
    for allowed in (("--resume", "auto"), ("--resume", "ck"),
                    ("--resume", "ck/step-00000003"), ("--overwrite",),
                    ("--resume", "elsewhere", "--overwrite")):
        code, out, err = cli("run", plan, "--dry-run", "--save", "ck", *allowed)
        assert code == 0, (allowed, err)
    assert cli("run", plan, "--dry-run", "--save", "fresh")[0] == 0  # nothing there to mix


def test_resuming_an_earlier_step_keeps_the_step_it_saves(one_rank, tmp_path, monkeypatch):
    """The issue's case: steps 1..3 saved, resumed from step 1 with --keep-last 1: the step
    this run saves (2) is the one kept, the old timeline's step 3 goes (with --overwrite)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    one = solved(tmp_path, "one", [UNITS])
    code, out, err = one_rank("run", one, "--iterations", 3, "--save", "ck", "--save-every", 1)
    assert code == 0, err
    steps = ["step-00000001", "step-00000002", "step-00000003"]
    assert sorted(p.name for p in Path("ck").iterdir() if p.name.startswith("step")) == steps
    again = ("run", one, "--iterations", 1, "--resume", "ck/step-00000001", "--save", "ck",
             "--keep-last", 1, "--json")
    code, out, err = one_rank(*again)
    assert code == 2 and "holds checkpoints up to step-00000003, and this run starts from " \
        "ck/step-00000001" in err, err
    code, out, err = one_rank(*again, "--overwrite")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["checkpoint"] == "ck/step-00000002"
    assert sorted(p.name for p in Path("ck").iterdir() if p.name.startswith("step")) == \
        ["step-00000002"]
    assert json.loads(Path("ck/step-00000002/pyplan.json").read_text())["step"] == 2


def test_a_second_run_saving_into_the_folder_is_refused(cli, tmp_path, monkeypatch):
    """The lock is the kernel's (flock): held while the first run lives, gone when it ends."""
    from pyplan import files

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(files, "_HELD", {})
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("PYPLAN_SAVE_LOCKED", raising=False)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pyplan.files import hold_lock; "
         "hold_lock('ck', '--save ck'); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        code, out, err = cli("run", Path(__file__).parent.parent / "plans" /
                             "transformer-vshape.resolved.yaml", "--save", "ck")
        assert (code, out) == (2, "")
        assert err == ("error: --save ck: another process is saving into this folder (hint: "
                       "wait until it ends, or choose another folder)\n")
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    assert sorted(p.name for p in Path("ck").iterdir()) == []  # the lock adds no file
    files.hold_lock("ck", "--save ck")  # released with the process that held it
    for fd in files._HELD.values():
        __import__("os").close(fd)


@pytest.mark.parametrize("left", ["both", "old only"])
def test_a_kill_between_the_renames_loses_no_step(left, tmp_path):
    """_complete renames step-N to .step-N.replaced, then .step-N.partial to step-N: killed in
    between, resume finds the step under its hidden name, and the next save puts it back."""
    pytest.importorskip("torch")
    from pyplan.train import checkpoint

    _fake_step(tmp_path, "step-00000001")
    old = _fake_step(tmp_path, ".step-00000002.replaced")
    (old / "which").write_text("old")
    if left == "both":
        new = _fake_step(tmp_path, ".step-00000002.partial")
        (new / "which").write_text("new")
    else:  # the new copy without its record: not complete
        (tmp_path / ".step-00000002.partial").mkdir()
    expected = "new" if left == "both" else "old"
    assert (checkpoint.find(tmp_path) / "which").read_text() == expected
    checkpoint._recover(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == (
        ["step-00000001", "step-00000002"] if left == "both" else
        [".step-00000002.partial", "step-00000001", "step-00000002"])
    assert (tmp_path / "step-00000002" / "which").read_text() == expected
