"""Layer-by-layer bisect: where a backend's run of the model parts from the reference's.

Each backend's session records one forward op by op (``Session.trace``: every op's output as a
global array; on the sharded executors every plan step checked against the simulator), and
``core.trace.compare_probes`` names the first op and the first collective where the runs part;
if the forward agrees, gradients are compared per parameter in backward order.
"""

from __future__ import annotations

from .core.program import Program
from .core.session import get_backend
from .core.trace import BisectReport, compare_probes

__all__ = ["bisect", "trace"]


def trace(session, batch):
    """In every process of a run: the session's recording of one forward (the lead's)."""
    return session.trace(batch)


def bisect(backend: str, program: Program, batch, *, params=None, seed: int = 0, reference: str = "jax-single",
           ref_grads=None, grads=None) -> BisectReport:
    """Record ``reference`` and ``backend`` on one batch and name where they part."""
    if program.seq_order is not None:
        raise ValueError(f"strategy {program.strategy.name!r} lays the sequence out zigzag, so the sharded run's "
                         f"activations are in another order than the reference's; the same strategy with "
                         f"ring_contiguous in place of ring can be bisected")
    ref = get_backend(reference).run(program, trace, batch, params=params, seed=seed)
    probes = get_backend(backend).run(program, trace, batch, params=params, seed=seed, timeout_s=600)
    order = [d.name for d in reversed(program.decls)]
    return compare_probes(backend, ref, probes, ref_grads=ref_grads, grads=grads, grad_order=order)
