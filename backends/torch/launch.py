"""Starting torch.distributed: parlay's own gloo processes on one machine, or under torchrun.

``spawn(fn, world_size, *args)`` starts the processes, initialises torch.distributed (gloo) in
each, calls ``fn(rank, *args)`` and returns the per-rank results. A rank that raises, dies or
hangs makes ``spawn`` raise one clear error within ``timeout_s``; it never waits forever.

Under ``torchrun`` (one node or many), call ``init_from_env()`` first: NCCL when CUDA is there,
gloo otherwise, each rank on its local GPU, with the same timeout rule.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

from ...core.session import RunFailure

__all__ = ["spawn", "init_from_env", "RankFailure"]


class RankFailure(RunFailure):
    """A rank raised, died or timed out."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout_s: float, fn, args, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        results.put((rank, True, fn(rank, *args)))
    except BaseException as e:  # report everything, including a collective timing out
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0,
          wall_s: float | None = -1) -> list[Any]:
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]``, each in its own gloo process.

    ``fn`` must be importable (a module-level function). Raises ``RankFailure`` naming the first
    rank that failed, or the ranks still running when ``timeout_s`` passed. ``timeout_s`` bounds
    each collective (a rank stuck in one fails); ``wall_s`` bounds the whole run (default
    ``timeout_s`` + 30 s; ``None``: no bound, for training runs of any length).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; spawn needs at least one rank.")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, timeout_s, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    wall = timeout_s + 30 if wall_s == -1 else wall_s  # the ranks' own collective timeout fires first
    deadline = None if wall is None else time.monotonic() + wall
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out and p.exitcode != 0]
                if dead:
                    raise RankFailure(
                        f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) before returning; the "
                        f"other ranks were stopped."
                    ) from None
                if deadline is not None and time.monotonic() > deadline:
                    waiting = [r for r in range(world_size) if r not in out]
                    raise RankFailure(f"ranks {waiting} did not finish within {wall:.0f} s; stopped them.") from None
                continue
            if not ok:
                raise RankFailure(f"rank {rank} failed: {value}")
            out[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
    return [out[r] for r in range(world_size)]


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
    dist.init_process_group(backend or ("nccl" if device == "cuda" else "gloo"),
                            timeout=datetime.timedelta(seconds=timeout_s))
    return device
