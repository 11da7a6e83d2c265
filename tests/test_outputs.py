"""Nothing the user had is lost: an output that exists and is not a regular file (a device, a
named pipe, a directory) is refused before any work, never renamed over; an output that is one
of the command's inputs (the plan, the resolved plan, the model's own module) is refused before
anything is written; a symlinked output keeps its link."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from conftest import PLANS
from pyplan.errors import PyplanError

NOT_A_FILE = "exists and is {}, not a regular file; pyplan replaces its outputs whole"


@pytest.fixture(params=["fifo", "directory", "device", "link-to-fifo"])
def special(request, tmp_path):
    """(an output path that is not a regular file, what the error says it is)."""
    path = tmp_path / "out"
    if request.param == "fifo":
        os.mkfifo(path)
        return path, "a named pipe"
    if request.param == "directory":
        path.mkdir()
        return path, "a directory"
    if request.param == "link-to-fifo":
        os.mkfifo(tmp_path / "pipe")
        path.symlink_to(tmp_path / "pipe")
        return path, "a named pipe"
    try:  # /dev/full's numbers, in tmp_path: never the system's own node
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    return path, "a device"


def _unchanged(path) -> tuple:
    info = os.lstat(path)
    return stat.S_IFMT(info.st_mode), info.st_ino, info.st_rdev


def _commands(tmp_path, out):
    for name in ("transformer-vshape.yaml", "transformer-vshape.resolved.yaml"):
        shutil.copy(PLANS / name, tmp_path / name)
    plan = tmp_path / "transformer-vshape.yaml"
    return [("solve", plan, "-o", out, "--quiet"),
            ("export", plan, "--format", "svg", "-o", out),
            ("export", plan, "--format", "megatron-layout", "-o", out),
            ("run", PLANS / "transformer-vshape.resolved.yaml", "--dry-run", "--trace", out),
            ("run", PLANS / "transformer-vshape.resolved.yaml", "--dry-run", "--log", out)]


def test_an_output_that_is_not_a_regular_file_is_refused(special, cli, tmp_path):
    out, kind = special
    before = _unchanged(out)
    for command in _commands(tmp_path, out):
        code, stdout, err = cli(*command)
        assert (code, stdout) == (2, ""), (command, err)
        flag = command[command.index(out) - 1]
        assert err == (f"error: {flag} {out} {NOT_A_FILE.format(kind)}, so it does not write there "
                       "(hint: choose a file name)\n"), command
        assert _unchanged(out) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_the_api_refuses_special_files_and_the_plan(tmp_path):
    import pyplan

    plan = tmp_path / "p.yaml"
    shutil.copy(PLANS / "1f1b-4stage.yaml", plan)
    solution = pyplan.solve(pyplan.load_plan(plan))
    before = plan.read_bytes()
    with pytest.raises(PyplanError, match="refusing to write over .*p.yaml"):
        solution.write(plan)
    assert plan.read_bytes() == before
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(PyplanError, match="is a named pipe, not a regular file"):
        solution.write(tmp_path / "pipe")


def test_a_symlinked_output_keeps_its_link(cli, tmp_path):
    target = tmp_path / "real.svg"
    target.write_text("old")
    (tmp_path / "link.svg").symlink_to("real.svg")
    code, _, _ = cli("export", PLANS / "1f1b-4stage.yaml", "--format", "svg", "-o",
                     tmp_path / "link.svg")
    assert code == 0
    assert (tmp_path / "link.svg").is_symlink()
    assert target.read_text().startswith("<?xml") or "<svg" in target.read_text()


def test_a_missing_directory_is_refused_before_solving(cli, tmp_path):
    code, out, err = cli("solve", PLANS / "1f1b-4stage.yaml", "-o", tmp_path / "no" / "x.yaml")
    assert (code, out) == (2, "")
    assert err == (f"error: -o {tmp_path / 'no' / 'x.yaml'}: its directory does not "
                   "exist (hint: create the directory first, or choose another output)\n")


def test_trace_and_log_are_not_the_plan_nor_each_other(cli, tmp_path):
    resolved = tmp_path / "transformer-vshape.resolved.yaml"
    _commands(tmp_path, tmp_path / "x")
    for option, target in (("--trace", resolved), ("--log", resolved),
                           ("--trace", tmp_path / "transformer-vshape.yaml")):
        before = target.read_bytes()
        code, out, err = cli("run", resolved, "--dry-run", option, target)
        assert (code, out) == (2, "") and err.count("\n") == 1
        assert "refusing to write over" in err and target.read_bytes() == before
    code, _, err = cli("run", resolved, "--dry-run", "--trace", tmp_path / "t.json", "--log",
                       tmp_path / "t.json")
    assert code == 2 and err == (f"error: --trace and --log both name {tmp_path / 't.json'} "
                                 "(hint: give them different files)\n")


MODEL = """\
import torch
from torch import nn


def model():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def batch(step):
    return torch.randn(8, 4), torch.randn(8, 4)
"""


def test_partition_never_writes_over_the_models_code(cli, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    (tmp_path / "usermodel.py").write_text(MODEL)
    (tmp_path / "userloss.py").write_text("def loss(output, target):\n"
                                          "    return ((output - target) ** 2).mean()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for name in ("usermodel", "userloss"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    for out in ("usermodel.py", "./userloss.py"):
        before = (tmp_path / out).read_bytes()
        code, stdout, err = cli("partition", "usermodel:model", "--data", "usermodel:batch",
                                "--loss", "userloss:loss", "--devices", "1", "-o", out)
        assert (code, stdout) == (2, "")
        assert err == (f"error: -o {out.lstrip('./')}: refusing to write over {tmp_path / out.lstrip('./')}, "
                       "which this command reads (hint: choose another output file)\n")
        assert (tmp_path / out).read_bytes() == before
