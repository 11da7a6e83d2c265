"""The fault watchdog (pyplan.train.faults) tells a slow rank from a dead or hung one: a rank is
alive while its process runs, whatever it computes (steps longer than --fault-timeout, one
call that holds the interpreter past the old 10 s default), a rank that dies is named at once
(its connections close), one whose heartbeat stops while its process lives is named after
--fault-timeout. (A hung data function: tests/test_user_code.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from test_checkpoints import launch, solved

SLOW = """
import ctypes
import os
import time

from torch import nn

from longrun import batch, loss  # noqa: F401

HOLD, SLEEP = (float(x) for x in os.environ["SLOW"].split(","))


class Slow(nn.Module):
    # Rank 1's first forward holds the interpreter for HOLD s in one C call (PyDLL keeps the
    # GIL, as a large pickle or an extension's loop does); each of its forwards sleeps SLEEP s.
    calls = 0

    def forward(self, x):
        if os.environ["RANK"] == "1":
            Slow.calls += 1
            if Slow.calls == 1 and HOLD:
                ctypes.PyDLL(None).sleep(int(HOLD))
            time.sleep(SLEEP)
        return x


def model():
    return nn.Sequential(nn.Linear(8, 16), Slow(), nn.Tanh(), nn.Linear(16, 4))
"""


@pytest.mark.torchrun
@pytest.mark.parametrize("slow, args", [
    ("12,0", ()),  # the interpreter held for 12 s, with the defaults (killed at 10 s before)
    pytest.param("0,3", ("--fault-timeout", "2"), marks=pytest.mark.slow),  # a 12 s step (4
    # micro-batches of 3 s) and a 2 s timeout: the heartbeat does not wait for the step
])
def test_a_slow_rank_is_alive(tmp_path, slow, args):
    (tmp_path / "slow.py").write_text(SLOW)
    solved(tmp_path, "two", [["0"], ["1", "2", "3"]], factory="slow:model")
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--iterations", "1", *args,
                            env={"SLOW": slow})
    assert code == 0, err
    assert "step 1:" in out


@pytest.mark.torchrun
def test_a_killed_rank_is_named_at_once_whatever_the_timeout(tmp_path):
    solved(tmp_path, "two", [["0"], ["1", "2", "3", "4", "5"]])
    started = time.monotonic()
    code, _, err = launch(tmp_path, "two.resolved.yaml", 2, "--iterations", "3",
                          "--fail-at", "1:3:kill", "--fault-timeout", "1000")
    assert code != 0
    assert ("error: rank 0 stops: rank 1 died (its process ended without a word: killed, or "
            "crashed); last seen at instruction 3 of iteration 0 (compute stage1@0)") in err, err
    assert time.monotonic() - started < 300  # launch's own limit; the timeout never came


PEER = """\
    import os
    import socket
    import sys
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from pyplan.train.faults import Watchdog

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    store = dist.PrefixStore("pyplan/", dist.TCPStore(
        "127.0.0.1", int(sys.argv[1]), is_master=True, timeout=timedelta(seconds=30)))
    listener = socket.create_server(("127.0.0.1", 0))  # rank 1, played here
    store.set("hb/1", "1 0 5 R")
    store.set("live/1", f"127.0.0.1 {listener.getsockname()[1]}")
    dog = Watchdog(0, 2, 60.0, lambda: (0, 0), lambda r, i, x: f"instruction {x}")
    held, _ = listener.accept()
    print("connected", flush=True)
    if sys.argv[2] == "done":  # it says it is done, then ends
        store.set("hb/1", "2 0 5 D")
        time.sleep(0.5)
    held.close()
    listener.close()
    time.sleep(3)
    print("alive", flush=True)
    dog.close()
"""


@pytest.mark.parametrize("how", ["dies", "done"])
def test_a_connection_that_closes_is_a_death_unless_the_rank_said_it_was_done(tmp_path, how):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "peer.py").write_text(textwrap.dedent(PEER))
    result = subprocess.run([sys.executable, "peer.py", str(port), how], capture_output=True,
                            text=True, cwd=tmp_path, timeout=120)
    if how == "done":
        assert (result.returncode, result.stdout.split()) == (0, ["connected", "alive"]), \
            result.stderr
    else:  # within the 3 s, not after the 60 s timeout
        assert (result.returncode, result.stdout.split()) == (1, ["connected"]), result.stderr
        assert result.stderr.strip() == (
            "error: rank 0 stops: rank 1 died (its process ended without a word: killed, or "
            "crashed); last seen at instruction 5")
