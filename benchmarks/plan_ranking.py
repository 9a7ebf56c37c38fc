"""Does ``parlay plan``'s cost model rank layouts as this machine runs them? For 4 small GPT
configurations, 5 layouts each on 8 fake JAX devices: the measured step time (JAX explicit mode,
the executor running the plans the report counts; the fastest of 15 timed steps after compilation,
the 5 layouts taking turns a step at a time)
against the predicted one on the "cpu" profile (core/cost.py), and the Spearman rank correlation
per configuration.

    python benchmarks/plan_ranking.py            # about 1.5 minutes on 2 cores
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

from parlay.core import Mesh, get_backend  # noqa: E402
from parlay.core.models.gpt import GPT, PRESETS  # noqa: E402
from parlay.core.program import make_program  # noqa: E402
from parlay.core.model import RandomData  # noqa: E402
from parlay.planning import plan_report, predict  # noqa: E402

CONFIGS = {  # (preset, changes, batch)
    "tiny b8": ("tiny", {}, 8),
    "tiny b64": ("tiny", {}, 64),
    "wide b16": ("tiny", {"embed": 256, "mlp": 1024, "heads": 8, "kv_heads": 8}, 16),
    "deep seq64 b16": ("tiny", {"layers": 4, "seq": 64}, 16),
}
LAYOUTS = [("dp", dict(dp=8)), ("fsdp", dict(dp=8)), ("tp", dict(tp=8)), ("dp+tp_sp", dict(dp=2, tp=4)),
           ("tp2d", dict(row=2, col=4))]


def _measure(programs, rounds: int = 15) -> list[float]:
    """Each program's step time: its fastest of ``rounds`` timed steps after compilation, the
    layouts taking turns a step at a time, so that a slow spell of the machine falls on all of them
    rather than on one layout's run."""
    sessions, batches = [], []
    for program in programs:
        session = get_backend("jax").run(program, lambda session: session)
        batch = RandomData(program.model).batch_at(0, program.batch, seed=0)
        session.step(batch)  # compile
        sessions.append(session)
        batches.append(batch)
    times = [[] for _ in programs]
    for _ in range(rounds):
        for session, batch, t in zip(sessions, batches, times):
            start = time.perf_counter()
            session.step(batch)
            t.append(time.perf_counter() - start)
    return [float(np.min(t)) for t in times]  # the least disturbed step: 2 shared cores make the others noisy


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> dict:
    out = {}
    for label, (preset, changes, batch) in CONFIGS.items():
        model = GPT(PRESETS[preset].with_(**changes))
        programs = [make_program(model, strategy, Mesh(**axes), batch=batch) for strategy, axes in LAYOUTS]
        rows = [(strategy, measured, predict(plan_report(program), "cpu"))
                for (strategy, _), program, measured in zip(LAYOUTS, programs, _measure(programs))]
        rho = spearman([r[1] for r in rows], [r[2].total for r in rows])
        out[label] = (rows, rho)
        print(f"{label}: Spearman {rho:.2f}")
        for strategy, measured, p in rows:
            print(f"  {strategy:10s} measured {1e3 * measured:8.2f} ms  predicted {1e3 * p.total:8.2f} ms "
                  f"(compute {1e3 * p.compute:.2f}, collectives {1e3 * p.comm:.2f}, optimizer {1e3 * p.optimizer:.2f})")
    return out


if __name__ == "__main__":
    main()
