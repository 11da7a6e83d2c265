"""Shared fixtures and helpers."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest

from pyplan.cli import main

# Plans that passed the schema are remembered in a cache directory: the tests (and the
# processes they start) use one of their own, empty at the start, not the user's.
os.environ["PYPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="pyplan-test-cache-")

# The CPU tests run on the CPU on a GPU machine too (every `pyplan run` and Pipeline they
# start); tests/test_gpu.py asks for CUDA explicitly.
os.environ["PYPLAN_DEVICE"] = "cpu"

ROOT = Path(__file__).resolve().parent.parent

# Files whose multi-rank cases run under `pytest -m slow` only: the meshes' sweeps of layouts
# and checkpoints (test_experts and test_sequence_parallel keep a tensor-parallel run in the
# default suite), the CPU runs of the CUDA paths and the GPU check's --cpu pass (a GPU runs
# them all through benchmarks/gpu_check.py).
SLOW_RANKS = {"test_meshes.py", "test_cuda_paths.py", "test_gpu_review.py", "test_gpu_check.py"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_RANKS and (item.get_closest_marker("torchrun") or
                                            item.path.name == "test_gpu_check.py"):
            item.add_marker(pytest.mark.slow)
PLANS = ROOT / "plans"
INVALID = Path(__file__).resolve().parent / "plans" / "invalid"


def example_plans() -> list[Path]:
    return sorted(PLANS.glob("*.yaml"), key=lambda p: p.name)


def spec_plans() -> list[Path]:
    return [p for p in example_plans() if not p.name.endswith(".resolved.yaml")]


@functools.cache
def solved(name: str):
    """plans/NAME.yaml solved once per test run, shared by every test file (a Schedule is
    immutable)."""
    from pyplan.problem import load_problem
    from pyplan.solver import solve

    return solve(load_problem(PLANS / f"{name}.yaml")).schedule


@pytest.fixture
def cli(capsys):
    """Run `pyplan ARGS...` in-process; returns (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def fake_world():
    """A process group of 2 ranks of which this process is rank 0 (torch's fake backend: the
    collectives return at once)."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()
