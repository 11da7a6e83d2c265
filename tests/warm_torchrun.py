"""torchrun for the tests' own scripts, with warm workers.

`torchrun(script, *args, nproc=N, cwd=...)` runs `python tests/warm_torchrun.py
--nproc-per-node N SCRIPT ARGS...`: torch's launcher (torch.distributed.run, any of its options
before SCRIPT) with every worker forked from pyplan's forkserver (pyplan.cli.launch, as `pyplan
run --nproc-per-node` does), which has imported torch, torch._dynamo and pyplan's runtime once,
instead of a new interpreter per worker importing them again (about 2 s of CPU each). Each
worker runs SCRIPT through tests/warm_worker.py as `python SCRIPT ARGS...` would (its folder
first on sys.path, `__name__ == "__main__"`).

A script whose subject is the start of a process (which modules are imported first, say) still
needs a new interpreter: plain `python -m torch.distributed.run`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "warm_worker.py")


def torchrun(script, *args, nproc: int, cwd, timeout: float = 300, env=None,
             options: tuple = ("--standalone",)) -> subprocess.CompletedProcess:
    """Run `script` with `args` on `nproc` warm workers; the finished process (text output)."""
    return subprocess.run([sys.executable, __file__, *options, "--nproc-per-node", str(nproc),
                           str(script), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from pyplan.cli.launch import forkserver

    args = get_args_parser().parse_args(argv)
    script = os.path.abspath(args.training_script)
    args.training_script, args.run_path, args.start_method = WORKER, True, "forkserver"
    args.training_script_args = [script, *args.training_script_args]
    with forkserver(int(args.nproc_per_node)):
        try:
            run(args)
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            print(f"warm_torchrun: rank {rank} failed first (exit code {failure.exitcode})",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing left to clean up: skip torch's teardown
