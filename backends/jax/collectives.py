"""Core plan steps executed inside ``shard_map`` with ``lax`` collectives (JAX differentiates
them: each one's transpose is the one ``core.executor.Comm`` names)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...core import AllGather, AllReduce, AllToAll, LocalSlice, Permute, ReduceScatter, Step

__all__ = ["run_step"]


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
