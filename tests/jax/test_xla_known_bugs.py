"""Wrong results of XLA's SPMD partitioner (and one of JAX's collectives) that parlay's checks found, as
minimal reproductions.

Each asserts the right answer and is marked ``xfail(strict=True)``: while the installed XLA has the
bug, its assertion fails and pytest reports an expected failure; the day an upgrade fixes it, the
assertion holds, strict turns that pass into a failure, and the workaround it documents can go.
A companion test without the mark checks the layout parlay uses instead.

jax 0.10.2 (Shardy on or off), 8 CPU devices on a (row, col, dep) = 2 x 2 x 2 mesh: the gradient of
``x @ w`` with ``x`` [batch over (dep, row), features over col] and ``w`` [row, col] is wrong
(about 5.6 off on values of order 1); with the batch over (row, dep) it is right. ``parlay compare``
found it on Tesseract's (2.5D) layout under GSPMD while the explicit lowering, torch and the
simulator agreed with one device. parlay's ``tp2.5d`` therefore splits the batch over
(row, dep): the same blocks under other labels, the same bytes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


def _input_gradient_error(batch_axes) -> float:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("row", "col", "dep"), axis_types=(AxisType.Auto,) * 3)
    x_sharding = NamedSharding(mesh, P(batch_axes, "col"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w = (0.1 * rng.standard_normal((64, 128))).astype(np.float32)
    g = rng.standard_normal((8, 128)).astype(np.float32)

    def f(x, w):
        x = jax.lax.with_sharding_constraint(x, x_sharding)
        return jnp.sum(jnp.einsum("be,ef->bf", x, w) * g)

    got = jax.jit(jax.grad(f))(jax.device_put(x, x_sharding), jax.device_put(w, NamedSharding(mesh, P("row", "col"))))
    return float(np.abs(np.asarray(got) - g @ w.T).max())


def test_the_batch_over_row_then_dep_gives_the_right_gradient():
    assert _input_gradient_error(("row", "dep")) < 1e-5


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="XLA SPMD partitioner: wrong dx for x[(dep, row), col] @ w[row, col]")
def test_the_batch_over_dep_then_row_gives_the_right_gradient():
    assert _input_gradient_error(("dep", "row")) < 1e-5


# -- JAX: a ppermute over several axes numbers its members in the mesh's order ----------------------
#
# jax 0.10.2, inside shard_map: lax.axis_index(('y', 'x')), all_gather, psum_scatter and all_to_all
# number a group of several axes in the order given (y major), but lax.ppermute(x, ('y', 'x'), perm)
# reads perm's indices in the mesh's order (x major). parlay's ring attention over a sequence split
# over ('y', 'x') on a mesh (x, y) sent its blocks to the wrong neighbours: a loss 2.9e-4 off one
# device, found by a random rule set. parlay's collectives.ppermute keeps the axes in the order
# given and renumbers the pairs into the mesh's order.

def _ring_sources(names, permute, sizes=(2, 2, 2)) -> tuple[np.ndarray, np.ndarray]:
    """Each device's index in ``names``' order, and the index it received from a ring shift by one."""
    axes = ("x", "y", "z")[:len(sizes)]
    n = int(np.prod(sizes))
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(sizes), axes, axis_types=(AxisType.Explicit,) * len(axes))

    def f(_):
        i = jax.lax.axis_index(names)
        got = permute(jnp.full((1,), i), names, [(j, (j + 1) % n) for j in range(n)])
        return jnp.stack([i, got[0]])[None]

    out = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(axes))(jnp.zeros(1))
    out = np.asarray(out)
    return out[:, 0], out[:, 1]


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="JAX: a multi-axis ppermute numbers members in mesh order, axis_index in the given order")
def test_lax_ppermute_over_axes_out_of_mesh_order_shifts_by_axis_index():
    index, source = _ring_sources(("z", "x", "y"), lambda x, names, perm: jax.lax.ppermute(x, names, perm))
    np.testing.assert_array_equal(source, (index - 1) % 8)


@pytest.mark.parametrize("names,sizes", [
    (("x", "y", "z"), (2, 2, 2)), (("z", "x", "y"), (2, 2, 2)), (("y", "z", "x"), (2, 2, 2)),
    (("z", "y", "x"), (2, 2, 2)),
    (("y", "x"), (3, 2)), (("y", "x"), (2, 3)), (("z", "x", "y"), (2, 3, 1)),  # unequal sizes: no order hides
])
def test_parlays_ppermute_shifts_by_axis_index_in_any_order(names, sizes):
    from parlay.backends.jax.collectives import ppermute

    n = int(np.prod(sizes))
    atoms = ("x", "y", "z")[:len(sizes)]
    index, source = _ring_sources(names, lambda x, nm, perm: ppermute(x, nm, perm, atoms), sizes)
    assert sorted(index) == list(range(n))
    np.testing.assert_array_equal(source, (index - 1) % n)
