"""Pipeline memory on JAX: what each pp rank holds during a step, GPipe against 1F1B, at m and 2m
microbatches of a fixed size, measured from JAX's live arrays, beside the simulator's figure.

JAX runs a pipeline as one jitted ``shard_map`` per stage on its pp rank's devices (explicit
mode), so what a rank holds between actions is what the schedule keeps there. After every compute
action the session sums the bytes of the live arrays on each pp rank's devices; the table shows
the peak over the step less the bytes at its start (parameters and optimizer states), i.e. the
stashed stage inputs, the values in flight between ranks, the microbatches' inputs and the
gradients. Doubling m at a fixed microbatch size doubles GPipe's stash and leaves 1F1B's (at
most p - s microbatches on stage s) where it was; the gradients and inputs are the same in both.

    python benchmarks/pipeline_memory.py                 # pp=4, microbatch 4, m in {4, 8}
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
    parser.add_argument("--m", default="4,8", help="microbatch counts")
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    use_host_devices(max(8, args.pp))
    import jax  # noqa: F401  (after the device count is set)

    from parlay.core import Mesh, get_backend, make_program
    from parlay.core.models.gpt import GPT, PRESETS
    from parlay.core.schedule import make_schedule, simulate_schedule

    config = dataclasses.replace(PRESETS["tiny"], embed=args.embed, mlp=4 * args.embed, seq=args.seq, layers=args.pp)
    model = GPT(config)
    x_bytes = args.microbatch * args.seq * args.embed * 4  # one stage input (fp32)
    print(f"GPT embed {args.embed}, {args.pp} layers, seq {args.seq}; pp={args.pp} host devices; microbatch "
          f"{args.microbatch} examples: a stage input is {x_bytes / 2**10:.0f} KiB")
    print(f"{'schedule':<8} {'m':>3} {'peak above start per rank (KiB)':>44} {'simulated peak held':>22}")
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (int(x) for x in args.m.split(",")):
            batch = m * args.microbatch
            program = make_program(model, "pp", Mesh(pp=args.pp), batch=batch, microbatches=m, schedule=schedule)
            rng = np.random.default_rng(0)
            data = {"tokens": rng.integers(0, config.vocab, (batch, config.seq)).astype(np.int32),
                    "targets": rng.integers(0, config.vocab, (batch, config.seq)).astype(np.int32)}

            def measure(session):
                session.step(data)  # compiles
                start = [session.live_bytes(r) for r in range(args.pp)]
                session.memory_trace = []
                session.step(data)
                trace, session.memory_trace = session.memory_trace, None
                return [max(b for rr, _, b in trace if rr == r) - start[r] for r in range(args.pp)]

            peak = get_backend("jax").run(program, measure)
            sim = simulate_schedule(make_schedule(schedule, args.pp, m)).peak_in_flight
            peaks[(schedule, m)] = peak
            print(f"{schedule:<8} {m:>3} {', '.join(f'{b / 2**10:8.0f}' for b in peak):>44} "
                  f"{', '.join(map(str, sim)):>22}")
    ms = sorted({m for _, m in peaks})
    if len(ms) == 2:
        print(f"from m={ms[0]} to m={ms[1]}, the peak's growth per rank in stage inputs ({x_bytes // 2**10} KiB), "
              f"measured | simulated (stage 0 stashes no activation: it recomputes from its tokens)")
        for schedule in ("gpipe", "1f1b"):
            grown = [(b - a) / x_bytes for a, b in zip(peaks[(schedule, ms[0])], peaks[(schedule, ms[1])])]
            sims = [simulate_schedule(make_schedule(schedule, args.pp, m)).peak_in_flight for m in ms]
            want = [0 if r == 0 else sims[1][r] - sims[0][r] for r in range(args.pp)]
            print(f"  {schedule:<6} {', '.join(f'{g:5.2f}' for g in grown)} | {', '.join(map(str, want))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
