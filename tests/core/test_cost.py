"""The step-time model (core/cost.py): which groups cross nodes, and the alpha-beta arithmetic on
a hand-made step."""

import math

import pytest

from parlay.core import Mesh
from parlay.core.cost import PROFILES, Profile, crosses_nodes, step_time
from parlay.core.log import CollectiveLog
from parlay.core.steps import Kind


def test_which_groups_cross_nodes():
    # Ranks row-major over (dp, tp): tp=8 is a node's 8 ranks; dp strides 8, so it leaves the node.
    mesh = Mesh(dp=4, tp=8)
    assert not crosses_nodes(mesh, ("tp",), 8)
    assert crosses_nodes(mesh, ("dp",), 8)
    assert crosses_nodes(mesh, ("dp", "tp"), 8)
    assert not crosses_nodes(Mesh(dp=2, tp=4), ("dp", "tp"), 8)  # all 8 in one node
    assert crosses_nodes(Mesh(tp=4, dp=4), ("tp",), 8)  # tp strides 4: ranks 0, 4, 8, 12
    assert not crosses_nodes(Mesh(pp=4, dp=2, tp=8), ("tp.0",), 8)  # a sub-axis counts as its axis


def test_the_arithmetic_on_a_hand_made_step():
    gpu = Profile("toy", {"float32": 1e12}, 1e11, 1e10, 1e-5, 1e9, 1e-4, 8, efficiency=0.5)
    mesh = Mesh(dp=2, tp=8)
    log = CollectiveLog()
    log.record(Kind.ALL_REDUCE, ("tp",), 10 ** 6)  # inside a node: 2*7 steps
    log.record(Kind.ALL_GATHER, ("dp",), 10 ** 6)  # across: 1 step
    log.record(Kind.ALL_REDUCE, ("dp",), 3 * 10 ** 6, backward=True, param="w")  # gradient sums: one bucket
    log.record(Kind.ALL_REDUCE, ("dp",), 10 ** 6, backward=True, param="b")
    t = step_time(mesh, log.entries, flops=10 ** 12, written=10 ** 9, optimizer_elems=10 ** 6, profile=gpu)
    assert math.isclose(t.compute, 10 ** 12 / 0.5e12 + 2 * 10 ** 9 / 1e11)
    assert math.isclose(t.intra, 14 * 1e-5 + 10 ** 6 / 1e10)
    assert math.isclose(t.inter, (1e-4 + 10 ** 6 / 1e9) + (2 * 1e-4 + 4 * 10 ** 6 / 1e9))
    assert math.isclose(t.optimizer, 10 ** 6 * 32 / 1e11)
    assert math.isclose(t.total, t.compute + t.intra + t.inter + t.optimizer)
    shared = Profile("host", {"float32": 1e12}, 1e11, 1e10, 1e-5, 1e10, 1e-5, 64, efficiency=1.0, shared=True,
                     per_collective=True)
    s = step_time(mesh, log.entries[:1], flops=10 ** 12, written=0, optimizer_elems=0, profile=shared)
    assert math.isclose(s.compute, 16 * 1.0) and math.isclose(s.comm, 1e-5 + 10 ** 6 / 1e10)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_says_where_its_figures_come_from(name):
    p = PROFILES[name]
    assert p.source and set(p.flops) == {"float32", "bfloat16", "float16"} and p.node_devices >= 1
