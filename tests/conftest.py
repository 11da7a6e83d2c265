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

# What runs under `pytest -m slow` only (CI runs it after the README's `pytest`, which then
# keeps one case of each behaviour within 10 minutes on 2 cores), chosen by CI's --durations:
# the multi-rank cases of these files (the CUDA paths' CPU runs, the GPU check's --cpu pass:
# a GPU runs them all through benchmarks/gpu_check.py) ...
SLOW_RANKS = {"test_cuda_paths.py", "test_gpu_review.py"}
# ... and these files and cases whole (a further model, layout or save of a behaviour that a
# faster case in the default run covers).
SLOW_CASES = (
    "tests/test_meshes.py::",  # the meshes' layouts and saves (TP, FSDP, data)
    "tests/test_gpu_check.py::",
    "tests/test_model_classes.py::",  # one torchrun of 13 model classes (tests/models/classes.py)
    "tests/test_families.py::test_every_family_trains_on_two_ranks",
    # (test_experts' q3 keeps a tensor-parallel run with sequence parallelism in the default)
    "tests/test_experts.py::test_tensor_parallel_experts_train_the_single_process_model[mix1",
    "tests/test_experts.py::test_tensor_parallel_experts_train_the_single_process_model[q2",
    "tests/test_restarts.py::test_sigterm_saves_and_the_same_command_continues_exactly",
    "tests/test_docs.py::test_guide_runs[README.md-root]",  # README's blocks: test_docs' others
    "tests/test_docs.py::test_guide_runs[cluster-planning.md-root]",
    "tests/test_run_flags.py::test_compiled_blocks_pass_the_check[1f1b]",
    "tests/test_partition.py::test_a_model_partitioned_solved_and_run_matches_single_process_training[interleaved-unequal-chain]",
    "tests/test_long_runs.py::test_lines_as_they_happen",
    "tests/test_run_flags.py::test_async_saves_resume_exactly_as_synchronous_ones",
    "tests/test_models.py::test_llama_interleaved_with_adamw_and_clipping",
    "tests/test_mshape.py::test_tied_gpt2_in_mshape_with_adamw_and_clipping",
    "tests/test_training.py::test_checkpoints_resume_exactly_reshard_and_consolidate",
    # (tied gradients: test_models' tied GPT-2; zb-v in torch's runtime: its FSDP case)
    "tests/test_oracle.py::test_a_users_loop_over_pipeline_accumulates_tied_gradients_exactly",
    "tests/test_export_torch.py::test_an_exported_schedule_trains_the_same_losses_in_torchs_runtime[zb-v]",
    "tests/test_long_runs.py::test_the_readmes_loop_saves_and_resumes_exactly",
)


_WHY = ("Fatal Python error", "terminate called", "what():", "Traceback", "error:")


def why_ranks_failed(stderr: str, tail: int = 2500) -> str:
    """A failed multi-rank run's stderr for an assertion message: the lines that say why a
    rank died (a native abort's first words come long before its stack dumps end), then the
    tail."""
    said = [line for line in stderr.splitlines() if line.lstrip().startswith(_WHY)]
    return "\n".join(said[:20]) + "\n...\n" + stderr[-tail:]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_RANKS and item.get_closest_marker("torchrun") or \
                item.nodeid.startswith(SLOW_CASES):
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
