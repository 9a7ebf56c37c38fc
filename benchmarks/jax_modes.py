"""JAX explicit mode (shard_map + core plans) against GSPMD mode (XLA's choices), on 8 CPU devices.

Two tables:
1. collectives: for each strategy, the collectives in the compiled training step (forward,
   backward, optimizer) of each mode, by kind and group size, and the bytes the busiest device
   sends (parlay's cost model, ``parlay.backends.jax.hlo``);
2. time: milliseconds per training step of a GPT-2-small-wide model (embed 768, 12 heads, mlp
   3072, vocab 50304), shortened to fit two CPU cores (2 layers, seq 64, batch 8 by default),
   in both modes, and the ratio.

    python benchmarks/jax_modes.py                 # both tables
    python benchmarks/jax_modes.py --markdown      # for the README
"""

from __future__ import annotations

import os

from parlay.backends.jax.env import use_host_devices

use_host_devices(8)
if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's rematerialization warnings

import argparse
import gc
import statistics
import sys
import time

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from parlay import Mesh
from parlay.backends.jax.hlo import busiest_device_bytes, count_collectives, parse_collectives
from parlay.backends.jax.session import JaxSession, Mode
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import make_program

STRATEGIES = [
    ("dp", Mesh(dp=8)),
    ("zero2", Mesh(dp=8)),
    ("fsdp", Mesh(dp=8)),
    ("tp", Mesh(tp=4)),
    ("tp_sp", Mesh(tp=4)),
    ("ulysses", Mesh(sp=4)),
    ("tp2d", Mesh(row=2, col=2)),
    ("dp+tp", Mesh(dp=2, tp=4)),
    ("fsdp+tp", Mesh(dp=2, tp=4)),
    ("dp+tp_sp", Mesh(dp=2, tp=4)),
]


def _batch(config, batch: int):
    tokens = np.random.default_rng(0).integers(0, config.vocab, (batch, config.seq + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def _session(model, name, mesh, mode, params, batch):
    return JaxSession(make_program(model, name, mesh, batch=batch), mode, params)


def collectives_rows(preset: str = "tiny", batch: int = 8):
    model = GPT(PRESETS[preset])
    params = model.init(0)
    b = _batch(model.config, batch)
    rows = []
    for name, mesh in STRATEGIES:
        row = [name, " x ".join(f"{a}={n}" for a, n in mesh.axes)]
        for mode in (Mode.EXPLICIT, Mode.GSPMD):
            colls = parse_collectives(_session(model, name, mesh, mode, params, batch).step_hlo(b), mesh.size)
            counts = count_collectives(colls)
            row += [", ".join(f"{k} x{v}" for k, v in counts.items()) or "-", busiest_device_bytes(colls)]
        rows.append(row)
    return rows


def time_rows(layers: int, seq: int, batch: int, steps: int, strategies):
    config = PRESETS["gpt2-small"].with_(layers=layers, seq=seq)
    model = GPT(config)
    params = model.init(0)
    b = _batch(config, batch)
    rows = []
    for name, mesh in strategies:
        ms = {}
        for mode in (Mode.EXPLICIT, Mode.GSPMD):
            session = _session(model, name, mesh, mode, params, batch)
            start = time.perf_counter()
            session.step(b)  # compiles; the loss is fetched, so the step has finished
            compile_s = time.perf_counter() - start
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                session.step(b)
                times.append(time.perf_counter() - start)
            ms[mode] = (1e3 * statistics.median(times), compile_s)
            del session  # two sessions of 8 replicas each do not fit 24 GiB together
            gc.collect()
        e, g = ms[Mode.EXPLICIT], ms[Mode.GSPMD]
        rows.append([name, " x ".join(f"{a}={n}" for a, n in mesh.axes), f"{e[0]:.0f}", f"{g[0]:.0f}",
                     f"{e[0] / g[0]:.2f}", f"{e[1]:.1f} / {g[1]:.1f}"])
    return rows


def _print(headers, rows, markdown: bool, title: str) -> None:
    if markdown:
        print(f"\n{title}\n")
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for r in rows:
            print("| " + " | ".join(str(c) for c in r) + " |")
        return
    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h)
    for r in rows:
        table.add_row(*(str(c) for c in r))
    Console(width=200).print(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode (median reported)")
    ap.add_argument("--time-strategies", default="dp,fsdp,tp,dp+tp,fsdp+tp,dp+tp_sp",
                    help="comma-separated strategies to time (meshes as in the collectives table)")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    assert jax.device_count() >= 8, "needs 8 devices (XLA_FLAGS is set at the top of this script)"
    headers = ["strategy", "mesh", "explicit: collectives in the step", "explicit B/device",
               "GSPMD: collectives in the step", "GSPMD B/device"]
    _print(headers, collectives_rows(), args.markdown,
           "Collectives in one compiled training step (tiny model, batch 8), by kind and group size")
    if not args.skip_time:
        wanted = args.time_strategies.split(",")
        chosen = [(n, m) for n, m in STRATEGIES if n in wanted]
        rows = time_rows(args.layers, args.seq, args.batch, args.steps, chosen)
        _print(["strategy", "mesh", "explicit ms/step", "GSPMD ms/step", "explicit / GSPMD", "compile s (explicit / GSPMD)"],
               rows, args.markdown,
               f"Training step time, GPT-2-small widths, {args.layers} layers, seq {args.seq}, batch {args.batch}, "
               f"8 CPU devices (median of {args.steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
