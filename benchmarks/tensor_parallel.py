"""1D, 2D, 2.5D and 3D tensor parallelism (``tp``, ``tp2d``, ``tp2.5d``, ``tp3d``): the bytes one
device sends per training step, counted from parlay's plans, against Colossal-AI's formulas, and
the activation memory one device keeps, at 8 and 64 devices. Nothing runs: each program is traced
on shapes (``collective_traffic``: every plan step forward and its transpose backward, as torch's
collectives send them, equal to torch's own log on 8 ranks in tests/torch/test_traffic.py;
``memory_report``: JAX's residual list of the per-device program).

**One linear** ``y = x @ w`` with x, w, y all n x n (S bytes each), the input's gradient needed.
The formulas, per device, forward plus backward:

- 1D (P): the backward all-reduces dx: 2(P-1)S/P (Colossal's 2(P-1)/P).
- 2D (q x q): all-gather x over col and w over row, reduce-scatter both gradients back:
  4(q-1)S/q^2 (on r x c: 2(r-1+c-1)S/(rc)). Colossal's table says 6(q-1)/q: SUMMA's count, 6(q-1)S/q^2, in units of S/q; its
  backward broadcasts both operands again, where parlay keeps the gathered ones (2 of 6 moves).
- 2.5D (q x q x d): the same on each of d layers, x being 1/d the size, plus the weight gradient's
  all-reduce over dep: 2(q-1)(d+1)S/(dq^2) + 2(d-1)S/(dq^2). Colossal's 3(q-1)(d+1)/(dq) is SUMMA's
  3(q-1)(d+1)S/(dq^2) in units of S/q, without the depth reduction.
- 3D (q x q x q): all-gather x over y and w over x, reduce-scatter y over z, and the three
  transposes backward: 6(q-1)S/q^3, Colossal's formula exactly.

**One GPT layer** (attention, MLP, norms; the embedding and head left out by differencing 2 and 1
layers): bytes per device forward plus backward, and the activations kept for the backward.

    python benchmarks/tensor_parallel.py
"""

from __future__ import annotations

import argparse
import dataclasses

from parlay import DType, InputDecl, Mesh, ParamDecl

# (strategy, label, mesh at 8 devices, mesh at 64 devices)
MESHES = [("tp", "1D", {"tp": 8}, {"tp": 64}),
          ("tp2d", "2D", {"row": 2, "col": 4}, {"row": 8, "col": 8}),
          ("tp2.5d", "2.5D", {"row": 2, "col": 2, "dep": 2}, {"row": 4, "col": 4, "dep": 4}),
          ("tp3d", "3D", {"x": 2, "y": 2, "z": 2}, {"x": 4, "y": 4, "z": 4})]


class OneLinear:
    """``y = (x + b) @ w``, every matrix n x n, loss sum(y * y). The bias makes x's gradient needed
    (x is an input); ``linear=False`` drops the product, so the difference is the linear's."""

    def __init__(self, n: int, linear: bool = True):
        self.n, self.linear = n, linear

    def decls(self):
        return (ParamDecl("b", (self.n,), ("embed",)), ParamDecl("w", (self.n, self.n), ("embed", "mlp")))

    def inputs(self, batch):
        return {"x": InputDecl((batch, self.n), ("batch", "embed"), DType.FLOAT32)}

    def loss(self, ops, params, batch):
        x = ops.add_bias(batch["x"], ops.param("b", params["b"], ("embed",)))
        if self.linear:
            y = ops.einsum("be,ef->bf", x, ops.param("w", params["w"], ("embed", "mlp")))
            y = ops.constrain(y, ("batch", "mlp"))
        else:
            y = ops.constrain(x, ("batch", "embed"))
        return ops.sum(ops.sum(ops.mul(y, y), 1), 0)


def formula(label: str, mesh: dict, S: int) -> float:
    """Bytes one device sends for one linear, forward and backward (see the module's docstring)."""
    if label == "1D":
        P = mesh["tp"]
        return 2 * (P - 1) * S / P
    if label == "2D":  # r x c; 4(q-1)S/q^2 on a square
        r, c = mesh["row"], mesh["col"]
        return 2 * ((c - 1) + (r - 1)) * S / (r * c)
    if label == "2.5D":
        q, d = mesh["row"], mesh["dep"]
        return 2 * (q - 1) * (d + 1) * S / (d * q**2) + 2 * (d - 1) * S / (d * q**2)
    q = mesh["x"]
    return 6 * (q - 1) * S / q**3


def _sent(log) -> int:
    """Bytes in the log, less the scalar loss's own sums (a few bytes, the same with or without a layer)."""
    return sum(e.nbytes for e in log.entries if e.nbytes >= 16)


def linear_bytes(strategy: str, mesh: dict, n: int) -> int:
    """Bytes one device sends for the linear alone: the model with it minus the model without."""
    from parlay.backends.jax.memory import collective_traffic
    from parlay.core import make_program

    traffic = lambda linear: _sent(collective_traffic(make_program(OneLinear(n, linear), strategy, Mesh(mesh), batch=n)))
    return traffic(True) - traffic(False)


def layer_figures(strategy: str, mesh: dict, config) -> tuple[int, int, int]:
    """(bytes sent, activation bytes kept, full activation bytes one device would keep alone) for
    one GPT layer: 2 layers minus 1."""
    from parlay.backends.jax.memory import activation_bytes, collective_traffic
    from parlay.core import make_program
    from parlay.core.models.gpt import GPT

    def figures(layers, strategy, mesh):
        p = make_program(GPT(dataclasses.replace(config, layers=layers)), strategy, Mesh(mesh), batch=BATCH)
        return _sent(collective_traffic(p)), activation_bytes(p)[0]

    (b2, a2), (b1, a1) = figures(2, strategy, mesh), figures(1, strategy, mesh)
    (_, w2), (_, w1) = figures(2, "dp", {"dp": 1}), figures(1, "dp", {"dp": 1})
    return b2 - b1, a2 - a1, w2 - w1


BATCH = 64


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024, help="the linear's matrices are n x n")
    parser.add_argument("--embed", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    from parlay.core.models.gpt import GPTConfig

    S = args.n * args.n * 4
    print(f"One linear, x, w, y all {args.n} x {args.n} fp32 (S = {S / 2**20:g} MiB): bytes per device, forward + "
          f"backward, from the plans, against the formula")
    print(f"{'':5} {'mesh':>22} {'plans':>12} {'formula':>12} {'ratio':>6}")
    for strategy, label, *meshes in MESHES:
        for mesh in meshes:
            got, want = linear_bytes(strategy, mesh, args.n), formula(label, mesh, S)
            print(f"{label:5} {'x'.join(map(str, mesh.values())):>22} {got:>12,} {want:>12,.0f} {got / want:>6.3f}")
    config = GPTConfig(vocab=4096, seq=args.seq, embed=args.embed, heads=64, kv_heads=64, layers=1,
                       mlp=4 * args.embed)
    print(f"\nOne GPT layer (embed {config.embed}, 64 heads, mlp {config.mlp}, batch {BATCH} x seq {config.seq}, "
          f"fp32): per device, forward + backward")
    print(f"{'':5} {'devices':>7} {'mesh':>9} {'sent MiB':>9} {'kept MiB':>9} {'kept/alone':>10}")
    for strategy, label, *meshes in MESHES:
        for mesh in meshes:
            sent, kept, alone = layer_figures(strategy, mesh, config)
            size = 1
            for v in mesh.values():
                size *= v
            print(f"{label:5} {size:>7} {'x'.join(map(str, mesh.values())):>9} {sent / 2**20:>9.1f} "
                  f"{kept / 2**20:>9.1f} {kept / alone:>10.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
