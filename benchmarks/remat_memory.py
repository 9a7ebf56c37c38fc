"""Activation checkpointing: what the backward keeps, per policy, on torch and JAX, for a GPT of L
layers, with the time of its forward and backward (the fastest of three).

Three measures, each where its framework decides:
- torch: the bytes autograd's saved-tensor hooks receive during the forward (what it keeps for
  the backward; ``selective`` keeps its attention outputs in the selective-checkpoint contexts'
  own storage, which those hooks do not see);
- JAX: the bytes of the residuals ``jax.vjp`` keeps (its ``print_saved_residuals`` list);
- XLA: ``memory_analysis()`` of the compiled loss-and-gradient function, temporary bytes: what
  the CPU compiler's buffer assignment needs at its peak, whatever it chose to fuse or keep.

    python benchmarks/remat_memory.py                      # embed 128, seq 128, batch 8, L in {4, 8}
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from parlay.backends.jax.env import use_host_devices


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="4,8")
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    use_host_devices(8)
    import torch
    from jax._src.ad_checkpoint import saved_residuals

    from parlay.core import Mesh, get_backend, make_program
    from parlay.core.models.gpt import GPT, PRESETS
    from parlay.core.ops import step_words

    def torch_saved(session, batch):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        times = []
        for _ in range(3):  # the fastest of three
            total[0] = 0
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = session._loss(batch, training=True)
            loss.backward()
            times.append(time.perf_counter() - start)
        return total[0], min(times)

    def jax_saved(session, batch):
        placed = session._place_microbatches(batch)
        res = saved_residuals(lambda p: session._loss(p, placed, step_words(0)), session.state["params"])
        kept = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, why in res
                   if "argument" not in why and "constant" not in why)
        compiled = session._grads.lower(session.state["params"], placed, step_words(0)).compile()
        compiled(session.state["params"], placed, step_words(0))[0].block_until_ready()  # warm
        times = []
        for _ in range(3):
            start = time.perf_counter()
            compiled(session.state["params"], placed, step_words(0))[0].block_until_ready()
            times.append(time.perf_counter() - start)
        return kept, compiled.memory_analysis().temp_size_in_bytes, min(times)

    heads = max(1, args.embed // 32)
    x = args.batch * args.seq * args.embed * 4
    print(f"GPT embed {args.embed}, seq {args.seq}, batch {args.batch}, {heads} heads, fp32: a layer's input "
          f"is {x / 2**10:.0f} KiB; one device")
    print(f"{'L':>3} {'remat':<10} {'torch saved MiB':>16} {'torch ms':>9} {'jax residuals MiB':>18} "
          f"{'XLA temp MiB':>13} {'jax ms':>7}")
    for layers in (int(v) for v in args.layers.split(",")):
        config = dataclasses.replace(PRESETS["tiny"], embed=args.embed, mlp=4 * args.embed, seq=args.seq,
                                     layers=layers, heads=heads, kv_heads=heads, vocab=256)
        model = GPT(config)
        rng = np.random.default_rng(0)
        batch = {k: rng.integers(0, config.vocab, (args.batch, config.seq)).astype(np.int32)
                 for k in ("tokens", "targets")}
        for remat in ("none", "block", "selective"):
            program = make_program(model, "dp", Mesh(dp=1), batch=args.batch, remat=remat)
            t_saved, t_s = get_backend("torch-single").run(program, torch_saved, batch)
            j_saved, temp, j_s = get_backend("jax-single").run(program, jax_saved, batch)
            print(f"{layers:>3} {remat:<10} {t_saved / 2**20:16.2f} {t_s * 1e3:9.1f} {j_saved / 2**20:18.2f} "
                  f"{temp / 2**20:13.2f} {j_s * 1e3:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
