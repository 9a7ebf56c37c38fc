"""Pipeline schedules: generators, validator and simulator against the published formulas.

Formulas (p ranks, m microbatches, v stages a rank; ANCHORS.md 1.2): GPipe and 1F1B bubble
(p-1)/(m+p-1) of the makespan; 1F1B stage s holds min(p-s, m) microbatches, GPipe m; interleaved
1F1B idles (p-1)/(v m) of the ideal (busy) time; ZB-H1 idles a third of 1F1B with F = I = W;
ZB-V idles only the fill no schedule avoids (p-1 chunk forwards) at 1F1B's peak memory.
Every figure is compared exactly (integer costs give exact float times; fractions by Fraction).
"""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parlay.core.schedule import (
    Action, Costs, Op, Placement, Schedule, ScheduleError, ScheduleKind, SCHEDULES, check_schedule, make_schedule,
    simulate_schedule,
)

ps = st.integers(1, 6)
costs = st.integers(1, 5)


def _bubble(sim) -> Fraction:
    return Fraction(int(sum(sim.idle)), int(len(sim.idle) * sim.makespan))


@settings(max_examples=60, deadline=None)
@given(p=ps, m=st.integers(1, 12), f=costs, b=costs, kind=st.sampled_from(["gpipe", "1f1b"]))
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m, f, b, kind):
    sim = simulate_schedule(make_schedule(kind, p, m), Costs(f=f, b=b))
    assert sim.makespan == (m + p - 1) * (f + b)
    assert sim.idle == ((p - 1) * (f + b),) * p
    assert _bubble(sim) == Fraction(p - 1, m + p - 1)


@settings(max_examples=40, deadline=None)
@given(p=ps, m=st.integers(1, 12))
def test_peak_in_flight_1f1b_min_p_minus_s_m_and_gpipe_m(p, m):
    assert simulate_schedule(make_schedule("1f1b", p, m)).peak_in_flight == tuple(min(p - s, m) for s in range(p))
    assert simulate_schedule(make_schedule("gpipe", p, m)).peak_in_flight == (m,) * p


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 6), groups=st.integers(1, 4), v=st.integers(2, 4), f=costs, b=costs)
def test_interleaved_idles_p_minus_1_over_v_m_of_the_ideal_time(p, groups, v, f, b):
    m = groups * p
    sim = simulate_schedule(make_schedule("interleaved", p, m, virtual=v), Costs(f=f, b=b))
    for r in range(p):
        assert sim.busy[r] == v * m * (f + b)
        assert Fraction(int(sim.idle[r]), int(sim.busy[r])) == Fraction(p - 1, v * m)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), extra=st.integers(0, 8))
def test_zb_h1_idles_a_third_of_1f1b_at_1f1b_peak_memory(p, extra):
    m = p + extra  # ZB-H1's figure needs m >= p (fewer microbatches leave nothing to fill with)
    unit = Costs(f=1, i=1, w=1)  # 1F1B's B is I + W = 2
    zb, base = (simulate_schedule(make_schedule(k, p, m), unit) for k in ("zb-h1", "1f1b"))
    assert zb.makespan == 3 * m + p - 1
    assert all(3 * z == b for z, b in zip(zb.idle, base.idle))
    assert max(zb.peak_in_flight) == max(base.peak_in_flight) == p


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 5), groups=st.integers(1, 3))
def test_zbv_idles_only_the_fill_at_1f1b_peak_memory(p, groups):
    # Rank r cannot start before r chunk forwards have run: p-1 idle units on the last rank is the
    # least any schedule reaches; ZB-V reaches it on every rank, whatever m (the steady state has
    # no bubble). Memory: 2p chunks = p microbatches of a 1F1B stage (1F1B's stage-0 peak).
    m = groups * p
    unit = Costs(f=1, i=1, w=1)
    sim = simulate_schedule(make_schedule("zbv", p, m), unit)
    assert sim.makespan == 6 * m + p - 1
    assert sim.idle == (p - 1,) * p
    one_f_one_b = simulate_schedule(make_schedule("1f1b", p, m), Costs(f=2, i=2, w=2))  # a whole stage: 2 chunks
    assert max(sim.peak_activations) <= max(one_f_one_b.peak_activations) == p
    assert one_f_one_b.idle[0] == 6 * (p - 1)


def test_zbv_places_stages_in_a_v():
    sc = make_schedule("zbv", 4, 4)
    assert sc.placement is Placement.V and sc.stages == 8
    assert [sc.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(SCHEDULES), p=st.integers(1, 6), m=st.integers(1, 12))
def test_every_generated_schedule_validates(kind, p, m):
    if kind == "interleaved":
        m = max(p, m - m % p)
    sc = make_schedule(kind, p, m)
    check_schedule(sc)
    per_stage = sc.stages * m * (3 if sc.splits_backward else 2)
    assert sum(map(len, sc.actions)) == per_stage
    # every send has one receive on the neighbouring stage's rank
    comm = [a for acts in sc.with_comms() for a in acts if not a.op.is_compute]
    assert sum(a.op is Op.SEND_F for a in comm) == sum(a.op is Op.RECV_F for a in comm)
    assert sum(a.op is Op.SEND_B for a in comm) == sum(a.op is Op.RECV_B for a in comm)


def test_bytes_sent_per_rank():
    sim = simulate_schedule(make_schedule("1f1b", 4, 8), Costs(activation_bytes=1000))
    # rank 0 sends 8 activations forward, rank 3 sends 8 gradients back, the middle both
    assert sim.bytes_sent == (8000, 16000, 16000, 8000)
    # ZB-V: stages p-1 and p share a rank, so the turn of the V sends nothing
    sim = simulate_schedule(make_schedule("zbv", 2, 2), Costs(activation_bytes=10))
    assert sim.bytes_sent == (2 * 2 * 10, 2 * 2 * 10)


def test_comm_cost_delays_crossings_only():
    sim = simulate_schedule(make_schedule("gpipe", 2, 2), Costs(f=1, b=1, comm=5))
    # F0 on rank 1 waits 5 after rank 0's F0; B0 on rank 0 waits 5 after rank 1's B0
    assert sim.makespan == 1 + 5 + 2 + 2 + 5 + 1


def test_actions_print_and_parse_like_torch():
    for text in ("2F0", "1SEND_B3", "0I12", "3W1"):
        assert str(Action.parse(text)) == text
    assert eval(repr(Action.parse("2F0"))) == Action(2, Op.F, 0)
    with pytest.raises(ValueError, match=r"'2X0' is not STAGE OP MICROBATCH"):
        Action.parse("2X0")


def test_1f1b_lowering_fuses_send_and_receive_like_torch():
    rows = make_schedule("1f1b", 2, 3).with_comms()
    assert " ".join(map(str, rows[0])) == "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2"
    assert " ".join(map(str, rows[1])) == "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2"


# -- bad input: one clear error ----------------------------------------------------------------------

@pytest.mark.parametrize("args, kwargs, match", [
    (("interleaved", 4, 6), {}, r"microbatches=6 is not a multiple of p=4. Use 4 or 8"),
    (("interleaved", 4, 2), {}, r"interleaved 1F1B needs at least p=4 microbatches .*got microbatches=2. Use 4 or 8"),
    (("zbv", 2, 2), {"virtual": 3}, r"zbv places exactly 2 stages on each rank"),
    (("1f1b", 2, 2), {"virtual": 2}, r"1f1b runs one stage per rank; got virtual=2. Choose interleaved"),
    (("pipedream", 2, 2), {}, r"schedule 'pipedream' is unknown; choose from gpipe, 1f1b, interleaved, zb-h1, zbv"),
    (("gpipe", 0, 2), {}, r"ranks \(the pp axis's size\) must be a positive integer, got 0"),
    (("gpipe", 2, 2.5), {}, r"microbatches must be a positive integer, got 2.5"),
])
def test_make_schedule_refuses_clearly(args, kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        make_schedule(*args, **kwargs)


def _custom(rows, p=2, m=1, v=1, placement=Placement.LOOP):
    return Schedule(p, m, v, placement, tuple(tuple(Action.parse(a) for a in r.split()) for r in rows))


@pytest.mark.parametrize("rows, v, match", [
    (["0F0 0B0", "1F0"], 1, r"stage 1, microbatch 0: no backward"),
    (["0F0 0B0 0F0", "1F0 1B0"], 1, r"rank 0: 0F0 appears twice"),
    (["0F0 0B0 1F0", "1B0"], 1, r"rank 0: 1F0 runs stage 1, which loop placement puts on rank 1"),
    (["0B0 0F0", "1F0 1B0"], 1, r"rank 0: 0B0 comes before 0F0, which it needs"),
    (["0F0 0I0 0W0", "1F0 1B0 1W0"], 1, r"stage 1, microbatch 0: both B and I/W"),
    (["0F0 0SEND_F0 0B0", "1F0 1B0"], 1, r"0SEND_F0 is a point-to-point op; give compute actions only"),
    (["0F0 0B0", "1F3 1B0"], 1, r"names stage 1 or microbatch 3 outside 2 stages x 1 microbatches"),
    # loop placement, 4 stages: rank 0 waits for stage 1's output before running stage 0
    (["2F0 0F0 2B0 0B0", "1F0 3F0 3B0 1B0"], 2, r"deadlocks[\s\S]*rank 0: 2RECV_F0 waits for rank 1's 1SEND_F0"
                                                  r"[\s\S]*rank 1: 1RECV_F0 waits for rank 0's 0SEND_F0"),
])
def test_check_schedule_lists_problems(rows, v, match):
    with pytest.raises(ScheduleError, match=match):
        check_schedule(_custom(rows, v=v))


def test_a_hand_written_table_runs():
    sc = _custom(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"], m=2)
    check_schedule(sc)
    assert simulate_schedule(sc).makespan == 9  # F=1, B=2: 1F1B's (m+p-1)(f+b)
    assert sc.name == "custom"
