import numpy as np
import pytest

from parlay import Mesh


def test_mapping_and_keyword_forms_are_equal():
    assert Mesh({"dp": 2, "tp": 4}) == Mesh(dp=2, tp=4)
    assert hash(Mesh(dp=2, tp=4)) == hash(Mesh({"dp": 2, "tp": 4}))
    assert Mesh(dp=2, tp=4) != Mesh(tp=4, dp=2)  # axis order is meaningful


def test_shape_and_repr_round_trip():
    m = Mesh(dp=2, tp=4)
    assert m.axis_names == ("dp", "tp") and m.sizes == (2, 4) and m.size == 8
    assert m.shape == {"dp": 2, "tp": 4}
    assert eval(repr(m)) == m


@pytest.mark.parametrize("sizes", [(2, 4), (3, 1, 2), (2, 2, 2), (5,)])
def test_rank_coords_row_major(sizes):
    names = ("a", "b", "c")[: len(sizes)]
    m = Mesh(dict(zip(names, sizes)))
    grid = np.arange(m.size).reshape(sizes)
    for r in range(m.size):
        coords = m.coords(r)
        assert grid[tuple(coords[n] for n in names)] == r
        assert m.rank(coords) == r


def test_groups_along_axes():
    m = Mesh(dp=2, tp=4)
    assert m.groups("tp") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert m.groups("dp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert m.groups(("dp", "tp")) == ((0, 1, 2, 3, 4, 5, 6, 7),)
    # The first axis named is major: over (tp, dp) ranks are ordered tp-major.
    assert m.groups(("tp", "dp")) == ((0, 4, 1, 5, 2, 6, 3, 7),)
    assert m.groups(()) == tuple((r,) for r in range(8))


def test_groups_partition_the_ranks():
    m = Mesh(a=2, b=3, c=2)
    for axes in [("a",), ("b",), ("a", "c"), ("c", "a", "b")]:
        groups = m.groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(m.size))
        assert all(len(g) == m.group_size(axes) for g in groups)


def test_numpy_ints_are_sizes():
    import numpy as np
    assert Mesh(dp=np.int64(2)) == Mesh(dp=2)


def test_refine_keeps_rank_numbers():
    m = Mesh(dp=2, tp=4)
    f = m.refine({"tp": (2, 2)})
    assert f.axes == (("dp", 2), ("tp.0", 2), ("tp.1", 2))
    assert repr(f) == "Mesh(dp=2, tp=4).refine({'tp': (2, 2)})" and eval(repr(f)) == f
    for r in range(8):
        assert f.coord(r, "tp.0") * 2 + f.coord(r, "tp.1") == m.coord(r, "tp")


@pytest.mark.parametrize("make, err, match", [
    (lambda: Mesh(), ValueError, "at least one axis"),
    (lambda: Mesh({"dp": 0}), ValueError, r"axis 'dp' has size 0; sizes are positive"),
    (lambda: Mesh(dp=2.0), TypeError, r"axis 'dp' has size 2.0; sizes are positive ints"),
    (lambda: Mesh([("dp", 2), ("dp", 2)]), ValueError, r"axis 'dp' is given twice"),
    (lambda: Mesh({"d p": 2}), ValueError, r"'d p' is not an identifier"),
    (lambda: Mesh({"tp.0": 2}), ValueError, r"'tp.0' is not an identifier .* '.' is reserved for the sub-axes"),
    (lambda: Mesh({"None": 2}), ValueError, r"'None' is not an identifier \(or is 'None'\)"),
    (lambda: Mesh(5), TypeError, r"Mesh takes a mapping of axis sizes"),
    (lambda: Mesh(dp=2).check_world_size("2"), TypeError, r"world_size='2'; it is a number of ranks"),
    (lambda: Mesh(dp=2).coord(-1, "dp"), ValueError, r"rank -1 is outside Mesh\(dp=2\)"),
    (lambda: Mesh(dp=2).coords(1.5), ValueError, r"rank 1.5 is outside"),
    (lambda: Mesh({1: 2}), TypeError, r"axis names are strings"),
    (lambda: Mesh({"dp": 2}, tp=2), TypeError, "either a mapping of axes or keyword sizes"),
    (lambda: Mesh(dp=2).coords(2), ValueError, r"rank 2 is outside Mesh\(dp=2\)"),
    (lambda: Mesh(dp=2).groups("tp"), ValueError, r"'tp' is not an axis of Mesh\(dp=2\); its axes are \['dp'\]"),
    (lambda: Mesh(dp=2, tp=4).check_world_size(4), ValueError,
     r"Mesh\(dp=2, tp=4\) has 8 ranks but the world has 4; .* launch 8 ranks"),
    (lambda: Mesh(tp=4).refine({"tp": (3, 2)}), ValueError, r"cannot split axis 'tp' of size 4 into \(3, 2\)"),
])
def test_errors(make, err, match):
    with pytest.raises(err, match=match):
        make()
