"""Fault handling: when a rank raises, dies or hangs, every other rank exits non-zero, naming
the failing rank and the instruction it was at.

A rank is alive while its process runs, whatever its main thread computes (a long step,
--check's reference, a checkpoint written, a first compile, a slow batch). So its death is
told by the kernel, not by a deadline: each rank listens on a TCP socket and every other rank
connects to it; when a process ends (SIGKILL, a crash, the OOM killer) the kernel closes its
sockets, and the peers see that at once. A rank that ends after saying so (its state DONE or
EXITING in its heartbeat) has not died.

A watchdog thread per rank uses torchrun's rendezvous store as a side channel (the gloo/NCCL
groups themselves can block forever): it writes a heartbeat with the rank's position every
PERIOD seconds (what "last seen at" names), watches the others', and watches the `failed` key.
The first failure wins that key (compare-and-set). A rank whose heartbeat stops for `timeout`
seconds while its process still holds its connections is declared hung: its process is
stopped, its host is lost, or its interpreter has been held that long by one call. Each rank
starts its watchdog once it has built its stages, so a rank not heard from at all gets a
start-up grace (`startup`, the collectives' own timeout by default) before it counts as dead:
it may still be building (a large model's `.to(cuda)`, weights being read).
torchrun stops the surviving ranks of a node with SIGTERM when one dies; the watchdog sees the
signal through a wakeup fd even while the main thread is blocked inside a collective. A SIGTERM
or SIGUSR1 is also a request to stop after the current step (pyplan.train.stopping):
`stop_signal` says which came, for the main thread to agree on with the others at the step's
end; a second one exits at once.
A user function (the data, the loss: pyplan.run.user_calls) that has not returned for `timeout`
seconds is this rank's fault, named (its first call gets the start-up grace: it may load a
dataset); the others wait for it in a collective, so their heartbeats alone would never tell.

TIMEOUT, the default: since death needs no deadline, the timeout only bounds a hang, and a
false alarm costs the whole run, so it is long: 300 s, past any healthy stall (torchtitan's
training timeout is 100 s, torch's NCCL watchdog's 600 s) and half the collectives' own 600 s,
so that a hang is named here before a collective times out without a culprit.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from pyplan.errors import RunError
from pyplan.run import user_calls
from pyplan.train.stopping import SIGNALS

__all__ = ["TIMEOUT", "Watchdog"]

PERIOD = 0.1
STARTUP = 600.0
TIMEOUT = 300.0
CAUSE = 10.0  # how long a failed transfer waits for its cause (a death shows at once)
RUNNING, TERMINATING, DONE, EXITING = "R", "T", "D", "X"


class Watchdog:
    def __init__(self, rank: int, world: int, timeout: float,
                 position: Callable[[], tuple[int, int]],
                 where: Callable[[int, int, int], str], *, startup: float = STARTUP) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self.startup = max(startup, timeout)
        self.position, self.where = position, where
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               is_master=False, timeout=timedelta(seconds=max(30.0, timeout)))
        self.store = dist.PrefixStore("pyplan/", client)
        self.lock = threading.Lock()  # held by whoever prints the last line of this process
        self.handling = False  # the main thread is reporting a failure itself
        self.state = RUNNING
        self.stop_signal: signal.Signals | None = None
        """The first SIGTERM or SIGUSR1 this rank received: stop after the current step."""
        self.beat = 0
        self.stopping = threading.Event()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.old_handlers = {s: signal.signal(s, lambda *_: None) for s in SIGNALS}
        self.old_fd = signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        self.listener = _listen(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                world)
        host, port = self.listener.getsockname()[:2]
        self.peers: dict[int, socket.socket] = {}  # a connection to each other rank
        self.held: list[socket.socket] = []  # the other ranks' connections to this one
        self.ended: set[int] = set()  # ranks whose connection closed
        self.heartbeat()
        self.store.set(f"live/{rank}", f"{host} {port}")
        self.thread = threading.Thread(target=self._loop, name="pyplan-watchdog", daemon=True)
        self.thread.start()

    # -- called by the main thread

    def fail(self, message: str, *, wait_for_cause: bool, code: int = 1) -> tuple[str, int]:
        """Publish this rank's failure (and the exit code it is worth), unless another rank
        failed first (after a collective or transfer failed, give the watchdogs time to find
        out who). Returns what to report and the exit code: the first failure's."""
        self.handling = True
        if wait_for_cause:
            deadline = time.monotonic() + min(self.timeout, CAUSE) + 3 * PERIOD
            while time.monotonic() < deadline and not self.store.check(["failed"]):
                time.sleep(PERIOD)
        winner = self.publish(message, code)
        deadline = time.monotonic() + min(3.0, self.timeout)
        while time.monotonic() < deadline:  # let the others print their line first
            states = self.states()
            if all(states[r] is None or states[r][3] in (DONE, EXITING)
                   for r in range(self.world) if r != self.rank):
                break
            time.sleep(PERIOD)
        self.close(EXITING)
        return _split(winner)

    def close(self, state: str = DONE) -> None:
        if self.stopping.is_set():  # closed already (after a failure)
            return
        self.state = state
        self.stopping.set()
        self.thread.join()
        self.heartbeat()
        signal.set_wakeup_fd(self.old_fd)
        if state != EXITING:  # a failing rank stays deaf to the launcher's SIGTERM until it
            for number, handler in self.old_handlers.items():  # has printed its line, exited
                signal.signal(number, handler)
        os.close(self.wake_r)
        os.close(self.wake_w)
        for connection in (self.listener, *self.peers.values(), *self.held):
            connection.close()

    # -- the watchdog thread

    def heartbeat(self) -> None:
        self.beat += 1
        iteration, index = self.position()
        self.store.set(f"hb/{self.rank}", f"{self.beat} {iteration} {index} {self.state}")

    def states(self) -> list[tuple[str, int, int, str] | None]:
        keys = [f"hb/{r}" for r in range(self.world)]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        return [None if v is None else tuple(_parse(v.decode())) for v in values]

    def publish(self, message: str, code: int = 1) -> str:
        """The first failure, as stored: "CODE MESSAGE" (_split reads it)."""
        return self.store.compare_set("failed", "", f"{code} {message}").decode()

    def _loop(self) -> None:
        seen = {r: (None, time.monotonic()) for r in range(self.world) if r != self.rank}
        while not self.stopping.is_set():
            watched = {c.fileno(): r for r, c in self.peers.items() if r not in self.ended}
            ready, _, _ = select.select([self.wake_r, self.listener, *watched], [], [], PERIOD)
            self._accept(self.listener in ready)
            for r in (watched[f] for f in ready if f in watched):
                if _closed(self.peers[r]):
                    self.ended.add(r)
            for number in os.read(self.wake_r, 64) if self.wake_r in ready else b"":
                if number not in SIGNALS:
                    continue
                if self.stop_signal is not None:  # the second: now, without a save
                    self._exit(f"stopped at once by a second {signal.Signals(number).name} "
                               "(the checkpoints saved before are intact)", 128 + number)
                self.stop_signal = signal.Signals(number)
                self.state = TERMINATING
            if self.stopping.is_set():
                break
            try:
                self.heartbeat()
                self._connect()
                self._watch(seen)
            except Exception as exc:  # the store's host is gone: nobody left to coordinate with
                self._exit(f"lost torchrun's rendezvous store ({type(exc).__name__}: {exc})")

    def _watch(self, seen) -> None:
        if self.store.check(["failed"]):
            self._exit(*_split(self.store.get("failed").decode()))
            return
        user = user_calls.now()
        limit = self.startup if user is not None and user.first else self.timeout
        if user is not None and time.monotonic() - user.since > limit:
            hangs = f"rank {self.rank}: {user.name()} has not returned for {limit:g} s"
            if self.stop_signal is None:
                self._exit(*_split(self.publish(f"{hangs} (it hangs, or needs longer than "
                                                "--fault-timeout)")))
            else:  # asked to stop after a step that cannot end: stop as a second signal does
                self._exit(*_split(self.publish(
                    f"{hangs}, so the step asked to stop by {self.stop_signal.name} cannot end; "
                    "stopped without a save (the checkpoints saved before are intact)",
                    128 + self.stop_signal)))
            return
        states, now = self.states(), time.monotonic()
        for r in seen:
            if states[r] is not None and states[r][0] != seen[r][0]:
                seen[r] = (states[r][0], now)
            if states[r] is not None and states[r][3] in (DONE, EXITING):
                continue
            if r in self.ended and self.store.check(["failed"]):  # it said why, then ended
                self._exit(*_split(self.store.get("failed").decode()))
                return
            if r in self.ended:
                last = _parse(self.store.get(f"hb/{r}").decode())  # written before it ended
                if last[3] in (DONE, EXITING):
                    continue
                at = self.where(r, *last[1:3])
                self._exit(*_split(self.publish(
                    f"rank {r} died (its process ended without a word: killed, or crashed); "
                    f"last seen at {at}")))
                return
            if states[r] is None and now - seen[r][1] > self.startup:
                self._exit(*_split(self.publish(
                    f"rank {r} did not start within {self.startup:g} s (its process died or "
                    "hangs while building its stages)")))
                return
            if states[r] is not None and now - seen[r][1] > self.timeout:
                at = self.where(r, *states[r][1:3])
                self._exit(*_split(self.publish(
                    f"rank {r} stopped responding for {self.timeout:g} s (its process is "
                    f"stopped or hangs, or its host is lost); last seen at {at}")))
                return

    def _connect(self) -> None:
        """Connect to each rank that listens by now (once: the connection lasts the run)."""
        for r in range(self.world):
            if r == self.rank or r in self.peers or not self.store.check([f"live/{r}"]):
                continue
            host, port = self.store.get(f"live/{r}").decode().split(" ")
            try:
                self.peers[r] = socket.create_connection((host, int(port)), timeout=PERIOD * 10)
            except OSError:  # refused: it listened, and its process has ended since
                self.peers[r] = socket.socket()
                self.ended.add(r)

    def _accept(self, ready: bool) -> None:
        while ready:
            try:
                self.held.append(self.listener.accept()[0])
            except BlockingIOError:
                return

    def _exit(self, message: str, code: int = 1) -> None:
        if self.handling or not self.lock.acquire(blocking=False):
            return
        self.state = EXITING
        try:
            self.heartbeat()
        except Exception:  # noqa: BLE001 - leaving anyway; the message matters more
            pass
        sys.stderr.write(f"{RunError(f'rank {self.rank} stops: {message}')}\n")  # one write
        sys.stderr.flush()
        os._exit(code)  # the main thread may be blocked inside a collective that never returns


def _listen(address: str, port: int, world: int) -> socket.socket:
    """A listening socket on the interface this host reaches torchrun's store through (the
    one the other ranks reach it by)."""
    family, kind, _, _, target = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:  # (a UDP "connection" sends nothing)
        probe.connect(target)
        host = probe.getsockname()[0]
    listener = socket.create_server((host, 0), family=family, backlog=max(world, 16))
    listener.setblocking(False)
    return listener


def _closed(connection: socket.socket) -> bool:
    """Whether a readable connection has ended (the other side never sends anything)."""
    try:
        return connection.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def _split(stored: str) -> tuple[str, int]:
    """(message, exit code) of a failure as publish stored it."""
    code, _, message = stored.partition(" ")
    return message, int(code)


def _parse(value: str):
    beat, iteration, index, state = value.split(" ")
    return beat, int(iteration), int(index), state
