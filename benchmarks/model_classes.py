"""Models beyond causal LMs (issue #59), tried as a user would: `python
benchmarks/model_classes.py` runs partition --devices 2 -> solve -> run --check (3 steps) for
every class of tests/models/classes.py (tiny configurations), one row each, and prints how
many pass."""

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "tests" / "models"
sys.path.insert(0, str(MODELS))

import classes  # noqa: E402  (tests/models/classes.py)


def _try(name: str, folder: Path) -> list[str]:
    pyplan = str(Path(sys.executable).with_name("pyplan"))
    shutil.copy(MODELS / "classes.py", folder / "classes.py")
    steps = (("partition", f"classes:{name}", "--data", f"classes:{name}_batch", "--loss",
              f"classes:{name}_loss", "--devices", "2", "--repeats", "1", "-o", "plan.yaml"),
             ("solve", "plan.yaml", "--quiet"),
             ("run", "plan.resolved.yaml", "--nproc-per-node", "2", "--check", "--iterations",
              "3", "--json", "--device", "cpu"))
    cells = []
    for step in steps:
        started = time.perf_counter()
        done = subprocess.run([pyplan, *step], capture_output=True, text=True, cwd=folder,
                              timeout=1800)
        cells.append(f"{time.perf_counter() - started:.0f}")
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error:" in line]
            return cells + [f"{step[0]} failed: {(errors or ['?'])[-1][:110]}"]
    cut = next((line.split(":", 1)[1].strip() for line in
                (folder / "plan.yaml").read_text().splitlines()
                if line.strip().startswith("cut:")), "chain")
    check = json.loads(done.stdout.strip().splitlines()[-1])["check"]
    return cells + [f"{'ok' if check['ok'] else 'CHECK FAILED'} (cut {cut})"]


def main(argv: list[str]) -> int:
    names = argv[0].split(",") if argv else list(classes.NAMES)
    print(f"{'class':<14} {'partition s':>11} {'solve s':>7} {'run s':>5}  result", flush=True)
    passed = 0
    for name in names:
        with tempfile.TemporaryDirectory() as folder:
            cells = _try(name, Path(folder))
        cells += [""] * (4 - len(cells))
        passed += cells[-1].startswith("ok")
        print(f"{name:<14} {cells[0]:>11} {cells[1]:>7} {cells[2]:>5}  {cells[3]}", flush=True)
    print(f"{passed} of {len(names)} pass partition -> solve -> run --check on 2 ranks")
    return 0 if passed == len(names) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
