"""How long ``parlay plan --devices N`` takes: the search for a 145.6B GPT (Megatron-LM's, sequence
2048) with a global batch of 4096 on 64, 512 and 4096 A100s, each in a fresh ``Search`` (no traces
shared between the three), on this machine's CPU. Prints the seconds, the layouts costed, the unit
traces they needed and the layout picked.

    python benchmarks/plan_search.py            # about 4 minutes on 2 cores
"""

from __future__ import annotations

import os
import time

from parlay.core.layers import Activation
from parlay.core.models.gpt import GPT, GPTConfig, Norm, Positions
from parlay.searching import search

CFG = GPTConfig(vocab=51200, seq=2048, embed=12288, heads=96, kv_heads=96, layers=80, mlp=4 * 12288,
                norm=Norm.LAYER, activation=Activation.GELU, positions=Positions.LEARNED)


def main(devices=(64, 512, 4096), batch: int = 4096) -> list[dict]:
    rows = []
    for n in devices:
        t0 = time.perf_counter()
        ranked, invalid, s = search(GPT(CFG), n, batch, "a100", workers=min(4, os.cpu_count() or 1))
        seconds = time.perf_counter() - t0
        fit = [e for e in ranked if e.fits]
        best = fit[0] if fit else None
        rows.append({"devices": n, "seconds": seconds, "layouts": len(ranked) + len(invalid), "fit": len(fit),
                     "traces": s.traces, "trace_seconds": s.trace_seconds,
                     "pick": best and f"{best.candidate.strategy()} {best.candidate.mesh_text()} "
                                      f"{best.candidate.microbatches}x{best.candidate.mbs} "
                                      f"{best.candidate.schedule or ''} {best.candidate.remat} "
                                      f"{best.candidate.precision}"})
        r = rows[-1]
        print(f"{n:>5} devices: {seconds:6.1f} s ({r['traces']} unit traces, {r['trace_seconds']:.1f} s of it), "
              f"{r['layouts']} layouts, {r['fit']} fit; picks {r['pick']}", flush=True)
    return rows


if __name__ == "__main__":
    main()
