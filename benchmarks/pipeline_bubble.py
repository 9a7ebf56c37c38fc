"""Pipeline bubbles on torch, measured, against the schedule simulator's prediction, in one run.

For each schedule and microbatch count, a GPT pipelined over pp gloo ranks takes training steps;
every rank records when each of its compute actions (F, B, I, W) started and ended
(``core.pipeline.run_pipeline``'s timeline). Per rank and step:

- measured idle share = 1 - (time in compute actions) / (the step's pipeline wall time, from the
  first rank's start to the last rank's end: ``perf_counter`` is one monotonic clock for every
  process of the machine), the simulator's measure;
- predicted = ``simulate_schedule`` with the measured mean time of each action kind on each stage
  as its costs (communication free: the stages differ, the last one holds the LM head and the
  loss), and the formula's figure (unit costs).

The difference between measured and predicted is what the simulator leaves out: point-to-point
transfers (gloo over loopback), Python between actions, and on this machine ranks that share
cores.

    python benchmarks/pipeline_bubble.py                   # pp=2, m in {2, 4, 8}, every schedule
    python benchmarks/pipeline_bubble.py --pp 4 --layers 8 # 4 gloo ranks (on 2 cores: oversubscribed)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import numpy as np
import torch
import torch.distributed as dist

from parlay import Mesh
from parlay.backends.torch.launch import spawn
from parlay.backends.torch.session import TorchSession
from parlay.core.models.gpt import GPT, PRESETS
from parlay.core.program import make_program
from parlay.core.schedule import Costs, simulate_schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")


def measure(rank, cases, config, batch, steps):
    """Per case: every rank's ((start, end), busy, mean cost per (op kind, stage)) of each measured step."""
    torch.set_num_threads(1)  # one core's worth per rank: busy time is compute, not contention for threads
    model = GPT(config)
    params = model.init(0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab, (batch, config.seq + 1)).astype(np.int32)
    data = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    out = {}
    for schedule, pp, m in cases:
        program = make_program(model, "pp", Mesh(pp=pp), batch=batch, microbatches=m, schedule=schedule)
        session = TorchSession(program, params)
        rows = []
        for step in range(steps + 1):
            dist.barrier()
            session.step(data)
            if step == 0:
                continue  # the first step pays for allocations and group creation
            span = (session.timeline_start, session.timeline_end)
            acts = session.timeline.get(session.pp_rank, [])
            busy = sum(e - s for s, e, _ in acts)
            per_op = {}
            for s, e, a in acts:
                per_op.setdefault((a.op.value, a.stage), []).append(e - s)
            rows.append((span, busy, {k: statistics.fmean(v) for k, v in per_op.items()}))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        out[(schedule, pp, m)] = (program.pipeline.schedule, gathered)
    return out if rank == 0 else None


def predicted(schedule, gathered) -> tuple[float, float]:
    """(the simulator's bubble with the measured mean cost of each action kind on each stage, with
    unit costs)."""
    costs: dict = {}
    for rows in gathered:
        for _, _, per_op in rows:
            for key, v in per_op.items():
                costs.setdefault(key, []).append(v)
    mean = {k: statistics.fmean(v) for k, v in costs.items()}
    per_stage = lambda op: tuple(mean[(op, s)] for s in range(schedule.stages))
    if schedule.splits_backward:
        c = Costs(f=per_stage("F"), i=per_stage("I"), w=per_stage("W"))
    else:
        c = Costs(f=per_stage("F"), b=per_stage("B"))
    unit = Costs(f=1, i=1, w=1)
    return simulate_schedule(schedule, c).bubble, simulate_schedule(schedule, unit).bubble


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    args = parser.parse_args(argv)
    config = dataclasses.replace(PRESETS["tiny"], embed=args.embed, heads=8, kv_heads=8, mlp=4 * args.embed,
                                 seq=args.seq, layers=args.layers)
    cases = []
    for s in args.schedules.split(","):
        for m in (int(x) for x in args.microbatches.split(",")):
            if s == "interleaved" and m % args.pp:
                continue
            cases.append((s, args.pp, m))
    results = spawn(measure, args.pp, cases, config, args.batch, args.steps, timeout_s=1800)[0]
    print(f"GPT embed {args.embed}, {args.layers} layers, seq {args.seq}, batch {args.batch}; pp={args.pp} gloo ranks; "
          f"{args.steps} measured steps each (after one warm-up)")
    print(f"{'schedule':<12} {'m':>3} {'measured idle':>14} {'per rank':>22} {'simulated':>10} {'ratio':>6} "
          f"{'formula':>8}")
    for (s, pp, m), (schedule, gathered) in results.items():
        walls = [max(rows[t][0][1] for rows in gathered) - min(rows[t][0][0] for rows in gathered)
                 for t in range(len(gathered[0]))]  # each step, first start to last end
        per_rank = [statistics.fmean(1 - busy / walls[t] for t, (_, busy, _) in enumerate(rows)) for rows in gathered]
        shares = per_rank
        sim, unit = predicted(schedule, gathered)
        measured = statistics.fmean(shares)
        print(f"{s:<12} {m:>3} {measured:>14.3f} {', '.join(f'{x:.3f}' for x in per_rank):>22} {sim:>10.3f} "
              f"{measured / sim if sim else float('nan'):>6.2f} {unit:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
