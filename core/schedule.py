"""Pipeline schedules as data: per-rank action lists, their generators, a validator and a simulator.

A pipeline cuts a model's repeated blocks into ``S = p * v`` stages over ``p`` ranks of a ``pp``
mesh axis (``v`` stages a rank: virtual stages). A ``Schedule`` says, for every rank, the order in
which it runs its stages' actions on ``m`` microbatches:

- ``F``: forward of a stage on a microbatch;
- ``B``: its whole backward; or, for the zero-bubble schedules, ``I`` (the gradient with respect to
  the stage's input, which the previous stage waits for) and ``W`` (the gradient with respect to
  its weights, which nobody waits for and can fill a bubble);
- ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``: the activations and their gradients crossing ranks,
  added by ``Schedule.with_comms`` (a send right after the action that made the value, the receive
  right before the action that needs it; adjacent ones form one batch of point-to-point ops).

Actions print as torch's pipelining IR does (``2F0``: stage 2, forward, microbatch 0; ``1SEND_B3``).
Stages map to ranks by a ``Placement``: ``LOOP`` (stage s on rank s mod p: GPipe, 1F1B,
interleaved 1F1B, ZB-H1) or ``V`` (rank r holds stages r and 2p-1-r: ZB-V, whose first and last
stage share rank 0).

``make_schedule(kind, ranks, microbatches, virtual=)`` builds the five schedules;
``check_schedule`` proves a table runs (every stage's m forwards and backwards, each after what it
needs, sends matched by receives, no deadlock when every batch of point-to-point ops waits for its
peers); ``simulate_schedule(schedule, Costs(...))`` replays it with per-action costs and reports the
makespan, each rank's idle time and bubble fraction, the peak number of microbatches whose
activations each rank holds, and the bytes each rank sends.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Op", "Action", "ScheduleKind", "Placement", "Schedule", "ScheduleError", "make_schedule",
           "check_schedule", "Costs", "Simulation", "simulate_schedule", "SCHEDULES"]


class Op(enum.Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the zero-bubble paper's name)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in (Op.F, Op.B, Op.I, Op.W)


_ACTION = re.compile(r"^(\d+)(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action.parse({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _ACTION.match(text.strip())
        if m is None:
            raise ValueError(f"action {text!r} is not STAGE OP MICROBATCH (e.g. '2F0', '1SEND_B3'); ops are "
                             f"{', '.join(o.value for o in Op)}.")
        return cls(int(m[1]), Op(m[2]), int(m[3]))


class ScheduleKind(enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZBV = "zbv"


SCHEDULES = tuple(k.value for k in ScheduleKind)


class Placement(enum.Enum):
    LOOP = "loop"  # stage s on rank s % p
    V = "v"  # rank r holds stages r and 2p-1-r


class ScheduleError(ValueError):
    """A schedule that cannot run, or cannot be built; ``problems`` lists every reason."""

    def __init__(self, headline: str, problems: Sequence[str] = ()):
        self.problems = tuple(problems)
        super().__init__(headline + "".join(f"\n  - {p}" for p in self.problems))


@dataclass(frozen=True)
class Schedule:
    """Compute actions per rank, in the order each rank runs them (``with_comms`` adds the sends
    and receives). ``kind`` is None for a table given by hand."""

    ranks: int
    microbatches: int
    virtual: int
    placement: Placement
    actions: tuple[tuple[Action, ...], ...]
    kind: ScheduleKind | None = None

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        p = self.ranks
        if self.placement is Placement.LOOP:
            return stage % p
        chunk, pos = divmod(stage, p)
        return pos if chunk % 2 == 0 else p - 1 - pos

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(self.stages) if self.rank_of(s) == rank)

    @property
    def splits_backward(self) -> bool:
        return any(a.op in (Op.I, Op.W) for acts in self.actions for a in acts)

    @property
    def name(self) -> str:
        return self.kind.value if self.kind is not None else "custom"

    def with_comms(self) -> tuple[tuple[Action, ...], ...]:
        """Every rank's actions with the point-to-point ops: after an F whose next stage lives on
        another rank, ``SEND_F``; before an F whose input comes from another rank, ``RECV_F``;
        likewise ``SEND_B``/``RECV_B`` after and before the actions that make and need input
        gradients (B or I)."""
        out = []
        for r, acts in enumerate(self.actions):
            seq: list[Action] = []
            for a in acts:
                s, j = a.stage, a.microbatch
                if a.op is Op.F and s > 0 and self.rank_of(s - 1) != r:
                    seq.append(Action(s, Op.RECV_F, j))
                if a.op in (Op.B, Op.I) and s < self.stages - 1 and self.rank_of(s + 1) != r:
                    seq.append(Action(s, Op.RECV_B, j))
                seq.append(a)
                if a.op is Op.F and s < self.stages - 1 and self.rank_of(s + 1) != r:
                    seq.append(Action(s, Op.SEND_F, j))
                if a.op in (Op.B, Op.I) and s > 0 and self.rank_of(s - 1) != r:
                    seq.append(Action(s, Op.SEND_B, j))
            out.append(tuple(seq))
        return tuple(out)

    def fifo_ordered(self) -> bool:
        """Whether between every pair of ranks the values are received in the order they are sent
        (what a transport that matches by order, NCCL's, needs; gloo matches by tag)."""
        sent: dict = {}
        got: dict = {}
        for r, acts in enumerate(self.with_comms()):
            for a in acts:
                if a.op in (Op.SEND_F, Op.SEND_B):
                    peer = self.rank_of(a.stage + (1 if a.op is Op.SEND_F else -1))
                    sent.setdefault((r, peer), []).append(_peer_key(a))
                elif a.op in (Op.RECV_F, Op.RECV_B):
                    peer = self.rank_of(a.stage + (-1 if a.op is Op.RECV_F else 1))
                    got.setdefault((peer, r), []).append((a.stage, a.op, a.microbatch))
        return all(sent.get(pair, []) == got.get(pair, []) for pair in set(sent) | set(got))

    def table(self, *, comms: bool = False) -> str:
        """One line per rank: its actions in order."""
        rows = self.with_comms() if comms else self.actions
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(rows))

    def __str__(self) -> str:
        return (f"{self.name} schedule, p={self.ranks}, m={self.microbatches}"
                + (f", v={self.virtual}" if self.virtual > 1 else "") + "\n" + self.table())


# -- generators ----------------------------------------------------------------------------------------

def make_schedule(kind: ScheduleKind | str, ranks: int, microbatches: int, *, virtual: int | None = None
                  ) -> Schedule:
    """The ``kind`` schedule over ``ranks`` pipeline ranks and ``microbatches`` microbatches
    (``virtual``: stages per rank; interleaved's default is 2, ZB-V's is 2 and only 2)."""
    kind = _kind(kind)
    p, m = _positive(ranks, "ranks (the pp axis's size)"), _positive(microbatches, "microbatches")
    v = {ScheduleKind.INTERLEAVED: 2, ScheduleKind.ZBV: 2}.get(kind, 1) if virtual is None else virtual
    v = _positive(v, "virtual stages")
    if kind is ScheduleKind.ZBV and v != 2:
        raise ScheduleError(f"zbv places exactly 2 stages on each rank (a V: rank r holds stages r and 2p-1-r); got "
                            f"virtual={v}. Leave --virtual-stages out, or choose interleaved for other counts.")
    if kind not in (ScheduleKind.INTERLEAVED, ScheduleKind.ZBV) and v != 1:
        raise ScheduleError(f"{kind.value} runs one stage per rank; got virtual={v}. Choose interleaved for "
                            f"{v} stages per rank.")
    if kind is ScheduleKind.INTERLEAVED and m < p:
        raise ScheduleError(f"interleaved 1F1B needs at least p={p} microbatches (it takes them in groups of p, "
                            f"Megatron's order); got microbatches={m}. Use {p} or {2 * p}.")
    if kind is ScheduleKind.INTERLEAVED and m % p:
        raise ScheduleError(f"interleaved 1F1B takes microbatches in groups of p (Megatron's order): "
                            f"microbatches={m} is not a multiple of p={p}. Use {m - m % p} or {m - m % p + p}.")
    if kind is ScheduleKind.GPIPE:
        acts = [tuple(Action(r, Op.F, j) for j in range(m)) + tuple(Action(r, Op.B, j) for j in range(m))
                for r in range(p)]
        return Schedule(p, m, 1, Placement.LOOP, tuple(acts), kind)
    if kind is ScheduleKind.ONE_F_ONE_B:
        return Schedule(p, m, 1, Placement.LOOP, tuple(_one_f_one_b(p, m, r) for r in range(p)), kind)
    if kind is ScheduleKind.INTERLEAVED:
        return Schedule(p, m, v, Placement.LOOP, tuple(_interleaved(p, m, v, r) for r in range(p)), kind)
    if kind is ScheduleKind.ZB_H1:
        return Schedule(p, m, 1, Placement.LOOP, tuple(_zb_h1(p, m, r) for r in range(p)), kind)
    return Schedule(p, m, 2, Placement.V, _zbv(p, m), kind)


def _kind(kind) -> ScheduleKind:
    if isinstance(kind, ScheduleKind):
        return kind
    try:
        return ScheduleKind(str(kind).lower())
    except ValueError:
        raise ScheduleError(f"schedule {kind!r} is unknown; choose from {', '.join(SCHEDULES)}.") from None


def _positive(n, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ScheduleError(f"{what} must be a positive integer, got {n!r}.")
    return n


def _one_f_one_b(p: int, m: int, s: int) -> tuple[Action, ...]:
    # Megatron's order: p - s - 1 warm-up forwards, then forward-backward pairs, then the rest of
    # the backwards; stage s then holds at most min(p - s, m) microbatches.
    warm = min(p - s - 1, m)
    out = [Action(s, Op.F, j) for j in range(warm)]
    for i in range(m - warm):
        out += [Action(s, Op.F, warm + i), Action(s, Op.B, i)]
    out += [Action(s, Op.B, j) for j in range(m - warm, m)]
    return tuple(out)


def _interleaved(p: int, m: int, v: int, r: int) -> tuple[Action, ...]:
    # Megatron's interleaved order: microbatches in groups of p; a group passes chunk 0, then
    # chunk 1, ... forward and the chunks in reverse backward. Rank r holds stages c*p + r.
    def nth(k: int, backward: bool) -> Action:
        group, pos = divmod(k, p * v)
        chunk = pos // p
        chunk = v - 1 - chunk if backward else chunk
        return Action(chunk * p + r, Op.B if backward else Op.F, group * p + pos % p)

    total = v * m
    warm = min((p - r - 1) * 2 + (v - 1) * p, total)
    out = [nth(k, False) for k in range(warm)]
    for i in range(total - warm):
        out += [nth(warm + i, False), nth(i, True)]
    out += [nth(k, True) for k in range(total - warm, total)]
    return tuple(out)


def _zb_h1(p: int, m: int, s: int) -> tuple[Action, ...]:
    # 1F1B's order with B split: I where 1F1B has B, and stage s puts off its first s weight
    # gradients (torch's num_1f1b_microbatches = rank), so that at the end the input gradients run
    # down the pipeline back to back while each stage's remaining W fill the ticks 1F1B leaves idle.
    warm = min(p - s - 1, m)
    out = [Action(s, Op.F, j) for j in range(warm)]
    w = 0
    for i in range(m):
        if i < m - warm:
            out.append(Action(s, Op.F, warm + i))
        out.append(Action(s, Op.I, i))
        if i >= s:
            out.append(Action(s, Op.W, w))
            w += 1
    return tuple(out + [Action(s, Op.W, j) for j in range(w, m)])


def _zbv(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """ZB-V by list scheduling on unit-time F, I and W: at each tick every rank runs, of what is
    ready, an I (a stage waits for it), else its oldest W, else an F, this one only while fewer
    than 2p of its (stage, microbatch) pairs have run F but not yet I. Among several stages, the
    one nearer the loss first (its microbatch leaves memory sooner). Since W runs before any new
    F, the pairs held from F to the end of W (``Simulation.peak_in_flight``) stay within 2p
    chunks too: p microbatches of a 1F1B stage, 1F1B's peak (the tests check it)."""
    S = 2 * p
    rank_of = lambda s: s if s < p else S - 1 - s
    done: set[tuple[int, Op, int]] = set()
    next_f = [0] * S  # each stage takes its microbatches in order
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    held = [0] * p
    acts: list[list[Action]] = [[] for _ in range(p)]
    stages = [sorted((s for s in range(S) if rank_of(s) == r), reverse=True) for r in range(p)]
    while sum(map(len, acts)) < 3 * S * m:
        ran = []
        for r in range(p):
            pick = next((Action(s, Op.I, j) for s in stages[r] for j in range(m)
                         if (s, Op.I, j) not in done and (s, Op.F, j) in done and (s == S - 1 or (s + 1, Op.I, j) in done)
                         and not any(a.stage == s and a.op is Op.I and a.microbatch == j for a in ran)), None)
            if pick is None and pending_w[r]:
                pick = Action(pending_w[r][0][0], Op.W, pending_w[r].pop(0)[1])
            if pick is None and held[r] < 2 * p:
                pick = next((Action(s, Op.F, next_f[s]) for s in stages[r]
                             if next_f[s] < m and (s == 0 or (s - 1, Op.F, next_f[s]) in done)), None)
            if pick is None:
                continue
            acts[r].append(pick)
            ran.append(pick)
            if pick.op is Op.F:
                next_f[pick.stage] += 1
                held[r] += 1
            elif pick.op is Op.I:
                pending_w[r].append((pick.stage, pick.microbatch))
                held[r] -= 1
        assert ran, "the ZB-V list scheduler made no progress"  # an I, a W or an F is always ready
        done.update((a.stage, a.op, a.microbatch) for a in ran)  # visible from the next tick
    return tuple(tuple(a) for a in acts)


# -- the validator -----------------------------------------------------------------------------------------

def check_schedule(schedule: Schedule) -> None:
    """One ``ScheduleError`` listing every problem: an action on a rank that does not hold its
    stage, a stage without exactly one F and one B (or one I and one W) per microbatch, an action
    before one it needs on the same rank, a send without its receive, a deadlock."""
    sc = schedule
    problems: list[str] = []
    if len(sc.actions) != sc.ranks:
        raise ScheduleError(f"the schedule has {len(sc.actions)} action lists for {sc.ranks} ranks.")
    seen: dict[tuple[int, Op, int], int] = {}
    for r, acts in enumerate(sc.actions):
        for a in acts:
            if not a.op.is_compute:
                problems.append(f"rank {r}: {a} is a point-to-point op; give compute actions only (with_comms adds them)")
            elif not 0 <= a.stage < sc.stages or not 0 <= a.microbatch < sc.microbatches:
                problems.append(f"rank {r}: {a} names stage {a.stage} or microbatch {a.microbatch} outside "
                                f"{sc.stages} stages x {sc.microbatches} microbatches")
            elif sc.rank_of(a.stage) != r:
                problems.append(f"rank {r}: {a} runs stage {a.stage}, which {sc.placement.value} placement puts on "
                                f"rank {sc.rank_of(a.stage)}")
            elif (a.stage, a.op, a.microbatch) in seen:
                problems.append(f"rank {r}: {a} appears twice")
            else:
                seen[(a.stage, a.op, a.microbatch)] = r
    for s in range(sc.stages):
        for j in range(sc.microbatches):
            has = {op for op in (Op.F, Op.B, Op.I, Op.W) if (s, op, j) in seen}
            if Op.F not in has:
                problems.append(f"stage {s} never runs F on microbatch {j}")
            if has >= {Op.B, Op.I} or has >= {Op.B, Op.W}:
                problems.append(f"stage {s}, microbatch {j}: both B and I/W (B is I and W together)")
            elif Op.B not in has and has & {Op.I, Op.W} != {Op.I, Op.W}:
                problems.append(f"stage {s}, microbatch {j}: no backward (B, or both I and W)")
    if problems:
        raise ScheduleError(f"the {sc.name} schedule (p={sc.ranks}, m={sc.microbatches}, v={sc.virtual}) is "
                            f"malformed:", problems)
    for r, acts in enumerate(sc.actions):
        pos = {(a.stage, a.op, a.microbatch): i for i, a in enumerate(acts)}
        for i, a in enumerate(acts):
            for need in _needs(sc, a):
                if need in pos and pos[need] > i:
                    problems.append(f"rank {r}: {a} comes before {_fmt(need)}, which it needs")
                elif sc.rank_of(need[0]) == r and need not in pos:
                    problems.append(f"rank {r}: {a} needs {_fmt(need)}, which no rank runs")
    if problems:
        raise ScheduleError(f"the {sc.name} schedule runs actions before their inputs:", problems)
    _replay_comms(sc)


def _fmt(key) -> str:
    return str(Action(key[0], key[1], key[2]))


def _needs(sc: Schedule, a: Action) -> list[tuple[int, Op, int]]:
    s, j = a.stage, a.microbatch
    backward = Op.I if sc.splits_backward else Op.B
    if a.op is Op.F:
        return [(s - 1, Op.F, j)] if s > 0 else []
    if a.op in (Op.B, Op.I):
        return [(s, Op.F, j)] + ([(s + 1, backward, j)] if s < sc.stages - 1 else [])
    if a.op is Op.W:
        return [(s, Op.I, j)]
    return []


_PEER = {Op.SEND_F: (Op.RECV_F, +1), Op.RECV_F: (Op.SEND_F, -1), Op.SEND_B: (Op.RECV_B, -1),
         Op.RECV_B: (Op.SEND_B, +1)}


def _peer_key(a: Action) -> tuple[int, Op, int]:
    op, step = _PEER[a.op]
    return (a.stage + step, op, a.microbatch)


def _replay_comms(sc: Schedule) -> None:
    """Run the table with its point-to-point ops as the torch lowering runs them: adjacent ones are
    one batch; a send is posted and never waited on before the step ends (``isend``); a batch
    completes once the sender of each of its receives has posted that send. Refuses unmatched
    ops and deadlocks, naming who waits on whom. (Had sends to wait for their receives too, a
    rendezvous, interleaved 1F1B's criss-crossed batches would deadlock: pytorch#127332.)"""
    rows = sc.with_comms()
    where: dict[tuple[int, Op, int], tuple[int, int]] = {}
    batches: list[list[tuple[int, int]]] = []  # per rank: (start, end) of each step (compute: length 1)
    batch_of: list[list[int]] = []
    for r, acts in enumerate(rows):
        spans, index, i = [], [], 0
        while i < len(acts):
            k = i + 1
            if not acts[i].op.is_compute:
                while k < len(acts) and not acts[k].op.is_compute:
                    k += 1
            index += [len(spans)] * (k - i)
            spans.append((i, k))
            i = k
        batches.append(spans)
        batch_of.append(index)
        for i, a in enumerate(acts):
            if not a.op.is_compute:
                where[(a.stage, a.op, a.microbatch)] = (r, i)
    unmatched = [f"rank {r}: {a} has no matching {_fmt(_peer_key(a))}" for r, acts in enumerate(rows) for a in acts
                 if not a.op.is_compute and _peer_key(a) not in where]
    if unmatched:
        raise ScheduleError("point-to-point ops without their peer:", unmatched)
    at = [0] * sc.ranks  # the batch each rank is at (posted, not yet complete)
    while True:
        moved = False
        for r in range(sc.ranks):
            if at[r] == len(batches[r]):
                continue
            start, end = batches[r][at[r]]
            if all(not _is_recv(rows[r][i]) or _posted(where[_peer_key(rows[r][i])], at, batch_of)
                   for i in range(start, end)):
                at[r] += 1
                moved = True
        if not moved:
            break
    stuck = [r for r in range(sc.ranks) if at[r] < len(batches[r])]
    if stuck:
        waits = []
        for r in stuck:
            start, end = batches[r][at[r]]
            missing = [f"{rows[r][i]} waits for rank {where[_peer_key(rows[r][i])][0]}'s {_fmt(_peer_key(rows[r][i]))}"
                       for i in range(start, end)
                       if _is_recv(rows[r][i]) and not _posted(where[_peer_key(rows[r][i])], at, batch_of)]
            waits.append(f"rank {r}: " + "; ".join(missing))
        raise ScheduleError(f"the {sc.name} schedule deadlocks (p={sc.ranks}, m={sc.microbatches}):", waits)


def _is_recv(a: Action) -> bool:
    return a.op in (Op.RECV_F, Op.RECV_B)


def _posted(peer: tuple[int, int], at: list[int], batch_of: list[list[int]]) -> bool:
    rank, i = peer
    return batch_of[rank][i] <= at[rank]


# -- the simulator -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Costs:
    """Time of one action on a stage (any unit; a number for every stage, or a tuple with one per
    stage), the time a value takes between ranks, and the bytes of one stage's activation (and of
    its gradient) per microbatch. ``b`` defaults to ``i + w``."""

    f: float | tuple = 1.0
    i: float | tuple = 1.0
    w: float | tuple = 1.0
    b: float | tuple | None = None
    comm: float = 0.0
    activation_bytes: int = 0

    def of(self, op: Op, stage: int = 0) -> float:
        pick = lambda v: v[stage] if isinstance(v, (tuple, list)) else v
        if op is Op.B:
            return pick(self.i) + pick(self.w) if self.b is None else pick(self.b)
        return pick({Op.F: self.f, Op.I: self.i, Op.W: self.w}[op])


@dataclass(frozen=True)
class Simulation:
    """``timeline[r]``: (start, end, action) of every compute action rank r runs. ``idle[r]``:
    makespan minus rank r's busy time; ``bubble``: the mean idle share of the makespan (the
    share of the ideal time, Megatron's measure for interleaving, is sum(idle) / sum(busy)).
    ``peak_in_flight[r]``: the most (stage, microbatch) pairs whose activations rank r holds at
    once (from F's start to the end of B, or of W); ``peak_activations[r]``: the same in units of
    one microbatch through p-th of the pipelined blocks (what a 1F1B stage holds per microbatch)."""

    schedule: Schedule
    costs: Costs
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    bytes_sent: tuple[int, ...]
    timeline: tuple[tuple[tuple[float, float, Action], ...], ...] = field(repr=False)

    @property
    def bubble(self) -> float:
        return sum(self.idle) / (len(self.idle) * self.makespan)

    @property
    def peak_activations(self) -> tuple[float, ...]:
        return tuple(n / self.schedule.virtual for n in self.peak_in_flight)

    def summary(self) -> str:
        sc = self.schedule
        lines = [f"{sc.name}: p={sc.ranks}, m={sc.microbatches}, v={sc.virtual}, {sc.placement.value} placement; "
                 f"makespan {self.makespan:g}, bubble {self.bubble:.4f}"]
        for r in range(sc.ranks):
            lines.append(f"  rank {r}: busy {self.busy[r]:g}, idle {self.idle[r]:g}, peak in flight "
                         f"{self.peak_in_flight[r]} ({self.peak_activations[r]:g} stage-activations), sends "
                         f"{self.bytes_sent[r]} B")
        return "\n".join(lines)


def simulate_schedule(schedule: Schedule, costs: Costs = Costs()) -> Simulation:
    """Replay a checked schedule: each rank runs its actions in order, each as soon as the rank is
    free and what it needs has ended (plus ``costs.comm`` when that came from another rank)."""
    check_schedule(schedule)
    sc = schedule
    end: dict[tuple[int, Op, int], float] = {}
    free = [0.0] * sc.ranks
    nxt = [0] * sc.ranks
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(sc.ranks)]
    left = sum(map(len, sc.actions))
    while left:
        for r in range(sc.ranks):
            while nxt[r] < len(sc.actions[r]):
                a = sc.actions[r][nxt[r]]
                needs = _needs(sc, a)
                if any(n not in end for n in needs):
                    break
                ready = max([free[r]] + [end[n] + (costs.comm if sc.rank_of(n[0]) != r else 0.0) for n in needs])
                stop = ready + costs.of(a.op, a.stage)
                end[(a.stage, a.op, a.microbatch)] = stop
                timeline[r].append((ready, stop, a))
                free[r], nxt[r], left = stop, nxt[r] + 1, left - 1
    makespan = max(free)
    busy = tuple(sum(e - s for s, e, _ in row) for row in timeline)
    release = Op.W if sc.splits_backward else Op.B
    peaks = []
    for row in timeline:
        events = sorted([(s, 1) for s, _, a in row if a.op is Op.F] + [(e, -1) for _, e, a in row if a.op is release],
                        key=lambda x: (x[0], x[1]))
        held = peak = 0
        for _, d in events:
            held += d
            peak = max(peak, held)
        peaks.append(peak)
    sends = [sum(1 for a in acts if a.op in (Op.SEND_F, Op.SEND_B)) * costs.activation_bytes
             for acts in sc.with_comms()]
    return Simulation(sc, costs, makespan, busy, tuple(makespan - b for b in busy), tuple(peaks), tuple(sends),
                      tuple(tuple(row) for row in timeline))
