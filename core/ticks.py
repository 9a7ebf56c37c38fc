"""A schedule as synchronous ticks: what one compiled program runs on every pp rank in lockstep.

``lower_to_ticks`` replays each rank's actions in their order, one compute action a tick at the
earliest tick its inputs are there (a value made in tick t is sent at the end of t and used from
t+1), and says, for every tick and rank: which (op, stage) to run (or nothing), on which
microbatch, from which buffer slots it reads its stage input and its output gradient, and where
each value that arrives at the end of the tick is written. Two buffers per rank hold the values
between ticks: ``x`` (a stage's input, from its arrival until the last backward piece that
recomputes the stage) and ``dy`` (an output gradient, until its last use); slots are reused as
soon as a value is dead (interval colouring: as few slots as the schedule ever holds at once).
So a loop over ticks holds what the schedule holds: GPipe's m inputs, 1F1B's at most p.

Every value travels by a fixed offset in pp rank per tick (``shifts``: +1 forward and -1
backward under loop placement; 0 for ZB-V's turn on the last rank, a local copy). A tick ends
with at most two collective permutes per nonzero offset, one of stage outputs and one of input
gradients, each over only the ranks that send one this tick (``sends``: the tick's pairs, the
same on every rank, so every rank takes the same branch); a tick where none does sends nothing.
So a rank sends what the schedule sends, no more: none of its bubbles' values.

The first stage reads its microbatch's inputs (no ``x`` slot); the last stage's forward ends in
the loss and its backward is seeded with 1/m (no ``dy`` slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schedule import Action, Op, Schedule, check_schedule

__all__ = ["TickPlan", "lower_to_ticks", "forward_ticks", "FIELDS"]

# Columns of ``TickPlan.table[rank, tick]``: the branch to run (0: nothing), its microbatch, the x
# and dy slots it reads (-1: none), then for each of ``shifts`` (0 first): the buffer the value
# arriving by that offset goes to (0 none, 1 x, 2 dy) and its slot; then for each of ``shifts``:
# which of its forward and of its backward permutes the tick runs (``sends``; 0 none, the same
# on every rank).
FIELDS = ("branch", "mb", "x_slot", "dy_slot")
NONE, TO_X, TO_DY = 0, 1, 2


@dataclass(frozen=True)
class TickPlan:
    schedule: Schedule
    ticks: int
    branches: tuple[tuple[Op, int], ...]  # branch b >= 1 runs (op, stage) = branches[b - 1]
    shifts: tuple[int, ...]  # pp-rank offsets values travel by; shifts[0] == 0 (a rank to itself)
    x_slots: int
    dy_slots: int
    table: np.ndarray  # int32 (ranks, ticks, len(FIELDS) + 4 * len(shifts))
    start: tuple[dict, ...]  # rank -> {(op, stage, mb): tick}
    # per shift: (forward, backward) permutes, each a tuple of the (source, destination) pairs of
    # one tick's sends by that offset; a tick's send column names one (1-based; 0: no send)
    sends: tuple[tuple[tuple[tuple[tuple[int, int], ...], ...], tuple[tuple[tuple[int, int], ...], ...]], ...]

    def column(self, shift: int) -> int:
        """The first of the two columns that say where a value arriving by ``shift`` goes."""
        return len(FIELDS) + 2 * self.shifts.index(shift)

    def send_column(self, shift: int) -> int:
        """The first of the two columns that say which forward (then backward) permute by ``shift``
        a tick runs."""
        return len(FIELDS) + 2 * len(self.shifts) + 2 * self.shifts.index(shift)

    @property
    def idle(self) -> float:
        """The share of rank-ticks that run nothing (the loop's bubble, every action one tick)."""
        return float(np.mean(self.table[:, :, 0] == 0))

    def describe(self) -> str:
        return (f"{self.ticks} ticks, {len(self.branches)} branches, shifts {list(self.shifts)}, "
                f"{self.x_slots} x slots and {self.dy_slots} dy slots a rank, {self.idle:.0%} idle")


def _unit_ticks(sc: Schedule, actions, needs) -> list[dict]:
    """Each rank's actions in order, one a tick, each at the first tick after what it needs."""
    end: dict = {}
    start: list[dict] = [{} for _ in range(sc.ranks)]
    free, nxt = [0] * sc.ranks, [0] * sc.ranks
    left = sum(map(len, actions))
    while left:
        moved = False
        for r in range(sc.ranks):
            while nxt[r] < len(actions[r]):
                a = actions[r][nxt[r]]
                req = needs(a)
                if any(n not in end for n in req):
                    break
                t = max([free[r]] + [end[n] for n in req])
                start[r][(a.op, a.stage, a.microbatch)] = t
                end[(a.stage, a.op, a.microbatch)] = t + 1
                free[r], nxt[r], left, moved = t + 1, nxt[r] + 1, left - 1, True
        if not moved:  # check_schedule refuses this first for a whole schedule
            raise ValueError(f"the actions of {sc.name} wait on each other: "
                             f"{[actions[r][nxt[r]] for r in range(sc.ranks) if nxt[r] < len(actions[r])]}")
    return start


def _colour(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Slots for values alive over (written after tick a, last read at tick b]: a slot read for the
    last time at tick b takes a value written at the end of b. Greedy by start: optimal."""
    free: list[tuple[int, int]] = []  # (last read, slot)
    slot_of, n = {}, 0
    for a, b, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        free.sort()
        if free and free[0][0] <= a:
            _, s = free.pop(0)
        else:
            s, n = n, n + 1
        slot_of[key] = s
        free.append((b, s))
    return slot_of, n


def _lower(sc: Schedule, actions, needs) -> TickPlan:
    start = _unit_ticks(sc, actions, needs)
    S, backward = sc.stages, (Op.I if sc.splits_backward else Op.B)
    at = {k: t for r in range(sc.ranks) for k, t in start[r].items()}
    ticks = 1 + max(at.values())
    # Who reads each (stage, mb)'s input and output gradient, and when.
    x_live, dy_live = [], []
    for (op, s, j), t in at.items():
        if op is Op.F and s > 0:  # the value arrives from stage s-1's forward
            reads = [t] + [at[(o, s, j)] for o in (Op.B, Op.I, Op.W) if (o, s, j) in at]
            x_live.append((at[(Op.F, s - 1, j)], max(reads), (s, j)))
        if op is backward and s < S - 1:  # its dy arrives from stage s+1's backward
            reads = [at[(o, s, j)] for o in (Op.B, Op.I, Op.W) if (o, s, j) in at]
            dy_live.append((at[(backward, s + 1, j)], max(reads), (s, j)))
    x_slot, dy_slot, nx, ndy = {}, {}, 0, 0
    for r in range(sc.ranks):  # each rank's buffers hold its own stages' values
        xs, n = _colour([v for v in x_live if sc.rank_of(v[2][0]) == r])
        x_slot.update(xs)
        nx = max(nx, n)
        ds, n = _colour([v for v in dy_live if sc.rank_of(v[2][0]) == r])
        dy_slot.update(ds)
        ndy = max(ndy, n)
    # The offsets values travel by.
    p = sc.ranks
    shifts = {0}
    for s in range(S - 1):
        shifts.add((sc.rank_of(s + 1) - sc.rank_of(s)) % p)
        shifts.add((sc.rank_of(s) - sc.rank_of(s + 1)) % p)
    shifts = (0,) + tuple(sorted(shifts - {0}))
    branches = sorted({(op, s) for (op, s, _) in at}, key=lambda b: (b[1], "FBIW".index(b[0].value)))
    branch = {b: i + 1 for i, b in enumerate(branches)}
    table = np.full((p, ticks, len(FIELDS) + 4 * len(shifts)), -1, np.int32)
    table[:, :, 0] = 0
    table[:, :, len(FIELDS):len(FIELDS) + 2 * len(shifts):2] = NONE
    for r in range(p):
        for (op, s, j), t in start[r].items():
            row = table[r, t]
            row[0], row[1] = branch[(op, s)], j
            row[2] = x_slot.get((s, j), -1) if s > 0 else -1
            row[3] = dy_slot.get((s, j), -1) if (op is not Op.F and s < S - 1) else -1
            # Where this action's output goes (written at the end of tick t on the receiver).
            if op is Op.F and s < S - 1:
                dst, buf, slot = sc.rank_of(s + 1), TO_X, x_slot[(s + 1, j)]
            elif op is backward and s > 0:
                dst, buf, slot = sc.rank_of(s - 1), TO_DY, dy_slot[(s - 1, j)]
            else:
                continue
            col = len(FIELDS) + 2 * shifts.index((dst - r) % p)
            assert table[dst, t, col] == NONE, (r, t, op, s, j)
            table[dst, t, col], table[dst, t, col + 1] = buf, slot
    # Each tick's sends by each offset: the pairs whose receiver's table says a value arrives.
    sends = []
    for i, shift in enumerate(shifts):
        col, send = len(FIELDS) + 2 * i, len(FIELDS) + 2 * len(shifts) + 2 * i
        kinds: tuple[list, list] = ([], [])
        for t in range(ticks):
            for d, buf in enumerate((TO_X, TO_DY)):
                pairs = tuple((r, (r + shift) % p) for r in range(p) if table[(r + shift) % p, t, col] == buf)
                if pairs and shift:
                    if pairs not in kinds[d]:
                        kinds[d].append(pairs)
                    table[:, t, send + d] = 1 + kinds[d].index(pairs)
                else:
                    table[:, t, send + d] = 0
        sends.append((tuple(kinds[0]), tuple(kinds[1])))
    return TickPlan(sc, ticks, tuple(branches), shifts, nx, ndy, table, tuple(start), tuple(sends))


def lower_to_ticks(schedule: Schedule) -> TickPlan:
    """A training step of ``schedule`` (checked first) as synchronous ticks."""
    check_schedule(schedule)
    sc = schedule
    backward = Op.I if sc.splits_backward else Op.B

    def needs(a: Action):
        s, j = a.stage, a.microbatch
        if a.op is Op.F:
            return [(s - 1, Op.F, j)] if s > 0 else []
        if a.op in (Op.B, Op.I):
            return [(s, Op.F, j)] + ([(s + 1, backward, j)] if s < sc.stages - 1 else [])
        return [(s, Op.I, j)]  # W

    compute = [tuple(a for a in acts if a.op in (Op.F, Op.B, Op.I, Op.W)) for acts in sc.actions]
    return _lower(sc, compute, needs)


def forward_ticks(schedule: Schedule) -> TickPlan:
    """Only the forwards of ``schedule``'s stages and microbatches (an evaluation), each rank
    taking its stages' forwards in the order they can start."""
    sc = schedule
    acts = [sorted((Action(s, Op.F, j) for s in sc.stages_of(r) for j in range(sc.microbatches)),
                   key=lambda a: (a.microbatch + a.stage, a.stage)) for r in range(sc.ranks)]
    return _lower(sc, acts, lambda a: [(a.stage - 1, Op.F, a.microbatch)] if a.stage > 0 else [])
