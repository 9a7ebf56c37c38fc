"""Lowering core meshes and layouts to ``jax.sharding``, and the explicit mode's mesh of prime
atoms (``AtomMesh``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import Mesh as JaxMesh
from jax.sharding import PartitionSpec

from ...core import Layout, Mesh
from ...core.mesh import prime_factors

__all__ = ["lower_mesh", "lower_spec", "lower_layout", "AtomMesh"]


def _devices(mesh: Mesh, devices) -> list:
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < mesh.size:
        raise ValueError(
            f"{mesh} needs {mesh.size} devices but JAX sees {len(devices)}; on the CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={mesh.size} before JAX starts."
        )
    return devices[: mesh.size]


def lower_mesh(mesh: Mesh, devices: Sequence[jax.Device] | None = None, *,
               axis_type: AxisType = AxisType.Explicit) -> JaxMesh:
    """A ``jax.sharding.Mesh`` with the same axes; device ``i`` is parlay rank ``i``.

    ``axis_type`` is explicit by default: shardings are part of the types, as parlay's layouts are.
    """
    grid = np.array(_devices(mesh, devices), dtype=object).reshape(mesh.sizes)
    return JaxMesh(grid, mesh.axis_names, axis_types=(axis_type,) * mesh.ndim)


def lower_spec(layout: Layout) -> PartitionSpec:
    return PartitionSpec(*layout.spec)


def lower_layout(layout: Layout, jax_mesh: JaxMesh) -> NamedSharding:
    """The ``NamedSharding`` of a complete (non-partial) layout."""
    if layout.partial:
        raise ValueError(
            f"{layout} is partial over {list(layout.partial)}; a NamedSharding holds complete values "
            f"only. Reduce the pending sums first (plan_redistribute to a layout without partial)."
        )
    if tuple(jax_mesh.axis_names) != layout.mesh.axis_names or tuple(jax_mesh.devices.shape) != layout.mesh.sizes:
        raise ValueError(f"JAX mesh {dict(jax_mesh.shape)} does not match {layout.mesh}; lower the same mesh.")
    return NamedSharding(jax_mesh, lower_spec(layout))


@dataclass(frozen=True)
class AtomMesh:
    """A core mesh and its factorisation into prime atoms (the shard_map mesh): every axis is
    split into its prime factors (``tp#0``, ``tp#1``; ranks keep their numbers), so any plan,
    including those that move part of an axis (``tp.1``), lowers to collectives over atoms."""

    mesh: Mesh

    @property
    def atoms(self) -> dict[str, tuple[tuple[str, int], ...]]:
        out = {}
        for axis, n in self.mesh.axes:
            primes = prime_factors(n) or (1,)
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

    def spec(self, layout) -> PartitionSpec:
        entries = [self.names(layout.dim_axes(d)) or None for d in range(len(layout.spec))]
        return PartitionSpec(*(e if e is None or len(e) > 1 else e[0] for e in entries))

    def jax_mesh(self, devices=None) -> JaxMesh:
        grid = np.array(_devices(self.mesh, devices), dtype=object).reshape([size for _, size in self.atom_axes])
        return JaxMesh(grid, self.atom_names, axis_types=(AxisType.Auto,) * len(self.atom_axes))
