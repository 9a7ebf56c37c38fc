"""``parlay step``: a few training steps of a preset model on a backend, on random tokens.

A smoke test of a strategy on a mesh: one line per step with the loss and the time. On the torch
backend parlay starts one gloo process per rank itself (``--ranks``, default the mesh size).
"""

from __future__ import annotations

import time

import numpy as np

from .xla_env import use_host_devices

__all__ = ["run_steps"]


def _torch_worker(rank, preset, strategy, axes, batch, steps, seed):
    from .backends.torch.train import ShardedModel, ShardedTrainer
    from .core import Mesh
    from .core.model import GPT, PRESETS

    model = GPT(PRESETS[preset])
    tokens = np.random.default_rng(seed).integers(0, model.config.vocab, (batch, model.config.seq + 1))
    trainer = ShardedTrainer(ShardedModel(model, strategy, Mesh(axes), batch=batch), model.init(seed))
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = trainer.step(tokens[:, :-1], tokens[:, 1:])
        out.append((loss, time.perf_counter() - start))
    return out


def run_steps(backend: str, preset: str, strategy: str, mesh, *, batch: int, steps: int, seed: int = 0,
              ranks: int | None = None, mode: str = "explicit", timeout_s: float = 600) -> list[tuple[float, float]]:
    """[(loss, seconds)] per step."""
    from .core.model import GPT, PRESETS
    from .core.strategies import get_strategy

    model = GPT(PRESETS[preset])
    get_strategy(strategy).check(mesh, model.config, batch=batch)  # fail before starting anything
    if backend == "torch":
        from .backends.torch.launch import spawn

        ranks = mesh.size if ranks is None else ranks
        mesh.check_world_size(ranks)
        return spawn(_torch_worker, ranks, preset, strategy, dict(mesh.axes), batch, steps, seed,
                     timeout_s=timeout_s)[0]
    if backend == "jax":
        use_host_devices(mesh.size)
        from .backends.jax.train import TrainStep

        tokens = np.random.default_rng(seed).integers(0, model.config.vocab, (batch, model.config.seq + 1))
        step = TrainStep(model, strategy=strategy, mesh=mesh, mode=mode, batch=batch)
        state, out = step.init(model.init(seed)), []
        for _ in range(steps):
            start = time.perf_counter()
            state, loss = step(state, tokens[:, :-1], tokens[:, 1:])
            out.append((float(loss), time.perf_counter() - start))
        return out
    raise ValueError(f"backend {backend!r} is unknown; choose torch or jax.")
