"""Hypothesis strategies for random meshes, layouts and shapes (shared by the test modules)."""

import math

from hypothesis import strategies as st

from parlay import Layout, Mesh, P

AXIS_NAMES = ("dp", "tp", "sp")


@st.composite
def meshes(draw, max_ranks: int = 8, max_axes: int = 3):
    n = draw(st.integers(1, max_axes))
    sizes = []
    for _ in range(n):
        room = max_ranks // math.prod(sizes or [1])
        sizes.append(draw(st.sampled_from([s for s in (1, 2, 3, 4, 8) if s <= room])))
    return Mesh(dict(zip(AXIS_NAMES, sizes)))


@st.composite
def layouts(draw, mesh: Mesh, ndim: int, *, partial: bool = True, allowed_partial=None):
    """Each axis shards a random dim (in random order), is partial, or is replicated."""
    stacks = [[] for _ in range(ndim)]
    part = []
    for a in draw(st.permutations(mesh.axis_names)):
        can_partial = partial and (allowed_partial is None or a in allowed_partial)
        role = draw(st.sampled_from(["rep", "shard"] + (["partial"] if can_partial else [])))
        if role == "shard" and ndim:
            stacks[draw(st.integers(0, ndim - 1))].append(a)
        elif role == "partial":
            part.append(a)
    return Layout(mesh, P(*(tuple(s) if s else None for s in stacks)), part)


@st.composite
def layout_pairs(draw, *, partial: bool = True):
    """(src, dst, shape) on one mesh; dst's pending sums are a subset of src's."""
    mesh = draw(meshes())
    ndim = draw(st.integers(1, 3))
    src = draw(layouts(mesh, ndim, partial=partial))
    keep = draw(st.sets(st.sampled_from(src.partial))) if src.partial else set()
    dst = draw(layouts(mesh, ndim, partial=bool(keep), allowed_partial=keep))
    shape = tuple(
        math.lcm(src.shard_count(d), dst.shard_count(d)) * draw(st.integers(1, 3)) for d in range(ndim)
    )
    return src, dst, shape


def assert_replicas_identical(shards, layout):
    """Ranks that differ only along the layout's replicated axes hold identical arrays."""
    rep = layout.replicated_axes
    for group in layout.mesh.groups(rep):
        for r in group[1:]:
            assert (shards[r] == shards[group[0]]).all(), f"ranks {group[0]} and {r} differ in {layout}"
