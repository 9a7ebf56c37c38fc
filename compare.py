"""``parlay compare``: one model, one strategy, one mesh, the same weights and batches, on every
backend, against the single-device reference.

Runs the reference (JAX on one device, by default) and each backend (torch on spawned gloo ranks,
JAX explicit, JAX GSPMD, the numpy simulator) for N AdamW steps through the same ``Session``
contract; reports each backend's loss per step, the largest relative difference of its step-1
gradients, and of its parameters after the last step (per tensor, the L2 norm of the difference
over the L2 norm of the distance the reference moved them). A backend that disagrees is bisected.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from .core.executor import Fault
from .core.model import model_dataset
from .core.precision import FP32, Precision
from .core.program import Program
from .core.session import BACKENDS, get_backend

__all__ = ["BACKENDS", "Tolerance", "BackendRun", "run_compare", "plot_compare", "compare_batches"]


@dataclass(frozen=True)
class Tolerance:
    """fp32 sums in another order: losses and gradients agree to ~1e-6 (measured); after AdamW
    steps single elements near Adam's eps can diverge, hence parameters per tensor (see
    tests/jax/test_sessions.py, where 2.2e-4 was measured)."""

    loss: float = 1e-5
    grad: float = 1e-4
    param: float = 2e-3

    @classmethod
    def of(cls, precision: Precision) -> "Tolerance":
        """bf16 and fp16 against the same framework's single device in the same precision. A
        16-bit value carries a relative rounding error up to its unit roundoff u (bf16 2^-8, fp16
        2^-11), and two correct runs round at different points (a tensor-parallel partial sum
        rounded before its float32 sum, a data-parallel gradient rounded per shard), so their
        values differ by a few roundings: step-1 gradients 4u per tensor (measured at most 2.0u,
        bf16, five strategies, both frameworks: tests/test_precision.py); the loss, a float32 mean
        over many tokens where independent roundings average out, u/4 (measured at most 0.07u over
        20 steps). Parameters are reported, not judged: Adam's update of an element is near its
        gradient's sign times the rate, so an element whose gradient is within a rounding of zero
        steps either way, 2 rates apart, whatever the layout (measured: 10.8u of the distance moved
        after 5 steps of the tiny GPT under dp+tp, 0.21 after 1 step of fsdp, where whole norm
        scales flip). A layout's bug moves gradients by their own size, far outside 4u."""
        if not precision.mixed:
            return cls()
        u = 2.0 ** -8 if precision.compute == "bfloat16" else 2.0 ** -11
        return cls(loss=u / 4, grad=4 * u, param=math.inf)


@dataclass
class BackendRun:
    name: str
    losses: list[float]
    grad_diff: float = 0.0
    param_diff: float = 0.0
    worst_grad: str = ""
    worst_param: str = ""
    grads: dict = field(default_factory=dict, repr=False)
    params: dict = field(default_factory=dict, repr=False)
    loss_diff: float = 0.0  # the largest relative loss difference over the steps
    agree: bool = True
    bisect: "object | None" = None  # a BisectReport where the run disagrees
    reference: str = ""  # the single-device run it was held to
    bisect_note: str = ""  # why a disagreeing run was not bisected
    others: list = field(default_factory=list, repr=False)  # a reference's: the other references run


NOISE = 1e-5  # a gradient below this fraction of the whole gradient's norm is rounding noise (see _noise)


def _noise(grads: dict) -> tuple[float, set]:
    """(floor, names): a tensor's gradient is judged against at least ``floor`` (NOISE times the
    whole gradient's norm), and ``names`` are the tensors whose reference gradient is below it.
    Their true gradient is zero (an attention key bias: softmax ignores a shift of a score row),
    so what each run computes is rounding alone, and AdamW turns that rounding into full steps of
    either sign: their parameters are reported, not judged. A real error in such a tensor is
    still caught once it exceeds the tolerance times the floor (1e-9 of the gradient's norm)."""
    floor = NOISE * float(np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values())))
    return floor, {k for k, g in grads.items() if np.linalg.norm(g) < floor}


def _rel(a: dict, b: dict, scale: dict, floor: float = 0.0, skip=frozenset()) -> tuple[float, str]:
    worst, name = 0.0, ""
    for k in b:
        if k in skip:
            continue
        denom = max(float(np.linalg.norm(scale[k])), floor)
        r = float(np.linalg.norm(a[k] - b[k]) / denom) if denom > 0 else float(np.abs(a[k] - b[k]).max())
        if not r <= worst:  # NaN is the worst
            worst, name = r, k
    return worst, name


def _rel_loss(a: float, b: float) -> float:
    """|a - b| / |b|; a non-finite loss on either side is as far as it gets."""
    if not (np.isfinite(a) and np.isfinite(b)):
        return float("inf")
    return abs(a - b) / abs(b) if b else abs(a - b)


def compare_steps(session, batches):
    """In every process of a run: step-1 gradients, then one AdamW step per batch; the final
    parameters."""
    _, grads = session.loss_and_grads(batches[0])
    losses = [session.step(b) for b in batches]
    return losses, grads, session.params()


def compare_batches(program: Program, steps: int, seed: int, data=None) -> list[dict]:
    """``steps`` batches of the model's dataset (or random inputs if it has none)."""
    if data is None:
        data = model_dataset(program.model, random=True)
    return [data.batch_at(t, program.batch, seed=seed) for t in range(steps)]


def reference_of(program: Program, backend: str, reference: str = "jax-single") -> str:
    """The single-device run a backend is held to: ``reference``, or under mixed precision the
    backend's own framework on one device (torch and JAX round 16-bit values differently)."""
    if program.precision.mixed and reference in ("jax-single", "torch-single"):
        return "torch-single" if backend.startswith("torch") else "jax-single"
    return reference


def run_compare(program: Program, *, steps: int, backends=BACKENDS, seed: int = 0, data=None,
                tol: Tolerance | None = None, bisect: bool = True, reference: str = "jax-single",
                params: dict | None = None, timeout_s: float = 900) -> tuple[BackendRun, list[BackendRun]]:
    """(reference, [one run per backend]) of ``program`` on ``steps`` batches of ``data`` (default:
    the model's dataset). A backend that disagrees beyond ``tol`` (default: the precision's) is
    bisected on the first batch. Under mixed precision each backend is held to its own framework's
    single device (``reference_of``; each run's ``reference`` names it). ``timeout_s``: the torch
    ranks' collective timeout."""
    tol = Tolerance.of(program.precision) if tol is None else tol
    batches = compare_batches(program, steps, seed, data)
    start = program.init(seed) if params is None else params
    refs: dict[str, BackendRun] = {}
    for name in dict.fromkeys([reference] + [reference_of(program, b, reference) for b in backends]):
        ref_losses, ref_grads, ref_params = get_backend(name).run(program, compare_steps, batches, params=start,
                                                                  seed=seed)
        refs[name] = BackendRun(name, ref_losses, grads=ref_grads, params=ref_params)
    runs = []
    for name in backends:
        ref = refs[reference_of(program, name, reference)]
        ref_losses, ref_grads, ref_params = ref.losses, ref.grads, ref.params
        moved = {k: ref_params[k] - start[k] for k in start}
        losses, grads, final = get_backend(name).run(program, compare_steps, batches, params=start, seed=seed,
                                                     timeout_s=timeout_s)
        run = BackendRun(name, losses, grads=grads, params=final, reference=ref.name)
        floor, noise = _noise(ref_grads)
        run.grad_diff, run.worst_grad = _rel(grads, ref_grads, ref_grads, floor)
        run.param_diff, run.worst_param = _rel(final, ref_params, moved, skip=noise)
        run.loss_diff = max(_rel_loss(a, b) for a, b in zip(losses, ref_losses))
        run.agree = run.loss_diff <= tol.loss and run.grad_diff <= tol.grad and run.param_diff <= tol.param
        if not run.agree and bisect:
            from .bisection import bisect as bisect_run

            try:
                if program.precision.mixed:  # a layout's bug shows exactly in float32, rounding does not hide it
                    run.bisect = bisect_run(name, program.replace(precision=FP32), batches[0], params=start,
                                            seed=seed, reference=ref.name)
                else:
                    run.bisect = bisect_run(name, program, batches[0], params=start, seed=seed, reference=reference,
                                            ref_grads=ref_grads, grads=grads)
            except ValueError as e:  # a run the bisect does not follow (a pipeline): the table still prints
                run.bisect_note = f"not bisected: {e}"
        runs.append(run)
    first = refs.pop(reference)
    first.others = list(refs.values())  # the other framework's single device, under mixed precision
    return first, runs


def drop_all_reduce(layer: str) -> Fault:
    """Fault injection, to watch the bisect work: every sharded executor (torch, JAX explicit,
    numpy) drops the forward all-reduces run while ``layer`` (a parameter-name prefix, e.g.
    ``blocks.1.mlp``) is the latest layer asked for its parameters: ``program.replace(fault=...)``."""
    return Fault("drop-all-reduce", layer)


def plot_compare(reference: BackendRun, runs: list[BackendRun], path: str, *, title: str, tol: Tolerance) -> None:
    """Loss curves of every backend, each backend's distance from the reference per step, and
    its gradient and parameter differences against the tolerances."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(reference.losses) + 1)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    a.plot(steps, reference.losses, "k-", lw=3, label=f"reference ({reference.name})")
    for r in runs:
        a.plot(steps, r.losses, "o--", label=r.name)
    a.set(xlabel="step", ylabel="loss", title="loss")
    a.legend()
    for r in runs:
        diff = [max(abs(x - y) / abs(y), 1e-12) for x, y in zip(r.losses, reference.losses)]
        b.semilogy(steps, diff, "o-", label=r.name)
    b.axhline(tol.loss, color="r", ls=":", label="tolerance")
    b.set(xlabel="step", ylabel="|loss - reference| / reference", title="loss difference (exact: 1e-12)")
    b.legend()
    x = np.arange(len(runs))
    c.bar(x - 0.2, [max(r.grad_diff, 1e-12) for r in runs], 0.4, label="step-1 gradients")
    c.bar(x + 0.2, [max(r.param_diff, 1e-12) for r in runs], 0.4, label=f"parameters after {len(steps)} steps")
    c.axhline(tol.grad, color="C0", ls=":")
    if math.isfinite(tol.param):  # (mixed precision reports parameters without judging them)
        c.axhline(tol.param, color="C1", ls=":")
    c.set_yscale("log")
    c.set_xticks(x, [r.name for r in runs])
    c.set(title="largest rel. difference per tensor\n(dotted: tolerances)")
    c.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
