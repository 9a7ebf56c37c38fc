"""Lowering core meshes and layouts to ``jax.sharding``."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import Mesh as JaxMesh
from jax.sharding import PartitionSpec

from ...core import Layout, Mesh

__all__ = ["lower_mesh", "lower_spec", "lower_layout"]


def lower_mesh(mesh: Mesh, devices: Sequence[jax.Device] | None = None, *,
               axis_type: AxisType = AxisType.Explicit) -> JaxMesh:
    """A ``jax.sharding.Mesh`` with the same axes; device ``i`` is parlay rank ``i``.

    ``axis_type`` is explicit by default: shardings are part of the types, as parlay's layouts are.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < mesh.size:
        raise ValueError(
            f"{mesh} needs {mesh.size} devices but JAX sees {len(devices)}; on the CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={mesh.size} before JAX starts."
        )
    grid = np.array(devices[: mesh.size], dtype=object).reshape(mesh.sizes)
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
