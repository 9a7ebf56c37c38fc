"""parlay's Triton kernels against torch's own, on one CUDA GPU: checked, then timed, in one run.

Each kernel is first compared with its torch peer on the same inputs (outputs and gradients, with
the tolerance printed), then both are timed with ``triton.testing.do_bench`` (median ms):

- ``rms_norm`` / ``layer_norm`` vs ``torch.nn.functional.rms_norm`` / ``layer_norm``: GB/s;
- ``attention`` (causal, MHA and GQA) vs ``scaled_dot_product_attention`` on the flash backend:
  TFLOP/s (causal: half the square; forward+backward counted as 3.5 forwards, as FlashAttention);
- ``cross_entropy`` vs ``torch.nn.functional.cross_entropy``: GB/s;
- ``adamw_step`` vs ``torch.optim.AdamW(fused=True)``: GB/s (each element reads p, g, m, v and
  writes p, m, v).

"ratio" is parlay's time over the peer's: below 1 parlay is faster. The run exits 1 if a check
fails. End to end it takes well under five minutes on one H100/H200.

    python benchmarks/triton_gpu.py              # GPU sizes (bf16 activations, fp32 AdamW)
    python benchmarks/triton_gpu.py --markdown   # the table as markdown
    python benchmarks/triton_gpu.py --smoke      # tiny sizes on the CPU under TRITON_INTERPRET=1,
                                                 # a plain timer for do_bench: exercises the script
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Sizes:
    norm: tuple[int, int]  # (tokens, hidden)
    attention: tuple[int, int, int, int, int]  # (batch, heads, kv heads, seq, head_dim); GQA uses kv heads
    vocab: tuple[int, int]  # (tokens, vocab)
    adamw: tuple[tuple[int, ...], ...]  # parameter shapes
    dtype: torch.dtype


GPU = Sizes(norm=(16384, 4096), attention=(4, 32, 8, 4096, 128), vocab=(8192, 50304),
            adamw=((50304, 768),) + ((768, 2304), (768, 768), (768, 3072), (3072, 768), (768,), (768,)) * 12,
            dtype=torch.bfloat16)
SMOKE = Sizes(norm=(37, 24), attention=(1, 4, 2, 40, 24), vocab=(30, 101), adamw=((1000,), (3, 37), (5,)),
              dtype=torch.float32)


@dataclass
class Row:
    kernel: str
    shape: str
    passes: str
    parlay_ms: float
    peer_ms: float
    unit: str
    amount: float  # FLOPs or bytes of the measured pass
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def cells(self) -> list[str]:
        rate = lambda ms: f"{self.amount / (ms * 1e-3) / 1e12:.1f}" if self.unit == "TFLOP/s" else \
            f"{self.amount / (ms * 1e-3) / 1e9:.0f}"
        return [self.kernel, self.shape, self.passes, f"{self.parlay_ms:.3f}", f"{self.peer_ms:.3f}",
                f"{self.parlay_ms / self.peer_ms:.2f}", f"{rate(self.parlay_ms)} / {rate(self.peer_ms)} {self.unit}",
                f"{self.error:.1e} ({'ok' if self.ok else 'FAIL'} <= {self.tolerance:.0e})"]


HEADERS = ["kernel", "shape", "pass", "parlay ms", "peer ms", "ratio (parlay/peer)", "parlay / peer rate",
           "max rel. error vs peer"]


def _timer(smoke: bool) -> Callable[[Callable[[], object], Sequence[torch.Tensor]], float]:
    if not smoke:
        import triton.testing

        return lambda fn, grads: triton.testing.do_bench(fn, grad_to_none=list(grads), return_mode="median")

    def plain(fn, grads, reps: int = 3) -> float:
        times = []
        for _ in range(reps):
            for g in grads:
                g.grad = None
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)

    return plain


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _pair(name, shape, parlay_fn, peer_fn, inputs, unit, amounts, tol, bench, device) -> list[Row]:
    """Check parlay_fn against peer_fn (output and input gradients), then time the forward and the
    forward+backward of both. ``amounts``: (forward, forward+backward) FLOPs or bytes."""
    leaves = [t for t in inputs if t.requires_grad]
    outs, grads = [], []
    for fn in (parlay_fn, peer_fn):
        for t in leaves:
            t.grad = None
        out = fn()
        outs.append(out.detach())
        out.backward(torch.ones_like(out) if out.ndim == 0 else _fixed_grad(out))
        grads.append([t.grad.detach().clone() for t in leaves])
    error = max([_rel(outs[0], outs[1])] + [_rel(a, b) for a, b in zip(grads[0], grads[1])])
    g = _fixed_grad(outs[0]) if outs[0].ndim else torch.ones((), device=device, dtype=outs[0].dtype)
    rows = []
    for passes, amount in zip(("fwd", "fwd+bwd"), amounts):
        times = []
        for fn in (parlay_fn, peer_fn):
            if passes == "fwd":
                with torch.no_grad():
                    times.append(bench(fn, []))
            else:
                times.append(bench(lambda fn=fn: fn().backward(g), leaves))
        rows.append(Row(name, shape, passes, times[0], times[1], unit, amount, error, tol))
    return rows


def _fixed_grad(out: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator(device=out.device).manual_seed(1)
    return torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)


def norm_rows(s: Sizes, device, bench, tk) -> list[Row]:
    m, n = s.norm
    isz = torch.finfo(s.dtype).bits // 8
    x = torch.randn(m, n, device=device, dtype=s.dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n, device=device, dtype=s.dtype)).requires_grad_()
    b = (0.1 * torch.randn(n, device=device, dtype=s.dtype)).requires_grad_()
    tol = 2e-2 if s.dtype != torch.float32 else 1e-4
    # fwd: read x, write y; bwd: read x and dy, write dx (weights are negligible)
    amounts = (2 * m * n * isz, 5 * m * n * isz)
    rows = _pair("rms_norm", f"{m}x{n} {_dt(s.dtype)}", lambda: tk.rms_norm(x, w, 1e-5),
                 lambda: F.rms_norm(x, (n,), w, 1e-5), [x, w], "GB/s", amounts, tol, bench, device)
    rows += _pair("layer_norm", f"{m}x{n} {_dt(s.dtype)}", lambda: tk.layer_norm(x, w, b, 1e-5),
                  lambda: F.layer_norm(x, (n,), w, b, 1e-5), [x, w, b], "GB/s", amounts, tol, bench, device)
    return rows


def attention_rows(s: Sizes, device, bench, tk, smoke: bool) -> list[Row]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, HKV, S, D = s.attention
    rows = []
    for label, hkv in (("MHA", H), ("GQA", HKV)):
        q = torch.randn(B, H, S, D, device=device, dtype=s.dtype, requires_grad=True)
        k = torch.randn(B, hkv, S, D, device=device, dtype=s.dtype, requires_grad=True)
        v = torch.randn(B, hkv, S, D, device=device, dtype=s.dtype, requires_grad=True)
        backends = [SDPBackend.MATH] if smoke else [SDPBackend.FLASH_ATTENTION]
        repeat = False  # torch's flash backend may not take GQA: then k, v are repeated per query head

        def peer(q=q, k=k, v=v, hkv=hkv):
            with sdpa_kernel(backends):
                if repeat:
                    k, v = k.repeat_interleave(H // hkv, 1), v.repeat_interleave(H // hkv, 1)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != H and not repeat)

        if hkv != H:
            try:
                with torch.no_grad():
                    peer()
            except RuntimeError:
                repeat, label = True, "GQA (peer: kv repeated)"

        fwd = 4 * B * H * S * S * D / 2  # two matmuls of 2*S*S*D each, half of them masked away
        tol = 3e-2 if s.dtype != torch.float32 else 1e-4
        rows += _pair(f"attention {label}", f"B{B} H{H}/{hkv} S{S} D{D} {_dt(s.dtype)} causal",
                      lambda q=q, k=k, v=v: tk.attention(q, k, v, causal=True), peer, [q, k, v], "TFLOP/s",
                      (fwd, 3.5 * fwd), tol, bench, device)
    return rows


def cross_entropy_rows(s: Sizes, device, bench, tk) -> list[Row]:
    m, vocab = s.vocab
    isz = torch.finfo(s.dtype).bits // 8
    logits = (2 * torch.randn(m, vocab, device=device, dtype=s.dtype)).requires_grad_()
    targets = torch.randint(0, vocab, (m,), device=device)
    tol = 2e-2 if s.dtype != torch.float32 else 1e-5
    # fwd reads the logits; bwd reads them again and writes their gradient
    return _pair("cross_entropy", f"{m}x{vocab} {_dt(s.dtype)}", lambda: tk.cross_entropy(logits, targets),
                 lambda: F.cross_entropy(logits, targets), [logits], "GB/s",
                 (m * vocab * isz, 3 * m * vocab * isz), tol, bench, device)


def adamw_rows(s: Sizes, device, bench, tk) -> list[Row]:
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(sh, device=device, generator=gen) for sh in s.adamw]
    grads = [torch.randn(sh, device=device, generator=gen) for sh in s.adamw]
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    peer_params = [p.clone().requires_grad_() for p in params]
    for p, g in zip(peer_params, grads):
        p.grad = g
    opt = torch.optim.AdamW(peer_params, fused=True, **hp)
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = 3
    for step in range(1, steps + 1):  # check: three steps each, then compare parameters and moments
        tk.adamw_step(params, grads, ms, vs, step=step, lr=hp["lr"], beta1=0.9, beta2=0.95, eps=hp["eps"],
                      weight_decay=hp["weight_decay"])
        opt.step()
    error = max(max(_rel(a, b.detach()) for a, b in zip(params, peer_params)),
                max(_rel(a, opt.state[p]["exp_avg_sq"]) for a, p in zip(vs, peer_params)))
    n = sum(p.numel() for p in params)
    t_parlay = bench(lambda: tk.adamw_step(params, grads, ms, vs, step=steps + 1, lr=hp["lr"], beta1=0.9, beta2=0.95,
                                           eps=hp["eps"], weight_decay=hp["weight_decay"]), [])
    t_peer = bench(opt.step, [])
    return [Row("adamw_step", f"{len(params)} tensors, {n / 1e6:.1f}M fp32", "step", t_parlay, t_peer, "GB/s",
                7 * 4 * n, error, 1e-5)]


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _print(rows: list[Row], markdown: bool, title: str) -> None:
    if markdown:
        print(f"\n{title}\n")
        print("| " + " | ".join(HEADERS) + " |")
        print("|" + "---|" * len(HEADERS))
        for r in rows:
            print("| " + " | ".join(r.cells()) + " |")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in HEADERS:
        table.add_column(h)
    for r in rows:
        table.add_row(*r.cells())
    Console(width=200).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, Triton's interpreter, a plain timer")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read at each launch (parlay.triton_kernels._launch)
        device, sizes = torch.device("cpu"), SMOKE
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke to exercise the script on the CPU", file=sys.stderr)
            return 2
        device, sizes = torch.device("cuda"), GPU
    from parlay import triton_kernels as tk

    torch.manual_seed(0)
    bench = _timer(args.smoke)
    start = time.perf_counter()
    rows = (norm_rows(sizes, device, bench, tk) + attention_rows(sizes, device, bench, tk, args.smoke)
            + cross_entropy_rows(sizes, device, bench, tk) + adamw_rows(sizes, device, bench, tk))
    where = "CPU, Triton interpreter (smoke: not a measurement)" if args.smoke else torch.cuda.get_device_name()
    _print(rows, args.markdown, f"parlay Triton kernels vs torch on {where}; {time.perf_counter() - start:.0f} s")
    failed = [f"{r.kernel} {r.passes}" for r in rows if not r.ok]
    if failed:
        print(f"checks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
