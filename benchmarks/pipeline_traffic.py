"""A pipeline step's collective bytes on device 0: JAX's tick loop against torch's pipeline.

    python benchmarks/pipeline_traffic.py          # GPT "small-ish": embed 256, 8 layers, seq 64, batch 32

For each schedule on pp=4 x dp=2 the JAX explicit tick loop's loss and gradients are traced
(nothing runs) and device 0's collectives read from its jaxpr, told pp rank 0's table row
(``JaxLoopSession.traffic``, backends/jax/jaxpr_traffic.py). Beside it, torch's pipeline: the
plan's records for rank 0 (``plan_report``; equal to torch's log, tests/torch/test_traffic.py).
By kind: pp sends (stage outputs and input gradients), dp (the gradients' sums), the rest.

The two differ by design in one way: the loop keeps only each stage's input, so each backward
piece runs the stage's forward again, its collectives too (here only the loss's scalar sum over
dp, on the last stage: under ZB-V rank 0 holds it, and its I and W each run it again); torch
keeps the forward's graph.
"""

from __future__ import annotations

import argparse

from parlay.backends.jax.env import use_host_devices

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args(argv)
    use_host_devices(8)
    import numpy as np

    from parlay.core import Mesh, get_backend
    from parlay.core.models.gpt import GPT, PRESETS
    from parlay.core.program import make_program
    from parlay.planning import plan_report

    model = GPT(PRESETS["tiny"].with_(embed=256, layers=8, seq=64))
    m = args.microbatches

    def by_kind(records) -> dict[str, int]:
        out = {"pp sends": 0, "dp sums": 0, "other": 0}
        for r in records:
            key = "pp sends" if r.kind.value == "permute" and "pp" in r.axes else \
                "dp sums" if r.axes == ("dp",) else "other"
            out[key] += r.nbytes
        return out

    print(f"GPT embed 256, 8 layers, seq 64, batch {args.batch} in {m} microbatches, pp=4 x dp=2; bytes device 0 "
          f"sends in one loss-and-gradients")
    print(f"{'schedule':<12} {'':<14} {'pp sends':>12} {'dp sums':>12} {'other':>8} {'total':>12} {'JAX/torch':>10}")
    for schedule, virtual in CASES:
        program = make_program(model, "pp+dp", Mesh(pp=4, dp=2), batch=args.batch, microbatches=m,
                               schedule=schedule, virtual=virtual)
        batch = {n: np.zeros(d.shape, d.dtype.numpy) for n, d in program.inputs.items()}
        loop = by_kind(get_backend("jax").run(program, lambda s: s.traffic(batch)).entries)
        report = plan_report(program)
        torch = by_kind(r for ph in ("forward", "backward") for r in report.records[ph])
        for name, row in (("JAX tick loop", loop), ("torch", torch)):
            total = sum(row.values())
            ratio = f"{total / sum(torch.values()):>10.2f}" if name != "torch" else ""
            print(f"{schedule if name != 'torch' else '':<12} {name:<14} {row['pp sends']:>12,} {row['dp sums']:>12,} "
                  f"{row['other']:>8,} {total:>12,} {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
