"""Pipeline parallelism: a model's repeated layers cut into stages over a ``pp`` mesh axis, run
microbatch by microbatch in the order a ``core.schedule.Schedule`` gives.

A model that can be pipelined splits its loss in three (``PipelineModel``): ``embed`` (inputs to
the residual stream), ``layer(i)`` for its L repeated layers, and ``head`` (the residual stream
to the loss). The logical dim ``layers`` names those L layers, and a rule ``("layers", "pp")``
(the ``pp`` strategy) puts them on the pp axis: with S = p * v stages, stage k runs layers
[k L/S, (k+1) L/S), the first stage also the embedding and the last also the head; the
schedule's placement (loop or V) says which pp rank runs each stage. No parameter is stacked:
each pp rank holds the parameters its stages use (``Pipeline.stages_of_param``), in their
layouts over the other mesh axes, which the strategy's other rules set as usual (dp, zero,
fsdp, tp, ...): the executor runs a stage on its pp rank's slice of the mesh, and nothing a
stage computes varies over pp.

``run_pipeline`` interprets the schedule's actions (with their sends and receives) once for
every backend, over a ``StageRunner`` (forward a stage, its backward, or only its input or
weight gradient) and a ``Transport`` (a batch of point-to-point ops). The last stage seeds each
microbatch's backward with 1/m: the model's loss is a mean over the examples of a microbatch,
all microbatches hold as many, so the step's loss and gradients are the whole batch's (the
loss normalised once, never per microbatch or per stage).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from .mesh import Mesh
from .ops import Ops
from .schedule import Action, Op, Schedule, ScheduleError, ScheduleKind, make_schedule

__all__ = ["PipelineModel", "Pipeline", "PipelineError", "make_pipeline", "pipeline_problems", "pipeline_axis", "run_pipeline",
           "StageRunner", "Transport", "Mailbox", "LAYERS"]

LAYERS = "layers"  # the logical dim of a model's repeated layers


@runtime_checkable
class PipelineModel(Protocol):
    """A ``Model`` whose loss is ``head(layer(L-1, ... layer(0, embed(batch)) ...), batch)``."""

    def layers(self) -> int: ...

    def residual(self, batch: int) -> tuple[tuple[int, ...], tuple]:
        """(global shape, logical dims) of the value between layers, for a batch of ``batch``."""

    def embed(self, ops: Ops, params: Mapping[str, Any], batch: Mapping[str, Any]) -> Any: ...

    def layer(self, ops: Ops, params: Mapping[str, Any], i: int, x: Any) -> Any: ...

    def head(self, ops: Ops, params: Mapping[str, Any], x: Any, batch: Mapping[str, Any]) -> Any: ...


class PipelineError(ScheduleError):
    """A model or mesh that cannot be pipelined; ``problems`` lists every reason."""


@dataclass(frozen=True)
class Pipeline:
    """Which stage runs which layers and uses which parameters, on which pp rank, in what order."""

    axis: str
    schedule: Schedule
    layers_of_stage: tuple[tuple[int, ...], ...]
    params_of_stage: tuple[frozenset, ...]
    # each stage's parameters that one layer alone uses, in declaration order: what a loop that runs
    # every stage as one program stacks (backends/jax/ticks.py); the rest it holds on every pp rank
    stacked_of_stage: tuple[tuple[str, ...], ...]

    @property
    def stages(self) -> int:
        return self.schedule.stages

    @property
    def ranks(self) -> int:
        return self.schedule.ranks

    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    def params_of_rank(self, rank: int) -> frozenset:
        return frozenset().union(*(self.params_of_stage[s] for s in self.schedule.stages_of(rank)))

    def held_by_loop(self, rank: int, names) -> frozenset:
        """The parameters (of ``names``, all the model's) pp rank ``rank`` holds in the JAX tick
        loop: its stages' stacked ones, and every parameter that is not stacked (the embedding,
        the head, a tied table: each pp rank holds a block of it, used or not)."""
        stacked = {n for ns in self.stacked_of_stage for n in ns}
        mine = {n for s in self.schedule.stages_of(rank) for n in self.stacked_of_stage[s]}
        return frozenset(mine | (set(names) - stacked))

    def __post_init__(self):
        # Who holds each parameter, once: sessions ask for every parameter every step.
        holders: dict = {}
        for s, names in enumerate(self.params_of_stage):
            for n in names:
                holders.setdefault(n, set()).add(self.schedule.rank_of(s))
        object.__setattr__(self, "_holders", {n: tuple(sorted(r)) for n, r in holders.items()})

    def ranks_of_param(self, name: str) -> tuple[int, ...]:
        """The pp ranks that hold (and update) parameter ``name``: one, or several where stages
        on several ranks use it (a tied embedding and LM head)."""
        return self._holders[name]

    def rank_of_param(self, name: str) -> int:
        """The first pp rank that holds parameter ``name`` (where its checkpoint blocks come from)."""
        return self.ranks_of_param(name)[0]

    @property
    def shared_params(self) -> tuple[str, ...]:
        """Parameters held by more than one pp rank: their gradients are summed over those ranks
        (Megatron's embedding group), so every copy takes the same update."""
        return tuple(sorted(n for n, ranks in self._holders.items() if len(ranks) > 1))

    def describe(self) -> str:
        sc = self.schedule
        return (f"{sc.name} over {self.axis}={sc.ranks}, {sc.stages} stages, {sc.microbatches} microbatches: "
                + "; ".join(f"stage {s} (rank {sc.rank_of(s)}) layers {list(ls)}"
                            for s, ls in enumerate(self.layers_of_stage)))


def pipeline_axis(strategy) -> str | None:
    """The mesh axis a strategy maps ``layers`` to (its pipeline axis), if any."""
    from .strategies import Role

    axes = {ax for role in Role for name, ax in strategy.rules(role).rules if name == LAYERS and ax}
    if not axes:
        return None
    if len(axes) > 1 or len(next(iter(axes))) != 1:
        raise PipelineError(f"strategy {strategy.name!r} maps {LAYERS!r} to {sorted(axes)}; a pipeline runs over one "
                            f"mesh axis: one rule ({LAYERS!r}, 'pp').")
    return next(iter(axes))[0]


def pipeline_problems(model, mesh: Mesh, axis: str, *, schedule: str | ScheduleKind, microbatches: int,
                      virtual: int | None = None) -> list[str]:
    """Every reason ``model`` cannot be pipelined over ``mesh``'s ``axis`` under ``schedule`` (the
    schedule's and the layers' both, so one error lists them all)."""
    return _checked(model, mesh, axis, schedule, microbatches, virtual)[1]


def _checked(model, mesh: Mesh, axis: str, schedule, microbatches: int, virtual) -> tuple[Schedule | None, list[str]]:
    """(the schedule, if it could be built; every problem)."""
    missing = [m for m in ("layers", "residual", "embed", "layer", "head") if not callable(getattr(model, m, None))]
    if missing:
        return None, [f"it lacks {', '.join(f'{m}()' for m in missing)}; a pipelined model splits its loss into "
                      f"embed(ops, params, batch), layer(ops, params, i, x) for i < layers() and head(ops, params, x, "
                      f"batch), with residual(batch) the (shape, dims) of x (see parlay.core.pipeline.PipelineModel)"]
    p = mesh.axis_size(axis)
    try:
        sched = make_schedule(schedule, p, microbatches, virtual=virtual)
        kind, v, problems = sched.kind, sched.virtual, []
    except ScheduleError as e:
        sched = None
        try:
            kind = ScheduleKind(str(getattr(schedule, "value", schedule)).lower())
        except ValueError:
            return None, [str(e)]  # an unknown schedule: nothing more to check
        v = virtual if isinstance(virtual, int) and virtual > 0 else \
            {ScheduleKind.INTERLEAVED: 2, ScheduleKind.ZBV: 2}.get(kind, 1)
        problems = [str(e)]
    n_layers = int(model.layers())
    if n_layers % (p * v):
        fix = (f"ZB-V runs 2 stages a rank, so it needs layers divisible by {2 * p}: choose a model with more layers "
               f"(e.g. --model tiny-deep), a smaller {axis}, or a schedule with one stage a rank (1f1b, zb-h1)"
               if kind is ScheduleKind.ZBV else
               f"choose {axis} and --virtual-stages whose product divides {n_layers}, or a model with more layers")
        problems.append(f"its {n_layers} layers do not divide into {p * v} stages ({p} ranks x {v} stages each, "
                        f"{kind.value}); {fix}")
    return sched, problems


def make_pipeline(model, mesh: Mesh, axis: str, *, schedule: str | ScheduleKind, microbatches: int,
                  virtual: int | None = None, batch: int) -> Pipeline:
    """The stages of ``model`` on ``mesh``'s ``axis`` under ``schedule`` (checked: one
    ``PipelineError`` listing what is wrong and how to fix it)."""
    from .shapes import part_params

    sched, problems = _checked(model, mesh, axis, schedule, microbatches, virtual)
    if problems:
        raise PipelineError(f"model {type(model).__name__} cannot be pipelined over {axis}={mesh.axis_size(axis)}:",
                            problems)
    n_layers, stages = int(model.layers()), sched.stages
    per = n_layers // stages
    layers_of = tuple(tuple(range(k * per, (k + 1) * per)) for k in range(stages))
    uses = part_params(model, batch // microbatches)  # ("embed" | i | "head") -> parameter names
    count = Counter(n for names in uses.values() for n in names)
    order = [d.name for d in model.decls()]
    alone = lambda i: [n for n in order if n in uses[i] and count[n] == 1]
    stacked = tuple(tuple(n for i in layers_of[k] for n in alone(i)) for k in range(stages))
    params_of = []
    for k in range(stages):
        names = set().union(*(uses[i] for i in layers_of[k]))
        if k == 0:
            names |= uses["embed"]
        if k == stages - 1:
            names |= uses["head"]
        params_of.append(frozenset(names))
    return Pipeline(axis, sched, layers_of, tuple(params_of), stacked)


# -- running a schedule ------------------------------------------------------------------------------------

class StageRunner(Protocol):
    """One pp rank's computation. ``forward(stage, mb, x)``: x is None on the first stage (the
    runner reads microbatch mb's inputs); returns (the stage's output, a context), the output
    being the loss (a float-like scalar) on the last stage. ``backward(ctx, dy, part)``: dy is the
    gradient of the stage's output (None on the last stage: the runner seeds 1/m); ``part`` is
    ``Op.B`` (input and weight gradients), ``Op.I`` (input only; ctx is kept for W) or ``Op.W``
    (weights only, with the dy its I had); returns the input gradient (None for W or the first
    stage)."""

    def forward(self, stage: int, mb: int, x: Any) -> tuple[Any, Any]: ...

    def backward(self, ctx: Any, dy: Any, part: Op) -> Any: ...


class Transport(Protocol):
    """Point-to-point between pp ranks, one batch at a time: ``exchange(rank, sends, recvs)`` posts
    ``sends`` ([(key, peer rank, value)]) and returns the values of ``recvs`` ([(key, peer rank)])
    by key, the sends never waited on before the step ends (as ``check_schedule`` assumes). A key
    is (kind 'F' or 'B', the stage that consumes the value, microbatch). A transport for several
    ranks in one process also has ``post(rank, sends)`` and ``ready(rank, recvs)``: the driver
    posts a batch's sends when a rank reaches it and takes its receives once they are there."""

    def exchange(self, rank: int, sends: Sequence[tuple], recvs: Sequence[tuple]) -> dict: ...


class Mailbox:
    """A ``Transport`` for every pp rank in one process: sends land in a box, receives take them."""

    def __init__(self):
        self.box: dict = {}

    def post(self, rank, sends) -> None:
        for key, _, value in sends:
            assert key not in self.box, key  # each value is sent once
            self.box[key] = value

    def ready(self, rank, recvs) -> bool:
        return all(key in self.box for key, _ in recvs)

    def exchange(self, rank, sends, recvs) -> dict:
        self.post(rank, sends)
        return {key: self.box.pop(key) for key, _ in recvs}


def run_pipeline(pipe: Pipeline, runners: Mapping[int, StageRunner], transport: Transport, *,
                 timeline: dict | None = None, clock=None) -> dict[int, list]:
    """Run the schedule on the pp ranks in ``runners`` (all of them in one process, or this
    process's one); returns each rank's per-microbatch losses (the last stage's rank has them).
    ``timeline``, with ``clock`` (e.g. ``time.perf_counter``): each rank's (start, end, action)
    of every compute action, to set against ``simulate_schedule``'s."""
    sc = pipe.schedule
    rows = sc.with_comms()
    states = {r: _RankState() for r in runners}
    pos = {r: 0 for r in runners}
    posted = {r: -1 for r in runners}  # the position of the batch whose sends are out
    two_phase = hasattr(transport, "post") and hasattr(transport, "ready")
    while any(pos[r] < len(rows[r]) for r in runners):
        moved = False
        for r, runner in runners.items():
            st, acts = states[r], rows[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.op.is_compute:
                    start = clock() if timeline is not None else 0.0
                    _compute(pipe, runner, st, a)
                    if timeline is not None:
                        timeline.setdefault(r, []).append((start, clock(), a))
                    pos[r] += 1
                    moved = True
                    continue
                end = pos[r]
                while end < len(acts) and not acts[end].op.is_compute:
                    end += 1
                batch = acts[pos[r]:end]
                recvs = [(_key(a), sc.rank_of(a.stage - 1 if a.op is Op.RECV_F else a.stage + 1))
                         for a in batch if a.op in (Op.RECV_F, Op.RECV_B)]
                sends = []
                if posted[r] != pos[r]:
                    for a in batch:
                        if a.op is Op.SEND_F:
                            sends.append((_key(a), sc.rank_of(a.stage + 1), st.out_y.pop((a.stage, a.microbatch))))
                        elif a.op is Op.SEND_B:
                            sends.append((_key(a), sc.rank_of(a.stage - 1), st.out_dx.pop((a.stage, a.microbatch))))
                if two_phase:
                    if posted[r] != pos[r]:
                        transport.post(r, sends)
                        posted[r], sends, moved = pos[r], [], True
                    if not transport.ready(r, recvs):
                        break
                st.inbox.update(transport.exchange(r, sends, recvs))
                pos[r] = end
                moved = True
        if not moved:  # check_schedule proved the table runs; a transport that loses a message lands here
            waiting = {r: str(rows[r][pos[r]]) for r in runners if pos[r] < len(rows[r])}
            raise RuntimeError(f"the {sc.name} pipeline made no progress; ranks wait at {waiting}")
    for r, st in states.items():
        assert not st.ctx and not st.out_y and not st.out_dx and not st.inbox and not st.dy, (r, st)  # nothing left behind
    return {r: st.losses for r, st in states.items()}


def _key(a: Action) -> tuple:
    """Where a point-to-point value goes: ('F', consuming stage, mb) or ('B', consuming stage, mb)."""
    if a.op is Op.SEND_F:
        return ("F", a.stage + 1, a.microbatch)
    if a.op is Op.RECV_F:
        return ("F", a.stage, a.microbatch)
    if a.op is Op.SEND_B:
        return ("B", a.stage - 1, a.microbatch)
    return ("B", a.stage, a.microbatch)


class _RankState:
    def __init__(self):
        self.ctx: dict = {}  # (stage, mb) -> the runner's context, from F to the end of B or W
        self.out_y: dict = {}  # (stage, mb) -> a stage's output, until sent or used by the next local stage
        self.out_dx: dict = {}  # (stage, mb) -> an input gradient, until sent or used by the previous stage
        self.inbox: dict = {}  # key -> received value
        self.dy: dict = {}  # (stage, mb) -> the output gradient an I used, for its W
        self.losses: list = []

    def __repr__(self) -> str:
        return f"_RankState(ctx={list(self.ctx)}, out_y={list(self.out_y)}, out_dx={list(self.out_dx)}, " \
               f"inbox={list(self.inbox)})"


def _compute(pipe: Pipeline, runner: StageRunner, st: _RankState, a: Action) -> None:
    s, j, last = a.stage, a.microbatch, a.stage == pipe.stages - 1
    if a.op is Op.F:
        x = None if s == 0 else st.inbox.pop(("F", s, j), None)
        if x is None and s > 0:
            x = st.out_y.pop((s - 1, j))  # the previous stage ran on this rank (the turn of a V)
        y, st.ctx[(s, j)] = runner.forward(s, j, x)
        if last:
            st.losses.append(y)
        else:
            st.out_y[(s, j)] = y
        return
    if a.op is Op.W:  # the same output gradient I had
        runner.backward(st.ctx.pop((s, j)), st.dy.pop((s, j)), Op.W)
        return
    dy = None
    if not last:
        dy = st.inbox.pop(("B", s, j), None)
        if dy is None:
            dy = st.out_dx.pop((s + 1, j))
    ctx = st.ctx.pop((s, j)) if a.op is Op.B else st.ctx[(s, j)]
    if a.op is Op.I:
        st.dy[(s, j)] = dy
    dx = runner.backward(ctx, dy, a.op)
    if s > 0:
        st.out_dx[(s, j)] = dx

