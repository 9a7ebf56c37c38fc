"""Gradient accumulation's collective bytes per step: JAX explicit against XLA's GSPMD.

    python benchmarks/accumulation_traffic.py     # tiny GPT, batch 16; dp on dp=4 and dp+tp on dp=2 x tp=2

For k = 1, 2, 4 microbatches each backend's gradient function is compiled (nothing runs) and the
collectives of its optimized HLO are costed on device 0, a loop body counted its known trip count
times (``backends/jax/hlo.py``). JAX explicit varies each parameter once before its microbatch
loop, so its gradients' sums run once per step whatever k; GSPMD leaves the sums to XLA. The
plan's bytes (torch's log, checked in tests/torch/test_traffic.py) are printed beside them; they
differ from the HLO's by a few bytes of rounding (the plan rounds each record down to whole
elements, the HLO each instruction up to whole bytes).
"""

from __future__ import annotations

import argparse

from parlay.backends.jax.env import use_host_devices

CASES = [("dp", {"dp": 4}), ("dp+tp", {"dp": 2, "tp": 2})]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    use_host_devices(8)
    import numpy as np

    from parlay.backends.jax.hlo import parse_collectives
    from parlay.core import Mesh, get_backend
    from parlay.core.ops import step_words
    from parlay.core.program import program_from
    from parlay.planning import PHASES, plan_report

    def grads_hlo(session, batch):
        placed = session._place_microbatches(batch)
        return session._grads.lower(session.state["params"], placed, step_words(0)).compile().as_text()

    print(f"tiny GPT, batch {args.batch}; bytes device 0 sends in one loss-and-gradients (HLO, loops by trip count)")
    print(f"{'strategy':<8} {'mesh':<10} {'k':>2} {'JAX explicit':>13} {'GSPMD':>11} {'GSPMD/explicit':>15} "
          f"{'plan (torch)':>13}")
    for strategy, axes in CASES:
        for k in args.microbatches:
            program = program_from("tiny", strategy, Mesh(axes), batch=args.batch, microbatches=k)
            batch = {n: np.zeros(d.shape, d.dtype.numpy) for n, d in program.inputs.items()}
            sent = {}
            for backend in ("jax", "jax-gspmd"):
                colls = parse_collectives(get_backend(backend).run(program, grads_hlo, batch), program.mesh.size)
                sent[backend] = sum(c.trips * c.per_device.get(0, 0) for c in colls)
            report = plan_report(program)
            plan = report.sent(PHASES[0]) + report.sent(PHASES[1])  # forward and backward
            mesh = ",".join(f"{a}={n}" for a, n in axes.items())
            print(f"{strategy:<8} {mesh:<10} {k:>2} {sent['jax']:>13,} {sent['jax-gspmd']:>11,} "
                  f"{sent['jax-gspmd'] / sent['jax']:>15.2f} {plan:>13,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
