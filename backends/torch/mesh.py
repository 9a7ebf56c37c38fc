"""The core mesh on torch.distributed: a DeviceMesh for the axes, and process groups for any set
of (sub-)axes a plan needs; every group waits at most the run's collective timeout (torch's own
default for groups made later is 30 minutes)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...core import Mesh
from .launch import collective_timeout, mark_progress

__all__ = ["TorchMesh"]


class TorchMesh:
    """``mesh`` lowered for this rank. ``group(axes, plan_mesh)`` returns this rank's process
    group over ``axes`` (axes of ``plan_mesh``, a refinement of ``mesh`` with the same ranks)
    and the members in the plan's order (first axis major); groups are made on first use, by
    every rank in the same order (SPMD), and cached. ``local_groups``: each group is made by its
    members alone (``use_local_synchronization``), for runs whose ranks do not all run the same
    code: under a pipeline, the pp ranks run different stages, and so ask for groups in another
    order (all of a group's members share a pp rank, so they agree)."""

    def __init__(self, mesh: Mesh, device_type: str = "cpu", *, local_groups: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; launch with parlay.backends.torch.spawn or torchrun.")
        mesh.check_world_size(dist.get_world_size())
        self.mesh, self.rank = mesh, dist.get_rank()
        self.timeout = collective_timeout()
        self.device_mesh: DeviceMesh = init_device_mesh(device_type, mesh.sizes, mesh_dim_names=mesh.axis_names,
                                                        backend_override=_with_timeout(mesh.axis_names, self.timeout))
        self._groups: dict = {}
        self.local_groups = local_groups

    def group(self, axes: tuple[str, ...], plan_mesh: Mesh | None = None):
        mark_progress()  # every collective asks for its group first
        plan_mesh = plan_mesh or self.mesh
        key = (plan_mesh, tuple(axes))
        if key not in self._groups:
            mine = None
            for members in plan_mesh.groups(axes):
                if len(axes) == 1 and axes[0] in self.mesh.axis_names:
                    pg = self.device_mesh.get_group(axes[0]) if self.rank in members else None
                elif self.local_groups:
                    if self.rank not in members:
                        continue
                    pg = dist.new_group(sorted(members), timeout=self.timeout, use_local_synchronization=True)
                else:
                    # every rank takes part in every new_group
                    pg = dist.new_group(sorted(members), timeout=self.timeout)
                if self.rank in members:
                    mine = (pg, members)
            self._groups[key] = mine
        return self._groups[key]


def _with_timeout(axis_names, timeout):
    """DeviceMesh's per-axis options: the default backend with the run's timeout."""
    backend = dist.get_backend()
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return {name: (backend, options) for name in axis_names}
