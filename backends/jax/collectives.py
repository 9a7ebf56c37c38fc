"""Core plan steps executed inside ``shard_map`` with ``lax`` collectives (JAX differentiates
them: each one's transpose is the one ``core.executor.Comm`` names)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...core import AllGather, AllReduce, AllToAll, LocalSlice, Permute, ReduceScatter, Step

__all__ = ["run_step", "ppermute"]


def ppermute(x, names: tuple[str, ...], perm, atom_names: tuple[str, ...]):
    """``lax.ppermute`` with ``perm``'s indices counted in ``names``' order, as ``lax.axis_index``,
    ``all_gather``, ``psum_scatter`` and ``all_to_all`` count a group of several axes.

    JAX (0.10) numbers a multi-axis ``ppermute``'s members in the mesh's axis order whatever order
    ``names`` come in, so a ring over ('y', 'x') on a mesh (x, y) sent to the wrong neighbours. The
    pairs are renumbered into the mesh's order here; ``names`` keep their order, so the jaxpr names
    the axes as the plan does. ``tests/jax/test_xla_known_bugs.py`` fails the day JAX changes this.
    """
    ordered = tuple(sorted(names, key=atom_names.index))
    if ordered == tuple(names):
        return lax.ppermute(x, names, perm=list(perm))
    sizes = [lax.axis_size(n) for n in names]
    to_mesh = {}
    for t in range(int(np.prod(sizes))):
        coords = dict(zip(names, np.unravel_index(t, sizes)))
        to_mesh[t] = int(np.ravel_multi_index([coords[n] for n in ordered], [lax.axis_size(n) for n in ordered]))
    return lax.ppermute(x, names, perm=[(to_mesh[s], to_mesh[d]) for s, d in perm])


def run_step(step: Step, x, names: tuple[str, ...], atom_names: tuple[str, ...]):
    """One plan step on the local shard ``x``; ``names`` are the step's JAX axis names."""
    if isinstance(step, AllGather):
        return lax.all_gather(x, names, axis=step.dim, tiled=True)
    if isinstance(step, ReduceScatter):
        return lax.psum_scatter(x, names, scatter_dimension=step.dim, tiled=True)
    if isinstance(step, AllReduce):
        return lax.psum(x, names)
    if isinstance(step, AllToAll):
        return lax.all_to_all(x, names, step.split_dim, step.concat_dim, tiled=True)
    if isinstance(step, LocalSlice):
        size = x.shape[step.dim] // _group_size(names)
        return lax.dynamic_slice_in_dim(x, lax.axis_index(names) * size, size, axis=step.dim)
    if isinstance(step, Permute):
        moved = lax.ppermute(x, atom_names, perm=list(step.pairs))
        # ppermute zero-fills ranks that receive nothing; in a plan they keep their shard.
        dests = np.zeros(_group_size(atom_names), dtype=bool)
        dests[[d for _, d in step.pairs]] = True
        is_dest = jnp.asarray(dests)[lax.axis_index(atom_names)]
        return jnp.where(is_dest, moved, x)
    raise TypeError(f"{step!r} is not a plan step")


def _group_size(names: tuple[str, ...]) -> int:
    return int(np.prod([lax.axis_size(n) for n in names])) if names else 1
