"""Atomic writes: whole files only, the usual permissions, nothing left behind on failure."""

from __future__ import annotations

import os
import stat

import pytest

from pyplan.errors import PyplanError
from pyplan.files import write_atomic


def test_new_file_gets_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a.yaml", "x: 1\n")
    finally:
        os.umask(old)
    assert (tmp_path / "a.yaml").read_text() == "x: 1\n"
    assert stat.S_IMODE((tmp_path / "a.yaml").stat().st_mode) == 0o644


def test_existing_file_keeps_its_mode(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text("old\n")
    path.chmod(0o640)
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["b.yaml"]


def test_missing_directory_is_a_user_error(tmp_path):
    with pytest.raises(PyplanError, match="cannot write"):
        write_atomic(tmp_path / "nope" / "c.yaml", "x\n")
