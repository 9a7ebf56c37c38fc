"""The executor's ``Comm`` on torch.distributed: plan steps as autograd collectives over the
mesh's process groups; ``vary`` an all-reduce of the gradient (for a parameter as stored, handed
to the data-parallel gradient buckets instead, which overlap the backward pass)."""

from __future__ import annotations

import torch

from ...core.log import CollectiveLog
from ...core.mesh import ring_pairs
from ...core.steps import Kind
from .collectives import _permute, all_gather_many, all_max, all_reduce, run_step, slice_shared, vary
from .grad_sync import GradSync, vary_param
from .mesh import TorchMesh
from .ops import TorchLocal

__all__ = ["TorchComm"]


class TorchComm:
    def __init__(self, tm: TorchMesh, local: TorchLocal, *, log: CollectiveLog | None = None,
                 grad_sync: GradSync | None = None):
        self.tm, self.mesh, self.local, self.log, self.grad_sync = tm, tm.mesh, local, log, grad_sync

    def run_step(self, step, x: torch.Tensor, plan_mesh) -> torch.Tensor:
        return run_step(step, x, self.tm, plan_mesh, self.log)

    def slice_shared(self, step, x: torch.Tensor, plan_mesh) -> torch.Tensor:
        return slice_shared(step, x, self.tm, plan_mesh, self.log)

    def vary(self, x: torch.Tensor, axes, *, param=None) -> torch.Tensor:
        if param is not None and self.grad_sync is not None and x.is_leaf and x.requires_grad:
            name, layout = param
            return vary_param(x, name, layout, tuple(axes), self.grad_sync)
        return vary(x, axes, self.tm, self.log)

    def psum(self, x: torch.Tensor, axes) -> torch.Tensor:
        return all_reduce(x, axes, self.tm, self.log)

    def pmax(self, x: torch.Tensor, axes) -> torch.Tensor:
        return all_max(x, axes, self.tm, self.log)

    def axis_index(self, axes) -> int:
        return self.mesh.index_in_group(self.tm.rank, axes)

    def all_gather_many(self, xs, dims, axes):
        return list(all_gather_many(xs, dims, axes, self.tm, None, self.log))

    def check(self, x) -> None:
        pass

    def shift(self, x: torch.Tensor, axes, *, backward: bool = False) -> torch.Tensor:
        pairs = ring_pairs(self.mesh, axes)
        if self.log is not None:
            self.log.record(Kind.PERMUTE, tuple(axes), x.numel() * x.element_size(), backward, dtype=x.dtype)
        return _permute(x, pairs, self.tm.rank)

    def custom(self, fwd, bwd, *xs):
        return _Custom.apply(fwd, bwd, *xs)


class _Custom(torch.autograd.Function):
    """An op with its own backward (``Comm.custom``): the residuals stay on ``ctx``."""

    @staticmethod
    def forward(ctx, fwd, bwd, *xs):
        out, ctx.res = fwd(*xs)
        ctx.bwd = bwd
        return out

    @staticmethod
    def backward(ctx, g):
        grads = ctx.bwd(ctx.res, g)
        ctx.res = None
        return (None, None, *grads)
