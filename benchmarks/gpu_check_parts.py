"""The parts of benchmarks/gpu_check.py, each run in a process of its own (`gpu_check.py --part
NAME`), returning {"status": passed | failed | skipped, "reason": ..., figures...}."""

from __future__ import annotations

import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_check_common import (CARRY_LIMIT, DEPENDENCIES, GPU_TESTS, PLATFORMS, ROOT, HERE,
                       TEST_TOOLS, Log, _write_json, run_command)

CLUSTER = HERE / "h200.yaml"


def _figure(value: float, digits: int = 3) -> float:
    return float(f"{value:.{digits}g}")


def _ratio(measured, predicted) -> float | None:
    if measured is None or predicted is None or predicted <= 0:
        return None
    return _figure(measured / predicted)


def _env() -> dict:
    """The children's: gpu_check_models importable."""
    return {**os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def _so_far(out: Path, part: str, doing: str, **figures) -> None:
    """What the part found so far, as the report will say should its box run out now."""
    _write_json(out / "parts" / f"{part}.json", {"status": "failed", "reason": "timed out "
                                                  f"during {doing}", **figures})


def _last(text: str | None) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


class Clock:
    """The seconds left of the part's box."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, reserve: float = 0.0) -> float:
        return max(self.end - time.monotonic() - reserve, 1.0)


# ---------------------------------------------------------------- 1. install

def _wheels(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.whl")) if folder.is_dir() else []


def install(args, out: Path) -> dict:
    log, clock = Log(out / "gpu_check.log"), Clock(args.seconds)
    wheels = _wheels(Path(args.wheels))
    size = sum(p.stat().st_size for p in wheels)
    figures = {"wheels": len(wheels), "wheels_mib": _figure(size / 2**20),
               "within_carry": size <= CARRY_LIMIT}
    if not wheels:
        reason = (f"no wheels in {args.wheels}: python benchmarks/gpu_check.py "
                  "--fetch-wheels (here, with a network), then carry the folder")
        return {"status": "skipped" if args.cpu else "failed", "reason": reason, **figures}
    if args.cpu:
        # Here: the folder must resolve pyplan's dependencies for the GPU machine's Python.
        target = Path(tempfile.mkdtemp(prefix="gpu-check-target-"))
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                   "--no-index", "--find-links", args.wheels, "--only-binary=:all:",
                   "--python-version", "3.12", "--implementation", "cp", "--target", target,
                   "--quiet", "--report", out / "install-resolved.json"]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        done = run_command(command + list(DEPENDENCIES + TEST_TOOLS), log, clock.left())
        if done is None or done.returncode:
            return {"status": "failed", "reason": "the wheels do not resolve for Python 3.12: "
                    + (_last(done.stdout) if done else "timed out"), **figures}
        resolved = json.loads((out / "install-resolved.json").read_text())["install"]
        names = sorted(f"{r['metadata']['name']}=={r['metadata']['version']}" for r in resolved)
        return {"status": "passed", "reason": "dry run (--cpu): the wheels resolve for Python "
                "3.12 on manylinux; this Python's pyplan runs the other parts",
                "resolved": names, **figures}
    venv = Path(tempfile.mkdtemp(prefix="gpu-check-venv-")) / "venv"
    steps, python = {}, str(venv / "bin" / "python")
    probe = ("import json, torch; print(json.dumps({'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0) if "
             "torch.cuda.is_available() else None}))")
    before = run_command([sys.executable, "-c", probe], log, clock.left())
    build_env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 4)}
    t0 = time.monotonic()
    made = run_command([sys.executable, "-m", "venv", "--system-site-packages", venv], log,
                       clock.left(60))
    steps["venv"] = round(time.monotonic() - t0, 1)
    where = "a virtualenv over this Python's packages"
    if made is None or made.returncode:  # (a Python without ensurepip): into this one
        python, where = sys.executable, "this Python (no virtualenv: " + (
            _last(made.stdout) if made else "timed out") + ")"
    for name, command, env in (
            ("dependencies", [python, "-m", "pip", "install", "--no-index", "--find-links",
                              args.wheels, *DEPENDENCIES, *TEST_TOOLS], None),
            ("pyplan", [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                        ROOT], build_env)):
        t0 = time.monotonic()
        done = run_command(command, log, clock.left(10), env=env)
        steps[name] = round(time.monotonic() - t0, 1)
        if done is None or done.returncode:
            return {"status": "failed", "reason": f"{name}: " + (_last(done.stdout) if done
                                                                else "timed out"),
                    "step_seconds": steps, **figures}
    after = run_command([python, "-c", probe.replace("import json, torch", "import json, torch, "
                                                     "z3, jsonschema, pyplan, pyplan._core")],
                        log, clock.left())
    if after is None or after.returncode:
        return {"status": "failed", "reason": "import: " + (_last(after.stdout) if after
                                                           else "timed out"), **figures}
    seen, was = json.loads(after.stdout.splitlines()[-1]), json.loads(
        before.stdout.splitlines()[-1]) if before and not before.returncode else {}
    if was and seen["torch"] != was["torch"]:
        return {"status": "failed", "reason": f"torch changed: {was['torch']} -> "
                f"{seen['torch']}", **figures}
    return {"status": "passed", "reason": f"pyplan built against torch {seen['torch']} into "
            f"{where}", "python": python, "step_seconds": steps, **seen, **figures}


# ---------------------------------------------------------------- 2. the GPU suite

def suite(args, out: Path) -> dict:
    log, clock = Log(out / "gpu_check.log"), Clock(args.seconds)
    # Without a GPU, test_cuda_paths.py and test_gpu_review.py are CPU tests of the normal
    # suite (minutes here): --cpu only shows that the GPU file collects and skips.
    tests = GPU_TESTS[:1] if args.cpu else GPU_TESTS
    junit = out / "suite.xml"
    junit.unlink(missing_ok=True)
    # On a GPU, with pytest-xdist (carried in the wheels), 6 workers side by side: each case
    # is one rank (or a CPU test), and one GPU holds several such processes
    workers = []
    if not args.cpu:
        probe = run_command([sys.executable, "-c", "import xdist"], log, clock.left())
        workers = ["-n", "6", "--dist", "load"] if probe and not probe.returncode else []
    # From tests/: `python -m pytest` puts its folder first on the path, and the root's would
    # put the source tree's pyplan/ (without its C++ core) before the installed one
    done = run_command([sys.executable, "-m", "pytest", "-o", "addopts=", "-p",
                        "no:cacheprovider", "-q", "-rfEs", f"--junitxml={junit}", *workers,
                        *(str(ROOT / t) for t in tests)], log, clock.left(3), env=_env(),
                       cwd=ROOT / "tests", grace=10)
    if not junit.exists():
        return {"status": "failed", "reason": "pytest " + ("timed out" if done is None else
                                                          _last(done.stdout)),
                "tests": list(tests)}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures, skips = [], {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            counts["failed"] += 1
            failures.append(f"{name}: {(bad.get('message') or '').splitlines()[0][:300]}"
                            if bad.get("message") else name)
        elif skipped is not None:
            counts["skipped"] += 1
            reason = (skipped.get("message") or "").removeprefix("Skipped: ")
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    figures = {"tests": list(tests), "workers": int(workers[1]) if workers else 1, **counts,
               "failures": failures, "skip_reasons": skips}
    if done is None:
        return {"status": "failed", "reason": "pytest stopped at the end of its box after "
                f"{sum(counts.values())} tests", **figures}
    if counts["failed"] or done.returncode not in (0, 5):
        return {"status": "failed", "reason": f"{counts['failed']} failed", **figures}
    if not counts["passed"]:
        return {"status": "skipped", "reason": f"all {counts['skipped']} skipped: " +
                "; ".join(skips) if skips else "no tests", **figures}
    return {"status": "passed", "reason": f"{counts['passed']} passed, {counts['skipped']} "
            "skipped", **figures}


# ---------------------------------------------------------------- 3. partition vs cost model

# The cost model's entry points, in one place so they can be re-pointed: the cluster file, the
# model's shape from its config, and per-piece costs (forward, input gradient, weight gradient,
# each by part) and activations of a layer, the embedding and the head.
def cost_model(hf_config, micro_batch: int, sequence: int, dtype: str, flash: bool):
    from pyplan.cluster.costs import Costs
    from pyplan.cluster.hardware import load_cluster
    from pyplan.cluster.layout import Batch, Layout
    from pyplan.cluster.memory import activations, ends
    from pyplan.cluster.model import from_config

    model = from_config(hf_config.to_dict())
    layout = Layout(tp=1, pp=1, dp=1, micro_batch=micro_batch)
    batch = Batch(global_batch=micro_batch, sequence=sequence, dtype=dtype,
                  flash_attention=flash)
    costs = Costs(model, load_cluster(str(CLUSTER)), layout, batch)
    embedding, head = ends(model, layout, batch)
    layer = activations(model, layout, batch, False)

    def pieces(kind: str) -> dict:
        """{forward, input, weight: {part: ms}} and the activation bytes of one `kind`."""
        got = {"embedding": costs.embedding, "layer": lambda: costs.layer(False),
               "head": costs.head}[kind]()
        held = {"embedding": embedding, "layer": layer, "head": head}[kind].held
        return {"forward": {k: v * 1e3 for k, v in got.forward.parts.items()},
                "input": {k: v * 1e3 for k, v in got.backward.parts.items()},
                "weight": {k: v * 1e3 for k, v in got.weight.parts.items()},
                "activation_bytes": held}
    return pieces


def _kinds(names: list[str]) -> list[str]:
    """embedding, layer or head for each unit: the numbered ones are the layers."""
    layers = [i for i, n in enumerate(names) if re.search(r"\.\d+$", n)]
    first, last = (layers[0], layers[-1]) if layers else (len(names), -1)
    return ["embedding" if i < first else "head" if i > last else "layer"
            for i in range(len(names))]


def _kernel_part(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "attention", "attn", "sdpa", "sdp_")):
        return "attention"
    if any(k in low for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm",
                              "aten::addmm", "aten::bmm", "aten::baddbmm")):
        return "gemm"
    return "elementwise"


def _profiled_parts(prof, cuda: bool) -> dict:
    """Milliseconds of a profiled region by part: CUDA kernels on a GPU, aten ops' own CPU
    time on the CPU."""
    parts = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0}
    if cuda:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            events = json.loads(Path(f.name).read_text())["traceEvents"]
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                parts[_kernel_part(e["name"])] += e.get("dur", 0) / 1e3
    else:
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                parts[_kernel_part(e.key)] += e.self_cpu_time_total / 1e3
    return parts


def _iteration_parts(name: str, device: str, dtype: str) -> dict:
    """One micro-batch's forward (with the loss) and backward, profiled apart after two
    warm-up iterations: the time of each by part."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import gpu_check_models as models

    cuda = device == "cuda"
    model = getattr(models, name)().to(device)
    inputs, labels = (t[:models.MODELS[models.size()][name]["micro_batch"]].to(device)
                      for t in models.batch_of(name, 0))
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def forward():
        with autocast:
            return models.loss(model(input_ids=inputs).logits, labels)
    for _ in range(2):
        forward().backward()
    model.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        value = forward()
        sync()
    forward_parts = _profiled_parts(prof, cuda)
    with profile(activities=activities) as prof:
        value.backward()
        sync()
    backward_parts = _profiled_parts(prof, cuda)
    del model, value
    return {"forward": forward_parts, "backward": backward_parts}


def _add(into: dict, parts: dict) -> None:
    for k, v in parts.items():
        into[k] = into.get(k, 0.0) + v


def _one_model(name: str, out: Path, device: str, dtype: str) -> dict:
    import pyplan

    import gpu_check_models as models

    spec = models.MODELS[models.size()][name]
    t0 = time.monotonic()
    found = pyplan.partition_model(
        f"gpu_check_models:{name}", f"gpu_check_models:{name}_batch", "gpu_check_models:loss",
        devices=1, output=out / f"{name}.yaml", shape="interleaved", chunks=2,
        micro_batches=models.MICRO_BATCHES, split_backward=True,
        repeats=1 if device == "cpu" else 3, device=device,
        dtype=dtype)
    (out / f"{name}.yaml").write_text(found.plans[0].text)
    measured_seconds = time.monotonic() - t0
    pieces = cost_model(models.config(name), spec["micro_batch"], spec["sequence"],
                        "bf16" if dtype == "bf16" else "fp32", flash=device == "cuda")
    units, kinds = found.units, _kinds([u.name for u in found.units])
    rows, total = [], {"forward": {}, "backward": {}}
    groups: dict = {}
    for unit, kind in zip(units, kinds):  # the ends are each one piece of the cost model
        key = unit.name if kind == "layer" else kind
        group = groups.setdefault(key, {"kind": kind, "units": [], "forward_ms": 0.0,
                                        "input_grad_ms": 0.0, "weight_grad_ms": 0.0,
                                        "activation_bytes": 0, "peak_bytes": 0})
        group["units"].append(unit.name)
        group["forward_ms"] += unit.forward_ms
        group["input_grad_ms"] += unit.input_grad_ms or 0.0
        group["weight_grad_ms"] += unit.weight_grad_ms
        group["activation_bytes"] += unit.activation_bytes
        group["peak_bytes"] = max(group["peak_bytes"], unit.forward_peak_bytes,
                                  unit.backward_peak_bytes)
    for key, group in groups.items():
        p = pieces(group["kind"])
        predicted = {"forward_ms": sum(p["forward"].values()),
                     "input_grad_ms": sum(p["input"].values()),
                     "weight_grad_ms": sum(p["weight"].values()),
                     "activation_bytes": p["activation_bytes"]}
        _add(total["forward"], p["forward"])
        _add(total["backward"], p["input"])
        _add(total["backward"], p["weight"])
        rows.append({"name": key, **{k: _figure(v) if isinstance(v, float) else v
                                     for k, v in group.items()},
                     "predicted": {k: _figure(v) for k, v in predicted.items()},
                     "ratio": {k: _ratio(group[k], predicted[k]) for k in predicted}})
    measured = _iteration_parts(name, device, dtype)
    by_part = {}
    for direction in ("forward", "backward"):
        model_parts = total[direction]
        predicted = {"gemm": model_parts.get("gemm", 0.0),
                     "attention": model_parts.get("attention", 0.0),
                     # the kernels' fixed costs are the small element-wise kernels' time
                     "elementwise": model_parts.get("elementwise", 0.0) +
                     model_parts.get("kernels", 0.0)}
        by_part[direction] = {part: {"measured_ms": _figure(measured[direction][part]),
                                     "predicted_ms": _figure(predicted[part]),
                                     "ratio": _ratio(measured[direction][part], predicted[part])}
                              for part in predicted}
        # what the model counts beside the kernels (host time, collectives: none at tp 1)
        by_part[direction]["other_predicted_ms"] = _figure(
            sum(model_parts.values()) - sum(predicted.values()))
    return {"status": "passed", "units": len(units), "sequence": spec["sequence"],
            "micro_batch": spec["micro_batch"], "dtype": dtype,
            "measure_seconds": round(measured_seconds, 1), "layers": rows,
            "by_part": by_part, "plan": str(out / f"{name}.yaml")}


def _print_model(name: str, result: dict) -> None:
    print(f"{name}: measured / predicted on {CLUSTER.name}")
    for row in result["layers"]:
        r = row["ratio"]
        print(f"  {row['name']:24} F {row['forward_ms']:9.3f} ms x{r['forward_ms']}  "
              f"B {row['input_grad_ms']:9.3f} ms x{r['input_grad_ms']}  "
              f"W {row['weight_grad_ms']:9.3f} ms x{r['weight_grad_ms']}  "
              f"act {row['activation_bytes'] / 2**20:9.1f} MiB x{r['activation_bytes']}")
    for direction, parts in result["by_part"].items():
        print(f"  {direction:8} " + "  ".join(
            f"{part} {v['measured_ms']:.3f}/{v['predicted_ms']:.3f} ms x{v['ratio']}"
            for part, v in parts.items() if isinstance(v, dict)))


def partition(args, out: Path) -> dict:
    device, dtype = ("cpu", "fp32") if args.cpu else ("cuda", "bf16")
    work = out / "partition"
    work.mkdir(exist_ok=True)
    results = {}
    for name in ("llama", "gpt2"):
        _so_far(out, "partition", name, models=results)
        try:
            results[name] = _one_model(name, work, device, dtype)
            _print_model(name, results[name])
        except Exception as exc:  # noqa: BLE001 - each model a failure of its own (OOM too)
            oom = type(exc).__name__ == "OutOfMemoryError"
            results[name] = {"status": "failed", "reason": ("out of memory: " if oom else
                             f"{type(exc).__name__}: ") + str(exc).splitlines()[0][:300]}
            print(f"{name}: {results[name]['reason']}", flush=True)
        finally:
            gc.collect()
            if device == "cuda":
                import torch

                torch.cuda.empty_cache()
    failed = [n for n, r in results.items() if r["status"] != "passed"]
    return {"status": "failed" if failed else "passed",
            "reason": f"failed: {', '.join(failed)}" if failed else
            f"{device}, {dtype}, against {CLUSTER.name}", "cluster": str(CLUSTER),
            "models": results}


# ---------------------------------------------------------------- 4. pyplan run on one GPU

def _trace_blocks(folder: Path) -> dict:
    """What the first trace of `folder` holds: its CUDA kernels, the blocks' ranges
    (NAME@MICROBATCH)."""
    traces = sorted(folder.glob("rank0-step*.json"))
    if not traces:
        return {"trace": None, "kernels": 0, "blocks": []}
    events = [e for e in json.loads(traces[0].read_text())["traceEvents"] if e.get("ph") == "X"]
    blocks = sorted({e["name"] for e in events if "@" in e["name"] and " " not in e["name"]})
    return {"trace": traces[0].name, "kernels": sum(e.get("cat") == "kernel" for e in events),
            "blocks": blocks}


def _pyplan_run(name: str, plan: Path, work: Path, device: str, log: Log, seconds: float,
                *extra: str) -> dict:
    command = [str(Path(sys.executable).with_name("pyplan")), "run", plan.name,
               "--nproc-per-node", "1", "--device", device, "--json", *extra]
    t0 = time.monotonic()
    done = run_command(command, log, seconds, env=_env(), cwd=work)
    wall = round(time.monotonic() - t0, 1)
    if done is None:
        return {"status": "failed", "reason": "timed out", "wall_seconds": wall}
    if done.returncode:
        return {"status": "failed", "reason": f"exit {done.returncode}: {_last(done.stdout)}",
                "wall_seconds": wall}
    report = json.loads([line for line in done.stdout.splitlines()
                         if line.startswith("{")][-1])
    memory = report["rank_memory"][0]
    cuda_peak = (report.get("cuda_max_allocated") or [None])[0]
    figures = {"wall_seconds": wall, "losses": report["losses"],
               "median_seconds": _figure(report["median_seconds"]),
               "predicted_seconds": _figure(report["predicted_seconds"]),
               "time_ratio": _ratio(report["median_seconds"], report["predicted_seconds"]),
               "peak_bytes": memory["peak_bytes"], "planned_peak_bytes":
               memory["planned_peak_bytes"], "cuda_max_allocated": cuda_peak,
               # the census's peak (the plan's tensors) and CUDA's (everything allocated)
               "peak_ratio": _ratio(memory["peak_bytes"], memory["planned_peak_bytes"]),
               "cuda_ratio": _ratio(cuda_peak, memory["planned_peak_bytes"]),
               "compiled_graphs": memory.get("compiled_graphs"),
               "dtype": report["dtype"], "params": report["params"],
               "compile": report["compile"], "checkpoint": report.get("checkpoint")}
    check = report.get("check")
    if check is not None:
        figures["check"] = check["message"][:300]
        if not check["ok"]:
            return {"status": "failed", "reason": "--check: " + check["message"][:300],
                    **figures}
    return {"status": "passed", **figures}


def run(args, out: Path) -> dict:
    log, clock = Log(out / "gpu_check.log"), Clock(args.seconds)
    device = "cpu" if args.cpu else "cuda"
    work = out / "run"
    work.mkdir(exist_ok=True)
    pyplan = str(Path(sys.executable).with_name("pyplan"))
    backend = "inductor"
    made = run_command([pyplan, "partition", "gpu_check_models:run", "--data",
                        "gpu_check_models:run_batch", "--loss", "gpu_check_models:loss",
                        "--devices", "1", "--shape", "interleaved", "--chunks", "2",
                        "--micro-batches", "4", "--device", device, "--repeats",
                        "1" if args.cpu else "3",
                        "-o", "run.yaml"], log, clock.left(20), env=_env(), cwd=work)
    if made is None or made.returncode:
        return {"status": "failed", "reason": "partition: " + (_last(made.stdout) if made else
                                                              "timed out")}
    solved = run_command([pyplan, "solve", "run.yaml", "--quiet"], log, clock.left(20),
                         env=_env(), cwd=work)
    if solved is None or solved.returncode:
        return {"status": "failed", "reason": "solve: " + (_last(solved.stdout) if solved else
                                                          "timed out")}
    plan = work / "run.resolved.yaml"
    runs = {}
    for name, extra in (
            ("check", ("--check", "--iterations", "3", "--profile", "prof", "--save", "ck",
                       "--save-every", "1", "--async-save")),
            ("resume", ("--resume", "ck/step-00000001", "--iterations", "2")),
            ("bf16", ("--dtype", "bf16", "--params", "bf16", "--check")),
            ("compile", ("--compile", backend, "--check", "--iterations", "4",
                         "--check-steps", "4"))):
        if args.cpu and name in ("bf16", "compile"):  # a minute more on a CPU shared by all
            runs[name] = {"status": "skipped", "reason": "--cpu: on a GPU only (tests/"
                          "test_gpu_review.py trains bf16 parameters and compiled blocks on "
                          "the CPU)", "flags": list(extra)}
            continue
        _so_far(out, "run", f"the {name} run", compile_backend=backend, runs=runs)
        runs[name] = _pyplan_run(name, plan, work, device, log, clock.left(), *extra)
    if runs["check"]["status"] == "passed":
        blocks = _trace_blocks(work / "prof")
        micro = sorted({b.split("@")[1] for b in blocks["blocks"]})
        runs["check"]["profile"] = {**blocks, "micro_batches": micro}
        if micro != [str(m) for m in range(4)] or (device == "cuda" and not blocks["kernels"]):
            runs["check"]["status"] = "failed"
            runs["check"]["reason"] = (f"--profile: the trace {blocks['trace']} has "
                                       f"{blocks['kernels']} kernels and blocks of "
                                       f"micro-batches {micro}, not 0..3")
        saved = sorted(p.name for p in (work / "ck").glob("step-*"))
        runs["check"]["saved"] = saved
    if runs["resume"]["status"] == "passed" and runs["check"]["status"] == "passed":
        want, got = runs["check"]["losses"][1:], runs["resume"]["losses"]
        runs["resume"]["losses_match"] = got == want
        if got != want:
            runs["resume"].update(status="failed", reason=f"resumed losses {got} differ from "
                                  f"the run's {want}")
    if runs["compile"]["status"] == "passed" and not runs["compile"].get("compiled_graphs"):
        runs["compile"].update(status="failed", reason="no compiled graphs")
    failed = [n for n, r in runs.items() if r["status"] == "failed"]
    ran = [n for n, r in runs.items() if r["status"] == "passed"]
    reason = "; ".join(f"{n}: {runs[n].get('reason', '')}" for n in failed)
    return {"status": "failed" if failed else "passed",
            "reason": reason or f"{', '.join(ran)}: 2 stages on one {device}",
            "compile_backend": backend, "runs": runs}


PARTS = {"install": install, "suite": suite, "partition": partition, "run": run}
