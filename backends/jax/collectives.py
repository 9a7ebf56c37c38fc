"""Core plan steps executed inside ``shard_map`` with ``lax`` collectives.

The shard_map mesh splits every mesh axis into its prime factors ("atoms", named ``tp#0``,
``tp#1``; ranks keep their numbers), so any plan, including those that move part of an axis
(``tp.1``), lowers to collectives over a tuple of atoms. Every executed step is logged, so a
test can count the collectives a training step issues.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...core import (
    AllGather, AllReduce, AllToAll, Kind, LocalSlice, Mesh, Permute, Plan, ReduceScatter, Step,
)
from ...core.plan import _prime_factors

__all__ = ["AtomMesh", "CollectiveLog", "run_plan", "run_step"]


@dataclass(frozen=True)
class AtomMesh:
    """A core mesh and its factorisation into prime atoms (the shard_map mesh)."""

    mesh: Mesh

    @property
    def atoms(self) -> dict[str, tuple[tuple[str, int], ...]]:
        out = {}
        for axis, n in self.mesh.axes:
            primes = _prime_factors(n) or (1,)
            out[axis] = ((axis, n),) if len(primes) == 1 else tuple((f"{axis}#{i}", p) for i, p in enumerate(primes))
        return out

    @property
    def atom_axes(self) -> tuple[tuple[str, int], ...]:
        """(JAX axis name, size) of every atom, in rank order (row-major, like the core mesh)."""
        return tuple(a for parts in self.atoms.values() for a in parts)

    @property
    def atom_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.atom_axes)

    def names(self, axes, plan_mesh: Mesh | None = None) -> tuple[str, ...]:
        """JAX axis names for core axes, or sub-axes ('tp.1') of ``plan_mesh``'s refinement."""
        out: list[str] = []
        for a in axes:
            base, dot, part = a.partition(".")
            atoms = self.atoms[base]
            if not dot:
                out += [n for n, _ in atoms]
                continue
            # The plan split `base` into sub-axes base.0, base.1, ... (major to minor); each is a
            # run of consecutive prime atoms.
            sizes = [plan_mesh.axis_size(f"{base}.{i}") for i in range(len(plan_mesh.axis_names))
                     if plan_mesh.has_axis(f"{base}.{i}")]
            start = 0
            for i, size in enumerate(sizes):
                run, prod = [], 1
                while prod < size:
                    run.append(atoms[start][0])
                    prod *= atoms[start][1]
                    start += 1
                if i == int(part):
                    out += run
                    break
        return tuple(out)

    def spec(self, layout) -> jax.sharding.PartitionSpec:
        entries = [self.names(layout.dim_axes(d)) or None for d in range(len(layout.spec))]
        return jax.sharding.PartitionSpec(*(e if e is None or len(e) > 1 else e[0] for e in entries))

    def jax_mesh(self, devices=None) -> jax.sharding.Mesh:
        n = self.mesh.size
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < n:
            raise ValueError(
                f"{self.mesh} needs {n} devices but JAX sees {len(devices)}; on the CPU set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts."
            )
        grid = np.array(devices[:n], dtype=object).reshape([size for _, size in self.atom_axes])
        return jax.sharding.Mesh(grid, self.atom_names, axis_types=(jax.sharding.AxisType.Auto,) * len(self.atom_axes))


@dataclass
class CollectiveLog:
    """What the executed plans issued: (kind, axes, bytes per device), in trace order."""

    entries: list = field(default_factory=list)

    def record(self, step: Step, nbytes: int) -> None:
        axes = getattr(step, "axes", ())
        self.entries.append((step.kind, tuple(axes), nbytes))

    def counts(self) -> dict:
        out: dict = {}
        for kind, axes, _ in self.entries:
            if kind is not Kind.LOCAL_SLICE:
                out[(kind, axes)] = out.get((kind, axes), 0) + 1
        return out


def run_step(step: Step, x: jax.Array, names: tuple[str, ...], atom_names: tuple[str, ...]) -> jax.Array:
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


def run_plan(plan: Plan, x: jax.Array, atoms: AtomMesh, log: CollectiveLog | None = None, tap=None) -> jax.Array:
    """``tap(plan, i, before, after)``, if given, sees each step's local input and output (the
    bisect checks every collective against the simulator with it)."""
    all_atoms = atoms.atom_names
    for i, (step, sent) in enumerate(zip(plan.steps, plan.step_bytes)):
        names = atoms.names(getattr(step, "axes", ()), plan.mesh)
        before, x = x, run_step(step, x, names, all_atoms)
        if log is not None:
            log.record(step, max(sent))
        if tap is not None:
            tap(plan, i, before, x)
    return x
