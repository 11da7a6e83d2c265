"""The type stub beside the extension lists exactly what the extension exports."""

from __future__ import annotations

import ast
from pathlib import Path

from pyplan import _core


def test_stub_matches_extension():
    stub = Path(_core.__file__).with_name("_core.pyi")
    if not stub.exists():  # editable installs keep the stub in the source tree
        stub = Path(__file__).resolve().parent.parent / "pyplan" / "_core.pyi"
    tree = ast.parse(stub.read_text())
    declared = next(node.value for node in tree.body if isinstance(node, ast.AnnAssign)
                    and getattr(node.target, "id", "") == "__all__")
    names = sorted(ast.literal_eval(declared))
    public = sorted(n for n in dir(_core) if not n.startswith("_"))
    assert names == public
