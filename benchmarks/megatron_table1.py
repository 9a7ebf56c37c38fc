"""``parlay plan --devices`` against published practice: the GPT-3-style models of Megatron-LM's
weak-scaling table (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Table 1; also the Megatron-LM README: A100 80GB DGX nodes, 8 GPUs on
NVLink, InfiniBand between nodes, sequence 2048, vocabulary 51200).

For each row: the search on the "a100" profile (core/cost.py: datasheet figures, matrix products
at the A100's measured maximum matmul efficiency, kernels counted fused) picks a layout for the row's GPUs and batch; and the row's own layout (its t, p
and d as Megatron ran it: tensor parallelism without sequence parallelism, one example per
microbatch, every block recomputed, 1F1B, bf16 with the activations' tensor-parallel sums in bf16:
"bf16-sum16", core/precision.py) is costed by the same estimator. Throughput is the
paper's own count: 96 B s l h^2 (1 + s / 6h + V / 16lh) FLOPs a step (recompute included) over
the step time and the GPUs.

    python benchmarks/megatron_table1.py            # about 10 minutes on 2 cores
    python benchmarks/megatron_table1.py --rows 7   # the 145.6B row only (1-based)
"""

from __future__ import annotations

import argparse
import json
import os
import time

from parlay.core.layers import Activation
from parlay.core.models.gpt import GPT, GPTConfig, Norm, Positions
from parlay.searching import Candidate, search

# params (B), heads, hidden, layers, t, p, GPUs, batch, achieved TFLOP/s per GPU
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200


def megatron_flops(batch: int, layers: int, hidden: int) -> float:
    return 96 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def row(params, heads, hidden, layers, t, p, gpus, batch, published) -> dict:
    cfg = GPTConfig(vocab=VOCAB, seq=SEQ, embed=hidden, heads=heads, kv_heads=heads, layers=layers, mlp=4 * hidden,
                    norm=Norm.LAYER, activation=Activation.GELU, positions=Positions.LEARNED)
    t0 = time.perf_counter()
    ranked, invalid, s = search(GPT(cfg), gpus, batch, "a100", top=3, workers=min(4, os.cpu_count() or 1))
    seconds = time.perf_counter() - t0
    fit = [e for e in ranked if e.fits]
    flops = megatron_flops(batch, layers, hidden)
    d = gpus // (t * p)
    theirs = Candidate(p, d, 1, "tp" if t > 1 else None, t, "dp", None, 1, batch // d, "1f1b" if p > 1 else None, 1,
                       "block", "bf16-sum16")
    mine = s.estimate(theirs, exact=True)
    out = {"params_B": params, "gpus": gpus, "batch": batch, "published": {"t": t, "p": p, "d": d,
                                                                             "tflops_per_gpu": published},
           "search_s": seconds, "layouts": len(ranked) + len(invalid), "fit": len(fit)}
    out["theirs_predicted"] = {"tflops_per_gpu": flops / mine.time / gpus / 1e12, "step_s": mine.time,
                               "peak_GiB": mine.memory / 2 ** 30, "fits": mine.fits}
    if fit:
        b = fit[0]
        c = b.candidate
        out["search_pick"] = {"strategy": c.strategy(), "mesh": c.mesh_text(), "t": c.tp_size if c.tensor else 1,
                              "p": c.pp, "d": c.dp, "sp": c.seq_size, "microbatches": c.microbatches, "mbs": c.mbs,
                              "schedule": c.schedule, "virtual": c.virtual, "remat": c.remat,
                              "precision": c.precision, "step_s": b.time, "peak_GiB": b.memory / 2 ** 30,
                              "tensor_in_node": (c.tp_size if c.tensor else 1) * c.seq_size <= 8,
                              "pipeline_across_nodes": c.pp > 1 and c.devices // c.pp >= 8,
                              "tflops_per_gpu": flops / b.time / gpus / 1e12}
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=None, help="1-based rows of the table, e.g. 7,10 (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    picks = [int(r) - 1 for r in args.rows.split(",")] if args.rows else range(len(TABLE1))
    rows = []
    print(f"{'model':>8} {'GPUs':>5} | {'Megatron t,p,d':>15} {'TF/s':>5} | {'parlay predicts for it':>22} "
          f"{'ratio':>6} | {'search picks (t,sp,p,d, strategy, micro, schedule, remat, precision)':<80} {'TF/s':>5} {'s':>5}")
    for i in picks:
        r = row(*TABLE1[i])
        rows.append(r)
        pub, th = r["published"], r["theirs_predicted"]
        pick = r.get("search_pick")
        what = (f"t{pick['t']} sp{pick['sp']} p{pick['p']} d{pick['d']} {pick['strategy']} {pick['microbatches']}x"
                f"{pick['mbs']} {pick['schedule'] or '-'}{' v' + str(pick['virtual']) if pick['virtual'] > 1 else ''} "
                f"{pick['remat']} {pick['precision']}") if pick else "none fits"
        print(f"{r['params_B']:>7}B {r['gpus']:>5} | {pub['t']:>5},{pub['p']:>3},{pub['d']:>4} "
              f"{pub['tflops_per_gpu']:>5} | {th['tflops_per_gpu']:>10.0f} TF/s{'' if th['fits'] else ' (no fit)':>8} "
              f"{th['tflops_per_gpu'] / pub['tflops_per_gpu']:>6.2f} | {what:<80} "
              f"{pick['tflops_per_gpu'] if pick else 0:>5.0f} {r['search_s']:>5.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
