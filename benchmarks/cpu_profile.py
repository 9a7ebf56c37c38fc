"""Measure this machine as a ``parlay plan --profile`` hardware profile (core/cost.py "cpu"):
XLA's CPU matrix-product rate, its memory bandwidth, and the alpha-beta cost of a collective among
8 fake JAX devices (an all-gather over all 8 at several sizes, least squares).

    python benchmarks/cpu_profile.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def _best(fn, *args, reps=7):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure() -> dict:
    dev = jax.devices()[0]
    n = 512
    a = jax.device_put(np.random.default_rng(0).normal(size=(n, n)).astype(np.float32), dev)
    mm = jax.jit(lambda a: a @ a)
    flops = 2 * n ** 3 / _best(mm, a)
    big = jax.device_put(np.ones(2 ** 24, np.float32), dev)  # 64 MiB
    bw = 2 * big.nbytes / _best(jax.jit(lambda x: x * 2.0 + 1.0), big)
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    rows = []
    for elems in (256, 4096, 65536, 262144):
        x = jax.device_put(np.ones(8 * elems, np.float32), NamedSharding(mesh, P("d")))
        gather = jax.jit(jax.shard_map(lambda b: jax.lax.all_gather(b, "d", tiled=True), mesh=mesh, in_specs=P("d"),
                                       out_specs=P(), check_vma=False))
        rows.append((7, 7 * elems * 4, _best(gather, x)))  # ring steps, bytes one device sends, seconds
    A = np.array([[s, b] for s, b, _ in rows], float)
    lat, inv_bw = np.linalg.lstsq(A, np.array([t for *_, t in rows]), rcond=None)[0]
    return {"flops": flops, "memory_bw": bw, "latency": max(lat, 0.0), "link_bw": 1 / inv_bw if inv_bw > 0 else bw,
            "gathers": rows}


if __name__ == "__main__":
    m = measure()
    print(f"matmul {m['flops'] / 1e9:.1f} GFLOP/s (one 512^3 fp32 product), memory {m['memory_bw'] / 1e9:.2f} GB/s, "
          f"collective step latency {m['latency'] * 1e6:.1f} us, link {m['link_bw'] / 1e9:.2f} GB/s")
    for steps, nbytes, t in m["gathers"]:
        print(f"  all-gather over 8: {nbytes} B sent per device, {t * 1e6:.0f} us")
