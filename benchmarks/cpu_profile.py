"""Measure this machine as a ``parlay plan`` hardware profile (core/cost.py "cpu"), the way a
step uses it: 8 fake JAX devices running at once on the machine's cores, under ``shard_map``.

- matrix products: a 256^3 fp32 product on every device at once (FLOP/s of all 8 together);
- memory: an elementwise pass over 8 MiB on every device at once (bytes read and written, all 8);
- a collective: the extra time of a chain of 9 dependent all-reduces over the 8 devices against 1,
  per collective (the latency), and the bytes one device sends per second in a 4 MiB one.

    python benchmarks/cpu_profile.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def _best(fn, x, reps=9):
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure() -> dict:
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    on_all = lambda body: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                                check_vma=False))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("d")))
    n = 256
    flops = 8 * 2 * n ** 3 / _best(on_all(lambda b: b @ b), put(np.ones((8 * n, n), np.float32)))
    x = put(np.ones(8 * 2 ** 21, np.float32))
    bw = 2 * x.nbytes / _best(on_all(lambda b: b * 2.0 + 1.0), x)

    def chain(k):
        def body(b):
            for _ in range(k):
                b = jax.lax.psum(b, "d") * 0.125
            return b
        return on_all(body)

    small = put(np.ones(8 * 64, np.float32))
    latency = (_best(chain(9), small) - _best(chain(1), small)) / 8
    big = put(np.ones(8 * 2 ** 20, np.float32))  # 4 MiB a device
    sent = 2 * 7 / 8 * big.nbytes / 8  # a ring all-reduce: what one device sends
    link = sent / max(_best(chain(1), big) - latency, 1e-9)
    return {"flops": flops, "memory_bw": bw, "latency": latency, "link_bw": link}


if __name__ == "__main__":
    m = measure()
    print(f"8 devices at once: matmul {m['flops'] / 1e9:.1f} GFLOP/s, memory {m['memory_bw'] / 1e9:.2f} GB/s; a "
          f"collective {m['latency'] * 1e6:.0f} us + the bytes one device sends at {m['link_bw'] / 1e9:.2f} GB/s")
