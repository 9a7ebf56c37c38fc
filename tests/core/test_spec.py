import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_strategies import assert_replicas_identical, layouts, meshes
from parlay import Layout, Mesh, P, check_layout, gather, resolve_partial, scatter

MESH = Mesh(dp=2, tp=4)


def test_p_normalizes_entries_and_round_trips():
    spec = P("dp", None, ("tp", "sp"))
    assert spec.entries == (("dp",), (), ("tp", "sp"))
    assert list(spec) == ["dp", None, ("tp", "sp")]
    assert spec[2] == ("tp", "sp") and spec.dim_axes(5) == ()
    assert eval(repr(spec)) == spec
    assert P(("dp",)) == P("dp") and P((), "tp") == P(None, "tp")
    assert str(spec) == "[dp, None, (tp,sp)]"


@pytest.mark.parametrize("text, spec", [
    ("dp,tp", P("dp", "tp")), ("None,dp", P(None, "dp")), ("(dp,tp),None", P(("dp", "tp"), None)),
    ("dp+tp", P(("dp", "tp"))), (" dp , None ", P("dp", None)), ("", P()),
])
def test_p_parse(text, spec):
    assert P.parse(text) == spec


def test_layout_fields_and_repr():
    layout = Layout(MESH, P(None, "dp"), partial=("tp",))
    assert layout.partial == ("tp",) and layout.is_partial
    assert layout.replicated_axes == ()
    assert Layout(MESH, P("tp")).replicated_axes == ("dp",)
    assert eval(repr(layout)) == layout and hash(eval(repr(layout))) == hash(layout)
    assert str(layout) == "[None, dp] partial(tp)"
    assert Layout(MESH, ("dp",)) == Layout(MESH, P("dp"))
    assert Layout(MESH, partial="tp").partial == ("tp",)
    assert Layout(MESH, partial=("tp", "dp")).partial == ("dp", "tp")  # mesh order


def test_local_shape_and_slices_example():
    layout = Layout(MESH, P(("tp", "dp"), None))
    assert layout.local_shape((16, 4)) == (2, 4)
    slices = layout.shard_slices((16, 4))
    # rank 1 is (dp=0, tp=1): block tp*2 + dp = 2 of dim 0.
    assert slices[1] == (slice(4, 6), slice(0, 4))
    assert slices[4] == (slice(2, 4), slice(0, 4))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_shard_slices_from_first_principles(data):
    """Each rank's slices cover the block its coordinates name, and every block is held."""
    mesh = data.draw(meshes())
    ndim = data.draw(st.integers(1, 3))
    layout = data.draw(layouts(mesh, ndim, partial=False))
    shape = tuple(layout.shard_count(d) * data.draw(st.integers(1, 3)) for d in range(ndim))
    x = np.arange(int(np.prod(shape))).reshape(shape)
    covered = np.zeros(shape, dtype=int)
    for r, sl in enumerate(layout.shard_slices(shape)):
        covered[sl] += 1
        for d in range(ndim):
            idx = 0
            for a in layout.dim_axes(d):
                idx = idx * mesh.axis_size(a) + mesh.coord(r, a)
            n = shape[d] // layout.shard_count(d)
            assert sl[d] == slice(idx * n, (idx + 1) * n)
    replicas = mesh.size // int(np.prod([layout.shard_count(d) for d in range(ndim)]))
    assert (covered == replicas).all()
    assert (gather(scatter(x, layout), layout) == x).all()


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_scatter_gather_round_trip_with_partials(data):
    mesh = data.draw(meshes())
    ndim = data.draw(st.integers(1, 3))
    layout = data.draw(layouts(mesh, ndim))
    shape = tuple(layout.shard_count(d) * data.draw(st.integers(1, 3)) for d in range(ndim))
    x = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).integers(-100, 100, shape)
    shards = scatter(x, layout, rng=data.draw(st.integers(0, 10)))
    assert all(s.shape == layout.local_shape(shape) for s in shards)
    assert (gather(shards, layout) == x).all()
    assert_replicas_identical(shards, layout)
    complete = layout.replace(partial=())
    for got, want in zip(resolve_partial(shards, layout), scatter(x, complete)):
        assert (got == want).all()
    if layout.partial and mesh.group_size(layout.partial) > 1:
        # Addends really differ from the block (else the test would not exercise the sums).
        assert any((a != b).any() for a, b in zip(shards, scatter(x, complete)))


def test_scatter_float_partial_sums_to_block():
    layout = Layout(MESH, P("dp"), partial="tp")
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_allclose(gather(scatter(x, layout), layout), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make, err, match", [
    (lambda: P("tp", "tp"), ValueError,
     r"spec P\('tp', 'tp'\) uses mesh axis 'tp' for dims 0 and 1; an axis may shard one dim, once. "
     r"To shard dim 0 over several axes write a tuple"),
    (lambda: P(("dp", "dp")), ValueError, r"uses mesh axis 'dp' for dim 0 twice"),
    (lambda: P(3), TypeError, r"P entry 0 is 3 \(int\); an entry is None, a mesh axis name, or a tuple"),
    (lambda: P.parse("(dp,tp"), ValueError, r"unbalanced '\('"),
    (lambda: P.parse("dp,1x"), ValueError, r"'1x' is not an axis name"),
    (lambda: Layout(MESH, P("dp", "xx")), ValueError,
     r"spec P\('dp', 'xx'\) names axis 'xx', which Mesh\(dp=2, tp=4\) lacks; a spec may only use the "
     r"mesh's axes \['dp', 'tp'\]"),
    (lambda: Layout(MESH, P("dp"), partial="sp"), ValueError, r"partial=\('sp',\) names axis 'sp', which"),
    (lambda: Layout(MESH, P(), partial=("tp", "tp")), ValueError, r"lists an axis twice"),
    (lambda: Layout(MESH, P("tp"), partial="tp"), ValueError,
     r"axis 'tp' both shards a dim in P\('tp'\) and is partial; an axis either shards a dim, is partial"),
    (lambda: Layout({"dp": 2}, P()), TypeError, r"Layout needs a parlay.Mesh"),
    (lambda: Layout(MESH, "dp"), TypeError, r"Layout spec must be a parlay.P"),
    (lambda: Layout(MESH, P("dp")).local_shape((7, 4)), ValueError,
     r"dim 0 of shape \(7, 4\) has size 7, not divisible by 2 \(dp=2\) in spec P\('dp'\) on "
     r"Mesh\(dp=2, tp=4\); shards are even: pad dim 0 to a multiple of 2"),
    (lambda: Layout(MESH, P(("dp", "tp"))).check((12,)), ValueError, r"not divisible by 8 \(dp=2 x tp=4\)"),
    (lambda: Layout(MESH, P(None, None, "dp")).check((4, 4)), ValueError,
     r"spec P\(None, None, 'dp'\) has 3 entries but the tensor of shape \(4, 4\) has 2 dims"),
    (lambda: check_layout(Layout(MESH, P()), (2.0,)), TypeError, r"must be a tuple of non-negative ints"),
    (lambda: Layout(MESH, P(None, None, None)).check((8, 8)), ValueError,
     r"spec P\(None, None, None\) has 3 entries but the tensor of shape \(8, 8\) has 2 dims"),
    (lambda: Layout(MESH, P("dp", None)).check((8,)), ValueError, r"has 2 entries but the tensor of shape \(8,\)"),
    (lambda: Layout(MESH, P(), partial=None), TypeError, r"partial=None; give mesh axis names"),
    (lambda: P.parse(None), TypeError, r"P.parse takes a str"),
    (lambda: scatter(np.ones(8, bool), Layout(MESH, P(), partial="tp")), TypeError, r"needs a numeric"),
    (lambda: gather([np.full(4, r) for r in range(8)], Layout(MESH, P("dp"))), ValueError,
     r"ranks 0 and 1 hold the same block of \[dp\] but different values; replicas must agree"),
    (lambda: gather([np.zeros(2)] * 3, Layout(MESH, P())), ValueError,
     r"got 3 shards for Mesh\(dp=2, tp=4\) with 8 ranks"),
])
def test_errors(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_check_lists_every_problem():
    with pytest.raises(ValueError) as info:
        Layout(MESH, P("dp", "tp")).check((3, 6))
    assert "dim 0 of shape (3, 6) has size 3" in str(info.value)
    assert "dim 1 of shape (3, 6) has size 6, not divisible by 4" in str(info.value)
