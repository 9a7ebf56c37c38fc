"""Starting torch.distributed: parlay's own gloo processes on one machine, or under torchrun.

``spawn(fn, world_size, *args)`` starts the processes, initialises torch.distributed (gloo) in
each, calls ``fn(rank, *args)`` and returns the per-rank results. It never waits forever and never
leaves a rank behind:

- every process group (the default one, the DeviceMesh's, parlay's own) waits at most
  ``timeout_s`` in a collective (``collective_timeout()`` in a rank);
- each rank beats a heartbeat into shared memory; a rank whose heartbeat is older than
  ``timeout_s`` (stopped with SIGSTOP, frozen) ends the run, named, and when a collective times
  out the rank that made no progress for longest is named, not the one that waited for it;
- a rank that raises or dies ends the run naming it (a rank killed by a signal: the signal);
- the launcher kills every rank with SIGKILL on any exit (a stopped process ignores SIGTERM), and
  ranks die with the launcher (``PR_SET_PDEATHSIG`` on Linux, and a parent watchdog elsewhere),
  so killing the launcher leaves no rank training.

Under ``torchrun`` (one node or many), call ``init_from_env()`` first: NCCL when CUDA is there,
gloo otherwise, each rank on its local GPU, with the same collective timeout.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

from ...core.session import MAIN_GUARD, RunFailure

__all__ = ["spawn", "init_from_env", "RankFailure", "collective_timeout", "mark_progress", "stop_all"]

HEARTBEAT_S = 0.5  # how often a rank's watchdog thread beats
_TIMED_OUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
_PEER_LOST = re.compile(r"timed? ?out|timeout|connection|closed|reset by peer|broken pipe", re.IGNORECASE)


class RankFailure(RunFailure):
    """A rank raised, died, stopped or timed out."""


# -- inside a rank -------------------------------------------------------------------------------

_rank_state: dict[str, Any] = {"timeout": datetime.timedelta(seconds=600), "progress": None, "rank": 0}


def collective_timeout() -> datetime.timedelta:
    """The run's bound on one collective, for every process group this rank makes."""
    return _rank_state["timeout"]


def mark_progress() -> None:
    """Record that this rank reached a collective or a step (the launcher names the rank whose
    last mark is oldest when a collective times out)."""
    progress = _rank_state["progress"]
    if progress is not None:
        progress[_rank_state["rank"]] = time.monotonic()


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the launcher ``parent`` exits (Linux), checked once now."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the launcher died before the line above ran
        os._exit(1)


def _watchdog(rank: int, beats, parent: int) -> None:
    """Beat the heartbeat; end this process if the launcher is gone (where PDEATHSIG is not)."""
    while True:
        beats[rank] = time.monotonic()
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(HEARTBEAT_S)


def _worker(rank: int, world: int, port: int, timeout_s: float, parent: int, beats, progress, fn, args,
            results) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole terminal: the launcher decides
    threading.Thread(target=_watchdog, args=(rank, beats, parent), daemon=True).start()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    _rank_state.update(timeout=timeout, progress=progress, rank=rank)
    mark_progress()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timeout)
        results.put((rank, True, fn(rank, *args)))
    except BaseException as e:  # report everything, including a collective timing out
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


# -- the launcher ------------------------------------------------------------------------------------

_live: dict = {}  # id -> (rank processes, stop event) of every spawn running in this process
_live_lock = threading.Lock()


def stop_all() -> int:
    """SIGKILL every rank this process started and has not reaped, and tell each running spawn
    to stop (a rank still being started is not alive yet: its spawn kills it once it is); how
    many were running."""
    with _live_lock:
        runs = list(_live.values())
    alive = 0
    for procs, stop in runs:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                alive += 1
    return alive


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(pid: int | None) -> str:
    """The process state letter from /proc (T: stopped), or '' where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _died(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"rank {rank} {how} before returning; stopped the other ranks"


class _Watch:
    """The launcher's view of the ranks: results, exits, heartbeats and progress marks."""

    STARTUP_S = 60  # a rank that has not beaten yet is importing torch: this much longer before it is silent

    def __init__(self, procs, beats, progress, timeout_s: float, started: float):
        self.procs, self.beats, self.progress, self.timeout_s = procs, beats, progress, timeout_s
        self.started = started

    def _stopped(self, r: int) -> bool:
        return self.procs[r].pid is not None and _state(self.procs[r].pid) == "T"

    def _age(self, r: int, now: float) -> float:
        return now - self.beats[r]

    def dead(self, done) -> str | None:
        for r, p in enumerate(self.procs):
            if r not in done and not p.is_alive() and p.exitcode != 0:
                if self.beats[r] == self.started and p.exitcode == 1:  # it never ran: see its error above
                    return f"{_died(r, p.exitcode)}. It exited before it began to run; {MAIN_GUARD}"
                return _died(r, p.exitcode)
        return None

    def silent(self, done) -> str | None:
        """A rank whose heartbeat is older than the collective timeout."""
        now = time.monotonic()
        for r, p in enumerate(self.procs):
            age = self._age(r, now)
            limit = self.timeout_s + (self.STARTUP_S if self.beats[r] == self.started else 0)
            if r not in done and p.pid is not None and age > limit:
                why = "is stopped (SIGSTOP or a debugger)" if self._stopped(r) else "is frozen"
                return (f"rank {r} {why}: no heartbeat for {age:.0f} s (the collective timeout is "
                        f"{self.timeout_s:g} s); stopped the run")
        return None

    def culprit(self, reporter: int, text: str, done) -> str:
        """The error for rank ``reporter``'s failure: a collective that timed out blames the rank
        that stopped beating, or the one whose last progress is oldest."""
        first = text.splitlines()[0] if text else "failed"
        if not _TIMED_OUT.search(text):
            return f"rank {reporter} failed: {text}"
        now = time.monotonic()
        others = [r for r in range(len(self.procs)) if r not in done and r != reporter]
        stale = [r for r in others if self._stopped(r) or self._age(r, now) > 4 * HEARTBEAT_S + 1]
        if stale:
            r = max(stale, key=lambda r: (self._stopped(r), self._age(r, now)))
            why = "is stopped (SIGSTOP or a debugger)" if self._stopped(r) else "stopped responding"
            beat = ("no heartbeat since it started" if self.beats[r] == self.started else
                    f"no heartbeat for {self._age(r, now):.0f} s")
            return (f"rank {r} {why}: {beat}; rank {reporter}'s collective timed out after {self.timeout_s:g} s "
                    f"waiting for it ({first})")
        if others:
            r = min(others, key=lambda r: self.progress[r])
            return (f"rank {r} made no progress for {now - self.progress[r]:.0f} s; rank {reporter}'s collective "
                    f"timed out after {self.timeout_s:g} s waiting for it ({first})")
        return f"rank {reporter} failed: {text}"


def spawn(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0,
          wall_s: float | None = -1) -> list[Any]:
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]``, each in its own gloo process.

    ``fn`` must be importable (a module-level function). Raises ``RankFailure`` naming the rank
    that failed, died or stopped. ``timeout_s`` bounds each collective and each heartbeat;
    ``wall_s`` bounds the whole run (default ``timeout_s`` + 30 s; ``None``: no bound, for
    training runs of any length).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; spawn needs at least one rank.")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}; the collective timeout must be a positive number of seconds")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    beats = ctx.Array("d", world_size, lock=False)
    progress = ctx.Array("d", world_size, lock=False)
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, timeout_s, os.getpid(), beats, progress, fn,
                                               args, results), daemon=True)
             for r in range(world_size)]
    stop = threading.Event()
    with _live_lock:
        _live[id(stop)] = (procs, stop)
    started = time.monotonic()
    watch = _Watch(procs, beats, progress, timeout_s, started)
    out: dict[int, Any] = {}
    wall = timeout_s + 30 if wall_s == -1 else wall_s  # the ranks' own collective timeout fires first
    deadline = None if wall is None else time.monotonic() + wall
    try:
        for r in range(world_size):  # a rank not yet beating counts from its start
            beats[r] = progress[r] = started
        for p in procs:
            if stop.is_set():
                break
            p.start()
        while len(out) < world_size:
            if stop.is_set():
                raise RankFailure("stopped: the launcher was told to stop its ranks")
            try:
                rank, ok, value = results.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                problem = watch.dead(out) or watch.silent(out)
                if problem:
                    raise RankFailure(problem) from None
                if deadline is not None and time.monotonic() > deadline:
                    waiting = [r for r in range(world_size) if r not in out]
                    raise RankFailure(f"ranks {waiting} did not finish within {wall:.0f} s; stopped them.") from None
                continue
            if not ok:
                # A peer that died makes the others fail at once ("connection closed"): name the
                # dead one, not the first to report.
                grace = time.monotonic() + (2 if _PEER_LOST.search(value) else 0)
                while time.monotonic() < grace and not watch.dead(out):
                    time.sleep(0.1)
                raise RankFailure(watch.dead(out) or watch.culprit(rank, value, out))
            out[rank] = value
    finally:
        _reap(procs)
        with _live_lock:
            _live.pop(id(stop), None)
    return [out[r] for r in range(world_size)]


def _reap(procs) -> None:
    """Every rank gone, at once: with every result in hand nothing is left to wait for (their
    files are fsynced before they return), and a stopped rank ignores anything but SIGKILL."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5)


def init_from_env(*, timeout_s: float = 600.0, backend: str | None = None) -> str:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); returns the device type ("cuda" or "cpu")."""
    import torch
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env: {missing} not set; start the program with torchrun, e.g. "
            f"torchrun --nproc_per_node=4 train.py (or use parlay.backends.torch.spawn on one machine)."
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = datetime.timedelta(seconds=timeout_s)
    _rank_state.update(timeout=timeout, rank=int(os.environ["RANK"]))
    dist.init_process_group(backend or ("nccl" if device == "cuda" else "gloo"), timeout=timeout)
    return device
