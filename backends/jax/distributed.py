"""JAX beyond one process: ``jax.distributed`` with one process per host (or per CPU group).

Launch: every process runs the same program with three environment variables set,

    PARLAY_COORDINATOR=host0:1234 PARLAY_NUM_PROCESSES=2 PARLAY_PROCESS_ID=0 python train.py
    PARLAY_COORDINATOR=host0:1234 PARLAY_NUM_PROCESSES=2 PARLAY_PROCESS_ID=1 python train.py

and calls ``parlay.backends.jax.distributed.initialize()`` before anything else touches JAX. On
the CPU, ``local_devices`` fake devices per process talk through gloo. Global arrays are then
built from the data every process holds (``put``) and read back with ``fetch``.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["initialize", "put", "fetch"]


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, local_devices: int | None = None, timeout_s: int = 120) -> None:
    """``jax.distributed.initialize`` from arguments or the PARLAY_* environment variables."""
    env = os.environ
    coordinator = coordinator or env.get("PARLAY_COORDINATOR")
    num_processes = int(num_processes if num_processes is not None else env.get("PARLAY_NUM_PROCESSES", 0))
    process_id = int(process_id if process_id is not None else env.get("PARLAY_PROCESS_ID", -1))
    if not coordinator or num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"distributed JAX needs a coordinator address, a number of processes and this process's "
            f"id in 0..N-1; got coordinator={coordinator!r}, num_processes={num_processes}, "
            f"process_id={process_id}. Set PARLAY_COORDINATOR=host:port, PARLAY_NUM_PROCESSES and "
            f"PARLAY_PROCESS_ID (or pass them)."
        )
    if local_devices is not None:  # CPU: fake devices per process, gloo between processes
        jax.config.update("jax_num_cpu_devices", local_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s)


def put(x, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from a numpy array every process holds in full (each keeps its shards)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def fetch(x: jax.Array) -> np.ndarray:
    """The whole value of a global array, on every process."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
