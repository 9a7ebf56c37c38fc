"""``parlay compare``: one model, one strategy, one mesh, the same weights and batches, on every
backend, against the single-device reference.

Runs the reference (JAX, one device), torch (spawned gloo ranks), JAX explicit (shard_map) and
JAX GSPMD for N AdamW steps; reports each backend's loss per step, the largest relative
difference of its step-1 gradients, and of its parameters after the last step (per tensor, the
L2 norm of the difference over the L2 norm of the distance the reference moved them).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import numpy as np

from .xla_env import use_host_devices

__all__ = ["BACKENDS", "Tolerance", "BackendRun", "run_compare", "plot_compare", "drop_all_reduce"]

BACKENDS = ("torch", "jax", "jax-gspmd")


@dataclass(frozen=True)
class Tolerance:
    """fp32 sums in another order: losses and gradients agree to ~1e-6 (measured); after AdamW
    steps single elements near Adam's eps can diverge, hence parameters per tensor (see
    tests/jax/test_train.py, where 2.2e-4 was measured)."""

    loss: float = 1e-5
    grad: float = 1e-4
    param: float = 2e-3


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


def _rel(a: dict, b: dict, scale: dict) -> tuple[float, str]:
    worst, name = 0.0, ""
    for k in b:
        denom = np.linalg.norm(scale[k])
        r = float(np.linalg.norm(a[k] - b[k]) / denom) if denom > 0 else float(np.abs(a[k] - b[k]).max())
        if r > worst:
            worst, name = r, k
    return worst, name


def _torch_worker(rank, preset, strategy, axes, batches, seed):
    from .backends.torch.train import ShardedModel, ShardedTrainer
    from .core import Mesh
    from .core.model import GPT, PRESETS

    model = GPT(PRESETS[preset])
    params = model.init(seed)
    sm = ShardedModel(model, strategy, Mesh(axes), batch=len(batches[0][0]))
    trainer = ShardedTrainer(sm, params)
    x, y = batches[0]
    loss = sm.loss(trainer.local, x, y)
    sm.backward(loss)
    grads = sm.gather_grads(trainer.local)
    for p in trainer.local.values():
        p.grad = None
    losses = [trainer.step(x, y) for x, y in batches]
    final = trainer.gather_params()
    return (losses, grads, final) if rank == 0 else None


def _jax_run(model, params, batches, mode, strategy=None, mesh=None):
    from .backends.jax.train import TrainStep

    step = TrainStep(model, strategy=strategy, mesh=mesh, mode=mode, batch=len(batches[0][0]))
    state = step.init(params)
    _, grads = step.loss_and_grads(state, *batches[0])
    losses = []
    for x, y in batches:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return losses, grads, step.params(state)


@contextlib.contextmanager
def drop_all_reduce(layer: str, backend: str = "jax"):
    """Fault injection, to watch the bisect work: in the explicit executor of ``backend`` ("jax":
    shard_map, "torch": this process's ranks), every forward all-reduce run while ``layer`` (a
    parameter-name prefix, e.g. ``blocks.1.mlp``) is the latest layer asked for its parameters
    returns its input unchanged. Yields ``{"count": n}``, the all-reduces dropped so far."""
    from .core import AllReduce

    if backend == "jax":
        from .backends.jax import collectives as steps
        from .backends.jax.explicit import ExplicitOps
    elif backend == "torch":
        from .backends.torch import explicit as steps
        from .backends.torch.explicit import ExplicitOps
    else:
        raise ValueError(f"drop_all_reduce: backend {backend!r} is not jax or torch.")
    real_param, real_step, scope = ExplicitOps.param, steps.run_step, {"name": ""}
    dropped = {"count": 0}

    def param(self, name, value, dims):
        scope["name"] = name
        return real_param(self, name, value, dims)

    def run_step(step, x, *args):
        if isinstance(step, AllReduce) and scope["name"].startswith(layer + "."):
            dropped["count"] += 1
            return x
        return real_step(step, x, *args)

    ExplicitOps.param, steps.run_step = param, run_step
    try:
        yield dropped
    finally:
        ExplicitOps.param, steps.run_step = real_param, real_step


def run_compare(preset: str, strategy: str, mesh, *, steps: int, batch: int, backends=BACKENDS, seed: int = 0,
                corpus=None, tol: Tolerance = Tolerance(), bisect: bool = True) -> tuple[BackendRun, list[BackendRun]]:
    """(reference, [one run per backend]) on batches drawn from ``corpus`` (default: the stdlib).
    A backend that disagrees beyond ``tol`` is bisected on the first batch (``run.bisect``)."""
    from .core.model import GPT, PRESETS
    from .core.strategies import get_strategy
    from .data import load_corpus

    model = GPT(PRESETS[preset])
    get_strategy(strategy).check(mesh, model.config, batch=batch)
    use_host_devices(mesh.size)
    corpus = corpus or load_corpus(max_bytes=2 * 2**20)
    if model.config.vocab < 256:
        raise ValueError(f"model {preset!r} has vocab {model.config.vocab}; byte-level text needs 256.")
    stream = corpus.batches(batch, model.config.seq, seed=seed)
    batches = [next(stream) for _ in range(steps)]
    params = model.init(seed)

    ref_losses, ref_grads, ref_params = _jax_run(model, params, batches, "single")
    reference = BackendRun("reference", ref_losses, grads=ref_grads, params=ref_params)
    moved = {k: ref_params[k] - params[k] for k in params}
    runs = []
    for name in backends:
        if name == "torch":
            from .backends.torch.launch import spawn

            losses, grads, final = spawn(_torch_worker, mesh.size, preset, strategy, dict(mesh.axes), batches, seed,
                                         timeout_s=900)[0]
        elif name in ("jax", "jax-gspmd"):
            losses, grads, final = _jax_run(model, params, batches, "explicit" if name == "jax" else "gspmd",
                                            strategy, mesh)
        else:
            raise ValueError(f"backend {name!r} is unknown; choose from {', '.join(BACKENDS)}.")
        run = BackendRun(name, losses, grads=grads, params=final)
        run.grad_diff, run.worst_grad = _rel(grads, ref_grads, ref_grads)
        run.param_diff, run.worst_param = _rel(final, ref_params, moved)
        run.loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        run.agree = run.loss_diff <= tol.loss and run.grad_diff <= tol.grad and run.param_diff <= tol.param
        if not run.agree and bisect:
            from .bisection import bisect as bisect_run

            run.bisect = bisect_run(name, model, strategy, mesh, params, *batches[0], seed=seed, preset=preset,
                                    ref_grads=ref_grads, grads=grads)
        runs.append(run)
    return reference, runs


def plot_compare(reference: BackendRun, runs: list[BackendRun], path: str, *, title: str, tol: Tolerance) -> None:
    """Loss curves of every backend, each backend's distance from the reference per step, and
    its gradient and parameter differences against the tolerances."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(reference.losses) + 1)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    a.plot(steps, reference.losses, "k-", lw=3, label="reference (1 device)")
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
