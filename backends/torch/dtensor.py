"""parlay layouts <-> PyTorch DTensor placements.

A parlay layout is per tensor dim (which axes split it, major to minor); DTensor's placements
are per mesh axis (``Shard(d)``, ``Replicate()``, ``Partial()``), and several ``Shard(d)`` on one
dim split it in mesh-axis order. So a dim split over axes in mesh order converts exactly; one
split in another order needs DTensor's private ``_StridedShard`` and is refused, never reordered.
Uneven DTensor shards have no parlay layout and are refused too.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ...core import Layout, Mesh, P

__all__ = ["placements_of", "layout_of", "to_dtensor", "from_dtensor"]


def placements_of(layout: Layout) -> tuple[Placement, ...]:
    """DTensor placements (one per mesh axis) of a parlay layout."""
    mesh = layout.mesh
    order = {a: i for i, a in enumerate(mesh.axis_names)}
    for d, axes in enumerate(layout.spec.entries):
        if list(axes) != sorted(axes, key=order.get):
            raise ValueError(
                f"{layout} splits dim {d} over {axes}, not in the mesh's axis order "
                f"{tuple(a for a in mesh.axis_names if a in axes)}; DTensor would need its private "
                f"_StridedShard for that. Reorder the dim's axes to mesh order, or redistribute first."
            )
    out = []
    for a in mesh.axis_names:
        if a in layout.partial:
            out.append(Partial())
        elif a in layout.spec.axes:
            out.append(Shard(next(d for d, axes in enumerate(layout.spec.entries) if a in axes)))
        else:
            out.append(Replicate())
    return tuple(out)


def layout_of(placements, mesh: Mesh, shape) -> Layout:
    """The parlay layout of DTensor placements on ``mesh`` (axes in mesh order), for ``shape``."""
    stacks: dict[int, list[str]] = {}
    partial = []
    for a, pl in zip(mesh.axis_names, placements):
        if type(pl).__name__ == "_StridedShard":
            raise ValueError(f"placement {pl} on axis {a!r} is a strided shard; parlay layouts split each dim "
                             f"in one axis order. Redistribute the DTensor to plain Shard placements first.")
        if isinstance(pl, Shard):
            stacks.setdefault(pl.dim % len(shape), []).append(a)
        elif isinstance(pl, Partial):
            if pl.reduce_op != "sum":
                raise ValueError(f"placement {pl} on axis {a!r}: parlay's partial layouts are pending sums only.")
            partial.append(a)
        elif not isinstance(pl, Replicate):
            raise ValueError(f"placement {pl!r} on axis {a!r} has no parlay equivalent.")
    spec = P(*(tuple(stacks[d]) if d in stacks else None for d in range(len(shape))))
    layout = Layout(mesh, spec, partial)
    try:
        layout.check(tuple(shape))
    except ValueError as e:
        raise ValueError(f"the DTensor's shards are uneven, which parlay layouts are not: {e}") from None
    return layout


def to_dtensor(local: torch.Tensor, layout: Layout, device_mesh, shape) -> DTensor:
    """This rank's block of ``layout`` as a DTensor on ``device_mesh`` (same axes as the layout's mesh)."""
    if tuple(device_mesh.mesh_dim_names or ()) != layout.mesh.axis_names or tuple(device_mesh.shape) != layout.mesh.sizes:
        raise ValueError(f"DeviceMesh {device_mesh.mesh_dim_names} {tuple(device_mesh.shape)} does not match {layout.mesh}.")
    expected = layout.local_shape(shape)
    if tuple(local.shape) != expected:
        raise ValueError(f"local block has shape {tuple(local.shape)} but {layout} of {tuple(shape)} gives {expected}.")
    return DTensor.from_local(local, device_mesh, placements_of(layout), shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def from_dtensor(dt: DTensor, mesh: Mesh) -> tuple[torch.Tensor, Layout]:
    """(this rank's block, its parlay layout) of a DTensor on a mesh with ``mesh``'s axes."""
    dm = dt.device_mesh
    if tuple(dm.mesh_dim_names or ()) != mesh.axis_names or tuple(dm.shape) != mesh.sizes:
        raise ValueError(f"the DTensor's DeviceMesh {dm.mesh_dim_names} {tuple(dm.shape)} does not match {mesh}.")
    return dt.to_local(), layout_of(dt.placements, mesh, tuple(dt.shape))
