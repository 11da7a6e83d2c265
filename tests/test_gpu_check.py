"""benchmarks/gpu_check.py --cpu: the GPU check runs on the CPU (tiny models) and writes the
report a GPU run writes, so that the script works when a GPU comes (issue 61)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
STATUSES = {"passed", "failed", "skipped"}

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    wheels = tmp_path_factory.mktemp("wheels")  # empty: the install part says what is missing
    result = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out),
                             "--wheels", str(wheels)], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    found = json.loads((out / "report.json").read_text())
    return found, out, result


def test_every_part_reports_a_status_and_why(report):
    found, out, result = report
    assert found["mode"] == "cpu" and list(found["parts"]) == ["install", "suite",
                                                               "partition", "run"]
    for name, part in found["parts"].items():
        assert part["status"] in STATUSES and part["reason"] and part["seconds"] >= 0, name
        assert f"{name:10} {part['status']}" in result.stdout, result.stdout
    assert found["ok"] == (result.returncode == 0)
    assert (out / "gpu_check.log").read_text().count("$ ") >= 4
    # each part ends by its deadline (the boxes' running sum), the whole by the last one
    assert sum(found["boxes_seconds"].values()) + 30 >= found["wall_seconds"] > 0


def test_without_wheels_the_install_says_how_to_get_them(report):
    install = report[0]["parts"]["install"]
    assert install["status"] == "skipped" and "--fetch-wheels" in install["reason"]
    assert install["wheels"] == 0


def test_the_gpu_suite_collects_and_skips_without_a_gpu(report):
    suite = report[0]["parts"]["suite"]
    assert suite["status"] == "skipped" and suite["failed"] == suite["passed"] == 0
    assert suite["skipped"] > 10 and any("GPU" in r for r in suite["skip_reasons"]), suite


def test_partition_holds_each_unit_against_the_cost_model(report):
    part = report[0]["parts"]["partition"]
    assert part["status"] == "passed", part["reason"]
    for name in ("llama", "gpt2"):
        model = part["models"][name]
        kinds = [row["kind"] for row in model["layers"]]
        assert kinds[0] == "embedding" and kinds[-1] == "head" and \
            kinds.count("layer") == 2, kinds
        for row in model["layers"]:
            assert row["forward_ms"] > 0 and row["predicted"]["forward_ms"] > 0, row
            assert row["ratio"]["forward_ms"] == pytest.approx(
                row["forward_ms"] / row["predicted"]["forward_ms"], rel=0.01)
        for direction in ("forward", "backward"):
            gemm = model["by_part"][direction]["gemm"]
            assert gemm["measured_ms"] > 0 and gemm["predicted_ms"] > 0, gemm
        assert Path(model["plan"]).is_file()


def test_run_checks_profiles_saves_and_resumes(report):
    part = report[0]["parts"]["run"]
    assert part["status"] == "passed", part["reason"]
    runs = part["runs"]
    assert list(runs) == ["check", "resume", "bf16", "compile"]  # the report keeps the order
    check = runs["check"]
    assert check["profile"]["micro_batches"] == ["0", "1", "2", "3"], check["profile"]
    assert check["saved"] == ["step-00000001", "step-00000002", "step-00000003"]
    assert runs["resume"]["losses"] == check["losses"][1:]
    for name in ("bf16", "compile"):  # on a GPU only
        assert runs[name]["status"] == "skipped" and "--cpu" in runs[name]["reason"]
    for run in (check, runs["resume"]):
        assert run["planned_peak_bytes"] > 0 and run["peak_ratio"] > 0, run
        assert run["time_ratio"] > 0 and run["cuda_max_allocated"] is None, run
