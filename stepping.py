"""``parlay step``: a few training steps of a model on a backend, on one batch of random inputs.

A smoke test of a strategy on a mesh: one line per step with the loss and the time. On the torch
backend parlay starts one gloo process per rank itself.
"""

from __future__ import annotations

import time

from .core.model import RandomData
from .core.program import Program
from .core.session import get_backend

__all__ = ["run_steps"]


def timed_steps(session, batches):
    """In every process of a run: [(loss, seconds)] per batch."""
    out = []
    for b in batches:
        start = time.perf_counter()
        loss = session.step(b)
        out.append((loss, time.perf_counter() - start))
    return out


def run_steps(backend: str, program: Program, *, steps: int, seed: int = 0, timeout_s: float = 600
              ) -> list[tuple[float, float]]:
    """[(loss, seconds)] per step, on random inputs drawn from the model's ``InputDecl``s (the
    same batch every step)."""
    batch = RandomData(program.model).batch_at(0, program.batch, seed=seed)
    return get_backend(backend).run(program, timed_steps, [batch] * steps, seed=seed, timeout_s=timeout_s)
