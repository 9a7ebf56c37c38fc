"""Pipeline memory on JAX: what each device holds during a step, GPipe against 1F1B, at m and 2m
microbatches of a fixed size.

JAX explicit mode compiles a pipelined step as one program: a tick loop inside ``shard_map``
(backends/jax/ticks.py) whose carried buffers have as many slots as the schedule holds stage
inputs and output gradients at once. XLA's ``memory_analysis()`` of the compiled step gives its
temporary bytes per device (the buffers, the gradients, one branch's activations); doubling m at
a fixed microbatch size adds GPipe's m extra stashed stage inputs and leaves 1F1B's (at most p)
where it was. Printed: the temporary bytes, the slots, and the growth measured against the growth
the slots predict (slots x one stage input's bytes per device).

``--mpmd`` also measures the other lowering (``--backend jax-mpmd``: a jitted program per stage,
driven from Python): the peak bytes of the live arrays on each pp rank's devices after every
action, above the step's start, against the simulator's peak held.

    python benchmarks/pipeline_memory.py                 # pp=4, microbatch 4, m in {4, 8, 16}
    python benchmarks/pipeline_memory.py --mpmd --m 4,8
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from parlay.backends.jax.env import use_host_devices


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatch", type=int, default=4, help="examples a microbatch")
    parser.add_argument("--m", default="4,8,16", help="microbatch counts")
    parser.add_argument("--mpmd", action="store_true", help="also measure the MPMD lowering's live arrays")
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    use_host_devices(max(8, args.pp))
    import jax  # noqa: F401  (after the device count is set)

    from parlay.core import Mesh, get_backend, make_program
    from parlay.core.memory import memory_report
    from parlay.core.models.gpt import GPT, PRESETS
    from parlay.core.schedule import make_schedule, simulate_schedule

    config = dataclasses.replace(PRESETS["tiny"], embed=args.embed, mlp=4 * args.embed, seq=args.seq, layers=args.pp)
    model = GPT(config)
    x_bytes = args.microbatch * args.seq * args.embed * 4  # one stage input (fp32)
    print(f"GPT embed {args.embed}, {args.pp} layers, seq {args.seq}; pp={args.pp} host devices; microbatch "
          f"{args.microbatch} examples: a stage input is {x_bytes / 2**10:.0f} KiB")
    ms = [int(x) for x in args.m.split(",")]

    def data_of(m):
        rng = np.random.default_rng(0)
        shape = (m * args.microbatch, config.seq)
        return {"tokens": rng.integers(0, config.vocab, shape).astype(np.int32),
                "targets": rng.integers(0, config.vocab, shape).astype(np.int32)}

    def program_of(schedule, m):
        return make_program(model, "pp", Mesh(pp=args.pp), batch=m * args.microbatch, microbatches=m,
                            schedule=schedule)

    print("\nthe tick loop (one compiled step): XLA memory_analysis() per device")
    print(f"{'schedule':<8} {'m':>3} {'temp KiB':>10} {'x+dy slots':>11} {'growth KiB':>11} {'slots predict':>14} "
          f"{'report: act KiB':>16} {'its growth':>11}")
    for schedule in ("gpipe", "1f1b"):
        prev = None
        for m in ms:
            def measure(session, data=data_of(m)):
                plan = session.train_plan
                return session.compiled_step(data).memory_analysis().temp_size_in_bytes, plan.x_slots + plan.dy_slots
            program = program_of(schedule, m)
            temp, slots = get_backend("jax").run(program, measure)
            act = memory_report(program, "jax").activations  # parlay's prediction (core/memory.py)
            grown = want = act_grown = ""
            if prev is not None:
                grown, want = f"{(temp - prev[0]) / 2**10:11.0f}", f"{(slots - prev[1]) * x_bytes / 2**10:14.0f}"
                act_grown = f"{(act - prev[2]) / 2**10:11.0f}"
            print(f"{schedule:<8} {m:>3} {temp / 2**10:10.0f} {slots:>11} {grown:>11} {want:>14} {act / 2**10:16.0f} "
                  f"{act_grown:>11}")
            prev = (temp, slots, act)
    if not args.mpmd:
        return 0

    print("\nMPMD (--backend jax-mpmd): peak live bytes above the step's start, per pp rank")
    print(f"{'schedule':<8} {'m':>3} {'peak above start per rank (KiB)':>44} {'simulated peak held':>22}")
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        for m in ms:
            data = data_of(m)

            def measure(session):
                session.step(data)  # compiles
                start = [session.live_bytes(r) for r in range(args.pp)]
                session.memory_trace = []
                session.step(data)
                trace, session.memory_trace = session.memory_trace, None
                return [max(b for rr, _, b in trace if rr == r) - start[r] for r in range(args.pp)]

            peak = get_backend("jax-mpmd").run(program_of(schedule, m), measure)
            sim = simulate_schedule(make_schedule(schedule, args.pp, m)).peak_in_flight
            peaks[(schedule, m)] = peak
            print(f"{schedule:<8} {m:>3} {', '.join(f'{b / 2**10:8.0f}' for b in peak):>44} "
                  f"{', '.join(map(str, sim)):>22}")
    a, b = ms[0], ms[1]
    print(f"from m={a} to m={b}, the peak's growth per rank in stage inputs ({x_bytes // 2**10} KiB), "
          f"measured | simulated (stage 0 stashes no activation: it recomputes from its tokens)")
    for schedule in ("gpipe", "1f1b"):
        grown = [(y - x) / x_bytes for x, y in zip(peaks[(schedule, a)], peaks[(schedule, b)])]
        sims = [simulate_schedule(make_schedule(schedule, args.pp, m)).peak_in_flight for m in (a, b)]
        want = [0 if r == 0 else sims[1][r] - sims[0][r] for r in range(args.pp)]
        print(f"  {schedule:<6} {', '.join(f'{g:5.2f}' for g in grown)} | {', '.join(map(str, want))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
