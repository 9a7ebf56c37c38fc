"""The bisect's recording and comparison, backend-neutral: where a run parts from the reference.

The model calls the same neutral ops in the same order on every backend, so the i-th op call of
one run matches the i-th of another. A ``Recorder`` wraps a backend's ``Ops`` and captures every
op's output; on an explicit executor (torch, JAX shard_map) it also taps every plan step, and
each step's output is checked against what the core simulator computes from the step's input:
that names a collective that does not do what its plan says, independently of the reference.

Values are compared as global arrays: an explicit run's per-rank blocks are assembled with
``core.sim.gather`` (pending partials summed; replicas that differ are a finding of their own).
If the forward agrees everywhere, gradients are compared per parameter in backward order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .sim import gather, simulate_step
from .steps import AllReduce, ReduceScatter

__all__ = ["Probe", "StepCheck", "Recorder", "BisectReport", "OP_TOL", "STEP_TOL", "assemble", "check_step",
           "compare_probes"]

OP_TOL = 1e-4  # relative L2 difference of an op's output (fp32 sums in another order: ~1e-7)
STEP_TOL = 1e-5  # a sum against the simulator, over its addends' size (data moves must be exact: 0)


@dataclass
class StepCheck:
    """One plan step run inside an op, and how far its output is from the simulator's."""

    plan: str
    step: str
    index: int
    count: int
    rel_err: float | None = None
    error: str | None = None
    exact: bool = True  # a data move: must equal the simulator's bits; a sum: within STEP_TOL

    @property
    def ok(self) -> bool:
        if self.error is not None or self.rel_err is None:
            return False
        return self.rel_err == 0 if self.exact else self.rel_err <= STEP_TOL

    def describe(self) -> str:
        what = f"{self.step} (step {self.index + 1}/{self.count} of {self.plan})"
        if self.error:
            return f"{what}: {self.error}"
        rule = "must be exact" if self.exact else f"over its addends' size, tolerance {STEP_TOL:g}"
        return f"{what}: rel. error {self.rel_err:.1e} against the simulator ({rule})"


@dataclass
class Probe:
    """One op call: its name, the layer it belongs to, its output as a global array."""

    index: int
    op: str
    scope: str
    value: np.ndarray | None = None
    error: str | None = None
    steps: list[StepCheck] = field(default_factory=list)
    layout: Any = None
    pieces: dict = field(default_factory=dict, repr=False)  # rank -> local block (explicit runs)

    @property
    def where(self) -> str:
        return f"op #{self.index} {self.op} in {self.scope}"


def _describe(name: str, args: Sequence) -> str:
    if name == "einsum":
        return f"einsum {args[0]}"
    if name == "param":
        return f"param {args[0]}"
    if name == "constrain":
        return f"constrain {tuple(args[1])}"
    return name


class Recorder:
    """An ``Ops`` that forwards every call to ``ops`` and hands each output to ``capture(probe,
    out)``. ``probe.scope`` is the layer: the dotted prefix of the last parameter the model asked
    for (``blocks.1.mlp``). On the sharded executor (it has ``hooks``), ``on_step(probe, plan, i,
    before, after)`` sees every plan step run inside the current op."""

    def __init__(self, ops, capture: Callable[[Probe, Any], None], on_step: Callable | None = None):
        self._ops, self._capture, self._on_step = ops, capture, on_step
        self.probes: list[Probe] = []
        self.outside: list[Probe] = []
        self._scope = "input"
        self._current: Probe | None = None
        if on_step is not None and hasattr(ops, "hooks"):  # the sharded executor: tap every plan step
            ops.hooks.tap = lambda plan, i, before, after: on_step(self._outside() if self._current is None
                                                                   else self._current, plan, i, before, after)

    def _outside(self) -> Probe:
        """A plan step run outside any op call (the model never does this: every redistribution
        is inside an op). Kept apart, so op i still matches op i of the other run."""
        probe = Probe(-1, "(outside any op)", self._scope)
        self.outside.append(probe)
        return probe

    def __getattr__(self, name: str):
        fn = getattr(self._ops, name)
        if name.startswith("_") or not callable(fn):
            return fn

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if name == "param":
                self._scope = args[0].rsplit(".", 1)[0]
            probe = Probe(len(self.probes), _describe(name, args), self._scope)
            self.probes.append(probe)
            self._current = probe
            try:
                out = fn(*args, **kwargs)
            finally:
                self._current = None  # a plan step outside any op is not this op's
            self._capture(probe, out)
            return out

        return call


# -- assembling explicit runs' blocks ---------------------------------------------------------------

def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    scale = np.linalg.norm(b)
    diff = np.linalg.norm(a - b)
    return float(diff / scale) if scale > 0 else float(diff)


def assemble(probe: Probe, world: int) -> None:
    """``probe.value`` from ``probe.pieces`` (one block per rank) and ``probe.layout``."""
    if sorted(probe.pieces) != list(range(world)):
        probe.error = f"blocks arrived from ranks {sorted(probe.pieces)} of {world}"
        return
    try:
        probe.value = gather([probe.pieces[r] for r in range(world)], probe.layout)
        probe.pieces = {}
    except ValueError as e:  # replicas that differ: keep the blocks, to show rank 0's
        probe.error = str(e)


def check_step(plan, i: int, before: Sequence[np.ndarray], after: Sequence[np.ndarray]) -> StepCheck:
    """Step ``i`` of ``plan`` as run (per-rank inputs and outputs) against ``simulate_step``. A
    data move (gather, all-to-all, slice, permute) must be exact; a sum may differ by the order
    of its additions, measured against the size of its addends (not of the sum, which may cancel)."""
    step = plan.steps[i]
    check = StepCheck(f"{plan.src} -> {plan.dst}", str(step), i, len(plan.steps))
    before = [np.asarray(b) for b in before]
    expected = simulate_step(step, before, plan.layouts[i])
    sums = isinstance(step, (AllReduce, ReduceScatter))
    check.exact = not sums
    scale = sum(float(np.linalg.norm(np.asarray(b, np.float64))) for b in before) if sums else 0.0
    worst = 0.0
    for r, (got, want) in enumerate(zip(after, expected)):
        if tuple(np.shape(got)) != tuple(np.shape(want)):
            check.error = f"rank {r} holds shape {tuple(np.shape(got))}; the plan says {tuple(np.shape(want))}"
            return check
        diff = float(np.linalg.norm(np.asarray(got, np.float64) - np.asarray(want, np.float64)))
        if sums:
            worst = max(worst, diff / scale if scale > 0 else diff)
        elif diff:
            worst = max(worst, float("inf") if not np.linalg.norm(want) else diff / float(np.linalg.norm(want)))
    check.rel_err = worst
    return check


# -- the report -------------------------------------------------------------------------------------

def _stats(x: np.ndarray | None, probe: Probe | None = None) -> str:
    what = ""
    if x is None:
        if probe is None or 0 not in probe.pieces:
            return "missing"
        x, what = probe.pieces[0], "rank 0's block: "
    x = np.asarray(x, np.float64)
    return f"{what}shape {x.shape}, mean {x.mean():+.4e}, std {x.std():.4e}, max|x| {np.abs(x).max():.4e}"


@dataclass
class BisectReport:
    backend: str
    ops: int
    first_op: Probe | None = None
    first_op_rel: float | None = None
    reference_stats: str = ""
    backend_stats: str = ""
    first_collective: tuple[Probe, StepCheck] | None = None
    collectives_checked: int = 0
    first_grad: tuple[str, float] | None = None
    grads_compared: bool = False
    structure: str | None = None  # the two runs called different ops

    def lines(self) -> list[str]:
        out = [f"bisect of {self.backend} against the reference on the first batch ({self.ops} ops"
               + (f", {self.collectives_checked} collective{'s' if self.collectives_checked != 1 else ''} checked against the "
                  f"simulator)" if self.collectives_checked else ")")]
        if self.structure:
            out.append(f"  the runs call different ops: {self.structure}")
        if self.first_op is not None:
            p = self.first_op
            out.append(f"  first op where the runs part: {p.where}"
                       + (f" ({p.error})" if p.error else f" (rel. difference {self.first_op_rel:.2e} > {OP_TOL:g})"))
            out.append(f"    reference: {self.reference_stats}")
            out.append(f"    {self.backend}: {self.backend_stats}")
        if self.first_collective is not None:
            p, c = self.first_collective
            out.append(f"  first collective that disagrees with its plan: {c.describe()}, in {p.where}")
        elif self.collectives_checked:
            out.append(f"  every collective did what its plan says (data moves exact, sums within {STEP_TOL:g})")
        if self.first_op is None and not self.structure:
            out.append(f"  the forward agrees at every op (rel. difference <= {OP_TOL:g})")
            if self.first_grad is not None:
                name, rel = self.first_grad
                out.append(f"  first gradient (in backward order) that differs: {name} (rel. {rel:.2e}): the backward "
                           f"pass parts there")
            elif self.grads_compared:
                out.append("  gradients agree too: the runs part in the optimizer step or later batches")
        return out

    def to_json(self) -> dict:
        return {
            "ops": self.ops,
            "first_op": None if self.first_op is None else {
                "index": self.first_op.index, "op": self.first_op.op, "layer": self.first_op.scope,
                "rel_diff": self.first_op_rel, "error": self.first_op.error,
                "reference": self.reference_stats, "backend": self.backend_stats},
            "first_collective": None if self.first_collective is None else {
                "op_index": self.first_collective[0].index, "layer": self.first_collective[0].scope,
                "step": self.first_collective[1].step, "plan": self.first_collective[1].plan,
                "rel_err": self.first_collective[1].rel_err, "error": self.first_collective[1].error},
            "collectives_checked": self.collectives_checked,
            "first_grad": None if self.first_grad is None else {"name": self.first_grad[0], "rel_diff": self.first_grad[1]},
            "structure": self.structure,
        }


def compare_probes(backend: str, reference: list[Probe], probes: list[Probe], *, ref_grads=None, grads=None,
                   grad_order: Sequence[str] = (), grad_tol: float = 1e-4) -> BisectReport:
    """``probes`` may end with the recording's plan steps outside any op (index -1): their
    collectives are checked with the others; only op calls are matched with the reference."""
    checked = probes
    reference = [p for p in reference if p.index >= 0]
    probes = [p for p in probes if p.index >= 0]
    report = BisectReport(backend, len(probes))
    for a, b in zip(reference, probes):
        if a.op != b.op:
            report.structure = f"op #{a.index} is {a.op} on the reference, {b.op} on {backend}"
            break
    else:
        if len(reference) != len(probes):
            report.structure = f"the reference calls {len(reference)} ops, {backend} {len(probes)}"
    for a, b in zip(reference, probes):
        if report.structure and a.op != b.op:
            break
        rel = None if b.error else _rel(b.value, a.value)
        if b.error or not rel <= OP_TOL:  # NaN parts too
            report.first_op, report.first_op_rel = b, rel
            report.reference_stats, report.backend_stats = _stats(a.value), _stats(b.value, b)
            break
    for p in checked:
        report.collectives_checked += len(p.steps)
        bad = next((c for c in p.steps if not c.ok), None)
        if bad is not None and report.first_collective is None:
            report.first_collective = (p, bad)
    if ref_grads is not None and grads is not None:
        report.grads_compared = True
        for name in grad_order:
            rel = _rel(grads[name], ref_grads[name])
            if not rel <= grad_tol:
                report.first_grad = (name, rel)
                break
    return report
