"""``parlay plan --check`` over the built-in strategies: the plan's collective bytes against the
optimized HLO of the same program on JAX explicit (by kind, forward+backward and the optimizer
step), and its predicted activations and peak against XLA's ``memory_analysis()`` (per device).

    python benchmarks/plan_check.py        # GPT embed 128, seq 128, 4 layers, batch 8; fp32 and bf16

Nothing runs: each program's gradient function and training step are compiled on 8 CPU devices.
"""

from __future__ import annotations

import argparse
import dataclasses

from parlay.backends.jax.env import use_host_devices

CASES = [  # strategy, mesh
    ("dp", {"dp": 4}), ("zero1", {"dp": 4}), ("zero2", {"dp": 4}), ("fsdp", {"dp": 4}), ("tp", {"tp": 4}),
    ("tp_sp", {"tp": 4}), ("dp+tp", {"dp": 2, "tp": 2}), ("fsdp+tp", {"dp": 2, "tp": 2}), ("ulysses", {"sp": 4}),
    ("ring", {"cp": 4}), ("tp2d", {"row": 2, "col": 2}), ("tp2.5d", {"row": 2, "col": 2, "dep": 2}),
    ("tp3d", {"x": 2, "y": 2, "z": 2}),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    args = parser.parse_args(argv)
    use_host_devices(8)
    from parlay.backends.jax.plan_check import check_plan
    from parlay.core import Mesh, make_program
    from parlay.core.models.gpt import GPT, PRESETS
    from parlay.planning import plan_report

    config = dataclasses.replace(PRESETS["tiny"], embed=args.embed, mlp=4 * args.embed, seq=args.seq,
                                 layers=args.layers, heads=max(1, args.embed // 32), kv_heads=max(1, args.embed // 32),
                                 vocab=256)
    print(f"GPT embed {args.embed}, seq {args.seq}, {args.layers} layers, batch {args.batch}; JAX explicit on 8 CPU "
          f"devices, compiled only; bytes rank 0 (plan) / device 0 (HLO) sends")
    print(f"{'strategy':<8} {'mesh':<16} {'prec':<5} {'collective bytes, plan vs HLO':<52} {'act':>6} {'peak':>6}")
    within, total, equal = 0, 0, 0
    for precision in args.precision:
        for strategy, axes in CASES:
            program = make_program(GPT(config), strategy, Mesh(axes), batch=args.batch, precision=precision)
            check = check_plan(plan_report(program, "jax"))
            diffs = [f"{r.phase} {r.kind} {r.xla_bytes - r.plan_bytes:+,}" for r in check.rows if not r.equal]
            act = check.activations[0] / check.activations[1]
            peak = check.peak[0] / check.peak[1]
            within += abs(peak - 1) <= 0.10
            total += 1
            equal += check.equal
            mesh = ",".join(f"{k}={v}" for k, v in axes.items())
            print(f"{strategy:<8} {mesh:<16} {precision:<5} {'; '.join(diffs) or 'equal':<52} {act:6.3f} {peak:6.3f}")
    print(f"\nbytes equal in every row: {equal} of {total}; predicted peak within 10% of XLA's: {within} of {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
