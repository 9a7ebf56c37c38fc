"""The executor's ``Comm`` on a simulated mesh: every rank's block in one process, numpy.

A local value is a ``PerRank`` (one array or ``autodiff.Var`` per rank). Plan steps run through
``core.sim`` (the executable specification of each step) and their transposes are written here
from the same definitions, so a whole model's forward and backward run on per-rank numpy arrays.
``check`` enforces what the variance bookkeeping promises in the forward: a value the executor
calls invariant over an axis holds the same bits on every rank along it.
"""

from __future__ import annotations

import numpy as np

from ...core.executor import Sharded
from ...core.mesh import Mesh, ring_pairs
from ...core.sim import step_on_mesh
from ...core.steps import AllGather, AllReduce, AllToAll, LocalSlice, Permute, ReduceScatter
from . import autodiff as ad
from .ops import NumpyLocal, PerRank, PerRankLocal

__all__ = ["NumpyComm", "VarianceError"]


class VarianceError(AssertionError):
    """The executor called a value invariant over an axis along which its blocks differ."""


def _collective(x: PerRank, forward, transpose) -> PerRank:
    """``forward`` maps every rank's value to every rank's output; ``transpose`` every rank's
    output cotangent to every rank's input cotangent. One graph node holds the stacked outputs."""
    vals = [np.asarray(ad.value(v)) for v in x.values]
    outs = forward(vals)
    if not any(isinstance(v, ad.Var) for v in x.values):
        return PerRank(outs)

    def vjp(g):
        grads = transpose(list(g))
        return tuple(gr for v, gr in zip(x.values, grads) if isinstance(v, ad.Var))

    joint = ad.Var(np.stack(outs), [v for v in x.values if isinstance(v, ad.Var)], vjp)
    return PerRank(joint[r] for r in range(len(outs)))


class NumpyComm:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.local = PerRankLocal(NumpyLocal(), mesh.size)

    def _groups(self, axes, mesh=None):
        return (mesh or self.mesh).groups(tuple(axes))

    def _sum(self, vals, axes):
        return step_on_mesh(AllReduce(tuple(axes)), vals, self.mesh)

    def run_step(self, step, x: PerRank, plan_mesh: Mesh) -> PerRank:
        fwd = lambda vals: step_on_mesh(step, vals, plan_mesh)
        if isinstance(step, AllGather):
            back = lambda g: step_on_mesh(ReduceScatter(step.axes, step.dim), g, plan_mesh)
        elif isinstance(step, ReduceScatter):
            back = lambda g: step_on_mesh(AllGather(step.axes, step.dim), g, plan_mesh)
        elif isinstance(step, AllReduce):
            back = lambda g: g
        elif isinstance(step, AllToAll):
            back = lambda g: step_on_mesh(AllToAll(step.axes, step.concat_dim, step.split_dim), g, plan_mesh)
        elif isinstance(step, LocalSlice):
            back = lambda g: self._pad(g, step, plan_mesh)
        elif isinstance(step, Permute):
            back = lambda g: self._permute_back(g, step)
        else:
            raise TypeError(f"{step!r} is not a plan step")
        return _collective(x, fwd, back)

    def slice_shared(self, step: LocalSlice, x: PerRank, plan_mesh: Mesh) -> PerRank:
        """The slice of a value the group shares: its transpose gathers every member's piece."""
        return _collective(x, lambda vals: step_on_mesh(step, vals, plan_mesh),
                           lambda g: step_on_mesh(AllGather(step.axes, step.dim), g, plan_mesh))

    def _pad(self, g, step: LocalSlice, plan_mesh: Mesh):
        """A slice's transpose: each rank's cotangent in its own piece, zeros elsewhere."""
        out = list(g)
        for group in plan_mesh.groups(step.axes):
            n = len(group)
            for k, r in enumerate(group):
                shape = list(g[r].shape)
                size = shape[step.dim]
                shape[step.dim] = size * n
                full = np.zeros(shape, g[r].dtype)
                index = [slice(None)] * len(shape)
                index[step.dim] = slice(k * size, (k + 1) * size)
                full[tuple(index)] = g[r]
                out[r] = full
        return out

    def _permute_back(self, g, step: Permute):
        """out[dst] = x[src], others keep theirs: x[r]'s cotangent is g[r] where r kept its
        block, plus g[d] for each d it sent to."""
        dests = {d for _, d in step.pairs}
        out = [np.zeros_like(a) if r in dests else a.copy() for r, a in enumerate(g)]
        for s, d in step.pairs:
            out[s] = out[s] + g[d]
        return out

    def vary(self, x: PerRank, axes, *, param=None) -> PerRank:
        return _collective(x, lambda vals: vals, lambda g: self._sum(g, axes))

    def psum(self, x: PerRank, axes) -> PerRank:
        return _collective(x, lambda vals: self._sum(vals, axes), lambda g: g)

    def pmax(self, x: PerRank, axes) -> PerRank:
        vals = [np.asarray(ad.value(v)) for v in x.values]
        out = list(vals)
        for group in self._groups(axes):
            top = np.maximum.reduce([vals[r] for r in group])
            for r in group:
                out[r] = top
        return PerRank(out)

    def axis_index(self, axes) -> PerRank:
        return PerRank(np.int32(self.mesh.index_in_group(r, axes)) for r in range(self.mesh.size))

    def all_gather_many(self, xs, dims, axes) -> list:
        return [self.run_step(AllGather(tuple(axes), d), x, self.mesh) for x, d in zip(xs, dims)]

    def shift(self, x: PerRank, axes, *, backward: bool = False) -> PerRank:
        """Each rank's block to the next member of its group over ``axes`` (raw: no gradient)."""
        out = list(x.values)
        for s, d in ring_pairs(self.mesh, axes):
            out[d] = x.values[s]
        return PerRank(out)

    def custom(self, fwd, bwd, *xs: PerRank) -> PerRank:
        """``fwd`` and ``bwd`` on every rank's plain arrays; one graph node holds the outputs."""
        out, res = fwd(*(PerRank(np.asarray(ad.value(v)) for v in x.values) for x in xs))
        leaves = [(i, r, v) for i, x in enumerate(xs) for r, v in enumerate(x.values) if isinstance(v, ad.Var)]
        if not leaves:
            return out

        def vjp(g):
            grads = bwd(res, PerRank(list(g)))
            return tuple(np.asarray(grads[i].values[r]) for i, r, _ in leaves)

        joint = ad.Var(np.stack([np.asarray(v) for v in out.values]), [v for _, _, v in leaves], vjp)
        return PerRank(joint[r] for r in range(len(out.values)))

    def check(self, x: Sharded) -> None:
        vals = [np.asarray(ad.value(v)) for v in x.local.values]
        for a in self.mesh.axis_names:
            if a in x.varying or self.mesh.axis_size(a) == 1:
                continue
            for group in self._groups((a,)):
                first = vals[group[0]]
                for r in group[1:]:
                    if not np.array_equal(vals[r], first, equal_nan=True):
                        raise VarianceError(
                            f"the executor calls a value of layout {x.layout} and shape {x.shape} invariant over "
                            f"{a!r}, but ranks {group[0]} and {r} hold different blocks: the variance rule missed "
                            f"a step (core/executor.py).")
