"""Shared fixtures and helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyplan.cli import main

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
INVALID = Path(__file__).resolve().parent / "plans" / "invalid"


def example_plans() -> list[Path]:
    return sorted(PLANS.glob("*.yaml"), key=lambda p: p.name)


def spec_plans() -> list[Path]:
    return [p for p in example_plans() if not p.name.endswith(".resolved.yaml")]


@pytest.fixture
def cli(capsys):
    """Run `pyplan ARGS...` in-process; returns (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return run
