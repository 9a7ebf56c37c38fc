"""core/ticks.py: a schedule lowered to synchronous ticks, checked by replaying its table with
tagged values (every read must find exactly the value the schedule says it uses)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parlay.core.schedule import Costs, Op, ScheduleKind, make_schedule, simulate_schedule
from parlay.core.ticks import FIELDS, TO_X, forward_ticks, lower_to_ticks


def replay(plan):
    """Run the table with values tagged (kind, stage, mb); returns {(op, stage, mb): tick} of what ran.
    Fails if a read finds another value than the one it needs, or a value lands where one is
    still to be read."""
    sc, p = plan.schedule, plan.schedule.ranks
    S, backward = sc.stages, (Op.I if sc.splits_backward else Op.B)
    xbuf = [[None] * max(plan.x_slots, 1) for _ in range(p)]
    dybuf = [[None] * max(plan.dy_slots, 1) for _ in range(p)]
    # the reads each value still has to serve: a slot may be overwritten only after its last one
    pending = {}
    for (op, s, j) in {k for r in range(p) for k in plan.start[r]}:
        if s > 0:
            pending[("x", s, j)] = pending.get(("x", s, j), 0) + 1
        if op is not Op.F and s < S - 1 and not (op is Op.I and s == 0):
            pending[("dy", s, j)] = pending.get(("dy", s, j), 0) + 1
    ran = {}
    for t in range(plan.ticks):
        out = [None] * p
        for r in range(p):
            b, j, xs, ds = plan.table[r, t, :len(FIELDS)]
            if b == 0:
                continue
            op, s = plan.branches[b - 1]
            assert sc.rank_of(s) == r
            ran[(op, s, int(j))] = t
            if s > 0:
                assert xbuf[r][xs] == ("x", s, j), (t, r, op, s, j, xbuf[r][xs])
                pending[("x", s, j)] -= 1
            if op is not Op.F and s < S - 1 and not (op is Op.I and s == 0):
                assert dybuf[r][ds] == ("dy", s, j), (t, r, op, s, j, dybuf[r][ds])
                pending[("dy", s, j)] -= 1
            if op is Op.F and s < S - 1:
                out[r] = ("x", s + 1, int(j))
            elif op is backward and s > 0:
                out[r] = ("dy", s - 1, int(j))
        for i, shift in enumerate(plan.shifts):
            col, send = plan.column(shift), plan.send_column(shift)
            pairs = set()  # (source, destination, 0 forward / 1 backward) of the tick's sends by ``shift``
            for d in (0, 1):
                k = plan.table[0, t, send + d]
                assert (plan.table[:, t, send + d] == k).all(), "every rank takes the same send branch"
                for a, dst in (plan.sends[i][d][k - 1] if k else ()):
                    assert shift and out[a] is not None and out[a][0] == ("x", "dy")[d], f"tick {t}: {a} sends nothing"
                    pairs.add((a, dst, d))
            received = 0
            for r in range(p):
                src = (r - shift) % p
                to, slot = plan.table[r, t, col], plan.table[r, t, col + 1]
                if to == 0:
                    continue
                received += 1
                assert not shift or (src, r, 0 if to == TO_X else 1) in pairs, (t, r, shift)
                value = out[src]
                assert value is not None and value[0] == ("x" if to == TO_X else "dy"), (t, r, shift, value)
                buf = xbuf[r] if to == TO_X else dybuf[r]
                assert buf[slot] is None or pending[buf[slot]] == 0, f"tick {t}: {value} overwrites {buf[slot]}"
                buf[slot] = value
            assert len(pairs) == (received if shift else 0), f"tick {t}: a send nobody receives"
    return ran


CASES = [(k, p, m) for k in ScheduleKind for p in (2, 3, 4) for m in (p, 2 * p, 3 * p)
         if not (k is ScheduleKind.INTERLEAVED and m % p)]


@pytest.mark.parametrize("kind, p, m", CASES, ids=[f"{k.value}-p{p}-m{m}" for k, p, m in CASES])
def test_the_ticks_run_every_action_in_order_and_every_read_finds_its_value(kind, p, m):
    sc = make_schedule(kind, p, m)
    plan = lower_to_ticks(sc)
    ran = replay(plan)
    for r, acts in enumerate(sc.actions):
        compute = [(a.op, a.stage, a.microbatch) for a in acts if a.op in (Op.F, Op.B, Op.I, Op.W)]
        assert set(compute) == set(plan.start[r])
        assert sorted(compute, key=lambda k: ran[k]) == compute  # the rank's own order
        assert len({ran[k] for k in compute}) == len(compute)  # one action a tick
    # with every action one tick and no transfer time, the ticks are the simulator's timeline
    sim = simulate_schedule(sc, Costs(f=1, i=1, w=1, b=1))
    assert plan.ticks == sim.makespan
    assert {(a.op, a.stage, a.microbatch): int(s) for row in sim.timeline for s, _, a in row} == ran
    evals = forward_ticks(sc)
    ran = replay(evals)
    assert set(ran) == {(Op.F, s, j) for s in range(sc.stages) for j in range(m)}


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), m=st.integers(1, 12))
def test_gpipe_holds_m_stage_inputs_and_1f1b_at_most_p(p, m):
    # What the loop carries: GPipe stashes every microbatch's input on the ranks after the first,
    # 1F1B at most p (p-s in flight on stage s plus one arrived for the next forward).
    gpipe, one = lower_to_ticks(make_schedule("gpipe", p, m)), lower_to_ticks(make_schedule("1f1b", p, m))
    assert gpipe.x_slots == m
    assert one.x_slots == min(p, m)
    assert one.dy_slots == gpipe.dy_slots == 1


def test_values_travel_by_one_rank_or_stay():
    assert lower_to_ticks(make_schedule("1f1b", 4, 8)).shifts == (0, 1, 3)  # +1 forward, -1 backward
    assert lower_to_ticks(make_schedule("1f1b", 2, 4)).shifts == (0, 1)  # on 2 ranks, +1 is -1
    zbv = lower_to_ticks(make_schedule("zbv", 4, 8))
    assert zbv.shifts == (0, 1, 3)
    # the V's turn: stage 3's output goes to stage 4 on the same rank (offset 0)
    col = zbv.column(0)
    assert (zbv.table[:, :, col] == TO_X).sum() == 8 and (zbv.table[3, :, col] == TO_X).sum() == 8


def test_a_table_that_reads_the_wrong_slot_is_caught_by_the_replay():
    import dataclasses

    plan = lower_to_ticks(make_schedule("1f1b", 2, 4))
    assert plan.x_slots == 2
    bad = plan.table.copy()
    t = plan.start[1][(Op.F, 1, 1)]
    bad[1, t, FIELDS.index("x_slot")] ^= 1
    with pytest.raises(AssertionError):
        replay(dataclasses.replace(plan, table=bad))
