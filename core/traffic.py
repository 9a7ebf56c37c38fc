"""What one training step sends besides its forward and backward: the optimizer step's moves.

torch's session (backends/torch/session.py, without gradient buckets) steps AdamW on each
parameter's optimizer shard: the gradient goes from the layout the backward left it in (the
parameter's own) to the optimizer layout, and after the update the parameter goes from the
optimizer layout back to its own (ZeRO's all-gather), each a ``plan_redistribute`` plan. Where
the two layouts are one (no ZeRO), AdamW steps the parameter in place and nothing moves. The
global gradient norm (clipping) is one all-reduce of a float64 scalar over every rank.
"""

from __future__ import annotations

from .log import CollectiveLog, Source, layer_of
from .plan import plan_redistribute
from .program import Program
from .steps import Kind
from .strategies import Role

__all__ = ["optimizer_moves", "NORM_BYTES"]

NORM_BYTES = 8  # the squared gradient norm's partial sum, float64, all-reduced over every rank


def optimizer_moves(program: Program, log: CollectiveLog | None = None, rank: int = 0) -> CollectiveLog:
    """The optimizer step's plan steps on ``rank`` (float32 masters and gradients), each recorded
    under its parameter's layer (``layer_of``), forward, source plan: what torch's session logs
    in ``step`` after the backward; under a pipeline, those of the parameters ``rank``'s pp rank
    holds. The norm's all-reduce is not among them (torch does not log it: ``NORM_BYTES``)."""
    log = CollectiveLog() if log is None else log
    lay, pipe = program.layouts, program.pipeline
    # under a pipeline each pp rank steps the parameters its stages use
    mine = program.shapes if pipe is None else pipe.params_of_rank(program.mesh.coord(rank, pipe.axis))
    for name, shape in program.shapes.items():
        if name not in mine:
            continue
        own, opt = lay[Role.PARAMS][name], lay[Role.OPTIMIZER][name]
        if opt == own and not program.offload:
            continue  # AdamW steps the parameter itself
        for src, dst in ((own, opt), (opt, own)):
            plan = plan_redistribute(src, dst, shape, itemsize=4)
            for step, sent in zip(plan.steps, plan.step_bytes):
                if step.kind is not Kind.LOCAL_SLICE:
                    log.record(step.kind, tuple(getattr(step, "axes", ())), sent[rank], False, Source.PLAN, "float32",
                               layer_of(name))
    return log
