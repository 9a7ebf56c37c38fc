"""The longest sequence one GPT trains on within a fixed memory budget per device: ring attention
(``ring``, cp=8), Ulysses (``ulysses``, sp=8) and Megatron's sequence parallelism (``tp_sp``,
tp=8), each on 8 devices. For every sequence length in a doubling grid, the training step's
loss-and-gradient function is compiled on JAX explicit mode (the same core plans as torch) and
XLA's ``memory_analysis()`` gives one device's bytes: its arguments (parameters, the batch)
plus its temporaries (activations kept for the backward, the backward's own). Nothing runs.
The last column is what the ring keeps for its backward, from the memory report (core/memory.py:
JAX's residual list of the per-device program).

Colossal-AI's claim to compare with (the RSA paper, arXiv 2105.13120, 64 P100s): ring
self-attention trains on 3.0x longer sequences than tensor parallelism. Their RSA keeps
O(s^2/N) scores; parlay's ring keeps one (s/2N x s/2N) tile per step, so the ratio here depends
on how much else the budget holds.

    python benchmarks/ring_sequence.py                 # embed 128, 2 layers, 64 MiB per device
    python benchmarks/ring_sequence.py --budget-mib 256 --max-seq 65536
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from parlay.backends.jax.env import use_host_devices

CASES = [("ring", {"cp": 8}), ("ulysses", {"sp": 8}), ("tp_sp", {"tp": 8})]


def device_bytes(program, batch) -> dict:
    """One device's argument and temporary bytes of the compiled loss and gradients."""
    from parlay.core import get_backend
    from parlay.core.ops import step_words

    def run(session, batch):
        placed = session._place_microbatches(batch)
        m = session._grads.lower(session.state["params"], placed, step_words(0)).compile().memory_analysis()
        return {"args": m.argument_size_in_bytes, "temp": m.temp_size_in_bytes}

    return get_backend("jax").run(program, run, batch)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget-mib", type=float, default=64.0)
    parser.add_argument("--min-seq", type=int, default=512)
    parser.add_argument("--max-seq", type=int, default=32768)
    args = parser.parse_args(argv)
    use_host_devices(8)
    from parlay.core import Mesh, make_program
    from parlay.core.memory import memory_report
    from parlay.core.models.gpt import GPT, PRESETS

    budget = args.budget_mib * 2**20
    print(f"GPT embed {args.embed}, 8 heads, {args.layers} layers, batch {args.batch}, fp32; JAX explicit, 8 devices; "
          f"budget {args.budget_mib:g} MiB per device (arguments + XLA temporaries)")
    print(f"{'seq':>7} " + " ".join(f"{s + ' MiB':>14}" for s, _ in CASES) + f"{'ring kept MiB':>15}")
    longest = {s: 0 for s, _ in CASES}
    seq, rng = args.min_seq, np.random.default_rng(0)
    while seq <= args.max_seq:
        config = dataclasses.replace(PRESETS["tiny"], embed=args.embed, mlp=4 * args.embed, seq=seq,
                                     layers=args.layers, heads=8, kv_heads=8, vocab=256)
        row, kept = [], ""
        for strategy, axes in CASES:
            if longest[strategy] < seq // 2 and seq > args.min_seq:  # already over budget at half this length
                row.append(f"{'-':>14}")
                continue
            program = make_program(GPT(config), strategy, Mesh(axes), batch=args.batch)
            if strategy == "ring":
                kept = f"{memory_report(program, 'jax').activations / 2**20:15.1f}"
            batch = {k: rng.integers(0, config.vocab, d.shape).astype(np.int32) for k, d in program.inputs.items()}
            got = device_bytes(program, batch)
            total = got["args"] + got["temp"]
            if total <= budget:
                longest[strategy] = seq
            row.append(f"{total / 2**20:14.1f}")
        print(f"{seq:7d} " + " ".join(row) + kept, flush=True)
        if all(longest[s] < seq for s, _ in CASES):
            break
        seq *= 2
    print("longest sequence within the budget: " + ", ".join(f"{s} {longest[s]}" for s, _ in CASES))
    base = longest["tp_sp"]
    if base:
        print(f"ring / tp_sp: {longest['ring'] / base:.1f}x; ring / ulysses: "
              f"{longest['ring'] / max(longest['ulysses'], 1):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
