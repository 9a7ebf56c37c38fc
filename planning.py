"""``parlay plan``: what one training step of a program sends and holds, before anything runs.

The collectives are counted on rank 0 without a device: the forward and backward by tracing the
sharded executor on shapes (``collective_traffic``, the JAX backend's tracer, reached by name
through the registry), the optimizer step from its plans (``core/traffic.py``); together they are
the records torch's session logs in ``step`` without gradient buckets (tests/torch/test_traffic.py
checks them equal, strategy by strategy). Each record is counted under the layer it belongs to
(``core/log.py: layer_of``). Memory is ``core/memory.py``'s report; a pipeline's bubble is its
schedule's (``simulate_schedule``, equal stage costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .core.log import CollectiveLog, CollectiveRecord, layer_of
from .core.memory import MemoryReport, memory_report
from .core.program import Program
from .core.steps import Kind
from .core.cost import PROFILES, Profile, StepTime, Written, step_time
from .core.strategies import Role
from .core.traffic import NORM_BYTES, optimizer_moves

__all__ = ["PlanReport", "plan_report", "predict", "print_plan", "PHASES"]

PHASES = ("forward", "backward", "optimizer")


@dataclass
class PlanReport:
    program: Program
    records: dict[str, list[CollectiveRecord]] = field(default_factory=dict)  # by phase
    memory: MemoryReport | None = None
    bubble: float | None = None  # the pipeline's idle share of a step (None: no pipeline)
    note: str = ""  # why something is not counted
    flops: int | None = None  # rank 0's matrix-product FLOPs in one forward and backward
    written: Written | None = None  # the bytes rank 0's other ops write in it (the memory-bound rest)
    backend: str = "torch"  # whose program it counts (differs under a pipeline: ``_pipeline_records``)

    def sent(self, phase: str | None = None) -> int:
        return sum(r.nbytes for p in ([phase] if phase else PHASES) for r in self.records.get(p, ()))

    def by_layer(self) -> list[tuple[str, dict[str, tuple[int, int]]]]:
        """(layer, {phase: (count, bytes)}) in the order the model declares the layers."""
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for phase in PHASES:
            for r in self.records.get(phase, ()):
                row = out.setdefault(r.where or "(model)", {})
                c, n = row.get(phase, (0, 0))
                row[phase] = (c + 1, n + r.nbytes)
        order = list(dict.fromkeys(layer_of(n) for n in self.program.shapes))
        return sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))

    def by_kind(self) -> list[tuple[str, tuple[str, ...], dict[str, tuple[int, int]]]]:
        """(kind, axes, {phase: (count, bytes)})."""
        out: dict[tuple, dict[str, tuple[int, int]]] = {}
        for phase in PHASES:
            for r in self.records.get(phase, ()):
                row = out.setdefault((r.kind.value, r.axes), {})
                c, n = row.get(phase, (0, 0))
                row[phase] = (c + 1, n + r.nbytes)
        return [(k, a, row) for (k, a), row in out.items()]

    def to_json(self) -> dict[str, Any]:
        p = self.program
        rec = lambda r: {"kind": r.kind.value, "axes": list(r.axes), "bytes": r.nbytes, "source": r.source.value,
                         "dtype": r.dtype, "layer": r.where, "backward": r.backward, "recomputed": r.again}
        pair = lambda row: {ph: {"count": c, "bytes": n} for ph, (c, n) in row.items()}
        return {
            "model": p.model_ref, "strategy": p.strategy.name, "mesh": dict(p.mesh.axes), "batch": p.batch,
            "precision": p.precision.name, "remat": p.remat.value, "microbatches": p.microbatches,
            "collectives": {ph: [rec(r) for r in self.records.get(ph, ())] for ph in PHASES},
            "sent_bytes": {ph: self.sent(ph) for ph in PHASES} | {"total": self.sent()},
            "clip_norm_all_reduce": {"axes": list(p.mesh.axis_names), "bytes": NORM_BYTES, "dtype": "float64"},
            "per_layer": {layer: pair(row) for layer, row in self.by_layer()},
            "per_kind": [{"kind": k, "axes": list(a), **pair(row)} for k, a, row in self.by_kind()],
            "memory": None if self.memory is None else self.memory.to_json(),
            "bubble": self.bubble, "note": self.note,
        }


def predict(report: PlanReport, profile: Profile | str) -> StepTime | None:
    """The report's step time on ``profile`` (core/cost.py; a name in ``PROFILES``), or None where
    its collectives are not counted (a pipeline, an NNX model)."""
    profile = PROFILES[profile] if isinstance(profile, str) else profile
    if report.flops is None:
        return None
    p = report.program
    lay = p.layouts[Role.OPTIMIZER]
    elems = sum(math.prod(lay[k].local_shape(s)) for k, s in p.shapes.items())
    records = [r for ph in PHASES for r in report.records[ph]]
    return step_time(p.mesh, records, report.flops, report.written, elems, profile, p.precision.compute)


def plan_report(program: Program, backend: str = "torch") -> PlanReport:
    """Every collective of one training step on rank 0 (forward, backward, optimizer step; local
    slices, which send nothing, left out), the memory of the busiest device on ``backend`` (a
    pipeline's stash differs per framework), the pipeline's bubble.

    A step of m microbatches (accumulation, or a pipeline's) runs each microbatch's forward and
    backward collectives m times; the parameters' gradient sums wait for the last microbatch and
    run once (torch's gradient buckets). Under a pipeline, rank 0 runs its own stages' collectives
    (each stage traced as the torch backend runs it), sends each microbatch's stage output to the
    next pp rank and its input gradient to the previous one, sums the gradients of parameters
    held by several pp ranks (a tied table) over pp, and steps its own parameters; on ``jax``,
    as JAX's tick loop runs it (``_pipeline_records``)."""
    from .core.schedule import simulate_schedule
    from .core.session import get_backend

    report = PlanReport(program, memory=memory_report(program, backend), backend=backend)
    if getattr(program.model, "runs_on", None):
        report.note = f"the model runs on {', '.join(program.model.runs_on)} only, not the sharded executor: its " \
                      f"collectives are XLA's (GSPMD)"
        return report
    m = program.microbatches
    tracer = get_backend("jax-single")
    if program.pipeline is not None:
        report.bubble = simulate_schedule(program.pipeline.schedule).bubble
        forward, backward = _pipeline_records(program, tracer, backend=backend)
        mean = "one float32 all-reduce" if backend == "jax" else "one float64 all-reduce, as the clip norm's"
        report.note = (f"the loss's mean over pp ({mean}) is not counted; a pipeline's time is the search's (parlay "
                       f"plan --devices), not predicted here")
    else:
        traced, flops, written = tracer.trace_step(program)
        report.flops, report.written = m * flops, Written(m * written.ops, m * written.kernels)
        forward, backward = _repeated(traced.entries, m)
    report.records = {"forward": forward, "backward": backward,
                      "optimizer": _sent(optimizer_moves(program, CollectiveLog()).entries)}
    return report


def _sent(records) -> list:
    return [r for r in records if r.kind is not Kind.LOCAL_SLICE]


def _repeated(records, m: int) -> tuple[list, list]:
    """(forward, backward) of ``m`` microbatches of one microbatch's ``records``: the parameters'
    gradient sums once."""
    each = [r for r in _sent(records) if not r.param]
    once = [r for r in _sent(records) if r.param]
    # remat's recomputed collectives (``again``) run in the backward, though torch logs them as forward
    return [r for r in each if not (r.backward or r.again)] * m, [r for r in each if r.backward or r.again] * m + once


def _pipeline_records(program: Program, tracer, pp_rank: int = 0, backend: str = "torch") -> tuple[list, list]:
    """(forward, backward) records of pp rank ``pp_rank``'s stages in one step, sends included.

    torch keeps each forward's graph, so a backward piece runs only the backward's collectives.
    JAX's tick loop (backends/jax/ticks.py) keeps only a stage's input: each backward piece (B, or
    I and W) runs the stage's forward again under ``jax.vjp``, so its collectives too, in the
    backward; and it sums each parameter's gradient once a step after the loop (torch once a
    stage), a tied table's block as the parameters are laid out (torch: the gradient bucket's). A
    parameter the executor sums over two sets of axes is summed per piece in the loop (its
    ``accumulation["per_microbatch"]``); this counts it once a step, so the check shows it."""
    from collections import Counter

    from .core.log import Source
    from .core.schedule import Op

    pipe, m = program.pipeline, program.microbatches
    sc, p, lay = pipe.schedule, program.micro, program.layouts
    shape, dims = p.model.residual(p.batch)
    x_bytes = math.prod(p.activation(dims, shape).local_shape(tuple(shape))) * p.precision.compute_itemsize
    loop = backend == "jax"
    forward, backward, once = [], [], {}
    for stage in sc.stages_of(pp_rank):
        runs = Counter(a.op for a in sc.actions[pp_rank] if a.stage == stage)  # m F, and m B or m (I, W)
        whole = tracer.trace_stage(program, stage).entries
        fwd = _repeated([r for r in whole if not r.backward], runs[Op.F])[0]
        bwd, summed = [], False
        for op in (Op.B, Op.I, Op.W):  # each pass with the recomputation it runs (``again``)
            if runs[op]:
                entries = _sent(whole if op is Op.B else tracer.trace_stage(program, stage, op.value).entries)
                if loop:  # the stage's forward again, then its backward; each parameter's sums once a step
                    bwd += [r for r in entries if not r.param] * runs[op]
                    for r in entries:
                        if r.param:
                            once.setdefault((r.param, r.axes), r)
                    continue
                each = [r for r in entries if (r.backward or r.again) and not (summed and r.param)]  # sums: once
                bwd += _repeated(each, runs[op])[1]
                summed = summed or any(r.param for r in each)
        where = f"pp stage {stage}"
        if stage < pipe.stages - 1 and sc.rank_of(stage + 1) != pp_rank:  # its output, to the next stage's rank
            fwd += [CollectiveRecord(Kind.PERMUTE, (pipe.axis,), x_bytes, False, Source.P2P, p.precision.compute,
                                     where)] * m
        if stage > 0 and sc.rank_of(stage - 1) != pp_rank:  # its input's gradient, back to the previous one
            bwd += [CollectiveRecord(Kind.PERMUTE, (pipe.axis,), x_bytes, True, Source.P2P, p.precision.compute,
                                     where)] * m
        forward, backward = forward + fwd, backward + bwd
    backward += list(once.values())
    for k in pipe.shared_params:  # every pp rank joins the sum (those without the table add zeros)
        layout = lay[Role.PARAMS if loop else Role.GRADS][k]  # torch's, with its gradient buckets
        backward.append(CollectiveRecord(Kind.ALL_REDUCE, (pipe.axis,),
                                         math.prod(layout.local_shape(program.shapes[k])) * 4, True, Source.OP,
                                         "float32", layer_of(k), k))
    return forward, backward


def print_plan(report: PlanReport, console, title: str) -> None:
    """The report's collectives as two tables (by layer, consecutive equal layers folded into one
    row; by kind and axes), the clipping norm's all-reduce, the pipeline's bubble."""
    from rich.table import Table

    from .cli import _size

    p = report.program
    console.print(f"plan: {title} (nothing runs: one step traced on shapes; rank 0)", soft_wrap=True)
    if report.bubble is not None:
        pipe = p.pipeline
        console.print(f"pipeline: {pipe.schedule.name}, {pipe.stages} stages on {pipe.schedule.ranks} ranks, "
                      f"{p.microbatches} microbatches: bubble {report.bubble:.1%} of a step (equal stage costs)",
                      soft_wrap=True)
    if report.note:
        console.print(f"collectives: {report.note}", soft_wrap=True)
    if not report.records:
        return
    cell = lambda row, ph: f"{row[ph][0]} / {_size(row[ph][1])}" if ph in row else ""
    table = Table(title="collectives per layer (count / bytes sent by rank 0)", title_justify="left")
    for col in ("layer", *PHASES, "total"):
        table.add_column(col, justify="left" if col == "layer" else "right", no_wrap=True)
    rows, folded = report.by_layer(), []
    for layer, row in rows:  # blocks.0 .. blocks.47 with equal counts: one row
        if folded and folded[-1][2] == row and layer.rsplit(".", 1)[0] == folded[-1][0].rsplit(".", 1)[0] \
                and layer.rsplit(".", 1)[-1].isdigit():
            folded[-1][1] = layer
        else:
            folded.append([layer, layer, row])
    for first, last, row in folded:
        name = first if first == last else f"{first}-{last.rsplit('.', 1)[-1]} (each)"
        table.add_row(name, *(cell(row, ph) for ph in PHASES), _size(sum(n for _, n in row.values())))
    table.add_row("step", *(_size(report.sent(ph)) for ph in PHASES), _size(report.sent()), style="bold")
    console.print(table)
    kinds = Table(title="by kind and mesh axes", title_justify="left")
    for col in ("kind", "axes", *PHASES):
        kinds.add_column(col, justify="left" if col in ("kind", "axes") else "right", no_wrap=True)
    for kind, axes, row in report.by_kind():
        kinds.add_row(kind, ",".join(axes) or "-", *(cell(row, ph) for ph in PHASES))
    console.print(kinds)
    console.print(f"and the gradient norm for clipping: one all-reduce of {NORM_BYTES} B (float64) over all "
                  f"{p.mesh.size} ranks", soft_wrap=True)
    again = [r for r in report.records.get("backward", ()) if r.again]
    if again:
        console.print(f"remat {p.remat.value}: {len(again)} of the backward's collectives "
                      f"({_size(sum(r.nbytes for r in again))}) are the forward's run again by the recomputation (torch's "
                      f"checkpoint re-runs a layer up to its last op that keeps a tensor for the backward)",
                      soft_wrap=True)
