"""Fuzzing the user's side of the contract: model modules written on the fly whose factory,
blocks, data or loss fail in a randomly drawn way (an exception of a random type and message,
sys.exit, a syntax error, a wrong return type or shape, an import that fails), fed to
`pyplan partition`, `pyplan run --dry-run` and `pyplan run` (one process). Every case must end
in one error line naming the failing function, exit 2; never a traceback, never exit 0.
`PYPLAN_FUZZ_CASES=2000 pytest tests/test_fuzz_user_code.py` is a long run."""

from __future__ import annotations

import os
import random
import sys

import pytest

pytest.importorskip("torch")

CASES = int(os.environ.get("PYPLAN_FUZZ_CASES", "24"))

GOOD = {
    "model": "def model():\n    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))\n",
    "batch": "def batch(step):\n    return torch.randn(8, 4), torch.randn(8, 4)\n",
    "loss": "def loss(output, target):\n    return ((output - target) ** 2).mean()\n",
    "build": "def build(name, group):\n    return nn.Linear(4, 4)\n",
}
SIGNATURES = {"model": "model()", "batch": "batch(step)", "loss": "loss(output, target)",
              "build": "build(name, group)"}
# What a data or loss function may return that looks right and is not: (value, what the error
# line says).
HOSTILE_RETURNS = {
    "batch": [("torch.randn(8, 4), torch.randn(16, 4)", "returned inputs of 8 samples and "
               "targets of 16"),
              ("(torch.randn(8, 4), None), torch.randn(8, 4)", "that hold None at inputs[1]"),
              ("{'x': torch.randn(8, 4)}, {'y': torch.randn(8, 4), 'w': None}",
               "that hold None at targets['w']"),
              ("torch.randn(8, 4, device='meta'), torch.randn(8, 4)", "on the meta device"),
              ("torch.randn(8, 4), torch.randn(4, 4)", "of 8 samples and targets of 4")],
    "loss": [("torch.zeros((), device='meta')", "returned a loss on the meta device"),
             ("torch.tensor(1.0)", "returned a loss that does not require grad")],
}
EXCEPTIONS = ["ValueError", "RuntimeError", "KeyError", "TypeError", "IndexError",
              "AttributeError", "ZeroDivisionError", "AssertionError", "OSError",
              "NotImplementedError", "MemoryError", "RecursionError"]


def _failure(rng: random.Random, function: str) -> tuple[str, str]:
    """(source of a failing `function`, what the error line must contain)."""
    head = f"def {SIGNATURES[function]}:\n"
    mode = rng.choice(["raise", "exit", "type", "shape", "none", "syntax", "import", "hostile"])
    if function in ("model", "build") and mode in ("shape", "hostile"):
        mode = "type"
    if mode == "raise":
        kind = rng.choice(EXCEPTIONS)
        text = "".join(rng.choice("abc xyz\n\t'\"%{}") for _ in range(rng.randint(0, 30)))
        return head + f"    raise {kind}({text!r})\n", f"raised {kind}"
    if mode == "exit":
        code = rng.choice([0, 1, 2, 3, 130, None, "'bye'"])
        return head + f"    import sys\n    sys.exit({code})\n", "raised SystemExit"
    if mode == "type":
        value = rng.choice(["42", "'text'", "[1, 2]", "{'a': 1}", "object()", "3.5"])
        return head + f"    return {value}\n", "returned"
    if mode == "shape":
        value = {"batch": "torch.randn(8, 4)", "loss": "torch.randn(3)"}[function]
        return head + f"    return {value}\n", "returned a tensor"
    if mode == "none":
        return head + "    pass\n", "returned"
    if mode == "hostile":
        value, expect = rng.choice(HOSTILE_RETURNS[function])
        return head + f"    return {value}\n", expect
    if mode == "syntax":
        return head + "    return (\n", "SyntaxError"
    return head + "    import no_such_module_pyplan\n", "raised ModuleNotFoundError"


def _module(rng: random.Random, failing: str) -> tuple[str, str]:
    source, expect = _failure(rng, failing)
    parts = ["import torch\nfrom torch import nn\n"]
    for name, good in GOOD.items():
        parts.append(source if name == failing else good)
    return "\n\n".join(parts), expect


PLAN = """\
pyplan: 1
name: fuzz
devices: 1
micro_batches: 2
training: {backward: {time_ratio: 1}}
blocks:
  - {name: a, devices: [0], time: 1, memory: 1}
model: {blocks: "fuzzmodel:build", data: "fuzzmodel:batch", loss: "fuzzmodel:loss"}
"""


def test_user_code_failures_are_one_line(tmp_path, monkeypatch, capfd):
    from pyplan.cli import main
    from test_runtime import _free_port

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    rng = random.Random(1234)
    counts: dict[str, int] = {}
    for case in range(CASES):
        command = rng.choice(["partition", "dry-run", "run"])
        failing = rng.choice(["model", "batch", "loss"] if command == "partition" else
                             ["build"] if command == "dry-run" else ["build", "batch", "loss"])
        source, expect = _module(rng, failing)
        (tmp_path / "fuzzmodel.py").write_text(source)
        sys.modules.pop("fuzzmodel", None)
        (tmp_path / "fuzz.yaml").write_text(PLAN)
        if command == "partition":
            args = ["partition", "fuzzmodel:model", "--data", "fuzzmodel:batch", "--loss",
                    "fuzzmodel:loss", "--devices", "1", "--micro-batches", "2", "--repeats",
                    "1", "-o", str(tmp_path / "out.yaml")]
        else:
            assert main(["solve", str(tmp_path / "fuzz.yaml"), "--quiet"]) == 0
            args = ["run", str(tmp_path / "fuzz.resolved.yaml"), "--device", "cpu"] + \
                (["--dry-run"] if command == "dry-run" else [])
            for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                               "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(_free_port())}.items():
                monkeypatch.setenv(key, value)
        capfd.readouterr()
        code = main(args)
        out, err = capfd.readouterr()
        where = f"case {case}: {command}, {failing} fails:\n{source}\n-> exit {code}, {err!r}"
        assert code == 2, where
        lines = err.splitlines()
        assert len(lines) == 1 and "error: " in lines[0] and "Traceback" not in err, where
        assert expect in lines[0], where
        assert not (tmp_path / "out.yaml").exists(), where
        counts[command] = counts.get(command, 0) + 1
    print(f"user-code fuzz: {CASES} cases ({', '.join(f'{n} {c}' for c, n in counts.items())})")
