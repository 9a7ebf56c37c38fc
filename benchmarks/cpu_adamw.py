"""The CPU AdamW that the torch offload runs (``torch.optim.AdamW(fused=True)`` on host tensors)
against torch's other CPU AdamWs, in the same run: the single-tensor loop (torch's default on the
CPU), ``foreach=True`` and ``fused=True``, on GPT-shaped float32 tensors; the fastest of five
steps each, parameters updated per second and the ratio to ``foreach``.

    python benchmarks/cpu_adamw.py                 # 25M parameters in 12 layers' worth of tensors
    python benchmarks/cpu_adamw.py --params 100e6
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args(argv)
    import torch

    per_layer = int(args.params) // args.layers
    e = int((per_layer / 12) ** 0.5)  # a layer's 12 e^2 parameters (attention 4e^2, MLP 8e^2)
    shapes = [s for _ in range(args.layers) for s in ((e, 3 * e), (e, e), (e, 4 * e), (4 * e, e), (e,), (e,))]
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    print(f"{n / 1e6:.1f}M float32 parameters in {len(shapes)} tensors; {torch.get_num_threads()} threads")
    results = {}
    for name, kwargs in (("loop", dict(foreach=False)), ("foreach", dict(foreach=True)), ("fused", dict(fused=True))):
        torch.manual_seed(0)
        params = [torch.randn(s, requires_grad=True) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kwargs)
        opt.step()  # the states exist
        times = []
        for _ in range(5):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        results[name] = min(times)
    for name, t in results.items():
        print(f"{name:<8} {t * 1e3:8.1f} ms   {n / t / 1e6:8.1f}M params/s   x{results['foreach'] / t:.2f} of foreach")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
