"""What a training step holds on each device, predicted from the program before it runs: the
parameters, gradients and AdamW moments from their layouts (float32, core/precision.py), the
batch's blocks, and the activations the backward keeps under the precision and remat policies.

Model state is exact: every tensor's block in its layout, on the device that holds the most
(under a pipeline, the pp rank whose stages hold the most parameters); under offload AdamW's
moments are counted in host memory, not the device's. Activations are what
reverse-mode autodiff keeps between the forward and the backward of one device's program: the
sharded executor is traced on shapes alone (``parlay.backends.jax.memory``, reached by name
through the backend registry: no device, no FLOP), its collectives replaced by ops of the same
local shapes, and JAX's own residual analysis (``saved_residuals``) lists what ``jax.vjp`` would
keep, remat policy included. Under a pipeline
the stash is the schedule's peak of stage activations (``simulate_schedule``) times one stage's
microbatch residuals (torch keeps each in-flight microbatch's graph), or its input (JAX's
pipelines recompute a stage in its backward) plus one stage's residuals.

JAX explicit's pipeline, the tick loop (``backend="jax"``), holds more; measured with ``parlay plan
--check``: one more gradient-sized buffer, the sums the loop carries from tick to tick
(``accumulators``: XLA's temporary bytes hold them beside the gradients it returns, within 4% on
pp=2·dp=4 with 1F1B at 2, 4 and 8 microbatches, GPipe at 4 and 8, 4 layers, 4 examples a
microbatch); and, as it runs every pp rank as one program, each rank holds its stages' stacked
parameters and a block of every parameter that is not stacked (the embedding, the head, a tied
table), with their gradients and moments (``Pipeline.held_by_loop``). Accumulation's scan without
a pipeline carries its sums too, but XLA's temporary bytes there grow by less than the gradients
(0.64 of them: ``parlay plan --strategy dp --mesh dp=4 --batch 16 --microbatches 2 --check``), so
none is added.

What it does not count: temporaries inside one op or one collective, the gradient of an
activation while the backward runs, a framework's workspace and fragmentation. ``peak`` is the
state plus the batch, the kept activations, the accumulators and the largest single value the model
computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .program import Program
from .strategies import Role

__all__ = ["MemoryReport", "memory_report", "state_bytes"]

F32 = 4


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per device (the busiest one)."""

    params: int
    grads: int
    optimizer: int  # on the device (0 under offload)
    inputs: int
    activations: int | None  # None: not predicted (``detail`` says why)
    largest: int  # the largest value one op computes, on one device
    unsharded: float  # the share of parameter elements every rank holds whole
    detail: str = ""  # how the activations were counted
    host: int = 0  # AdamW's moments in host memory (offload)
    accumulators: int = 0  # the gradient sums JAX's tick loop carries across ticks

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int | None:
        if self.activations is None:
            return None
        return self.state + self.inputs + self.activations + self.accumulators + self.largest

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters (float32)", self.params), ("gradients (float32)", self.grads),
                ("AdamW moments (float32)", self.optimizer), ("batch", self.inputs),
                ("activations kept for the backward", self.activations),
                ("gradient accumulators (float32)", self.accumulators), ("largest single value", self.largest),
                ("peak (sum)", self.peak)]

    def to_json(self) -> dict:
        return {**{k: getattr(self, k) for k in ("params", "grads", "optimizer", "host", "inputs", "activations",
                                                 "accumulators", "largest")},
                "peak": self.peak, "unsharded_share": self.unsharded, "detail": self.detail}


def _block_elems(program: Program, role: Role, names) -> int:
    lay, shapes = program.layouts[role], program.shapes
    return sum(math.prod(lay[k].local_shape(shapes[k])) for k in names)


def state_bytes(program: Program, backend: str = "torch") -> tuple[int, int, int]:
    """(parameters, gradients, AdamW moments) per device in bytes, on the device holding the most
    (under JAX's tick loop, what each pp rank holds there: ``Pipeline.held_by_loop``)."""
    pipe = program.pipeline
    if pipe is None:
        holders = [program.shapes]
    elif backend == "jax":
        holders = [pipe.held_by_loop(r, program.shapes) for r in range(pipe.schedule.ranks)]
    else:
        holders = [pipe.params_of_rank(r) for r in range(pipe.schedule.ranks)]
    best = (0, 0, 0)
    for names in holders:
        names = list(names)
        got = (F32 * _block_elems(program, Role.PARAMS, names), F32 * _block_elems(program, Role.GRADS, names),
               2 * F32 * _block_elems(program, Role.OPTIMIZER, names))
        best = max(best, got, key=sum)
    return best


def memory_report(program: Program, backend: str = "torch") -> MemoryReport:
    """The per-device memory of one training step of ``program`` on ``backend`` (which matters
    under a pipeline only: see ``activation_bytes``); see the module's docstring."""
    from .session import get_backend

    params, grads, opt = state_bytes(program, backend)
    looped = backend == "jax" and program.pipeline is not None
    lay = program.layouts[Role.ACTIVATIONS]
    inputs = sum(math.prod(lay[k].local_shape(d.shape)) * d.dtype.numpy.itemsize
                 for k, d in program.inputs.items())
    runs_on = getattr(program.model, "runs_on", None)
    if runs_on and "jax" not in runs_on:  # a model the sharded executor does not run (an NNX module)
        activations, largest, detail = None, 0, f"the model runs on {', '.join(runs_on)} only, not the sharded executor"
    else:
        # JAX's tracer counts them (backends/jax/memory.py), reached by name like every backend
        activations, largest, detail = get_backend("jax-single").activation_bytes(program, backend)
    total = sum(math.prod(s) for s in program.shapes.values())
    whole = sum(math.prod(s) for k, s in program.shapes.items() if not program.layouts[Role.PARAMS][k].spec.axes)
    host, opt = (opt, 0) if program.offload else (0, opt)
    return MemoryReport(params, grads, opt, inputs, activations, largest, whole / total if total else 0.0, detail,
                        host, grads if looped else 0)
