"""The core's shard slices agree with JAX's NamedSharding for random layouts."""

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_strategies import layouts, meshes
from parlay import Layout, Mesh, P
from parlay.backends.jax.mesh import lower_layout, lower_mesh


def _norm(slices, shape):
    return tuple(s.indices(n)[:2] for s, n in zip(slices, shape))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_shard_slices_match_devices_indices_map(data):
    assert jax.device_count() >= 8
    mesh = data.draw(meshes())
    ndim = data.draw(st.integers(1, 3))
    layout = data.draw(layouts(mesh, ndim, partial=False))
    shape = tuple(layout.shard_count(d) * data.draw(st.integers(1, 3)) for d in range(ndim))
    jmesh = lower_mesh(mesh)
    index_map = lower_layout(layout, jmesh).devices_indices_map(shape)
    for rank, slices in enumerate(layout.shard_slices(shape)):
        device = jmesh.devices.flat[rank]
        assert _norm(index_map[device], shape) == _norm(slices, shape)


def test_lowering_errors():
    mesh = Mesh(dp=2, tp=2)
    jmesh = lower_mesh(mesh)
    with pytest.raises(ValueError, match=r"is partial over \['tp'\]; a NamedSharding holds complete values only"):
        lower_layout(Layout(mesh, P("dp"), "tp"), jmesh)
    with pytest.raises(ValueError, match=r"JAX mesh .* does not match Mesh\(dp=4\)"):
        lower_layout(Layout(Mesh(dp=4), P("dp")), jmesh)
    with pytest.raises(ValueError, match=r"Mesh\(dp=16\) needs 16 devices but JAX sees 8; .*device_count=16"):
        lower_mesh(Mesh(dp=16))
