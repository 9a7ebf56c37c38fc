import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_strategies import layouts, meshes
from parlay import AllGather, Layout, Mesh, P, gather, plan_einsum, scatter
from parlay.core.sim import simulate_einsum

M = Mesh(dp=2, tp=2)


def run(eq, ops, specs, partials=None):
    """Plan, simulate on integer data, and compare with numpy.einsum on the global arrays."""
    partials = partials or [()] * len(ops)
    lays = [Layout(M, s, p) for s, p in zip(specs, partials)]
    plan = plan_einsum(eq, lays, [o.shape for o in ops])
    out = simulate_einsum(plan, *(scatter(o, l, rng=i) for i, (o, l) in enumerate(zip(ops, lays))))
    np.testing.assert_array_equal(gather(out, plan.out), np.einsum(eq, *ops))
    return plan


rng = np.random.default_rng(0)
X, W_IN, W_OUT = rng.integers(-5, 5, (4, 6, 8)), rng.integers(-5, 5, (8, 12)), rng.integers(-5, 5, (12, 8))


def test_megatron_column_then_row():
    """The DESIGN's worked example: x @ w_in is local, h @ w_out is partial over tp."""
    up = run("bsd,df->bsf", [X, W_IN], [P("dp"), P(None, "tp")])
    assert up.bytes_per_device == 0 and up.out == Layout(M, P("dp", None, "tp"))
    h = np.einsum("bsd,df->bsf", X, W_IN)
    down = run("bsf,fd->bsd", [h, W_OUT], [P("dp", None, "tp"), P("tp")])
    assert down.bytes_per_device == 0 and down.out == Layout(M, P("dp", None, None), partial="tp")


def test_partial_operand_stays_partial():
    plan = run("ij,jk->ik", [W_OUT, W_OUT.T.copy()], [P(), P()], partials=[("tp",), ()])
    assert plan.out.partial == ("tp",) and plan.bytes_per_device == 0


def test_both_operands_partial_over_one_axis_reduces_one():
    a, b = rng.integers(-5, 5, (4, 6)), rng.integers(-5, 5, (6, 4))
    plan = run("ij,jk->ik", [a, b], [P(), P()], partials=[("dp",), ("dp",)])
    assert plan.bytes_per_device > 0 and plan.out.partial == ("dp",)


def test_conflict_is_resolved_by_bytes():
    """tp2d-style: x (batch->row, embed->col) @ w (embed->row, mlp->col)."""
    m = Mesh(row=2, col=2)
    x, w = rng.integers(-5, 5, (8, 16)), rng.integers(-5, 5, (16, 12))
    lx, lw = Layout(m, P("row", "col")), Layout(m, P("row", "col"))
    plan = plan_einsum("be,em->bm", [lx, lw], [x.shape, w.shape])
    out = simulate_einsum(plan, scatter(x, lx), scatter(w, lw))
    np.testing.assert_array_equal(gather(out, plan.out), x @ w)
    # Every other consistent choice costs at least as much: the all-gather-everything one more.
    naive = plan_einsum("be,em->bm", [lx.replace(spec=P()), lw.replace(spec=P())], [x.shape, w.shape])
    assert plan.bytes_per_device < (1 * x.size // 4 + 1 * w.size // 4) * 4 + 1
    assert naive.bytes_per_device == 0


def test_fsdp_weight_is_gathered_when_that_is_cheaper():
    x, w = rng.integers(-5, 5, (64, 8)), rng.integers(-5, 5, (8, 4))
    plan = run("bd,df->bf", [x, w], [P("dp"), P("dp")])
    assert plan.operand_plans[0].steps == ()
    assert plan.operand_plans[1].steps == (AllGather(("dp",), 0),)
    assert plan.out == Layout(M, P("dp"))


@st.composite
def einsum_cases(draw):
    mesh = draw(meshes())
    letters = "abcd"
    nops = draw(st.integers(1, 3))
    terms = [
        "".join(draw(st.permutations(letters))[: draw(st.integers(1, 3))]) for _ in range(nops)
    ]
    used = sorted(set("".join(terms)))
    out = "".join(c for c in used if draw(st.booleans()))
    size = {c: mesh.size * draw(st.integers(1, 2)) for c in used}
    lays = [draw(layouts(mesh, len(t))) for t in terms]
    return ",".join(terms) + "->" + out, lays, [tuple(size[c] for c in t) for t in terms]


@settings(max_examples=150, deadline=None)
@given(case=einsum_cases(), seed=st.integers(0, 2**31))
def test_simulated_einsum_equals_numpy(case, seed):
    eq, lays, shapes = case
    r = np.random.default_rng(seed)
    ops = [r.integers(-9, 10, s) for s in shapes]
    plan = plan_einsum(eq, lays, shapes)
    out = simulate_einsum(plan, *(scatter(o, l, rng=seed + i) for i, (o, l) in enumerate(zip(ops, lays))))
    np.testing.assert_array_equal(gather(out, plan.out), np.einsum(eq, *ops))
    assert plan.out_shape == np.einsum(eq, *ops).shape


def test_repeated_letter_is_gathered_not_doubly_sharded():
    a = rng.integers(-5, 5, (4, 4))
    plan = run("ii->i", [a], [P("dp")])
    assert plan.out.spec.entries == ()
    b = rng.integers(-5, 5, (4, 4, 6))
    run("iij->j", [b], [P(None, None, "tp")])


def test_agreeing_layouts_on_a_large_mesh_move_nothing():
    m = Mesh(pp=4, dp=8, tp=8)
    plan = plan_einsum("bhqd,bhkd->bhqk", [Layout(m, P("dp", "tp")), Layout(m, P("dp", "tp"))], [(64, 64, 128, 64)] * 2)
    assert plan.bytes_per_device == 0 and plan.out == Layout(m, P("dp", "tp"))


def test_implicit_output_follows_numpy():
    plan = plan_einsum("ij,jk", [Layout(M, P()), Layout(M, P())], [(2, 4), (4, 6)])
    assert plan.out_shape == (2, 6)


@pytest.mark.parametrize("eq, specs, shapes, err, match", [
    ("...i,ij->...j", [P(), P()], [(2, 4), (4, 2)], ValueError, r"'\.\.\.' is not supported; name every dim"),
    ("i1,ij->j", [P(), P()], [(2, 4), (4, 2)], ValueError, r"'1' is not a dim letter"),
    ("ij->j", [P(), P()], [(2, 4), (4, 2)], ValueError, r"has 1 operands but 2 layouts were given"),
    ("ij,jk->ik", [P(), P()], [(2, 4), (5, 2)], ValueError, r"letter 'j' has size 4 and 5"),
    ("ijk,jk->i", [P(), P()], [(2, 4), (4, 2)], ValueError, r"operand 0 is 'ijk' \(3 dims\) but has shape \(2, 4\)"),
    ("ij,jk->iz", [P(), P()], [(2, 4), (4, 2)], ValueError, r"output letter 'z' appears in no operand"),
    ("ij,jk->ii", [P(), P()], [(2, 4), (4, 2)], ValueError, r"output 'ii' repeats a letter"),
    ("ij,jk->ik", [P("dp"), P()], [(3, 4), (4, 2)], ValueError, r"dim 0 of shape \(3, 4\) has size 3, not divisible"),
])
def test_errors(eq, specs, shapes, err, match):
    with pytest.raises(err, match=match):
        plan_einsum(eq, [Layout(M, s) for s in specs], shapes)



def test_too_long_spec_fails_after_an_equal_layout_was_planned():
    """As plan_redistribute: the cached plan of equal layouts does not skip the length check."""
    mesh = Mesh(dp=2, sp=3)
    match = r"^spec P\('dp', None, None\) has 3 entries but the tensor of shape \(4, 6\) has 2 dims"
    w = Layout(mesh, P())
    with pytest.raises(ValueError, match=match):  # cold
        plan_einsum("ij,jk->ik", [Layout(mesh, P("dp", None, None)), w], [(4, 6), (6, 2)])
    plan_einsum("ij,jk->ik", [Layout(mesh, P("dp")), w], [(4, 6), (6, 2)])
    with pytest.raises(ValueError, match=match):  # warm
        plan_einsum("ij,jk->ik", [Layout(mesh, P("dp", None, None)), w], [(4, 6), (6, 2)])

def test_not_a_layout():
    with pytest.raises(TypeError, match=r"operand 0's layout is 'dp' \(str\), not a parlay.Layout"):
        plan_einsum("i->i", ["dp"], [(2,)])


def test_mixed_meshes_error():
    with pytest.raises(ValueError, match=r"operand 1 is on Mesh\(dp=4\) but operand 0 on Mesh\(dp=2, tp=2\)"):
        plan_einsum("i,i->", [Layout(M, P()), Layout(Mesh(dp=4), P())], [(4,), (4,)])
