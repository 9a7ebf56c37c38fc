"""``parlay plan --check``: the plan against what JAX explicit runs and XLA compiles for the same
program.

The program is built on this machine's JAX devices in explicit mode (``shard_map``, parlay's own
collectives) and its two jitted functions compiled, nothing run:

- the loss and gradients: the collectives of its optimized HLO (``hlo.parse_collectives``),
  device 0's bytes by kind, against the plan's forward and backward records (rank 0's); and the
  temporary bytes of its ``memory_analysis()`` against the activations the plan predicts;
- the whole training step (gradients and AdamW's update, the state donated): its collectives
  less the gradients' are the optimizer's, against the plan's optimizer records; its
  ``memory_analysis()`` total (arguments + outputs - aliased + temporary) against the plan's
  predicted peak;
- the loss and gradients' jaxpr, before XLA (``jaxpr_traffic``): JAX explicit's collectives,
  forward and backward, by phase, kind and mesh axes, against the plan's, exactly (``jax_rows``).

Under a pipeline the step is JAX's tick loop (backends/jax/ticks.py): each device runs the
branch its table row names each tick, which neither the HLO nor the jaxpr says. Its jaxpr is
read told pp rank 0's row (``JaxLoopSession.traffic``) and compared with the plan of JAX's loop
(the report must be ``plan_report(program, "jax")``: a backward piece runs its stage's forward
again); its HLO's
collectives are not compared (``hlo.py`` counts a conditional's branches only as a bound); its
memory is, as above.

XLA's counts differ by design: XLA combines collectives of one group into one instruction (its
all-reduce combiner) and drops a collective whose result another already computed. Bytes are
compared instead: equal up to the rounding of the ring formula (each record and each
instruction rounds to whole bytes, ``tolerance``). Where they differ the check says so, with the
kinds' rows side by side; the README's "Checking a plan against XLA" lists the differences
measured for the built-in strategies and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.program import Program

__all__ = ["KindCheck", "PlanCheck", "check_plan", "traffic_rows"]

PHASES = ("fwd+bwd", "optimizer")


@dataclass(frozen=True)
class KindCheck:
    """One kind of collective in one phase: the plan's records against XLA's instructions."""

    phase: str
    kind: str
    plan_count: int
    plan_bytes: int  # rank 0 sends (the plan)
    xla_count: int
    xla_bytes: int  # device 0 sends (the optimized HLO)

    @property
    def tolerance(self) -> int:
        """The ring formula rounds each record down to whole elements (at most 4 bytes each) and
        each HLO instruction up to a whole byte."""
        return 4 * self.plan_count + self.xla_count

    @property
    def equal(self) -> bool:
        return abs(self.xla_bytes - self.plan_bytes) <= self.tolerance

    def to_json(self) -> dict:
        return {"phase": self.phase, "kind": self.kind, "plan": [self.plan_count, self.plan_bytes],
                "xla": [self.xla_count, self.xla_bytes], "equal": self.equal}


@dataclass
class PlanCheck:
    rows: list[KindCheck] = field(default_factory=list)
    norm_bytes: int = 0  # XLA's clip-norm partial sums: scalar all-reduces the optimizer adds
    activations: tuple[int, int] = (0, 0)  # (predicted activations + accumulators, XLA temporary bytes of the gradients)
    peak: tuple[int, int] = (0, 0)  # (predicted, XLA's total for the step)
    accumulators: int = 0  # of ``activations[0]``: the gradient sums JAX's loop carries (core/memory.py)
    # the plan's forward and backward beside JAX explicit's jaxpr (``traffic_rows``): exactly
    jax_rows: list[tuple] = field(default_factory=list)
    # k microbatches: the parameters JAX explicit sums per microbatch, and why a step fell back to that
    accumulation: dict | None = None
    hlo: bool = True  # False: the HLO's collectives not compared (a pipeline's tick loop)

    @property
    def equal(self) -> bool:
        return all(r.equal for r in self.rows)

    @property
    def jax_equal(self) -> bool:
        return all(r[3:5] == r[5:7] for r in self.jax_rows)

    def to_json(self) -> dict:
        ratio = lambda pair: pair[0] / pair[1] if pair[1] else None
        return {"collectives": [r.to_json() for r in self.rows], "hlo_compared": self.hlo,
                "xla_clip_norm_bytes": self.norm_bytes if self.hlo else None,
                "activations": {"predicted": self.activations[0], "xla_temp": self.activations[1],
                                "ratio": ratio(self.activations), "of_which_accumulators": self.accumulators},
                "peak": {"predicted": self.peak[0], "xla_total": self.peak[1], "ratio": ratio(self.peak)},
                "jax_explicit": [{"phase": ph, "kind": kind, "axes": list(axes), "plan": [pc, pb], "jax": [jc, jb],
                                  "equal": (pc, pb) == (jc, jb)} for ph, kind, axes, pc, pb, jc, jb in self.jax_rows]}


def traffic_rows(records: dict, log, mesh) -> list[tuple]:
    """The plan's forward and backward records (``records``: phase -> records) beside JAX
    explicit's (``log``: ``jaxpr_traffic``'s), by phase, kind and axes: rows of (phase, kind, axes,
    plan count, plan bytes, JAX count, JAX bytes). A plan's layout permute names no axes (its
    pairs name devices); JAX's runs over every axis of the mesh: it is counted under those. A part
    of an axis is ``tp[part]`` on both sides (the plan's sub-axis ``tp.1``, JAX's prime atoms
    ``tp#1``: which part, the record does not say). A sum over a group of one sends nothing and
    is left out on both sides (XLA drops it; JAX's variance types and the plan each ask for some),
    and so is a size-1 axis from a group's axes (JAX's sums leave it out, the plan's may name it)."""
    whole = tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1)

    def key(phase, r):
        axes = whole if r.kind.value == "permute" and not r.axes else r.axes
        axes = [a for a in axes if a.partition(".")[0].partition("#")[0] in whole]
        return phase, r.kind.value, tuple(dict.fromkeys(_whole_or_part(a) for a in axes))

    plan = [(ph, r) for ph in ("forward", "backward") for r in records.get(ph, ())]  # a recomputation's: backward
    jax_ = [("backward" if r.backward else "forward", r) for r in log.entries]
    sides: list[dict] = [{}, {}]
    for side, entries in ((0, plan), (1, jax_)):
        for phase, r in entries:
            if r.kind.value != "local-slice" and (r.nbytes or r.kind.value == "permute"):
                row = sides[side].setdefault(key(phase, r), [0, 0])
                row[0] += 1
                row[1] += r.nbytes
    return [(*k, *sides[0].get(k, (0, 0)), *sides[1].get(k, (0, 0)))
            for k in sorted(set(sides[0]) | set(sides[1]), key=lambda k: (k[0] != "forward", k[1:]))]


def _whole_or_part(axis: str) -> str:
    base = axis.partition(".")[0].partition("#")[0]
    return base if base == axis else f"{base}[part]"


def _by_kind(colls, device: int = 0) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for c in colls:
        row = out.setdefault(c.kind.value, [0, 0])
        row[0] += c.trips
        row[1] += c.trips * c.per_device.get(device, 0)
    return out


def _scalar_all_reduce_bytes(colls, device: int = 0) -> int:
    """Device ``device``'s bytes in all-reduces of one-element operands (norms' partial sums)."""
    from ...core import Kind, collective_bytes

    return sum(collective_bytes(Kind.ALL_REDUCE, c.group_size, 1, c.itemsize) * c.operand_elems.count(1) * c.trips
               for c in colls if c.kind is Kind.ALL_REDUCE and device in c.per_device)


def check_plan(report, batch=None) -> PlanCheck:
    """Compile ``report.program`` on JAX explicit and compare (module docstring)."""
    import numpy as np

    from ...core import get_backend
    from ...core.memory import memory_report
    from ...core.ops import step_words
    from .hlo import parse_collectives

    program: Program = report.program
    if program.pipeline is not None and report.backend != "jax":
        raise ValueError(f"--check of a pipeline compares JAX's tick loop with the plan of it; this plan counts "
                         f"{report.backend}'s pipeline: pass plan_report(program, 'jax')")
    # what JAX keeps (the backend changes the report under a pipeline only, which is JAX's here)
    memory = report.memory if report.memory is not None else memory_report(program, "jax")
    if memory.activations is None:
        raise ValueError(f"--check needs the plan's memory prediction: {memory.detail}")
    if batch is None:  # compiled, never run: the values do not matter
        batch = {k: np.zeros(d.shape, d.dtype.numpy) for k, d in program.inputs.items()}
    if program.pipeline is not None:
        return _check_loop(report, memory, batch)

    def compile_both(session, batch):
        grads = session._grads.lower(session.state["params"], session._place_microbatches(batch),
                                     step_words(0)).compile()
        step = session._step.lower(session.state, *session._step_args(batch)).compile()
        return (grads.as_text(), grads.memory_analysis(), step.as_text(), step.memory_analysis(),
                session.traffic(batch), dict(session.accumulation))

    g_hlo, g_mem, s_hlo, s_mem, traffic, accumulation = get_backend("jax").run(program, compile_both, batch)
    n = program.mesh.size
    g_colls, s_colls = parse_collectives(g_hlo, n), parse_collectives(s_hlo, n)
    g, s = _by_kind(g_colls), _by_kind(s_colls)
    opt = {k: [s.get(k, [0, 0])[i] - g.get(k, [0, 0])[i] for i in (0, 1)] for k in set(s) | set(g)}
    norm = _scalar_all_reduce_bytes(s_colls) - _scalar_all_reduce_bytes(g_colls)
    if "all-reduce" in opt:  # the norm's partial sums are reported on their own line
        opt["all-reduce"][1] -= norm

    out = PlanCheck(norm_bytes=norm, jax_rows=traffic_rows(report.records, traffic, program.mesh),
                    accumulation=accumulation if program.microbatches > 1 else None)
    for phase, plan_phases, xla in ((PHASES[0], ("forward", "backward"), g), (PHASES[1], ("optimizer",), opt)):
        plan: dict[str, list[int]] = {}
        for p in plan_phases:
            for r in report.records.get(p, ()):
                if r.kind.value == "local-slice":
                    continue
                row = plan.setdefault(r.kind.value, [0, 0])
                row[0] += 1
                row[1] += r.nbytes
        for kind in sorted(set(plan) | set(xla)):
            (pc, pb), (xc, xb) = plan.get(kind, [0, 0]), xla.get(kind, [0, 0])
            if pc or pb or xb:  # (a count alone: XLA combined the two functions' differently)
                out.rows.append(KindCheck(phase, kind, pc, pb, max(xc, 0), xb))
    return _with_memory(out, memory, g_mem, s_mem)


def _with_memory(out: PlanCheck, memory, g_mem, s_mem) -> PlanCheck:
    """``out`` with the predicted memory beside XLA's: the kept activations (and a loop's gradient
    accumulators) against the gradient function's temporary bytes, the peak against the step's
    whole footprint."""
    out.activations = (memory.activations + memory.accumulators, g_mem.temp_size_in_bytes)
    out.accumulators = memory.accumulators
    out.peak = (memory.peak, _step_total(s_mem))
    return out


def _step_total(mem) -> int:
    """A compiled step's whole footprint: arguments + outputs - donated + temporary bytes."""
    return (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes)


def _check_loop(report, memory, batch) -> PlanCheck:
    """``check_plan`` of a pipelined program: JAX's tick loop, against ``report`` (JAX's plan of it)."""
    from ...core import get_backend

    program = report.program

    def compile_both(session, batch):
        grads = session._grads.lower(session.state["params"], *session._args(batch)).compile()
        return (grads.memory_analysis(), session.compiled_step(batch).memory_analysis(), session.traffic(batch),
                dict(session.accumulation))

    g_mem, s_mem, traffic, accumulation = get_backend("jax").run(program, compile_both, batch)
    out = PlanCheck(jax_rows=traffic_rows(report.records, traffic, program.mesh),
                    accumulation=accumulation, hlo=False)
    return _with_memory(out, memory, g_mem, s_mem)
