"""The memory report's predictions against XLA: for strategy x precision x remat cases of one GPT
on JAX explicit mode, the activations ``parlay`` predicts a device keeps for its backward
(core/memory.py: the per-device program traced on shapes, JAX's residual list) against the
temporary bytes of the compiled loss-and-gradient function (``memory_analysis()``, per device),
and the model state it predicts against the bytes of the arrays the session holds on device 0.

    python benchmarks/memory_report.py            # embed 128, seq 128, batch 8, 4 layers, 4 devices
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

from parlay.backends.jax.env import use_host_devices

CASES = [  # strategy, mesh, precision, remat
    ("dp", {"dp": 1}, "fp32", "none"),
    ("dp+tp", {"dp": 2, "tp": 2}, "fp32", "none"),
    ("fsdp", {"dp": 4}, "fp32", "none"),
    ("tp_sp", {"tp": 4}, "fp32", "none"),
    ("dp+tp", {"dp": 2, "tp": 2}, "bf16", "none"),
    ("fsdp", {"dp": 4}, "fp32", "block"),
    ("fsdp+tp", {"dp": 2, "tp": 2}, "bf16", "selective"),
]


def device0_bytes(tree) -> int:
    """Bytes of the arrays' shards on the first device (what one device holds of them)."""
    import jax

    dev = jax.devices()[0]
    return sum(math.prod(s.data.shape) * s.data.dtype.itemsize for a in jax.tree.leaves(tree)
               for s in getattr(a, "addressable_shards", []) if s.device == dev)


def measure(program, batch) -> dict:
    """XLA's temporary bytes of the loss and gradients, and the state one device holds."""
    from parlay.core import get_backend
    from parlay.core.ops import step_words

    def run(session, batch):
        placed = session._place_microbatches(batch)
        compiled = session._grads.lower(session.state["params"], placed, step_words(0)).compile()
        opt = [leaf for kind, _, leaf in session._opt_leaves(session.state["opt"]) if kind != "count"]
        return {"temp": compiled.memory_analysis().temp_size_in_bytes,
                "params": device0_bytes(session.state["params"]), "optimizer": device0_bytes(opt)}

    return get_backend("jax").run(program, run, batch)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    use_host_devices(8)
    from parlay.core import Mesh, make_program
    from parlay.core.memory import memory_report
    from parlay.core.models.gpt import GPT, PRESETS

    config = dataclasses.replace(PRESETS["tiny"], embed=args.embed, mlp=4 * args.embed, seq=args.seq,
                                 layers=args.layers, heads=max(1, args.embed // 32), kv_heads=max(1, args.embed // 32),
                                 vocab=256)
    model = GPT(config)
    rng = np.random.default_rng(0)
    print(f"GPT embed {args.embed}, seq {args.seq}, {args.layers} layers, batch {args.batch}; JAX explicit, per device")
    print(f"{'strategy':<9} {'mesh':<10} {'prec':<5} {'remat':<9} {'predicted act MiB':>17} {'XLA temp MiB':>13} "
          f"{'ratio':>6} {'state predicted/held':>21}")
    for strategy, axes, precision, remat in CASES:
        program = make_program(model, strategy, Mesh(axes), batch=args.batch, precision=precision, remat=remat)
        report = memory_report(program, "jax")
        batch = {k: rng.integers(0, config.vocab, d.shape).astype(np.int32) for k, d in program.inputs.items()}
        got = measure(program, batch)
        state = f"{(report.params + report.optimizer) / 2**20:.3f}/{(got['params'] + got['optimizer']) / 2**20:.3f}"
        mesh = ",".join(f"{k}={v}" for k, v in axes.items())
        print(f"{strategy:<9} {mesh:<10} {precision:<5} {remat:<9} {report.activations / 2**20:17.2f} "
              f"{got['temp'] / 2**20:13.2f} {report.activations / got['temp']:6.3f} {state:>21}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
